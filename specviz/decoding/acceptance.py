"""Acceptance by draft position (RunningAcceptance): the running α, per sequence and for the batch, that the
cost-aware γ policy prices each γ with."""

from __future__ import annotations

from typing import Sequence


class RunningAcceptance:
    """α by draft position, per sequence and for the batch, recent iterations weighted most.

    Each examined draft's min(1, p/q) is the chance its context accepts a draft sample, so their mean at
    position k estimates the chance of passing k given that 0..k-1 passed. Position k's estimate leans on
    position k-1's (and position 0's on PRIOR) by a few pseudo-observations, and a sequence's on the
    batch's: a position seen twice is not trusted like one seen fifty times, and a position never reached
    is priced like the one before it, not like the batch's average over deeper, harder positions."""

    PRIOR = 0.8  # before anything is seen: a draft worth trying (a pessimistic prior would never draft)
    # Position 0 hears from every iteration that drafts, but with a greedy draft each sample is 0 or 1: at a weight
    # of 1 one rejection halved the estimate and the cost policy then stepped plainly until a probe (the speech clip:
    # 5 of 50 iterations drafted, 1.02× target-only; at 3, 9 of 23 and 1.28×; news_water sampled 1.42× → 1.91×).
    PRIOR_WEIGHT = 3.0
    SHRINK = 3.0

    def __init__(self, decay: float = 0.95):
        self.decay = decay  # per iteration that examined something: ~20 iterations of memory
        self.stats: dict[tuple[int | None, int], list[float]] = {}  # (sequence or None, k) → [Σ weight·a, Σ weight]

    def fade(self) -> None:
        """Age what was seen by one iteration without adding to it (a drafter that sat out: its estimate
        drifts back towards the prior, so that it is tried again)."""
        for entry in self.stats.values():
            entry[0] *= self.decay
            entry[1] *= self.decay

    def add(self, examined: dict[int, Sequence[float]]) -> None:
        """examined: sequence → min(1, p/q) of its examined drafts, in position order."""
        if not any(examined.values()):
            return
        self.fade()
        for seq, probs in examined.items():
            for k, a in enumerate(probs):
                for key in ((seq, k), (None, k)):
                    entry = self.stats.setdefault(key, [0.0, 0.0])
                    entry[0] += a
                    entry[1] += 1.0

    def alphas(self, sequence: int | None, length: int) -> list[float]:
        out: list[float] = []
        for k in range(length):
            prior, weight = (self.PRIOR, self.PRIOR_WEIGHT) if k == 0 else (out[k - 1], self.SHRINK)
            s, n = self.stats.get((None, k), (0.0, 0.0))
            at_k = (s + weight * prior) / (n + weight)
            if sequence is not None:
                s, n = self.stats.get((sequence, k), (0.0, 0.0))
                at_k = (s + self.SHRINK * at_k) / (n + self.SHRINK)
            out.append(at_k)
        return out
