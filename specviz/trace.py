"""The trace: every sequence's decisions, the batch's iterations, a summary, and a versioned JSON form.

Only the trace crosses from the engine to the figures and the page; a trace loaded from JSON draws the
same pictures as a live one. A TraceBuilder turns the engine's records into a Trace; whoever consumes the
records owns its builder, so no trace is shared between the decoding thread and a reader.

Schema version 3: `sequences` (one per decoded sequence: label, prompt and output ids, output text, its
per-iteration decisions, each with the distributions behind it in `why`) and `steps` (per iteration, once
for the batch: γ, timings, padding and cache-hole counts, and `explain_s`). Version 2 files (no `why`, no
`explain_s`) and version 1 files (one sequence, decisions and timings together in `iterations`) are read
and converted.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

from . import theory
from .config import MAX_EXPLAIN_TOP
from .cost import CostModel
from .records import (ACCEPTED, BONUS, DISCARDED, DRAFTERS, FINISH_REASONS, LOOKUP, MODEL, NEXT_KINDS, OUTCOMES, REJECTED,
                      TARGET, Completed, Decision, Event, Examined, Finished, Iteration, Prefilled, StepRecord, TopTokens)

SCHEMA_VERSION = 3


class TraceFormatError(ValueError):
    """A trace file that this version of specviz cannot read; the message says what is wrong."""


@dataclass
class SequenceTrace:
    index: int
    label: str
    group: str  # sequences of one group form one output (speech: the 30 s windows of one file)
    info: dict[str, Any]
    prompt_ids: list[int]
    output_ids: list[int]
    output_text: str
    decisions: list[Decision] = field(default_factory=list)
    finish: str = ""  # "eos", "length", or "" while decoding
    finished_s: float = 0.0  # seconds from the start of the run until it left the batch

    @property
    def tokens_per_s(self) -> float:
        return len(self.output_ids) / self.finished_s if self.finished_s > 0 else 0.0


@dataclass
class Trace:
    meta: dict[str, Any]  # mode, config (sampling, γ policy, ...), models, device, dtype, task, batch size
    sequences: list[SequenceTrace]
    steps: list[StepRecord] = field(default_factory=list)
    prefill_s: float = 0.0
    prefill_passes: int = 0  # groups of sequences prefilled (one per batch of up to batch_size sequences)
    total_s: float = 0.0  # wall time of the whole run, prefill included
    schema_version: int = SCHEMA_VERSION

    # ---- outputs -------------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return max((len(s.sequences) for s in self.steps), default=len(self.sequences))

    def texts(self) -> dict[str, str]:
        """Output text per group (speech joins a file's windows)."""
        out: dict[str, list[str]] = {}
        for s in self.sequences:
            out.setdefault(s.group, []).append(s.output_text.strip())
        return {g: " ".join(t for t in parts if t) for g, parts in out.items()}

    @property
    def output_text(self) -> str:
        texts = self.texts()
        if len(texts) == 1:
            return next(iter(texts.values()))
        return "\n\n".join(f"[{g}] {t}" for g, t in texts.items())

    @property
    def outputs(self) -> list[list[int]]:
        return [s.output_ids for s in self.sequences]

    def decisions(self) -> list[Decision]:
        return [d for s in self.sequences for d in s.decisions]

    def drafted(self) -> list[Decision]:
        """Decisions that drafted something (not target-only steps)."""
        return [d for d in self.decisions() if d.gamma > 0]

    # ---- summary -------------------------------------------------------------------------------
    @property
    def new_tokens(self) -> int:
        return sum(len(s.output_ids) for s in self.sequences)

    @property
    def tokens_per_s(self) -> float:
        """All sequences' tokens over the run's wall time (throughput)."""
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    @property
    def decode_s(self) -> float:
        """Wall time after the prefills: the iterations alone."""
        return max(0.0, self.total_s - self.prefill_s)

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens over the decoding time (prefill left out: it is the same work with or without a draft,
        except the draft's own prefill)."""
        return self.new_tokens / self.decode_s if self.decode_s > 0 else 0.0

    def per_sequence_tokens_per_s(self) -> float:
        """Mean over sequences of tokens over the time until that sequence finished (its latency)."""
        rates = [s.tokens_per_s for s in self.sequences if s.finished_s > 0]
        return sum(rates) / len(rates) if rates else self.tokens_per_s

    @property
    def target_forward_passes(self) -> int:
        """Batched target forwards: one per iteration plus one prefill per group of sequences."""
        return len(self.steps) + self.prefill_passes

    def alpha_estimate(self, sequence: int | None = None) -> float | None:
        """Mean of min(1, p/q) over the drafted tokens verification examined (up to the first rejection).

        Each is the chance that its context accepts a draft sample, so the mean estimates α = 1 - D_LK
        (Leviathan §3) as seen along the decoded text; tokens drafted after a rejection are left out
        because their contexts never occur in the output. `sequence`: that sequence's drafts only.
        """
        probs = [a for d in self.drafted() if sequence is None or d.sequence == sequence
                 for a in d.examined_accept_probs]
        return sum(probs) / len(probs) if probs else None

    def alpha_by_position(self) -> list[float]:
        """α at draft position k (0-based): the mean of min(1, p/q) over the drafts examined there, i.e. the
        chance of passing k once 0..k-1 passed. Ends at the last position any draft was examined."""
        sums: list[float] = []
        counts: list[int] = []
        for d in self.drafted():
            for k, a in enumerate(d.examined_accept_probs):
                if k == len(sums):
                    sums.append(0.0)
                    counts.append(0)
                sums[k] += a
                counts[k] += 1
        return [s / n for s, n in zip(sums, counts)]

    def acceptance_rate(self) -> float | None:
        drafted = self.drafted()
        total = sum(d.gamma for d in drafted)
        return sum(d.n_accepted for d in drafted) / total if total else None

    def padding_fraction(self) -> float | None:
        """Share of the tokens fed to draft and target that were padding (compute raggedness costs)."""
        fed = sum(s.real_tokens + s.pad_tokens for s in self.steps)
        return sum(s.pad_tokens for s in self.steps) / fed if fed else None

    def hole_fraction(self) -> float | None:
        """Mean share of KV-cache entries that were masked holes, over iterations."""
        shares = [s.cache_holes / s.cache_slots for s in self.steps if s.cache_slots]
        return sum(shares) / len(shares) if shares else None

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "mode": self.meta.get("mode"),
            "sequences": len(self.sequences),
            "new_tokens": self.new_tokens,
            "total_s": self.total_s,
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "tokens_per_s": self.tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "tokens_per_s_per_sequence": self.per_sequence_tokens_per_s(),
            "target_forward_passes": self.target_forward_passes,
        }
        steps = self.steps
        if steps:
            out.update(iterations=len(steps), median_target_ms=1e3 * statistics.median(s.target_s for s in steps))
        drafted = self.drafted()
        if drafted:
            alpha = self.alpha_estimate()
            out.update(
                alpha=alpha,
                acceptance_rate=self.acceptance_rate(),
                tokens_per_iteration=sum(d.n_accepted + 1 for d in drafted) / len(drafted),
                predicted_tokens_per_iteration=sum(theory.expected_tokens(alpha, d.gamma) for d in drafted) / len(drafted),
                mean_gamma=sum(d.gamma for d in drafted) / len(drafted),
                draft_s=sum(s.draft_s for s in steps),
                target_s=sum(s.target_s for s in steps),
                verify_s=sum(s.verify_s for s in steps),
            )
            if steps:  # a crafted trace may hold decisions without the steps they refer to
                out.update(median_verify_ms=1e3 * statistics.median(s.verify_s for s in steps))
            out.update(lookup_share=sum(d.drafter == LOOKUP for d in drafted) / len(drafted),
                       cost_ratio=self.cost_ratio())
        if explained := sum(s.explain_s for s in steps):
            out.update(explain_s=explained)
        if (gap := self.sigmoid_gap()) is not None:
            out.update(sigmoid_gap=gap)
        if len(self.sequences) > 1:
            out.update(padding_fraction=self.padding_fraction(), cache_hole_fraction=self.hole_fraction())
        return out

    def sigmoid_gap(self) -> dict[str, float] | None:
        """How far sigmoid's decisions are from exact's on the same draws, at the positions it examined.

        accepted: drafts sigmoid accepted; exact_would_accept: how many of those exact would have accepted
        with the same uniform (min(1, p/(l·q)) with softmax p and q); inflation: their difference over the
        examined drafts; mean_tv / max_tv: total-variation distance of normalized p̂ from p. None unless the
        trace is a sampled sigmoid run that recorded its distributions.
        """
        pairs = []  # (sigmoid accepted, exact would accept) per examined draft
        tvs = []
        for d in self.drafted():
            for ex in d.why:
                if ex.sigmoid_tv is not None:
                    tvs.append(ex.sigmoid_tv)
                if ex.exact_accept_prob is not None and ex.position < d.gamma:
                    pairs.append((d.outcome[ex.position] == ACCEPTED, d.uniform[ex.position] <= ex.exact_accept_prob))
        if not pairs:
            return None
        accepted = sum(a for a, _ in pairs)
        exact = sum(a and e for a, e in pairs)
        disagree = sum(a != e for a, e in pairs)
        return {"examined": len(pairs), "accepted": accepted, "exact_would_accept": exact,
                "disagreements": disagree, "inflation": (accepted - exact) / len(pairs),
                "mean_tv": sum(tvs) / len(tvs) if tvs else 0.0, "max_tv": max(tvs, default=0.0)}

    def until(self, steps: int) -> "Trace":
        """The trace as it stood after its first `steps` iterations (the page's replay).

        Outputs are rebuilt from the decisions' token texts, which is what the token view shows; the
        full trace keeps the tokenizer's own decoding."""
        if steps >= len(self.steps):
            return self
        kept = self.steps[:steps]
        sequences = []
        for s in self.sequences:
            decisions = [d for d in s.decisions if d.step < steps]
            ids = [t for d in decisions for t in d.tokens]
            text = "".join(t for d in decisions for t in (d.draft_text[: d.n_accepted] + [d.next_text])[: d.emitted])
            finished = s.finished_s if len(decisions) == len(s.decisions) else 0.0
            sequences.append(SequenceTrace(s.index, s.label, s.group, s.info, s.prompt_ids, ids, text, decisions,
                                           s.finish if finished else "", finished))
        end = kept[-1].end_s if kept else self.prefill_s
        return Trace(meta=self.meta, sequences=sequences, steps=kept, prefill_s=self.prefill_s,
                     prefill_passes=self.prefill_passes, total_s=end, schema_version=self.schema_version)

    def cost_ratio(self) -> float | None:
        """Measured c (Leviathan et al.): seconds per draft-model forward over the median seconds per target
        call. A draft forward advances every drafting row by one token, so an iteration makes as many as its
        longest model draft. None when the draft model never ran (prompt lookup drafted everything)."""
        by_step: dict[int, int] = {}
        for d in self.drafted():
            if d.drafter == MODEL:
                by_step[d.step] = max(by_step.get(d.step, 0), d.gamma)
        forwards = sum(by_step.values())
        steps = [s for s in self.steps if s.index in by_step]
        if not forwards or not steps:
            return None
        scored = [s.target_s for s in self.steps if s.gamma > 0]
        if not scored:  # only a crafted trace drafts in steps that say γ = 0
            return None
        target = statistics.median(scored)
        return (sum(s.draft_s for s in steps) / forwards) / target if target > 0 else None

    # ---- JSON ----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["summary"] = self.summary()  # for readers of the file; recomputed, never trusted, on load
        return d

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), ensure_ascii=False, allow_nan=False))

    @classmethod
    def from_dict(cls, d: Any) -> "Trace":
        if not isinstance(d, dict):
            raise TraceFormatError("not a specviz trace: the top level must be a JSON object")
        version = d.get("schema_version")
        if not isinstance(version, int) or isinstance(version, bool):
            raise TraceFormatError("not a specviz trace: no integer schema_version")
        if version > SCHEMA_VERSION:
            raise TraceFormatError(
                f"trace schema_version {version} is newer than this specviz reads ({SCHEMA_VERSION}); upgrade specviz"
            )
        if version < 1:
            raise TraceFormatError(f"unknown trace schema_version {version}")
        trace = _from_v1(d) if version == 1 else _from_v2(d)
        _check_consistent(trace)
        _check_derived(trace)
        return trace

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        path = Path(path)
        size = path.stat().st_size
        if size > MAX_TRACE_BYTES:
            raise TraceFormatError(f"{path.name} is {size:,} bytes; traces over {MAX_TRACE_BYTES:,} bytes are refused")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise TraceFormatError(f"{path.name} is not a text file, so not a specviz trace") from e
        return cls.loads(text, path.name)

    @classmethod
    def loads(cls, text: str, name: str = "the trace") -> "Trace":
        """Parse and check a trace's JSON text: refused with a TraceFormatError that names what is wrong."""
        try:
            data = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float, parse_int=_bounded_int)
        except json.JSONDecodeError as e:
            raise TraceFormatError(f"{name} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from e
        except TraceFormatError:
            raise
        except ValueError as e:  # the decoder's own limits (e.g. Python's cap on integer digits)
            raise TraceFormatError(f"{name} holds a number JSON cannot hold here ({e})") from e
        except RecursionError:
            raise TraceFormatError(f"{name} nests too deeply to be a specviz trace") from None
        _check_plain_json(data, "trace", 0)
        return cls.from_dict(data)


class TraceBuilder:
    """Builds a Trace from the engine's records, in the consumer's thread."""

    def __init__(self, meta: dict[str, Any], sequences: list, detokenize: Callable[[list[int]], str]):
        self.detokenize = detokenize
        self.trace = Trace(meta=dict(meta), sequences=[
            SequenceTrace(i, s.label, s.group, dict(s.info), list(s.prompt_ids), [], "") for i, s in enumerate(sequences)
        ])

    def add(self, event: Event) -> None:
        trace = self.trace
        if isinstance(event, Prefilled):
            trace.prefill_s += event.seconds
            trace.prefill_passes += 1
            if event.reused:
                trace.meta["prompts_reused"] = trace.meta.get("prompts_reused", 0) + event.reused
        elif isinstance(event, Iteration):
            trace.steps.append(event.step)
            trace.total_s = event.step.end_s
            for d in event.decisions:
                seq = trace.sequences[d.sequence]
                seq.decisions.append(d)
                seq.output_ids.extend(d.tokens)
                seq.output_text = self.detokenize(seq.output_ids)
        elif isinstance(event, Finished):
            seq = trace.sequences[event.sequence]
            seq.finish, seq.finished_s = event.reason, event.at_s
        elif isinstance(event, Completed):
            trace.total_s = event.total_s
            if event.costs is not None:
                trace.meta["costs"] = event.costs


# ---- reading ---------------------------------------------------------------------------------------

MAX_TRACE_BYTES = 64 << 20  # a 256-token run of 8 sequences is about 1 MB
MAX_DEPTH = 32  # the schema nests 5 deep; meta holds the run's settings
MAX_INT = 1 << 53  # beyond this a JSON number is no longer an exact count or id


MAX_FLOAT = 1e12  # seconds, probabilities and counts: anything larger is not a measurement (and sums overflow)


def json_number(value: object) -> float | None:
    """A finite number from a trace's free-form meta (untrusted JSON), else None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _bounded(value: float) -> bool:
    return math.isfinite(value) and abs(value) <= MAX_FLOAT


def _no_constant(name: str):
    raise TraceFormatError(f"malformed trace: {name} is not a number a trace may hold")


MAX_NUMBER_CHARS = 64  # no number a trace holds needs more characters (an id, a time, a probability)


def _finite_float(text: str) -> float:
    value = float(text)
    if len(text) > MAX_NUMBER_CHARS or not math.isfinite(value):
        raise TraceFormatError(f"malformed trace: the number {text[:40]}… is not a finite number a trace may hold"
                               if len(text) > 40 else f"malformed trace: {text} is not a finite number a trace may hold")
    return value


def _bounded_int(text: str) -> int:
    if len(text) > MAX_NUMBER_CHARS:
        raise TraceFormatError(f"malformed trace: a number of {len(text):,} digits is not a number a trace may hold")
    return int(text)


def _check_plain_json(value: Any, where: str, depth: int) -> None:
    """Bounded nesting, integers, and strings that can be written back (no lone surrogates)."""
    if depth > MAX_DEPTH:
        raise TraceFormatError(f"malformed trace: {where} nests deeper than {MAX_DEPTH} levels")
    if isinstance(value, dict):
        for key, item in value.items():
            _check_plain_json(key, where, depth + 1)
            _check_plain_json(item, f"{where}.{key[:40]}", depth + 1)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_plain_json(item, f"{where}[{i}]", depth + 1)
    elif isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise TraceFormatError(f"malformed trace: {where} holds a string that is not valid Unicode") from None
    elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
        raise TraceFormatError(f"malformed trace: {where} holds an integer beyond ±2^53")

_JSON_TYPES = {"int": (int,), "float": (int, float), "str": (str,), "list[int]": (list,), "list[str]": (list,),
               "list[float]": (list,), "dict[str, Any]": (dict,)}
_ELEMENT_TYPES = {"list[int]": (int,), "list[str]": (str,), "list[float]": (int, float)}
_TYPE_NAMES = {"int": "an integer", "float": "a finite number (|x| ≤ 1e12)", "str": "a string", "list[int]": "a list of integers",
               "list[str]": "a list of strings", "list[float]": "a list of finite numbers (|x| ≤ 1e12)", "dict[str, Any]": "an object"}


def _json_name(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return {int: "an integer", float: "a number", str: "a string", list: "a list", dict: "an object",
            type(None): "null"}.get(type(value), type(value).__name__)


def _typed(d: Any, cls: type, where: str, skip: set[str] = frozenset(), optional: set[str] = frozenset()) -> dict[str, Any]:
    """Check that d has every field of dataclass cls with a JSON value of the right type."""
    if not isinstance(d, dict):
        raise TraceFormatError(f"malformed trace: {where} must be a JSON object")
    out = {}
    for f in fields(cls):
        if f.name in skip:
            continue
        if f.name not in d:
            if f.name in optional:
                continue
            raise TraceFormatError(f"malformed trace: {where} is missing '{f.name}'")
        value = d[f.name]
        kind = str(f.type)
        ok = isinstance(value, _JSON_TYPES[kind]) and not isinstance(value, bool)
        if ok and kind in _ELEMENT_TYPES:
            bad = [v for v in value if not isinstance(v, _ELEMENT_TYPES[kind]) or isinstance(v, bool)
                   or (kind == "list[float]" and not _bounded(v))]
            if bad:
                raise TraceFormatError(f"malformed trace: '{f.name}' in {where} should be {_TYPE_NAMES[kind]}, "
                                       f"but holds {_json_name(bad[0])}")
        if ok and kind == "float":
            ok = _bounded(value)
        if not ok:
            raise TraceFormatError(f"malformed trace: '{f.name}' in {where} should be {_TYPE_NAMES[kind]}, "
                                   f"got {_json_name(value)}")
        out[f.name] = value
    return out


def _list(d: dict, key: str, where: str) -> list:
    value = d.get(key, [])
    if not isinstance(value, list):
        raise TraceFormatError(f"malformed trace: '{key}' in {where} must be a list")
    return value


def _from_v2(d: dict) -> Trace:
    top = _typed(d, Trace, "trace", skip={"sequences", "steps"})
    steps = [StepRecord(**_typed(s, StepRecord, f"step {i}", optional={"explain_s"}))
             for i, s in enumerate(_list(d, "steps", "trace"))]
    sequences = []
    for i, s in enumerate(_list(d, "sequences", "trace")):
        where = f"sequence {i}"
        seq = SequenceTrace(**_typed(s, SequenceTrace, where, skip={"decisions"}))
        seq.decisions = [_decision(x, f"decision {k} of {where}") for k, x in enumerate(_list(s, "decisions", where))]
        sequences.append(seq)
    if not sequences:
        raise TraceFormatError("malformed trace: 'sequences' is empty")
    return Trace(**top, sequences=sequences, steps=steps)


def _decision(x: Any, where: str) -> Decision:
    fields_ = _typed(x, Decision, where, skip={"why"}, optional={"drafter"})
    why = [_examined(e, f"why[{i}] of {where}") for i, e in enumerate(_list(x, "why", where))]
    return Decision(**fields_, why=why)


def _optional_float(d: dict, key: str, where: str) -> float | None:
    value = d.get(key)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= 1:
        raise TraceFormatError(f"malformed trace: '{key}' in {where} should be null or a number in [0, 1]")
    return float(value)


def _examined(e: Any, where: str) -> Examined:
    if not isinstance(e, dict):
        raise TraceFormatError(f"malformed trace: {where} must be a JSON object")
    position = e.get("position")
    if not isinstance(position, int) or isinstance(position, bool):
        raise TraceFormatError(f"malformed trace: 'position' in {where} should be an integer")
    tops = {k: None if e.get(k) is None and k != "p" else _top_tokens(e.get(k), f"{k} of {where}")
            for k in ("p", "q", "drawn_from")}
    return Examined(position=position, **tops, exact_accept_prob=_optional_float(e, "exact_accept_prob", where),
                    sigmoid_tv=_optional_float(e, "sigmoid_tv", where))


def _top_tokens(t: Any, where: str) -> TopTokens:
    top = TopTokens(**_typed(t, TopTokens, where))
    if not len(top.ids) == len(top.texts) == len(top.probs) <= MAX_EXPLAIN_TOP:
        raise TraceFormatError(f"malformed trace: {where} needs ids, texts and probs of one length, at most "
                               f"{MAX_EXPLAIN_TOP}")
    if any(not 0 <= v <= 1 for v in top.probs + [top.rest]) or any(not 0 <= i < MAX_INT for i in top.ids):
        raise TraceFormatError(f"malformed trace: {where} has a probability outside [0, 1] or a negative token id")
    return top


@dataclass
class _V1Iteration:
    """A version-1 iteration: one sequence's decisions and the timings together."""

    index: int
    gamma: int
    draft_ids: list[int]
    draft_text: list[str]
    q: list[float]
    p: list[float]
    accept_prob: list[float]
    uniform: list[float]
    outcome: list[str]
    n_accepted: int
    next_id: int
    next_text: str
    next_kind: str
    emitted: int
    draft_s: float
    target_s: float
    verify_s: float
    window: int = 0


@dataclass
class _V1Top:
    meta: dict[str, Any]
    prompt_ids: list[int]
    output_ids: list[int]
    output_text: str
    prefill_s: float
    total_s: float


def _from_v1(d: dict) -> Trace:
    top = _typed(d, _V1Top, "trace")
    its = [_V1Iteration(**_typed(it, _V1Iteration, f"iteration {i}", optional={"window"}))
           for i, it in enumerate(_list(d, "iterations", "trace"))]
    decisions, steps, end = [], [], top["prefill_s"]
    for k, it in enumerate(its):
        end += it.draft_s + it.target_s + it.verify_s
        steps.append(StepRecord(index=k, gamma=it.gamma, sequences=[0], draft_s=it.draft_s, target_s=it.target_s,
                                verify_s=it.verify_s, end_s=end, real_tokens=0, pad_tokens=0, cache_slots=0,
                                cache_holes=0))
        decisions.append(Decision(step=k, sequence=0, gamma=it.gamma, draft_ids=it.draft_ids, draft_text=it.draft_text,
                                  q=it.q, p=it.p, accept_prob=it.accept_prob, uniform=it.uniform, outcome=it.outcome,
                                  n_accepted=it.n_accepted, next_id=it.next_id, next_text=it.next_text,
                                  next_kind=it.next_kind, emitted=it.emitted))
    meta = top["meta"]
    seq = SequenceTrace(0, str(meta.get("input", "input"))[:80], "input", {}, top["prompt_ids"], top["output_ids"],
                        top["output_text"], decisions, "", top["total_s"])
    return Trace(meta=meta, sequences=[seq], steps=steps, prefill_s=top["prefill_s"], prefill_passes=1,
                 total_s=top["total_s"])


# meta fields that the figures and the summary read, and the JSON types they must have when present
_META_TYPES = {"mode": (str,), "task": (str,), "config": (dict,), "prompt_text": (str,), "wer": (int, float),
               "rouge1": (int, float), "batch_size": (int,), "target_only": (dict,), "page_settings": (dict,),
               "draft_weights": (str,), "target_weights": (str,), "prompts_reused": (int,),
               "costs": (dict,)}


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


def _check_derived(trace: Trace) -> None:
    """What the page computes from a loaded trace must be finite too: a total_s of 5e-324 is a valid number
    but makes every rate infinite, and a target-only rate near zero an infinite speedup."""
    for path, value in _numbers(trace.summary(), ""):
        if not math.isfinite(value):
            raise TraceFormatError(f"malformed trace: its {path} works out to {value} (times or counts no run "
                                   "produces)")
    reference = trace.meta.get("target_only")
    if isinstance(reference, dict):
        for key in ("decode_tokens_per_s", "tokens_per_s"):
            value = reference.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not 1e-6 <= value <= 1e9):
                raise TraceFormatError(f"malformed trace: meta.target_only.{key} should be a rate between 1e-6 "
                                       f"and 1e9 tokens/s, got {str(value)[:40]}")


