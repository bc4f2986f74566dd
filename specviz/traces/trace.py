"""The trace: every sequence's decisions, the batch's iterations, a summary, and a versioned JSON form.

Only the trace crosses from the engine to the figures and the page; a trace loaded from JSON draws the
same pictures as a live one. A TraceBuilder turns the engine's records into a Trace; whoever consumes the
records owns its builder, so no trace is shared between the decoding thread and a reader.

Schema version 3: `sequences` (one per decoded sequence: label, prompt and output ids, output text, its
per-iteration decisions, each with the distributions behind it in `why`) and `steps` (per iteration, once
for the batch: γ, timings, padding and cache-hole counts, and `explain_s`). Version 2 files (no `why`, no
`explain_s`) and version 1 files (one sequence, decisions and timings together in `iterations`) are read
and converted (specviz.traces.json_format reads and checks them: a trace file is untrusted input).
"""

from __future__ import annotations

import json
import math
import os
import secrets
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from specviz import theory
from specviz.decoding.cost import CostModel
from specviz.decoding.records import (ACCEPTED, LOOKUP, MODEL, Completed, Decision, Event, Finished, Iteration, Prefilled, StepRecord)

SCHEMA_VERSION = 3


class TraceFormatError(ValueError):
    """A trace file that this version of specviz cannot read; the message says what is wrong."""


def json_number(value: object) -> float | None:
    """A finite number from a trace's free-form meta (untrusted JSON), else None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _str(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _dict(value: object) -> dict[str, Any] | None:
    return value if isinstance(value, dict) else None


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

    # ---- the run's settings, read from meta --------------------------------------------------------
    # meta is free-form JSON (a loaded trace is untrusted; trace_json checks the types of the keys it knows),
    # so each reader falls back to "not recorded" rather than trusting a value's type.
    @property
    def task(self) -> str | None:
        """The page's task ("summarize", "transcribe"), when recorded."""
        return _str(self.meta.get("task"))

    @property
    def mode(self) -> str | None:
        """The verification mode ("exact", "sigmoid", "baseline", ..., or "target-only"), when recorded."""
        return _str(self.meta.get("mode"))

    @property
    def config(self) -> dict[str, Any]:
        """The run's SpecConfig as a dict (SpecConfig.to_dict); empty when not recorded."""
        return _dict(self.meta.get("config")) or {}

    @property
    def temperature(self) -> float | None:
        """The sampling temperature (0: greedy), when config.sampling records a number."""
        return json_number((_dict(self.config.get("sampling")) or {}).get("temperature"))

    @property
    def stopped(self) -> bool:
        """Whether someone stopped the run before it finished (the page records it)."""
        return bool(self.meta.get("stopped"))

    @property
    def costs(self) -> CostModel | None:
        """The call costs the run measured (meta["costs"]); None for target-only runs, older traces, or a table
        CostModel does not accept."""
        table = _dict(self.meta.get("costs"))
        if table is None:
            return None
        try:
            return CostModel.from_dict(table)
        except ValueError:
            return None

    @property
    def target_only(self) -> dict[str, Any] | None:
        """What the run keeps about the target-only run it is measured against (report.reference_meta)."""
        return _dict(self.meta.get("target_only"))

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

    def decisions_by_step(self) -> dict[tuple[int, int], Decision]:
        """(step index, sequence index) -> that sequence's decision in that iteration."""
        return {(d.step, d.sequence): d for d in self.decisions()}

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

    def alpha_by_position(self, drafter: str | None = None) -> list[float]:
        """α at draft position k (0-based): the mean of min(1, p/q) over the drafts examined there, i.e. the
        chance of passing k once 0..k-1 passed. Ends at the last position any draft was examined. `drafter`:
        only the drafts of MODEL or LOOKUP (a run that mixes them)."""
        sums: list[float] = []
        counts: list[int] = []
        for d in self.drafted():
            if drafter is not None and d.drafter != drafter:
                continue
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
            "mode": self.mode,
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
            # per verification call: plain steps (γ = 0) call none, and with the cost policy they can be most
            # iterations (a median over every step read 0 ms for a batch that verified 22 times in 57)
            if verified := [s.verify_s for s in steps if s.gamma > 0]:  # a crafted trace may lack its steps
                out.update(median_verify_ms=1e3 * statistics.median(verified))
            out.update(lookup_share=sum(d.drafter == LOOKUP for d in drafted) / len(drafted),
                       cost_ratio=self.cost_ratio())
        if explained := sum(s.explain_s for s in steps):
            out.update(explain_s=explained)
        if (costs := self.costs) is not None and costs.calibration_s > 0:
            out.update(calibration_s=costs.calibration_s)  # the cost policy's measuring, off the clock
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

    def until(self, steps: int | None) -> "Trace":
        """The trace as it stood after its first `steps` iterations (the page's replay); None: the whole trace.

        Outputs are rebuilt from the decisions' token texts, which is what the token view shows; the
        full trace keeps the tokenizer's own decoding."""
        if steps is None or steps >= len(self.steps):
            return self
        steps = max(0, steps)
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

    def to_json(self) -> str:
        """The trace as the indented JSON a trace file holds; ValueError for a value JSON cannot hold."""
        return json.dumps(self.to_dict(), ensure_ascii=False, allow_nan=False, indent=2)

    def save(self, path: str | Path) -> None:
        """Write the trace as indented UTF-8 JSON, whole or not at all.

        The text goes to a fresh temporary file beside `path` and replaces it only when complete, so a reader
        never sees half a trace; on any failure (a value JSON cannot hold, a full disk) the partial file is
        removed and `path` is left as it was.
        """
        path = Path(path)
        text = self.to_json()
        partial = path.with_name(f".{path.name}.{secrets.token_hex(4)}.part")
        handle = open(partial, "x", encoding="utf-8")  # "x": a new file, never someone else's
        try:
            with handle:
                handle.write(text)
            os.replace(partial, path)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise


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
            read = trace.meta.setdefault("prefill_s_by_model", {})  # what each model's reading of the input took
            for model, seconds in event.by_model:
                read[model] = read.get(model, 0.0) + seconds
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
