"""Why a run paid or did not: the speedup its measured costs predict, the time split of its iterations, the
break-even α, and one plain sentence built from those numbers. Built from a trace alone (its cost table,
specviz.decoding.cost, and its steps and decisions); None for traces without a cost table (target-only runs, and
traces written before the cost model)."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass

from specviz.decoding.expectation import break_even_alpha, catch_up_s
from specviz.decoding.records import DRAFTERS, LOOKUP, MODEL, Decision, drafted_by
from specviz.theory import expected_tokens_by_position
from specviz.traces.trace import Trace


@dataclass(frozen=True)
class Prediction:
    speedup: float  # predicted decoding speedup over target-only (a prediction, from measured costs and α)
    tokens_per_iteration: float  # predicted, over the drafting iterations (α by position, each row's γ)
    measured_tokens_per_iteration: float  # what those iterations kept
    alphas: list[float]  # α by draft position over the run
    gamma: int  # the γ the run drafted most often
    scored_ratio: float  # a target call scoring γ + 1 tokens over one scoring 1, at that γ (measured)
    split_s: dict[str, float]  # median seconds of a drafting iteration: draft, target, verify, other
    plain_s: float  # one target-only step (a forward over one token and the draw), measured
    iteration_steps: float  # a drafting iteration's seconds in target-only steps
    break_even: float | None  # the α at which that γ neither gains nor loses; None: no α pays
    plain_share: float  # share of iterations that were plain target steps (γ = 0)
    batch: int
    lookup_share: float = 0.0  # share of drafting iterations that prompt lookup alone drafted (no draft step)
    # where plain_s comes from: "reference" (a target-only run on the same input and settings: its decoding time
    # per step) or "costs" (the run's cost table: its own plain steps, else the calibration's price)
    plain_from: str = "costs"

    @property
    def verdict(self) -> str:
        """Whether the kept tokens outweigh the cost, from the measured iterations (not the prediction)."""
        margin = self.measured_tokens_per_iteration / self.iteration_steps if self.iteration_steps else 0.0
        return "faster" if margin > 1.02 else "slower" if margin < 0.98 else "even"


def _others(trace: Trace) -> list[float]:
    """The rest of each iteration: wall time between iteration ends less its draft, target and verify."""
    out = []
    for prev, step in zip(trace.steps, trace.steps[1:]):
        if step.gamma > 0 and step.sequences == prev.sequences:  # a new group starts with a prefill
            out.append(max(0.0, step.end_s - prev.end_s - step.draft_s - step.target_s - step.verify_s))
    return out


def _still_needed(trace: Trace) -> dict[tuple[int, int], int]:
    """(step, sequence) -> the tokens that sequence emitted from that iteration to its end. An iteration is worth to
    a row at most what its output still needed: drafts past its EOS or its budget are cut, and on a short output
    (a speech window: ~11 iterations) pricing the last iteration's full expectation over-predicted by ~10%."""
    needed = {}
    for seq in trace.sequences:
        left = sum(d.emitted for d in seq.decisions)
        for d in sorted(seq.decisions, key=lambda d: d.step):
            needed[(d.step, d.sequence)] = left
            left -= d.emitted
    return needed


def _reference_rate(trace: Trace, target_only_tokens_per_s: float | None) -> float | None:
    """Target-only's measured decoding speed (tokens/s over all sequences): the argument, else the reference the
    trace records (meta["target_only"], the page's); None where neither is known."""
    rate = target_only_tokens_per_s
    if rate is None and trace.target_only:
        rate = trace.target_only.get("decode_tokens_per_s")
    return float(rate) if isinstance(rate, (int, float)) and not isinstance(rate, bool) and rate > 0 else None


