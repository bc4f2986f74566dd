"""γ policies: how many tokens the draft proposes next, from what the last iterations showed."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from . import theory


@dataclass(frozen=True)
class Feedback:
    """What one iteration tells a policy."""

    gamma: int  # the policy's γ for this iteration
    drafted: Sequence[int]  # tokens each sequence drafted (≤ γ: a confidence stop or the token limit ends some early)
    n_accepted: Sequence[int]  # one count per sequence in the batch
    accept_probs: Sequence[float]  # min(1, p/q) at the drafted tokens examined (up to the first rejection)
    draft_s: float  # time spent drafting (max(drafted) batched draft forwards)
    target_s: float  # time of the one target forward that scored them


def _any_accepted_all(fb: Feedback) -> bool:
    """Some sequence kept every token it drafted."""
    return any(n == d for n, d in zip(fb.n_accepted, fb.drafted))


class Constant:
    name = "constant"

    def __init__(self, gamma: int = 5):
        self.gamma = gamma

    def current(self) -> int:
        return self.gamma

    def update(self, fb: Feedback) -> None:
        pass


class HFHeuristic:
    """transformers' 'heuristic' schedule: +2 when every drafted token was accepted, else -1 (minimum 1)."""

    name = "hf"

    def __init__(self, gamma: int = 5):
        self.gamma = gamma

    def current(self) -> int:
        return self.gamma

    def update(self, fb: Feedback) -> None:
        if _any_accepted_all(fb):
            self.gamma += 2
        else:
            self.gamma = max(1, self.gamma - 1)


class BASS:
    """BASS Algorithm 1 (Qian et al.): grow when any sequence accepted all, shrink faster on repeated misses."""

    name = "bass"

    def __init__(self, gamma: int = 7, incre: int = 2, mod: int = 10, limit: int = 32):
        self.gamma, self.incre, self.mod, self.limit = gamma, incre, mod, limit
        self.streak = 0  # s in the paper: 1 after a step that decreased

    def current(self) -> int:
        return self.gamma

    def update(self, fb: Feedback) -> None:
        best = max(fb.n_accepted)
        if _any_accepted_all(fb):
            self.gamma = min(self.gamma + self.incre, self.limit)
            self.streak = 0
        else:
            self.gamma = self.gamma - math.ceil(self.gamma / self.mod) - self.streak
            self.gamma = max(1, best, self.gamma)
            self.streak = 1


class Optimal:
    """Leviathan §3.5: the γ maximizing (1 - α^{γ+1}) / ((1 - α)(γc + 1)) from running estimates.

    α is the running mean of min(1, p/q) over examined drafted tokens (estimates 1 - D_LK); c is the
    draft's time per token over the target's time per forward, both summed over all iterations so far.
    """

    name = "optimal"

    def __init__(self, gamma: int = 5, max_gamma: int = 32):
        self.gamma, self.max_gamma = gamma, max_gamma
        self.prob_sum = 0.0
        self.prob_count = 0
        self.draft_s = 0.0
        self.draft_tokens = 0
        self.target_s = 0.0
        self.target_calls = 0

    def current(self) -> int:
        return self.gamma

    @property
    def alpha(self) -> float:
        return self.prob_sum / self.prob_count if self.prob_count else 0.0

    @property
    def c(self) -> float:
        if not self.draft_tokens or not self.target_s:
            return 0.0
        return (self.draft_s / self.draft_tokens) / (self.target_s / self.target_calls)

    def update(self, fb: Feedback) -> None:
        self.prob_sum += sum(fb.accept_probs)
        self.prob_count += len(fb.accept_probs)
        self.draft_s += fb.draft_s
        self.draft_tokens += max(fb.drafted)  # draft forwards: the batch drafts its rows together
        self.target_s += fb.target_s
        self.target_calls += 1
        alpha = min(max(self.alpha, 0.0), 0.999)  # α → 1 would make every γ look free
        self.gamma = theory.optimal_gamma(alpha, self.c, self.max_gamma)


_POLICIES = {"constant": Constant, "hf": HFHeuristic, "bass": BASS, "optimal": Optimal}


def default_policy(batch: int) -> str:
    """BASS Algorithm 1 for batches, transformers' heuristic for one sequence."""
    return "bass" if batch > 1 else "hf"


def make_policy(name: str, initial: int | None = None):
    """A fresh policy; `initial` overrides its starting γ (hf/constant/optimal: 5, bass: 7)."""
    cls = _POLICIES[name]
    return cls() if initial is None else cls(initial)
