"""The cost model and the cost-aware γ policy: closed forms on synthetic cost curves, the policy's choice
against brute force, γ = 0 steps in the driver (greedy equality, and the output distribution of a run that
mixes plain and speculative steps by chi-square goodness of fit), calibration's cache, a trace's cost table."""

from __future__ import annotations

import dataclasses
import json
import math
import time

import numpy as np

import pytest
import torch

from specviz.decoding import engine
from specviz import theory
from specviz.theory import expected_tokens_by_position
from specviz.config import SamplingConfig, SpecConfig
from specviz.decoding.acceptance import RunningAcceptance
from specviz.decoding import calibration
from specviz.figures import report
from specviz.decoding.calibration import CALIBRATION_TOKENS, CHECK_TOKENS, MAX_GAMMA, calibrate
from specviz.decoding.cost import CostModel
from specviz.decoding.expectation import best_gamma, break_even_alpha, expected_speedup, priced_speedups, speedups
from specviz.decoding.gamma import CostAware, Feedback, Plan
from specviz.models.loading import ModelPair
from specviz.models.prompt_cache import PromptCache
from specviz.decoding.records import BONUS, RESAMPLED, TARGET
from specviz.runs.decode import run
from specviz.text.source import TextSource, prompt_sequences
from specviz.traces.trace import TraceFormatError
from specviz.traces.json_format import loads_trace

from conftest import decode, perturbed_copy, tiny_qwen, word_tokenizer
from test_verify_statistics import FAMILY_ALPHA, POWER, gof_failure, samples_to_detect_tv


def synthetic(t1: float = 0.1, per_token: float = 0.02, draft: float = 0.01, plain: float | None = None,
              verify: float = 0.0, other: float = 0.0, batch: int = 1) -> CostModel:
    """A cost model whose target call costs t1 + per_token · (M - 1) at every calibrated M."""
    m = CostModel()
    for tokens in CALIBRATION_TOKENS:
        m.set_target(batch, tokens, t1 + per_token * (tokens - 1))
    m.set_plain(batch, t1 if plain is None else plain)
    if draft:
        m.set_draft(batch, draft)
    if verify:
        m.verify.append(verify)
    if other:
        m.other.append(other)
    return m


# ---- closed forms -----------------------------------------------------------------------------------

@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.77, 0.95, 1.0])
@pytest.mark.parametrize("gamma", [0, 1, 4, 9])
def test_one_alpha_is_leviathans_formula(alpha, gamma):
    assert expected_tokens_by_position([alpha], gamma) == pytest.approx(theory.expected_tokens(alpha, gamma))


def test_alphas_by_position_multiply():
    a = [0.9, 0.5, 0.2]
    assert expected_tokens_by_position(a, 3) == pytest.approx(1 + 0.9 + 0.9 * 0.5 + 0.9 * 0.5 * 0.2)
    # the last α repeats
    assert expected_tokens_by_position(a, 5) == pytest.approx(1 + 0.9 + 0.45 + 0.09 + 0.018 + 0.0036)


def test_flat_cost_is_leviathans_speedup():
    """With T(M) = T(1) for every M, no verify or other cost, and T_draft = c·T(1): Theorem 3.8 exactly."""
    m = synthetic(t1=0.2, per_token=0.0, draft=0.2 * 0.3)
    for gamma in (1, 3, 7):
        for alpha in (0.5, 0.8):
            assert expected_speedup(m, 1, gamma, [[alpha]]) == pytest.approx(theory.walltime_factor(alpha, gamma, 0.3))


def test_measured_cost_speedup_closed_form():
    m = synthetic(t1=0.1, per_token=0.03, draft=0.02, plain=0.105, verify=0.004, other=0.001)
    alphas = [[0.8, 0.7], [0.6]]  # two rows of a batch of 2, measured at B = 2 below
    m2 = synthetic(t1=0.15, per_token=0.05, draft=0.03, plain=0.16, verify=0.004, other=0.001, batch=2)
    for gamma in (1, 2, 5):
        tokens = expected_tokens_by_position(alphas[0], gamma) + expected_tokens_by_position(alphas[1], gamma)
        iteration = gamma * 0.03 + 0.15 + 0.05 * gamma + 0.004 + 0.001
        assert expected_speedup(m2, 2, gamma, alphas) == pytest.approx(tokens / iteration * 0.16 / 2)
    assert m.iteration_s(1, 0) == pytest.approx(0.105)  # γ = 0: a plain step
    assert expected_speedup(m, 1, 0, [[0.9]]) == 1.0


@pytest.mark.parametrize("alpha", [0.2, 0.5, 0.7, 0.85, 0.95])
@pytest.mark.parametrize("per_token,draft", [(0.0, 0.005), (0.01, 0.02), (0.03, 0.04), (0.09, 0.05)])
def test_best_gamma_is_the_brute_force_optimum(alpha, per_token, draft):
    m = synthetic(t1=0.1, per_token=per_token, draft=draft, verify=0.002, other=0.001)
    gamma, speedup = best_gamma(m, 1, [[alpha]])
    grid = {g: expected_speedup(m, 1, g, [[alpha]]) for g in range(0, MAX_GAMMA + 1)}
    assert speedups(m, 1, [[alpha]]) == pytest.approx([grid[g] for g in sorted(grid)])  # the one-pass table
    best = max(grid.values())
    assert speedup == pytest.approx(best)
    assert gamma == min(g for g, s in grid.items() if s == best)


def test_nothing_pays_means_gamma_zero():
    """A steep curve (each token scored costs 90% of a call) and a poor draft: every γ loses."""
    m = synthetic(t1=0.1, per_token=0.09, draft=0.05)
    assert best_gamma(m, 1, [[0.4]]) == (0, 1.0)
    assert break_even_alpha(m, 1, 1) is None  # even a perfect draft cannot pay here at γ = 1


def test_break_even_alpha_is_where_the_speedup_crosses_one():
    m = synthetic(t1=0.1, per_token=0.02, draft=0.03)
    for gamma in (1, 3, 6):
        a = break_even_alpha(m, 1, gamma)
        assert a is not None and 0 < a < 1
        assert expected_speedup(m, 1, gamma, [[a]]) == pytest.approx(1.0, abs=1e-6)


