"""Checking a trace that was read from JSON, for what its types cannot say: list lengths, enumerations,
ranges, references between sequences and iterations, and derived values (rates, speedups) that must stay
finite. specviz.traces.json_format reads; this module refuses with a TraceFormatError naming the problem."""

from __future__ import annotations

import math
from typing import Any

from specviz.decoding.cost import CostModel
from specviz.decoding.records import (ACCEPTED, BONUS, DISCARDED, DRAFTERS, FINISH_REASONS, NEXT_KINDS, OUTCOMES,
                                      REJECTED, TARGET, Decision, StepRecord)
from specviz.traces.trace import SequenceTrace, Trace, TraceFormatError

MAX_INT = 1 << 53  # beyond this a JSON number is no longer an exact count or id


def json_name(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return {int: "an integer", float: "a number", str: "a string", list: "a list", dict: "an object",
            type(None): "null"}.get(type(value), type(value).__name__)


# ---- checks: what types cannot say, and what the page derives ------------------------------------------

# meta fields that the figures and the summary read, and the JSON types they must have when present
_META_TYPES = {"mode": (str,), "task": (str,), "config": (dict,), "prompt_text": (str,), "wer": (int, float),
               "rouge1": (int, float), "batch_size": (int,), "target_only": (dict,), "page_settings": (dict,),
               "draft_weights": (str,), "target_weights": (str,), "target_encoder": (str,), "prompts_reused": (int,),
               "costs": (dict,), "prefill_s_by_model": (dict,)}


def check_consistent(trace: Trace) -> None:
    """What types alone cannot say: list lengths, enumerations, ranges, and references between parts."""
    _check_meta(trace.meta)
    if trace.prefill_s < 0 or trace.total_s < 0 or trace.prefill_passes < 0:
        raise TraceFormatError("malformed trace: negative prefill_s, total_s or prefill_passes")
    for k, step in enumerate(trace.steps):
        _check_step(k, step, len(trace.sequences))
    for i, seq in enumerate(trace.sequences):
        _check_sequence(i, seq, len(trace.steps))


def _check_meta(meta: dict[str, Any]) -> None:
    for key in _META_TYPES:  # null means absent: readers can then take a present value's type for granted
        if key in meta and meta[key] is None:
            del meta[key]
    for key, types in _META_TYPES.items():
        value = meta.get(key)
        if value is not None and (not isinstance(value, types) or isinstance(value, bool)):
            raise TraceFormatError(f"malformed trace: meta.{key} should be {' or '.join(t.__name__ for t in types)}, "
                                   f"got {json_name(value)}")
    if "costs" in meta:
        try:
            CostModel.from_dict(meta["costs"])
        except ValueError as e:
            raise TraceFormatError(f"malformed trace: meta.costs: {e}") from None
    policy = meta.get("config", {}).get("gamma_policy")
    if policy is not None and not isinstance(policy, str):
        raise TraceFormatError(f"malformed trace: meta.config.gamma_policy should be a string, got {json_name(policy)}")


def _check_step(k: int, step: StepRecord, n_sequences: int) -> None:
    if step.index != k:
        raise TraceFormatError(f"malformed trace: step {k} says it is step {step.index}")
    if not step.sequences:  # every iteration scores at least one row (the prediction divides by their number)
        raise TraceFormatError(f"malformed trace: step {k} scores no sequence")
    if any(not 0 <= s < n_sequences for s in step.sequences):
        raise TraceFormatError(f"malformed trace: step {k} names a sequence that the trace does not have")
    if step.gamma < 0 or min(step.real_tokens, step.pad_tokens, step.cache_slots, step.cache_holes) < 0 \
            or step.cache_holes > step.cache_slots:
        raise TraceFormatError(f"malformed trace: step {k} has a negative γ or count, or more holes than slots")
    if min(step.draft_s, step.target_s, step.verify_s, step.end_s, step.explain_s) < 0:
        raise TraceFormatError(f"malformed trace: step {k} has a negative time")


def _check_sequence(i: int, seq: SequenceTrace, n_steps: int) -> None:
    if seq.index != i:
        raise TraceFormatError(f"malformed trace: sequence {i} says it is sequence {seq.index}")
    if seq.finish not in FINISH_REASONS:
        raise TraceFormatError(f"malformed trace: sequence {i} has finish {seq.finish[:40]!r}; "
                               f"expected one of {', '.join(repr(r) for r in FINISH_REASONS)}")
    for k, d in enumerate(seq.decisions):
        where = f"decision {k} of sequence {i}"
        if d.sequence != i:
            raise TraceFormatError(f"malformed trace: {where} belongs to sequence {d.sequence}")
        if n_steps and not 0 <= d.step < n_steps:
            raise TraceFormatError(f"malformed trace: {where} refers to step {d.step}, which the trace lacks")
        _check_decision(d, where)
    if any(not 0 <= t < MAX_INT for t in seq.prompt_ids + seq.output_ids) or seq.finished_s < 0:
        raise TraceFormatError(f"malformed trace: sequence {i} has a negative token id or finish time")


def _check_decision(d: Decision, where: str) -> None:
    lists = ("draft_ids", "draft_text", "q", "p", "accept_prob", "uniform", "outcome")
    if {len(getattr(d, name)) for name in lists} != {d.gamma}:
        raise TraceFormatError(f"malformed trace: {where} has per-token lists that do not all have "
                               f"γ = {d.gamma} entries")
    if bad := [o for o in d.outcome if o not in OUTCOMES]:
        raise TraceFormatError(f"malformed trace: {where} has outcome {bad[0][:40]!r}; expected one of "
                               f"{', '.join(OUTCOMES)}")
    if d.next_kind not in NEXT_KINDS:
        raise TraceFormatError(f"malformed trace: {where} has next_kind {d.next_kind[:40]!r}; expected one "
                               f"of {', '.join(NEXT_KINDS)}")
    if d.drafter not in DRAFTERS:
        raise TraceFormatError(f"malformed trace: {where} has drafter {d.drafter[:40]!r}; expected one of "
                               f"{', '.join(DRAFTERS)}")
    if not 0 <= d.n_accepted <= d.gamma or not 0 <= d.emitted <= d.n_accepted + 1:
        raise TraceFormatError(f"malformed trace: {where} has n_accepted {d.n_accepted} and emitted "
                               f"{d.emitted} for γ = {d.gamma}")
    expected = [ACCEPTED] * d.n_accepted + ([REJECTED] if d.n_accepted < d.gamma else [])
    expected += [DISCARDED] * (d.gamma - len(expected))
    if d.outcome != expected:
        raise TraceFormatError(f"malformed trace: {where} has outcomes {d.outcome[:4]}…; with n_accepted "
                               f"{d.n_accepted} of γ = {d.gamma} they must be {d.n_accepted} accepted, then "
                               f"one rejected and the rest discarded")
    if (d.gamma == 0) != (d.next_kind == TARGET):
        raise TraceFormatError(f"malformed trace: {where}: only target-only steps draft nothing")
    if d.gamma and (d.n_accepted == d.gamma) != (d.next_kind == BONUS):
        raise TraceFormatError(f"malformed trace: {where}: the next token is a bonus exactly when every "
                               f"draft was accepted")
    if any(not 0 <= x <= 1 for x in d.accept_prob + d.uniform + d.p + d.q):
        raise TraceFormatError(f"malformed trace: {where} has a probability or uniform outside [0, 1]")
    if any(not 0 <= t < MAX_INT for t in d.draft_ids + [d.next_id]):
        raise TraceFormatError(f"malformed trace: {where} has a negative token id")
    positions = [ex.position for ex in d.why]
    if positions and (positions != sorted(set(positions)) or not 0 <= positions[0] or positions[-1] > d.gamma):
        raise TraceFormatError(f"malformed trace: {where} explains positions {positions[:8]}; they must "
                               f"increase within 0..γ = {d.gamma}")


def _numbers(node, path: str):
    """(path, value) for every number in a summary-like tree."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _numbers(v, f"{path}.{k}" if path else str(k))
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            yield from _numbers(v, f"{path}[{i}]")
    elif isinstance(node, (int, float)) and not isinstance(node, bool):
        yield path, node


def check_derived(trace: Trace) -> None:
    """What the page computes from a loaded trace must be finite too: a total_s of 5e-324 is a valid number
    but makes every rate infinite, and a target-only rate near zero an infinite speedup."""
    for path, value in _numbers(trace.summary(), ""):
        if not math.isfinite(value):
            raise TraceFormatError(f"malformed trace: its {path} works out to {value} (times or counts no run "
                                   "produces)")
    if (reference := trace.target_only) is not None:
        for key in ("decode_tokens_per_s", "tokens_per_s"):
            value = reference.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not 1e-6 <= value <= 1e9):
                raise TraceFormatError(f"malformed trace: meta.target_only.{key} should be a rate between 1e-6 "
                                       f"and 1e9 tokens/s, got {str(value)[:40]}")