def _check_consistent(trace: Trace) -> None:
    """What types alone cannot say: list lengths, enumerations, ranges, and references between parts."""
    for key in _META_TYPES:  # null means absent: readers can then take a present value's type for granted
        if key in trace.meta and trace.meta[key] is None:
            del trace.meta[key]
    for key, types in _META_TYPES.items():
        value = trace.meta.get(key)
        if value is not None and (not isinstance(value, types) or isinstance(value, bool)):
            raise TraceFormatError(f"malformed trace: meta.{key} should be {' or '.join(t.__name__ for t in types)}, "
                                   f"got {_json_name(value)}")
    if "costs" in trace.meta:
        try:
            CostModel.from_dict(trace.meta["costs"])
        except ValueError as e:
            raise TraceFormatError(f"malformed trace: meta.costs: {e}") from None
    policy = trace.meta.get("config", {}).get("gamma_policy")
    if policy is not None and not isinstance(policy, str):
        raise TraceFormatError(f"malformed trace: meta.config.gamma_policy should be a string, got {_json_name(policy)}")
    if trace.prefill_s < 0 or trace.total_s < 0 or trace.prefill_passes < 0:
        raise TraceFormatError("malformed trace: negative prefill_s, total_s or prefill_passes")
    n_steps = len(trace.steps)
    for k, step in enumerate(trace.steps):
        if step.index != k:
            raise TraceFormatError(f"malformed trace: step {k} says it is step {step.index}")
        if any(not 0 <= s < len(trace.sequences) for s in step.sequences):
            raise TraceFormatError(f"malformed trace: step {k} names a sequence that the trace does not have")
        if step.gamma < 0 or min(step.real_tokens, step.pad_tokens, step.cache_slots, step.cache_holes) < 0 \
                or step.cache_holes > step.cache_slots:
            raise TraceFormatError(f"malformed trace: step {k} has a negative γ or count, or more holes than slots")
        if min(step.draft_s, step.target_s, step.verify_s, step.end_s, step.explain_s) < 0:
            raise TraceFormatError(f"malformed trace: step {k} has a negative time")
    for i, seq in enumerate(trace.sequences):
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
        if any(not 0 <= t < MAX_INT for t in seq.prompt_ids + seq.output_ids) or seq.finished_s < 0:
            raise TraceFormatError(f"malformed trace: sequence {i} has a negative token id or finish time")