def test_unmeasured_points_interpolate_and_unmeasured_batches_borrow_the_shape():
    m = CostModel()
    for tokens, s in ((1, 0.1), (4, 0.16), (8, 0.24)):
        m.set_target(2, tokens, s)
    m.set_plain(2, 0.11)
    assert m.target_s(2, 6) == pytest.approx(0.20)  # between 4 and 8
    assert m.target_s(2, 12) == pytest.approx(0.32)  # extrapolated with the last slope
    assert m.plain_s(1) == pytest.approx(0.11)  # batch 1 never seen: batch 2's numbers
    for _ in range(2):  # the first call of a shape is set aside (one-off setup)
        m.observe(1, 3, 4, 0, 0.0, 0.08, 0.0, 0.0, False)  # batch 1 scores 4 tokens in half batch 2's time
    assert m.target_s(1, 8) == pytest.approx(0.12)  # batch 2's shape at batch 1's level
    assert m.plain_s(1) == pytest.approx(0.055)  # the plain step's share over one token, at that level


def test_the_runs_own_calls_set_the_level_of_a_calibration_from_another_day():
    m = synthetic(t1=0.1, per_token=0.02, draft=0.05, plain=0.105)
    m.observe(1, 3, 4, 3, 3.0, 2.0, 0.002, 0.001, False)  # a run's first call: one-off setup, set aside
    assert m.target_s(1, 4) == pytest.approx(0.16) and m.draft_s(1) == pytest.approx(0.05)
    m.observe(1, 3, 4, 3, 0.18, 0.16 * 1.2, 0.002, 0.001, False)  # today the machine is 20% slower
    assert m.target_s(1, 4) == pytest.approx(0.192)  # not yet trusted alone: the curve at today's level
    assert m.target_s(1, 1) == pytest.approx(0.12) and m.plain_s(1) == pytest.approx(0.126)
    # one call of its own does not yet replace the calibration's draft, priced at today's level as the target is
    assert m.draft_s(1) == pytest.approx(0.05 * 1.2)
    for _ in range(2):
        m.observe(1, 3, 4, 3, 0.18, 0.2, 0.002, 0.001, False)
    assert m.target_s(1, 4) == pytest.approx((0.192 + 0.2 + 0.2) / 3)  # three calls of its own: their mean
    assert m.draft_s(1) == pytest.approx(0.06)
    m.observe(1, 0, 1, 0, 0.0, 0.13, 0.0, 0.0, False)  # plain steps are their own table
    assert m.plain_s(1) == pytest.approx(0.105 / 0.1 * m.target_s(1, 1))  # one: the calibration's share still
    m.observe(1, 0, 1, 0, 0.0, 0.13, 0.0, 0.0, False)
    assert m.plain_s(1) == pytest.approx(0.13)  # PLAIN_TRUST of its own: their mean
    table = CostModel.from_dict(m.to_dict())
    assert table.target_s(1, 4) == pytest.approx(m.target_s(1, 4)) and table.plain_s(1) == pytest.approx(m.plain_s(1))


def test_running_acceptance_learns_positions_and_forgets_slowly():
    acc = RunningAcceptance(decay=1.0)
    for _ in range(200):
        acc.add({0: [0.9, 0.5], 1: [0.2]})
    batch = acc.alphas(None, 3)
    assert batch[0] == pytest.approx(0.55, abs=0.01) and batch[1] == pytest.approx(0.5, abs=0.01)
    assert batch[2] == pytest.approx(batch[1])  # never reached: priced like the position before it
    assert acc.alphas(0, 2)[0] == pytest.approx(0.9, abs=0.01)  # per sequence: its own
    assert acc.alphas(1, 1)[0] == pytest.approx(0.2, abs=0.01)
    fresh = RunningAcceptance()
    assert fresh.alphas(None, 2) == [pytest.approx(RunningAcceptance.PRIOR)] * 2
    once = RunningAcceptance()
    once.add({0: [1.0, 0.0]})  # one greedy iteration: accepted, then rejected
    first, second = once.alphas(None, 2)
    weight = RunningAcceptance.PRIOR_WEIGHT
    assert first == pytest.approx((1 + weight * 0.8) / (1 + weight))
    assert second == pytest.approx((0.0 + 3 * first) / 4)  # one rejection does not condemn position 1
    rejected = RunningAcceptance()
    rejected.add({0: [0.0]})  # nor position 0: one greedy rejection keeps a draft worth trying
    assert rejected.alphas(None, 1)[0] == pytest.approx(weight * 0.8 / (1 + weight)) and weight >= 3
    recent = RunningAcceptance(decay=0.9)
    for a in [0.1] * 50 + [0.9] * 30:
        recent.add({0: [a]})
    assert recent.alphas(None, 1)[0] > 0.8  # the draft got better: the estimate follows


# ---- the policy -------------------------------------------------------------------------------------

def feedback(gamma: int, probs: dict[int, list[float]]) -> Feedback:
    return Feedback(gamma, [gamma] * len(probs), [len(p) for p in probs.values()], probs, 0.0, 0.0)


def test_policy_picks_the_expected_best_gamma():
    m = synthetic(t1=0.1, per_token=0.005, draft=0.01)
    p = CostAware(costs=m)
    for _ in range(60):
        p.update(feedback(p.current() or 1, {0: [0.9] * max(1, p.current())}))
    alphas = [p.acceptance.alphas(None, MAX_GAMMA)]
    assert p.current() == best_gamma(m, 1, alphas)[0] > 3


def test_the_first_gamma_is_short_while_alpha_is_the_priors_guess():
    """Before any draft is examined α is the prior's guess: γ at most PRIOR_MAX_GAMMA, the best among those."""
    m = synthetic(t1=0.1, per_token=0.005, draft=0.01)
    prior = [[RunningAcceptance.PRIOR] * MAX_GAMMA]
    table = speedups(m, 1, prior, MAX_GAMMA)
    cap = CostAware.PRIOR_MAX_GAMMA
    assert best_gamma(m, 1, prior)[0] > cap  # e.g. speech drafted γ = 6 at the prior and lost it
    p = CostAware(costs=m)
    assert p.current() == max(range(1, cap + 1), key=lambda g: table[g]) == cap
    for _ in range(40):
        p.update(feedback(p.current(), {0: [0.9] * p.current()}))
    assert p.current() == best_gamma(m, 1, [p.acceptance.alphas(None, MAX_GAMMA)])[0] > cap
    priced = CostAware(costs=m)  # the same cap where the policy also names who drafts
    assert priced.plan([0], [0]) == Plan(cap, "model")
    short = synthetic(t1=0.1, per_token=0.05, draft=0.01)  # the best γ at the prior is within the cap: kept
    best = best_gamma(short, 1, prior)[0]
    assert 0 < best <= cap and CostAware(costs=short).current() == best


