"""γ policies follow their published rules."""

from __future__ import annotations

import pytest

from specviz import theory
from specviz.decoding.gamma import (BASS, DEFAULT_POLICY, Constant, Feedback, HFHeuristic, Optimal, Replay,
                                    make_policy)


def fb(gamma: int, accepted: list[int], probs=(0.5,), draft_s=0.1, target_s=1.0, drafted=None) -> Feedback:
    return Feedback(gamma, drafted or [gamma] * len(accepted), accepted, {0: list(probs)}, draft_s, target_s)


def test_constant_never_moves():
    p = Constant(4)
    for n in (0, 4, 2):
        p.update(fb(4, [n]))
        assert p.current() == 4


def test_hf_heuristic_plus_two_minus_one_floor_one():
    p = HFHeuristic()
    assert p.current() == 5
    p.update(fb(5, [5]))
    assert p.current() == 7
    p.update(fb(7, [3]))
    assert p.current() == 6
    for _ in range(10):
        p.update(fb(p.current(), [0]))
    assert p.current() == 1


def test_bass_algorithm_1():
    p = BASS()
    assert p.current() == 7
    p.update(fb(7, [7, 2]))  # one sequence took everything: grow by l_incre
    assert p.current() == 9
    p.update(fb(9, [3, 1]))  # 9 - ceil(9/10) - 0 = 8, floored at max accepted (3)
    assert p.current() == 8
    p.update(fb(8, [2, 0]))  # consecutive decrease: 8 - ceil(8/10) - 1 = 6
    assert p.current() == 6
    p.update(fb(6, [5, 1]))  # 6 - 1 - 1 = 4, but never below the best sequence's 5
    assert p.current() == 5
    for _ in range(20):
        p.update(fb(p.current(), [p.current()]))
    assert p.current() == 32  # l_limit
    for _ in range(40):
        p.update(fb(p.current(), [0]))
    assert p.current() == 1


def test_optimal_picks_leviathan_argmax_from_running_estimates():
    p = Optimal()
    assert p.current() == 5
    # α ≈ 0.8, c = (0.2 s / 4 tokens) / (1.0 s / 1 forward) = 0.05
    p.update(Feedback(4, [4], [2], {0: [0.9, 0.7, 0.8]}, 0.2, 1.0))
    assert p.alpha == pytest.approx(0.8)
    assert p.c == pytest.approx(0.05)
    best = max(range(1, 33), key=lambda g: theory.walltime_factor(0.8, g, 0.05))
    assert p.current() == best
    assert theory.walltime_factor(0.8, best, 0.05) >= theory.walltime_factor(0.8, best + 1, 0.05)
    # a draft as slow as the target makes speculation pointless: γ falls to 1
    p2 = Optimal()
    p2.update(Feedback(4, [4], [0], {0: [0.1]}, 4.0, 1.0))
    assert p2.current() == 1


def test_a_row_that_kept_its_shorter_draft_counts_as_all_accepted():
    """With ragged drafts (a confidence stop), 'accepted all' is per row: 3 of 3 drafted grows γ."""
    p = HFHeuristic()
    p.update(fb(5, [3, 2], drafted=[3, 5]))
    assert p.current() == 7
    b = BASS()
    b.update(fb(7, [3, 2], drafted=[7, 7]))  # nobody kept all 7: shrink
    assert b.current() == 6


def test_the_default_policy_is_the_cost_aware_one():
    assert DEFAULT_POLICY == "cost"


def test_replay_reads_its_schedule_and_holds_the_last_gamma():
    p = make_policy("replay", schedule=(3, 0, 5))
    assert isinstance(p, Replay)
    seen = []
    for _ in range(5):
        seen.append(p.current())
        p.update(fb(seen[-1], [0]))
    assert seen == [3, 0, 5, 5, 5]
    with pytest.raises(ValueError, match="schedule"):
        make_policy("replay")


def test_make_policy_initial():
    assert make_policy("hf").current() == 5
    assert make_policy("bass").current() == 7
    assert make_policy("constant", 3).current() == 3


def test_theory_formulas():
    assert theory.expected_tokens(0.0, 5) == 1.0
    assert theory.expected_tokens(1.0, 5) == 6.0
    assert theory.expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert theory.walltime_factor(0.5, 2, 0.0) == pytest.approx(1.75)
    # Leviathan Table: α = 0.8, c = 0.05 gives optimal γ around 7-8 (their Figure 3)
    assert theory.optimal_gamma(0.8, 0.05) in (7, 8)


def _decided(sequence: int, drafted: list[int], accepted: int, next_id: int, drafter: str = "model"):
    from specviz.decoding.records import ACCEPTED, BONUS, DISCARDED, REJECTED, RESAMPLED, Decision

    g = len(drafted)
    outcome = [ACCEPTED] * accepted + ([REJECTED] if accepted < g else []) + [DISCARDED] * max(0, g - accepted - 1)
    return Decision(step=0, sequence=sequence, gamma=g, draft_ids=drafted, draft_text=[""] * g, q=[1.0] * g,
                    p=[0.6] * g, accept_prob=[0.6] * g, uniform=[0.5] * g, outcome=outcome, n_accepted=accepted,
                    next_id=next_id, next_text="", next_kind=BONUS if accepted == g else RESAMPLED,
                    emitted=accepted + 1, drafter=drafter)


def test_lookup_learns_from_iterations_it_did_not_draft():
    """A priced run's lookup samples: where the model drafted, whether lookup's candidate matched the emitted
    tokens (up to the first miss); where lookup drafted, its own examined drafts; no candidate, no sample."""
    decisions = [_decided(0, [7, 8, 9], 2, 4),  # emitted 7 8 4: the candidate 7 8 5 hits twice, then misses
                 _decided(1, [3], 1, 6),  # emitted 3 6: the candidate 3 6 2 matches all that was emitted
                 _decided(2, [1, 2], 0, 9, drafter="lookup"),  # lookup drafted: its examined drafts
                 _decided(3, [5], 1, 5)]  # no candidate
    fb = Feedback.of(2, decisions, draft_s=0.01, target_s=0.02, candidates={0: [7, 8, 5], 1: [3, 6, 2], 2: [1, 2]})
    assert fb.lookup == {0: [1.0, 1.0, 0.0], 1: [1.0, 1.0], 2: [0.6]}
    assert fb.examined_by("lookup") == fb.lookup
    assert fb.examined_by("model") == {0: [0.6, 0.6, 0.6], 1: [0.6], 3: [0.6]}
    assert Feedback.of(2, decisions, draft_s=0.01, target_s=0.02).lookup == {}  # not a priced run