def predict(trace: Trace, target_only_tokens_per_s: float | None = None) -> Prediction | None:
    """The speedup the run's measured call costs and α by draft position predict. The target-only side is a
    measured reference's decoding speed where one exists (target_only_tokens_per_s, or the trace's
    meta["target_only"]): a plain step's price from the calibration moved ±15–20% with the host's load (docs/
    history.md, the speech predictions), while a reference measures exactly what the prediction is set against.
    Without one, plain steps are priced from the cost table."""
    costs = trace.costs
    drafting = [s for s in trace.steps if s.gamma > 0]
    alphas = trace.alpha_by_position()
    if costs is None or not costs.ready or not drafting or not alphas:
        return None
    # where a run mixes proposers, each row's drafts are priced with its own drafter's α; an iteration that only
    # prompt lookup drafted costs no draft step, and the draft model pays for what it missed (after lookup or
    # plain steps) where it drafts again, by reading it first: priced there, as the run paid it (a run whose model
    # sat out for good pays nothing; charged to every lookup iteration instead, a batch of 4 read 0.89× predicted
    # against 1.09× measured)
    by_drafter = {who: trace.alpha_by_position(who) or alphas for who in DRAFTERS}
    by_step: dict[int, list[Decision]] = {}
    for d in trace.decisions():
        by_step.setdefault(d.step, []).append(d)
    reference = _reference_rate(trace, target_only_tokens_per_s)
    needed = _still_needed(trace)
    spec_s = target_only_s = predicted_tokens = 0.0
    lag = 0.0  # tokens a row has made since the draft model last read its row, expected
    previous: set[int] = set()
    for step in trace.steps:
        batch = len(step.sequences)
        if not set(step.sequences) <= previous:  # a new group: fresh decoders, prefilled, nothing to catch up on
            lag = 0.0
        previous = set(step.sequences)
        rows = by_step.get(step.index, [])
        # E[min(tokens, still needed)]: the expectation over the positions the output could still use
        tokens = sum(expected_tokens_by_position(by_drafter[d.drafter], max(0, min(d.gamma, needed[(d.step, d.sequence)] - 1)))
                     if d.gamma else 1.0 for d in rows)
        spec_s += costs.iteration_s(batch, step.gamma)
        if step.gamma and drafted_by(rows) == LOOKUP:  # no draft step
            spec_s -= step.gamma * costs.draft_s(batch)
        if step.gamma and any(d.drafter == MODEL and d.gamma for d in rows):
            if lag > 2:  # 1-2 tokens: what every draft's first forward reads anyway
                spec_s += catch_up_s(costs, batch, lag) - costs.draft_s(batch)
            lag = 1.0  # the token verification added
        else:
            lag += tokens / batch if batch else 0.0
        target_only_s += tokens * (1 / reference if reference else costs.plain_s(batch) / batch)
        if step.gamma > 0:
            predicted_tokens += tokens / batch
    drafted = trace.drafted()
    measured = sum(d.emitted for d in drafted) / len(drafted)  # what the output kept (cut at its EOS and budget)
    gamma = Counter(s.gamma for s in drafting).most_common(1)[0][0]
    batch = Counter(len(s.sequences) for s in drafting).most_common(1)[0][0]
    others = _others(trace)
    split = {"draft": statistics.median(s.draft_s for s in drafting),
             "target": statistics.median(s.target_s for s in drafting),
             "verify": statistics.median(s.verify_s for s in drafting),
             "other": statistics.median(others) if others else 0.0}
    plain = batch / reference if reference else costs.plain_s(batch)
    return Prediction(
        speedup=target_only_s / spec_s if spec_s else 0.0,
        tokens_per_iteration=predicted_tokens / len(drafting),
        measured_tokens_per_iteration=measured,
        alphas=alphas, gamma=gamma,
        scored_ratio=costs.target_s(batch, gamma + 1) / costs.target_s(batch, 1),
        split_s=split, plain_s=plain, plain_from="reference" if reference else "costs",
        iteration_steps=sum(split.values()) / plain if plain else 0.0,
        break_even=break_even_alpha(costs, batch, gamma),
        plain_share=1 - len(drafting) / len(trace.steps),
        batch=batch,
        lookup_share=sum(drafted_by(by_step.get(st.index, [])) == LOOKUP for st in drafting) / len(drafting),
    )


def sentence(p: Prediction) -> str:
    """One plain sentence from the numbers: what a call costs here, what an iteration kept, the verdict."""
    draft = p.split_s["draft"] / p.plain_s if p.plain_s else 0.0
    kept = p.measured_tokens_per_iteration
    rows = " per sequence" if p.batch > 1 else ""
    text = (f"Scoring {p.gamma + 1} tokens costs {p.scored_ratio:.1f}× scoring one here, and drafting {p.gamma} "
            f"costs {draft:.1f}× more: an iteration cost as much as {p.iteration_steps:.1f} target-only steps and "
            f"kept {kept:.1f} tokens{rows}")
    if p.verdict == "faster":
        text += ", so it beat target-only."
    elif p.verdict == "slower":
        text += ", so it could not beat target-only."
    else:
        text += ": about even with target-only."
    if p.break_even is None:
        text += f" At γ = {p.gamma} no draft, however good, pays on these costs."
    else:
        text += (f" γ = {p.gamma} pays from α ≈ {p.break_even:.2f} (this run: α ≈ {p.alphas[0]:.2f} at the first "
                 f"position).")
    if p.lookup_share:
        text += (f" Prompt lookup drafted {100 * p.lookup_share:.0f}% of the drafting iterations, with no draft "
                 "step to pay.")
    if p.plain_share:
        text += (f" The cost-aware policy stepped plainly (γ = 0) in {100 * p.plain_share:.0f}% of iterations, "
                 f"where no γ was expected to pay.")
    return text