def test_policy_steps_plainly_and_probes_by_expected_loss_where_nothing_pays():
    m = synthetic(t1=0.1, per_token=0.09, draft=0.05)
    p = CostAware(costs=m)
    assert p.current() == 0  # the calibrated costs alone say that no γ pays even at the prior α
    gammas = []
    for _ in range(300):
        g = p.current()
        gammas.append(g)
        p.update(feedback(g, {0: [0.3][:g]}))
    probes = [i for i, g in enumerate(gammas) if g > 0]
    assert probes and all(gammas[i] == 1 for i in probes)  # γ = 1 is the cheapest probe on this curve
    # a probe right after a draft (nothing to catch up on) loses (0.05 + 0.19) / 0.1 - (1 + α) ≈ 1.1 plain steps:
    # one probe per ~38 plain steps would keep probing at 3% of the time
    alphas = [p.acceptance.alphas(None, MAX_GAMMA)]
    speedup = expected_speedup(m, 1, 1, alphas)
    spacing = p.probe_after(1, 1, speedup, lag=1)
    assert spacing == math.ceil((2.4 - expected_tokens_by_position(alphas[0], 1)) / CostAware.EXPLORE_SHARE)
    # but its first forward reads every token the draft missed (here each costs 0.9 of its step: 0.45 of a plain
    # step), so the loss grows faster than the plain run: probes only at the most spacing, PROBE_MAX plain steps
    assert spacing < p.probe_after(1, 1, speedup, lag=2) < p.probe_after(1, 1, speedup, lag=4) == CostAware.PROBE_MAX
    assert np.diff(probes).tolist() == [CostAware.PROBE_MAX + 1] * (len(probes) - 1)
    assert sum(g == 0 for g in gammas) / len(gammas) > 0.95
    near = CostAware(costs=synthetic(t1=0.1, per_token=0.03, draft=0.05))  # drafting nearly pays: probe often
    assert near.probe_after(1, 1, expected_speedup(near.costs, 1, 1, [[0.6]]), lag=1) < spacing


def test_plain_steps_let_an_unlucky_start_fade_back_towards_the_prior():
    """A run whose first drafts were rejected (a window's first words: the speech batch of two stepped plainly to
    its end after three short drafts) does not keep that α for good: each plain step ages it, as a drafter's that
    sits out, so drafting resumes sooner than by probes at the unlucky α alone, and stays."""
    m = synthetic(t1=0.1, per_token=0.01, draft=0.05)  # γ = 1 pays at α 0.8 (1.13×), not at 0.4 (0.88×)

    def run(fading: bool) -> list[int]:
        p = CostAware(costs=m)
        if not fading:
            p.acceptance.fade = lambda: None
        for _ in range(3):
            p.update(feedback(1, {0: [0.0]}))
        assert p.current() == 0 and p.acceptance.alphas(None, 1)[0] < 0.5
        gammas = []
        for _ in range(60):
            gammas.append(p.current())
            p.update(feedback(gammas[-1], {0: [1.0] * gammas[-1]} if gammas[-1] else {}))
        return gammas

    faded, kept = run(True), run(False)
    first = [next((i for i, g in enumerate(gammas) if g), len(gammas)) for gammas in (faded, kept)]
    assert first[0] < 30 < first[1]  # measured: 21 plain steps, against none in 60 (probes come 64 apart here)
    assert sum(g > 0 for g in faded) > 20 and faded[-1] > 1


def test_policy_prices_plain_steps_itself_where_the_choice_is_close():
    """Drafting iterations never time a plain step, and its calibrated price can be off (the curve's shape
    drifts): where the best γ is expected to gain little, every PLAIN_PROBE_EVERY-th iteration is a plain step
    until the run has PLAIN_TRUST of its own; where drafting clearly pays, none."""
    def run(costs: CostModel, alpha: float, iterations: int = 60) -> list[int]:
        p = CostAware(costs=costs)
        gammas = []
        for _ in range(iterations):
            g = p.current()
            gammas.append(g)
            p.update(feedback(g, {0: [alpha] * g}))  # the engine's order: the policy hears, then the costs
            costs.observe(1, g, g + 1, g, 0.02 * g, 0.1 if g == 0 else 0.1 + 0.02 * g, 0.0, 0.0, False)
        return gammas

    close = synthetic(t1=0.1, per_token=0.02, draft=0.02)  # γ = 2 at α = 0.6: ~1.1× a plain step
    gammas = run(close, 0.6)
    plain = [i for i, g in enumerate(gammas) if g == 0]
    every = CostAware.PLAIN_PROBE_EVERY
    assert len(plain) == close.PLAIN_TRUST  # after drafting calls a plain step pays no setup: each one is priced
    assert all(b - a == every + 1 for a, b in zip(plain, plain[1:])) and plain[0] == every
    assert close.plain_calls(1) == close.PLAIN_TRUST and all(g > 0 for g in gammas[plain[-1] + 1:])
    clear = synthetic(t1=0.1, per_token=0.005, draft=0.01)  # drafting pays several times over at α = 0.9
    assert all(g > 0 for g in run(clear, 0.9))
    unpriced = synthetic(t1=0.1, per_token=0.02, draft=0.02)
    unpriced.observe = lambda *args: None  # plain steps whose time never counts (a clock that reads 0, say)
    assert run(unpriced, 0.6, 200).count(0) == CostAware.PLAIN_PROBES  # probing stops anyway


def test_policy_without_measurements_keeps_its_gamma():
    p = CostAware(3, costs=CostModel())
    p.update(feedback(3, {0: [0.5, 0.5, 0.1]}))
    assert p.current() == 3


# ---- calibration and its cache ----------------------------------------------------------------------

def test_calibration_is_measured_once_and_then_read(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECVIZ_CACHE", str(tmp_path))
    monkeypatch.setattr(calibration, "CHECK_INTERVAL_S", 0.0)  # every read spot checked, as in a new process
    calls = []
    per_token = [0.0005]  # the machine's shape: a target call sleeps 2 ms + per_token · M

    def target(m: int) -> None:
        calls.append(("target", m))
        time.sleep(0.002 + per_token[0] * m)

    def plain() -> None:  # a one-token forward and a draw
        calls.append(("plain",))
        time.sleep(0.002 + per_token[0])

    draft_s = [0.001]

    def draft() -> None:
        calls.append(("draft",))
        time.sleep(draft_s[0])

    steps = (target, draft, plain)
    first = CostModel()
    calibrate(first, {"target": "t"}, 1, *steps)
    assert {c[1] for c in calls if c[0] == "target"} == set(CALIBRATION_TOKENS)
    assert not first.calibrated_from_cache and first.ready
    # every point is timed in each round, so a slow spell falls on all of them: rounds interleave the points
    timed = [c[1] for c in calls if c[0] == "target"]
    assert timed.index(CALIBRATION_TOKENS[-1]) < len(timed) - timed[::-1].index(1) - 1
    n = len(calls)
    again = CostModel()
    calibrate(again, {"target": "t"}, 1, *steps)
    spot = calls[n:]  # read from the file after a spot check of its shape: CHECK_TOKENS, a plain step and a draft
    assert {c[1] for c in spot if c[0] == "target"} == {1, CHECK_TOKENS} and ("plain",) in spot
    assert ("draft",) in spot and again.calibrated_from_cache
    assert sorted(again.target) == sorted(first.target)
    per_token[0] = 0.006  # the machine now prices several tokens far above what the file says: measured again
    n = len(calls)
    changed = CostModel()
    calibrate(changed, {"target": "t"}, 1, *steps)
    assert {c[1] for c in calls[n:] if c[0] == "target"} == set(CALIBRATION_TOKENS) and not changed.calibrated_from_cache
    # the new shape is recorded: 4 tokens at (2 + 24) / (2 + 6) = 3.25× one against 1.6× before (1.5×: a margin for
    # sleeps that overshoot on a loaded machine; 2× failed once at 3.10 against 3.15)
    assert changed.curve[(1, CHECK_TOKENS)] / changed.curve[(1, 1)] > 1.5 * again.curve[(1, CHECK_TOKENS)] / again.curve[(1, 1)]
    n = len(calls)
    draft_s[0] = 0.012  # a draft forward now far above its cached share (a busy spell when it was written): again
    slow_draft = CostModel()
    calibrate(slow_draft, {"target": "t"}, 1, *steps)
    assert {c[1] for c in calls[n:] if c[0] == "target"} == set(CALIBRATION_TOKENS)
    assert not slow_draft.calibrated_from_cache and slow_draft.curve_draft[1] > 2 * changed.curve_draft[1]
    draft_s[0] = 0.001
    n = len(calls)
    slow_plain = (target, draft, lambda: (calls.append(("plain",)), time.sleep(0.03)))
    stale = CostModel()  # a plain step now far above its cached share of a one-token forward: measured again
    calibrate(stale, {"target": "t"}, 1, *slow_plain)
    assert {c[1] for c in calls[n:] if c[0] == "target"} == set(CALIBRATION_TOKENS) and not stale.calibrated_from_cache
    n = len(calls)
    other_batch = CostModel()
    calibrate(other_batch, {"target": "t"}, 2, *steps)  # another batch size is another curve
    assert len(calls) > n and not other_batch.calibrated_from_cache
    for f in (tmp_path / "costs").iterdir():  # a damaged file is measured again, never trusted
        f.write_text('{"target": [[1, 1, "x", 2]]')
    n = len(calls)
    damaged = CostModel()
    calibrate(damaged, {"target": "t"}, 1, *steps)
    assert len(calls) > n and not damaged.calibrated_from_cache


def test_a_curve_this_process_just_measured_or_checked_is_read_without_a_spot_check(tmp_path, monkeypatch):
    """The spot check costs ~16 calls before every run; within CHECK_INTERVAL_S of this process measuring the curve,
    or of a check that held, the file is read as it is. Later, or from a file this process has not checked, the
    check runs again; a damaged file is measured again whatever the memo says."""
    monkeypatch.setenv("SPECVIZ_CACHE", str(tmp_path))
    clock = [1000.0]
    monkeypatch.setattr(calibration, "_clock", lambda: clock[0])
    calls = []

    def target(m: int) -> None:  # a shape the spot check can time: 2 ms + 0.5 ms a token
        calls.append(("target", m))
        time.sleep(0.002 + 0.0005 * m)

    steps = (target, lambda: (calls.append(("draft",)), time.sleep(0.001)),
             lambda: (calls.append(("plain",)), time.sleep(0.0025)))
    calibrate(CostModel(), {"target": "memo"}, 1, *steps)  # measured: every point
    assert {c[1] for c in calls if c[0] == "target"} == set(CALIBRATION_TOKENS)
    n = len(calls)
    read = CostModel()
    calibrate(read, {"target": "memo"}, 1, *steps)  # just measured here: read, not one call
    assert len(calls) == n and read.calibrated_from_cache and read.ready
    clock[0] += calibration.CHECK_INTERVAL_S + 1  # later: spot checked again (and it holds: the same calls)
    checked = CostModel()
    calibrate(checked, {"target": "memo"}, 1, *steps)
    assert {c[1] for c in calls[n:] if c[0] == "target"} == {1, CHECK_TOKENS} and checked.calibrated_from_cache
    n = len(calls)
    calibrate(CostModel(), {"target": "memo"}, 1, *steps)  # the check that held counts as a check
    assert len(calls) == n
    for f in (tmp_path / "costs").iterdir():
        f.write_text("not json")
    damaged = CostModel()
    calibrate(damaged, {"target": "memo"}, 1, *steps)
    assert {c[1] for c in calls[n:] if c[0] == "target"} == set(CALIBRATION_TOKENS) and not damaged.calibrated_from_cache


@pytest.mark.parametrize("costs,message", [
    ([], "costs must be an object"),
    ({"target": [[1, 1, "0.1", 2]]}, "finite numbers"),
    ({"target": [[1, 1, 0.1]]}, "lists of 4"),
    ({"target": [[0, 1, 0.1, 2]]}, "out of range"),
    ({"target": [[1, 1.5, 0.1, 2]]}, "out of range"),
    ({"draft": [[1, -0.1, 2]]}, "out of range"),
    ({"verify_s": -1}, "seconds"),
    ({"plain": [[1, 0.1, 1]] * 5000}, "at most"),
])
def test_malformed_cost_tables_are_refused(costs, message):
    with pytest.raises(ValueError, match=message):
        CostModel.from_dict(costs)


# ---- γ = 0 in the driver ----------------------------------------------------------------------------

class Scripted:
    """A policy that plays a fixed γ sequence (then repeats its last value): any γ sequence, 0 included,
    must leave the output exact."""

    name = "scripted"

    def __init__(self, script: list[int], kinds: list[str] = ()):
        self.script, self.kinds, self.i = script, list(kinds), 0

    def current(self) -> int:
        return self.script[min(self.i, len(self.script) - 1)]

    def plan(self, sequences, lookups, **batch) -> Plan:  # a priced run: who drafts, from the script too
        return Plan(self.current(), self.kinds[min(self.i, len(self.kinds) - 1)] if self.kinds else "lookup+model")

    def update(self, fb) -> None:
        self.i += 1


SCRIPT = [3, 0, 0, 2, 0, 4, 1, 0, 0, 0, 5, 0, 2]


@pytest.mark.parametrize("mode", ["baseline", "exact"])
def test_greedy_with_plain_steps_in_the_mix_equals_target_only(tiny_pair, prompt_ids, batch_prompts, mode,
                                                               monkeypatch):
    cfg = SpecConfig(mode=mode, max_new_tokens=40)
    alone = [decode(tiny_pair, [p], cfg, target_only=True).outputs[0] for p in [prompt_ids, *batch_prompts]]
    monkeypatch.setattr(engine, "make_policy", lambda *a, **k: Scripted(SCRIPT))
    single = decode(tiny_pair, [prompt_ids], cfg)
    assert single.outputs == alone[:1]
    assert {d.next_kind for d in single.decisions()} == {TARGET, BONUS, RESAMPLED}
    assert [s.gamma for s in single.steps[:len(SCRIPT)]] == SCRIPT
    batched = decode(tiny_pair, batch_prompts, cfg)  # ragged rows, a draft cache that lags after plain steps
    assert batched.outputs == alone[1:]
    assert loads_trace(json.dumps(batched.to_dict())).outputs == batched.outputs  # γ = 0 steps load back


def test_cost_policy_on_a_draft_costlier_than_its_target(tiny_pair, prompt_ids):
    """A draft with four times its target's layers (and so, on tiny models where a call's fixed costs
    dominate, a step dearer than the target scoring several tokens): drafting cannot pay, so the policy steps
    plainly (with probes) and its greedy output is target-only's; the trace keeps the measured cost table.
    (A copy of the target as the draft costs about what it saves, and the policy's choice then follows the
    machine's noise.)"""
    pair = dataclasses.replace(tiny_pair, draft=tiny_qwen(5, layers=8), draft_name="tiny-deep-draft",
                               draft_prompts=PromptCache(), target_prompts=PromptCache())
    cfg = SpecConfig(mode="exact", gamma_policy="cost", max_new_tokens=40)
    reference = decode(pair, [prompt_ids], cfg, target_only=True)
    trace = decode(pair, [prompt_ids], cfg)
    assert trace.outputs == reference.outputs
    gammas = [s.gamma for s in trace.steps]
    assert gammas.count(0) > len(gammas) / 2, gammas
    costs = CostModel.from_dict(trace.meta["costs"])
    assert costs.ready and costs.draft_s(1) > 0
    loaded = loads_trace(json.dumps(trace.to_dict()))
    assert loaded.meta["costs"] == trace.meta["costs"]
    # the time the policy spent timing calls before decoding is said, beside the times it is left out of
    took = trace.summary()["calibration_s"]
    assert took == trace.meta["costs"]["calibration_s"] > 0 and loaded.summary()["calibration_s"] == took
    assert "for the cost policy" in report.summary_markdown(trace)
    assert "calibration_s" not in reference.summary()  # target-only times nothing beforehand


def test_a_trace_with_a_malformed_cost_table_is_refused(tiny_pair, prompt_ids):
    trace = decode(tiny_pair, [prompt_ids], SpecConfig(gamma_policy="cost", max_new_tokens=6))
    for key, bad in (("target", [[1, 1, 1e300, 1]]), ("calibration_s", -1.0), ("calibration_s", "2 s")):
        d = trace.to_dict()
        d["meta"]["costs"][key] = bad
        with pytest.raises(TraceFormatError, match="meta.costs"):
            loads_trace(json.dumps(d))


GOF_V = 48  # vocabulary of the goodness-of-fit pair: small enough to enumerate two tokens exactly
GOF_TV = 0.06


@pytest.fixture(scope="module")
def small_vocab_pair() -> ModelPair:
    target = tiny_qwen(3, vocab_size=GOF_V)
    draft = perturbed_copy(target, noise=0.5, seed=4)  # disagrees often: rejections and resamples
    return ModelPair(draft, target, word_tokenizer(GOF_V), "gof-draft", "gof-target", GOF_V)


def _second_token_probs(pair: ModelPair, prompt: list[int], sampling: SamplingConfig) -> np.ndarray:
    """P(second output token) by enumeration over the first; the last entry: the output ended at EOS first."""
    from test_verify_statistics import probs_of

    with torch.inference_mode():
        first = probs_of(pair.target(torch.tensor([prompt])).logits[0, -1], sampling)
        rows = torch.tensor([prompt + [x] for x in range(GOF_V)])
        second = np.stack([probs_of(z, sampling) for z in pair.target(rows).logits[:, -1]])
    eos = GOF_V - 1
    out = np.zeros(GOF_V + 1)
    for x in range(GOF_V):
        if x == eos:
            out[GOF_V] += first[x]
        else:
            out[:GOF_V] += first[x] * second[x]
    return out


@pytest.mark.parametrize("script", [[0, 3], [1, 0]], ids=["plain-then-draft", "draft-then-plain"])
def test_runs_mixing_plain_and_speculative_steps_follow_the_target(small_vocab_pair, script, monkeypatch):
    """The second token of a sampled run (T = 1) whose first iteration is a plain step and second a
    speculative one (the draft catches up first), or the reverse, follows the target's two-token marginal.
    Sample size: enough to detect TV 0.06 with power 0.99 at level FAMILY_ALPHA / 2 (two cases)."""
    sampling = SamplingConfig(temperature=1.0)
    prompt = [5, 17, 9, 30, 2]
    p = _second_token_probs(small_vocab_pair, prompt, sampling)
    alpha = FAMILY_ALPHA / 2
    n = samples_to_detect_tv(GOF_TV, int((p > 0).sum()) - 1, alpha, POWER)
    monkeypatch.setattr(engine, "make_policy", lambda *a, **k: Scripted(script))
    batch = 64
    counts = np.zeros(GOF_V + 1, dtype=np.int64)
    kinds = set()
    for seed in range(-(-n // batch)):
        cfg = SpecConfig(mode="exact", sampling=sampling, max_new_tokens=2, seed=seed, explain_top=0)
        source = TextSource(small_vocab_pair, prompt_sequences([("p", prompt)], batch, cfg))
        trace = run(source, cfg, batch_size=batch)
        for out in trace.outputs:
            counts[out[1] if len(out) > 1 else GOF_V] += 1
        kinds |= {d.next_kind for d in trace.decisions()}
    assert {TARGET, RESAMPLED} <= kinds
    assert (failure := gof_failure(counts, p, alpha)) is None, failure


def _priced_policy(draft_s: float, model_alpha: float, lookup_alpha: float) -> CostAware:
    """A cost policy on a fixed table (target 10 ms + 1 ms per extra token) that has seen 30 iterations in
    which the model's drafts passed with model_alpha and lookup's candidates with lookup_alpha."""
    costs = CostModel()
    for m in CALIBRATION_TOKENS:
        costs.set_target(1, m, 0.010 + 0.001 * (m - 1))
    costs.set_plain(1, 0.010)
    costs.set_draft(1, draft_s)
    policy = CostAware(costs=costs)
    for _ in range(30):
        policy.by_drafter["model"].add({0: [model_alpha] * 3})
        policy.by_drafter["lookup"].add({0: [lookup_alpha] * 3})
    return policy


def test_the_priced_plan_names_who_drafts_by_expected_tokens_per_second():
    # a continuation that passes more often than the model's drafts, and costs no draft forward: lookup
    assert _priced_policy(0.003, 0.6, 0.9).plan([0], [8]).kind == "lookup"
    # a continuation that rarely passes against a good, cheap draft: the model
    assert _priced_policy(0.001, 0.9, 0.1).plan([0], [8]).kind == "model"
    # no continuation found: lookup is not on offer
    assert _priced_policy(0.003, 0.6, 0.9).plan([0], [0]).kind == "model"
    # a draft that costs more than the target and no continuation: a plain step
    plain = _priced_policy(0.05, 0.5, 0.9)
    assert plain.plan([0], [0]) == Plan(0, "")
    # with a found continuation a plain step is not the best any more: lookup costs no draft
    assert plain.plan([0], [8]).kind == "lookup"


def test_a_batch_pays_for_its_slowest_row_near_its_end():
    """batch_tokens: after n drafting iterations the slowest of B rows trails the mean by about c_B · σ · √n tokens,
    checked by simulation (4 rows, γ = 1 at α = 0.8, n = 36: 20,000 batches, within 5%), and spread over the
    iterations left; nothing changes for one row, a plain step, or a run whose rows' budgets are not known. A
    priced batch plan that pays early in a run is a plain step when a few tokens are left."""
    from specviz.decoding.expectation import batch_tokens, expected_max_of_normals

    assert expected_max_of_normals(1) == 0 and expected_max_of_normals(2) == pytest.approx(1 / math.sqrt(math.pi),
                                                                                          abs=1e-4)
    assert expected_max_of_normals(4) == pytest.approx(1.0294, abs=1e-3)
    rng = np.random.default_rng(0)
    rows, n, alpha = 4, 36, 0.8
    made = 1 + (rng.random((20000, n, rows)) < alpha).sum(1)  # tokens per row after n iterations
    shortfall = (made.mean(-1) - made.min(-1)).mean()
    sigma = math.sqrt(alpha * (1 - alpha))
    assert shortfall == pytest.approx(expected_max_of_normals(rows) * sigma * math.sqrt(n), rel=0.05)
    drafting = [(1 + alpha, sigma ** 2)] * rows
    tied = [round(n * (1 + alpha))] * rows
    loss = rows * (1 + alpha) - batch_tokens(drafting, tied)  # per iteration: the total spread over the n left
    assert loss * n == pytest.approx(rows * expected_max_of_normals(rows) * sigma * math.sqrt(n), rel=0.02)
    assert batch_tokens(drafting) == batch_tokens(drafting[:1], tied[:1]) * rows == rows * (1 + alpha)
    assert batch_tokens([(1.0, 0.0)] * rows, tied) == rows  # plain
    assert rows * (1 + alpha) - batch_tokens(drafting, [8] * rows) > 2 * loss  # near the end
    costs = CostModel()
    for m in CALIBRATION_TOKENS:
        costs.set_target(4, m, 0.060 + 0.030 * (m - 1))
    costs.set_plain(4, 0.060)
    costs.set_draft(4, 0.005)
    policy = CostAware(costs=costs)
    for _ in range(30):
        policy.by_drafter["model"].add({s: [0.75] for s in range(4)})
    assert policy.plan([0, 1, 2, 3], [0] * 4, remaining=[200] * 4) == Plan(1, "model")  # 1.08× expected
    assert policy.plan([0, 1, 2, 3], [0] * 4, remaining=[4] * 4) == Plan(0, "")


def test_a_draft_model_that_sat_out_drafts_again_only_where_its_catching_up_pays():
    """After plain steps or lookup iterations the draft model first reads the tokens it missed (one forward over
    `lag` tokens: 0.001 s · target(lag) / target(1) here); it comes back only where its plans' saving over the
    rest of the run, against the best plan without it, covers that."""
    policy = _priced_policy(0.004, 0.9, 0.1)
    assert policy.plan([0], [0], lag=2, remaining=[1]).kind == "model"  # 1-2 tokens: what any first draft reads
    assert policy.plan([0], [0], lag=40, remaining=[]).kind == "model"  # the run's length unknown: no limit
    assert policy.plan([0], [0], lag=40, remaining=[200]).kind == "model"  # a long run left: it pays back
    assert policy.plan([0], [0], lag=40, remaining=[3]) == Plan(0, "")  # three tokens left: it cannot
    # a continuation that passes half the time: below the model while it keeps up; once the model sits out for
    # good, lookup (which reads nothing first, and leaves no catch-up to price) beats a plain step
    lookup = _priced_policy(0.004, 0.9, 0.5)
    assert lookup.plan([0], [8], lag=1, remaining=[200]).kind == "model"
    assert lookup.plan([0], [8], lag=40, remaining=[3]).kind == "lookup"
    # the boundary: the saving of the best model plan over plain steps equals the catch-up's extra reading, with
    # the target's curve extended past its calibrated points (40 tokens: 0.004 · 0.049 / 0.010 s)
    costs = policy.costs
    table = priced_speedups(costs, 1, [policy.by_drafter["model"].alphas(None, MAX_GAMMA)],
                            [policy.by_drafter["lookup"].alphas(None, MAX_GAMMA)], [0], MAX_GAMMA)
    best = max(table.values())
    extra = 0.004 * (0.010 + 0.001 * 39) / 0.010 - 0.004
    boundary = extra / (costs.plain_s(1) * (1 - 1 / best))
    assert 3 < boundary < 200
    assert policy.plan([0], [0], lag=40, remaining=[math.ceil(boundary + 1e-9)]).kind == "model"
    assert policy.plan([0], [0], lag=40, remaining=[math.floor(boundary - 1e-9)]) == Plan(0, "")


PRICED_SCRIPTS = {"plain-then-lookup": ([0, 2], ["", "lookup"]), "lookup-then-model": ([1, 2], ["lookup", "model"]),
                  "model-then-lookup": ([1, 2], ["model", "lookup"])}


@pytest.mark.parametrize("script", list(PRICED_SCRIPTS))
def test_priced_runs_mixing_proposers_follow_the_target(small_vocab_pair, script, monkeypatch):
    """Draft kind "priced" with who drafts changing between iterations (prompt lookup's one-hot q, the draft
    model catching up on tokens it did not draft, plain steps): the second token of a sampled run (T = 1)
    follows the target's two-token marginal. The prompt ends in a 2-gram that recurs, so lookup proposes.
    Sample size: enough to detect TV 0.06 with power 0.99 at level FAMILY_ALPHA / 3 (three cases)."""
    sampling = SamplingConfig(temperature=1.0)
    prompt = [5, 17, 9, 30, 5, 17]
    p = _second_token_probs(small_vocab_pair, prompt, sampling)
    alpha = FAMILY_ALPHA / 3
    n = samples_to_detect_tv(GOF_TV, int((p > 0).sum()) - 1, alpha, POWER)
    gammas, kinds = PRICED_SCRIPTS[script]
    monkeypatch.setattr(engine, "make_policy", lambda *a, **k: Scripted(gammas, kinds))
    batch = 64
    counts = np.zeros(GOF_V + 1, dtype=np.int64)
    drafters = set()
    for seed in range(-(-n // batch)):
        cfg = SpecConfig(mode="exact", sampling=sampling, max_new_tokens=2, seed=seed, explain_top=0,
                         draft_kind="priced")
        source = TextSource(small_vocab_pair, prompt_sequences([("p", prompt)], batch, cfg))
        trace = run(source, cfg, batch_size=batch)
        for out in trace.outputs:
            counts[out[1] if len(out) > 1 else GOF_V] += 1
        drafters |= {d.drafter for d in trace.decisions() if d.gamma}
    assert drafters == ({"lookup"} if script == "plain-then-lookup" else {"lookup", "model"})
    assert (failure := gof_failure(counts, p, alpha)) is None, failure


# ---- what the page and the CLI say ------------------------------------------------------------------

def test_prediction_and_its_sentence_on_a_run(tiny_pair, prompt_ids):
    """A constant-γ run on the tiny pair: the prediction is built from its own cost table, the time split
    adds up to the iterations it measured, and the page and the figures show it, labelled a prediction."""
    from specviz.figures import report
    from specviz.figures.plots import acceptance_figure, theory_figure
    from specviz.traces.prediction import predict, sentence

    cfg = SpecConfig(mode="exact", gamma_policy="constant", gamma_init=3, max_new_tokens=30)
    trace = decode(tiny_pair, [prompt_ids], cfg)
    p = predict(trace)
    assert p is not None and p.gamma == 3 and p.batch == 1
    costs = CostModel.from_dict(trace.meta["costs"])
    alphas = trace.alpha_by_position()
    # the last iteration may be cut
    assert p.tokens_per_iteration == pytest.approx(expected_tokens_by_position(alphas, 3), rel=0.1)
    drafting = [s for s in trace.steps if s.gamma]
    assert p.split_s["target"] == pytest.approx(float(np.median([s.target_s for s in drafting])))
    assert p.plain_s == pytest.approx(costs.plain_s(1))
    assert p.scored_ratio == pytest.approx(costs.target_s(1, 4) / costs.target_s(1, 1))
    text = sentence(p)
    assert f"Scoring 4 tokens costs {p.scored_ratio:.1f}×" in text and "target-only" in text
    markdown = report.summary_markdown(trace)
    assert f"Predicted: {p.speedup:.2f}×" in markdown and "a prediction" in markdown
    names = [t.name for t in theory_figure(trace).data]
    assert "measured costs, γ=3" in names and "predicted from measured costs" in names
    histogram = [t for t in acceptance_figure(trace).data if t.type == "bar" and t.name == "iterations"]
    assert histogram and sum(histogram[0].y) == len(drafting)


def test_prediction_prices_an_iteration_at_most_what_its_output_still_needed(tiny_pair, prompt_ids):
    """A run whose last iteration drafts past its budget: that iteration is worth only the tokens the output still
    took, E[min(tokens, needed)] (the expectation over the positions it could still use), so the prediction sets
    the same tokens against target-only as the run emitted; priced at its full expectation it over-predicted short
    outputs (a speech window, ~10%)."""
    from specviz.traces.prediction import predict

    cfg = SpecConfig(mode="exact", gamma_policy="constant", gamma_init=6, max_new_tokens=9)
    trace = decode(tiny_pair, [prompt_ids], cfg)
    drafted = trace.drafted()
    assert len(drafted) >= 2
    alphas = trace.alpha_by_position()
    left, worth = sum(d.emitted for d in trace.decisions()), []
    for d in trace.decisions():
        if d.gamma:
            worth.append(expected_tokens_by_position(alphas, min(d.gamma, left - 1)))
        left -= d.emitted
    p = predict(trace)
    assert p.tokens_per_iteration == pytest.approx(sum(worth) / len(worth), rel=1e-9)
    uncapped = sum(expected_tokens_by_position(alphas, d.gamma) for d in drafted) / len(drafted)
    assert p.tokens_per_iteration < uncapped  # the last iteration's γ + 1 positions were more than 9 tokens needed
    assert p.measured_tokens_per_iteration == pytest.approx(sum(d.emitted for d in drafted) / len(drafted))
    assert sum(d.emitted for d in trace.decisions()) == 9


def test_prediction_sets_the_run_against_a_measured_reference(tiny_pair, prompt_ids):
    """Where target-only was measured (compare's reference, the page's meta["target_only"]), the prediction sets
    the run's priced iterations against that speed, not the cost table's plain price; malformed figures fall
    back to the table."""
    from specviz.figures import report
    from specviz.traces.prediction import predict

    cfg = SpecConfig(mode="exact", gamma_policy="constant", gamma_init=3, max_new_tokens=30)
    trace = decode(tiny_pair, [prompt_ids], cfg)
    priced = predict(trace)
    assert priced.plain_from == "costs"
    rate = 1.0 / priced.plain_s  # tokens/s of a target-only run whose steps cost what the table says
    for given in (2 * rate, 0.5 * rate):
        p = predict(trace, given)
        assert p.plain_from == "reference" and p.plain_s == pytest.approx(1 / given)
        assert p.speedup == pytest.approx(priced.speedup * rate / given, rel=1e-9)  # only the target-only side moves
    trace.meta["target_only"] = {"decode_tokens_per_s": 2 * rate}  # the page's record of its reference
    assert predict(trace).speedup == pytest.approx(priced.speedup / 2, rel=1e-9)
    assert "measured by target-only" in report.prediction_markdown(trace)
    for bad in (0.0, -1.0, float("nan"), True, "fast", None):
        trace.meta["target_only"] = {"decode_tokens_per_s": bad}
        assert predict(trace).plain_from == "costs" and predict(trace).speedup == pytest.approx(priced.speedup)


@pytest.mark.parametrize("returns", [True, False], ids=["model-returns", "model-sits-out"])
def test_prediction_prices_the_drafts_catching_up_where_the_run_paid_it(tiny_pair, prompt_ids, monkeypatch,
                                                                      returns):
    """A draft model that sat out ten plain steps first reads the 11 tokens it missed where it drafts again: the
    prediction prices that reading there, once; where it never drafts again, nothing (charged to every iteration it
    sat out instead, a batch of 4 read 0.89× predicted against 1.09× measured)."""
    from specviz.traces import prediction

    script = [1] + [0] * 10 + ([1, 1] if returns else [0, 0])
    monkeypatch.setattr(engine, "make_policy", lambda *a, **k: Scripted(script))
    trace = decode(tiny_pair, [prompt_ids], SpecConfig(mode="exact", max_new_tokens=len(script) + 4))
    assert [s.gamma for s in trace.steps][:len(script)] == script
    read = []

    def catching_up(costs, batch, tokens):
        read.append(tokens)
        return costs.draft_s(batch) + 0.5  # half a second more than one draft step: visible in the prediction

    plain = prediction.predict(trace)
    monkeypatch.setattr(prediction, "catch_up_s", catching_up)
    priced = prediction.predict(trace)
    assert read == ([pytest.approx(11.0)] if returns else [])
    if returns:  # the stub's extra half second is in the run's priced time
        assert priced.speedup < plain.speedup * 0.9
    else:
        assert priced.speedup == pytest.approx(plain.speedup)


def test_prediction_owes_no_catching_up_across_groups(tiny_pair, prompt_ids, batch_prompts, monkeypatch):
    """Sequences beyond the batch size decode in groups, each with fresh, prefilled decoders: a group that ended on
    plain steps leaves the next group's draft nothing to catch up on."""
    from specviz.traces import prediction

    cfg = SpecConfig(mode="exact", max_new_tokens=8)
    script = [1] + [0] * 6 + [1] * 20  # greedy: the first group ends on plain steps, the second drafts from its start
    monkeypatch.setattr(engine, "make_policy", lambda *a, **k: Scripted(script))
    trace = decode(tiny_pair, [prompt_ids, batch_prompts[0]], cfg, batch_size=1)
    groups = [s.sequences for s in trace.steps]
    second = groups.index([1])
    assert all(s.gamma == 0 for s in trace.steps[second - 3:second]) and trace.steps[second].gamma > 0
    read = []
    monkeypatch.setattr(prediction, "catch_up_s", lambda costs, batch, tokens: read.append(tokens) or 0.0)
    prediction.predict(trace)
    assert read == []


def test_traces_without_a_cost_table_predict_nothing(tiny_pair, prompt_ids):
    from specviz.figures import report
    from specviz.traces.prediction import predict

    trace = decode(tiny_pair, [prompt_ids], SpecConfig(max_new_tokens=8))
    del trace.meta["costs"]  # as written before the cost model
    assert predict(trace) is None and "Predicted" not in report.summary_markdown(trace)
    reference = decode(tiny_pair, [prompt_ids], SpecConfig(max_new_tokens=8), target_only=True)
    assert "costs" not in reference.meta and predict(reference) is None


def test_break_even_and_plain_share_in_the_sentence():
    from specviz.traces.prediction import Prediction, sentence

    base = dict(speedup=0.8, tokens_per_iteration=2.0, measured_tokens_per_iteration=2.1, alphas=[0.7], gamma=2,
                scored_ratio=1.4, split_s={"draft": 0.1, "target": 0.14, "verify": 0.0, "other": 0.0}, plain_s=0.1,
                iteration_steps=2.4, break_even=0.83, plain_share=0.0, batch=1)
    slow = sentence(Prediction(**base))
    assert "could not beat target-only" in slow and "α ≈ 0.83" in slow and "plainly" not in slow
    mixed = sentence(Prediction(**{**base, "break_even": None, "plain_share": 0.6}))
    assert "no draft, however good, pays" in mixed and "60% of iterations" in mixed
    fast = sentence(Prediction(**{**base, "measured_tokens_per_iteration": 3.0}))
    assert "so it beat target-only" in fast
