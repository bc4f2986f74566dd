"""The measured cost of each call of an iteration (CostModel): the target's by batch size and tokens scored,
a plain target-only step, a draft forward, verification and the rest, and its JSON table.

Leviathan's speedup assumes a target call costs the same whatever the number of tokens it scores; on a CPU
it does not (8 tokens cost ~2.5× one on the embedded pair), so the curve is measured: a few calls at the
start of a run (specviz.decoding.calibration) and every call of the run after that (`CostModel.observe`),
the last RECENT samples per point, so it follows the machine's load. What each γ is expected to buy on
these costs is specviz.decoding.expectation's.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Sequence

RECENT = 16  # samples kept per point: old enough to smooth noise, recent enough to follow the load
MAX_POINTS = 4096  # a trace's cost table is refused beyond this many entries (untrusted input)


def _mean(samples: Sequence[float]) -> float:
    """The run's own calls are priced by their mean: a run's time is their sum, and on a shared machine
    their distribution has a long tail that a median would leave out."""
    return statistics.fmean(samples)


def _interpolate(points: dict[int, float], x: int) -> float:
    """Piecewise-linear through (tokens, seconds) points; linear extrapolation beyond the last two."""
    xs = sorted(points)
    if x in points:
        return points[x]
    if len(xs) == 1:
        return points[xs[0]] * x / xs[0]  # one point: cost proportional to tokens, the pessimistic guess
    lo = max((k for k in xs if k < x), default=None)
    hi = min((k for k in xs if k > x), default=None)
    if lo is None:
        lo, hi = xs[0], xs[1]
    elif hi is None:
        lo, hi = xs[-2], xs[-1]
    slope = (points[hi] - points[lo]) / (hi - lo)
    return max(points[lo] + slope * (x - lo), 1e-9)


class CostModel:
    """Seconds per part of an iteration, by batch size B and tokens per row M.

    Two sources: the calibration (a whole curve, possibly read from a file written on another day) and
    the run's own calls. A point the run has called often enough is its own mean; any other point is the
    calibrated curve scaled by the run's level, the mean ratio of its calls to the curve, because a
    machine's speed drifts (load, clocks) while the curve's shape does not.

    Written by the decoding driver after every iteration, read by the cost-aware γ policy, both in the
    driver's thread (the policy holds a reference, never a copy)."""

    TRUST = 3  # calls of its own after which a point no longer leans on the calibration
    # A plain step (one token a row, nothing drafted) varies least, and the policy's plain probes buy its own price
    # one step each: two (heat_pumps greedy on the Xeon: a third probe took the run 3.06 → 3.13 s, six rounds each)
    PLAIN_TRUST = 2

    def __init__(self) -> None:
        self.curve: dict[tuple[int, int], float] = {}  # (B, M) → calibrated seconds of a target forward
        self.curve_plain: dict[int, float] = {}  # B → calibrated target-only step (forward over 1 token + draw)
        self.curve_draft: dict[int, float] = {}  # B → calibrated draft forward
        self.target: dict[tuple[int, int], deque] = {}  # the run's own calls, per point
        self.plain: dict[int, deque] = {}
        self.draft: dict[int, deque] = {}
        self.level: dict[int, deque] = {}  # B → the run's target calls over the calibrated curve
        self.verify: deque = deque(maxlen=RECENT)
        self.other: deque = deque(maxlen=RECENT)  # the rest of an iteration: bookkeeping, records
        self.calibration_s = 0.0
        self.calibrated_from_cache = False
        self._seen: set[tuple[int, object]] = set()  # (table, key) whose first call was set aside

    # ---- calibration ---------------------------------------------------------------------------
    def set_target(self, batch: int, tokens: int, seconds: float) -> None:
        self.curve[(batch, tokens)] = seconds

    def set_plain(self, batch: int, seconds: float) -> None:
        self.curve_plain[batch] = seconds

    def set_draft(self, batch: int, seconds: float) -> None:
        self.curve_draft[batch] = seconds

    # ---- the run's calls -----------------------------------------------------------------------
    def _add(self, table: dict, key, seconds: float, setup: bool = True) -> bool:
        """Keep a sample, except a run's first call of each kind and shape where it may pay one-off setup
        (`setup`: a fresh cache, first allocations; a Whisper draft's first call measured twice its step)."""
        if not (seconds > 0 and math.isfinite(seconds)):
            return False
        if setup and (id(table), key) not in self._seen:
            self._seen.add((id(table), key))
            return False
        table.setdefault(key, deque(maxlen=RECENT)).append(seconds)
        return True

    def observe(self, batch: int, gamma: int, scored: int, draft_forwards: int, draft_s: float, target_s: float,
                verify_s: float, other_s: float, draft_caught_up: bool) -> None:
        """One iteration of the run: γ = 0 is a plain step; otherwise the target scored `scored` tokens per
        row and the draft made `draft_forwards` forwards. A draft that first caught up on many tokens (after
        plain steps) is not a sample of its step."""
        if gamma == 0:  # after the run's target has scored drafts, a plain step pays no setup of its own
            self._add(self.plain, batch, target_s, setup=not any(b == batch for b, _ in self.target))
            return
        calibrated = self._calibrated(batch)
        if self._add(self.target, (batch, scored), target_s) and calibrated:
            self.level.setdefault(batch, deque(maxlen=RECENT)).append(target_s / _interpolate(calibrated, scored))
        if draft_forwards and not draft_caught_up:
            self._add(self.draft, batch, draft_s / draft_forwards)
        if verify_s > 0:
            self.verify.append(verify_s)
        if other_s >= 0:
            self.other.append(other_s)

    # ---- estimates ---------------------------------------------------------------------------
    @staticmethod
    def _nearest(batch: int, batches) -> int | None:
        return min(batches, key=lambda b: (abs(b - batch), -b), default=None)

    def _calibrated(self, batch: int) -> dict[int, float]:
        """The calibrated curve of this batch size, else of the nearest calibrated one (rows leave a batch as
        they finish, so smaller batches appear mid-run; the level then absorbs the difference)."""
        near = self._nearest(batch, {b for b, _ in self.curve})
        return {m: s for (b, m), s in self.curve.items() if b == near}

    def _level(self, batch: int) -> float:
        """The run's target calls over the calibrated curve for this batch size (1 before any)."""
        return _mean(self.level[batch]) if self.level.get(batch) else 1.0

    def target_s(self, batch: int, tokens: int) -> float:
        """Seconds of a target forward scoring `tokens` per row of a batch of `batch` rows."""
        return self.target_curve(batch, tokens)[tokens - 1]

    def target_curve(self, batch: int, most: int) -> list[float]:
        """target_s(batch, m) for m = 1..most, reading the tables once (the policy asks every iteration)."""
        return self.target_points(batch, range(1, most + 1))

    def target_points(self, batch: int, tokens: Sequence[int]) -> list[float]:
        """target_s(batch, m) for each m of `tokens` (a catch-up's reading of hundreds of tokens asks for two
        points, not the curve up to there)."""
        calibrated = self._calibrated(batch)
        level = self._level(batch)
        called = {m: _mean(s) for (b, m), s in self.target.items() if b == batch}
        if not calibrated and not called:
            raise LookupError("no target call measured yet")
        out = []
        for m in tokens:
            own = self.target.get((batch, m))
            if own and len(own) >= self.TRUST:
                out.append(_mean(own))
            else:
                out.append(_interpolate(calibrated, m) * level if calibrated else _interpolate(called, m))
        return out

    def plain_s(self, batch: int) -> float:
        """Seconds of one target-only step for `batch` rows: its own calls, else the calibrated step's share
        over a one-token forward times today's one-token forward."""
        own = self.plain.get(batch)
        if own and len(own) >= self.PLAIN_TRUST:
            return _mean(own)
        near = self._nearest(batch, self.curve_plain)
        if near is not None and (near, 1) in self.curve:
            return self.curve_plain[near] / self.curve[(near, 1)] * self.target_s(batch, 1)
        return self.target_s(batch, 1)

    def plain_calls(self, batch: int) -> int:
        """How many of the run's own plain steps for `batch` rows `plain_s` rests on."""
        return len(self.plain.get(batch, ()))

    def draft_s(self, batch: int) -> float:
        """Seconds of one draft forward; 0 when no draft model has run (prompt lookup costs ~nothing)."""
        own = self.draft.get(batch)
        if own and (len(own) >= self.TRUST or batch not in self.curve_draft):
            return _mean(own)
        near = self._nearest(batch, self.curve_draft)
        if near is not None:  # at the run's level, as the target's curve is: a slow spell slowed both alike
            return self.curve_draft[near] * self._level(batch)
        near = self._nearest(batch, self.draft)
        return _mean(self.draft[near]) if near is not None else 0.0

    def verify_s(self) -> float:
        return _mean(self.verify) if self.verify else 0.0

    def other_s(self) -> float:
        return _mean(self.other) if self.other else 0.0

    def iteration_s(self, batch: int, gamma: int) -> float:
        """Expected seconds of an iteration drafting γ tokens per row (γ = 0: a plain target step)."""
        if gamma == 0:
            return self.plain_s(batch)
        return gamma * self.draft_s(batch) + self.target_s(batch, gamma + 1) + self.verify_s() + self.other_s()

    @property
    def ready(self) -> bool:
        return bool(self.curve) or any(m == 1 for (_, m) in self.target)

    # ---- the trace's copy --------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The estimates at every point calibrated or called, with how many of the run's calls each rests on
        (what a trace keeps; old traces simply lack it)."""
        batches = sorted({b for b, _ in self.curve} | {b for b, _ in self.target} | set(self.plain))
        target, plain, draft = [], [], []
        for b in batches:
            tokens = sorted(set(self._calibrated(b)) | {m for (bb, m) in self.target if bb == b})
            target += [[b, m, self.target_s(b, m), len(self.target.get((b, m), ()))] for m in tokens]
            plain.append([b, self.plain_s(b), len(self.plain.get(b, ()))])
            if self.draft_s(b) > 0:
                draft.append([b, self.draft_s(b), len(self.draft.get(b, ()))])
        return {"target": target, "plain": plain, "draft": draft, "verify_s": self.verify_s(),
                "other_s": self.other_s(), "calibration_s": self.calibration_s,
                "calibrated_from_cache": self.calibrated_from_cache}

    @classmethod
    def from_dict(cls, d: object) -> "CostModel":
        """A model whose curve is a trace's (or a cache file's) table; ValueError with a message for anything
        malformed."""
        if not isinstance(d, dict):
            raise ValueError("costs must be an object")
        model = cls()

        def rows(name: str, width: int) -> list[list[float]]:
            value = d.get(name, [])
            if not isinstance(value, list) or len(value) > MAX_POINTS:
                raise ValueError(f"costs.{name} must be a list of at most {MAX_POINTS} entries")
            for row in value:
                if not (isinstance(row, list) and len(row) == width and all(_number(x) for x in row)):
                    raise ValueError(f"costs.{name} entries must be lists of {width} finite numbers")
                if any(x != int(x) or not 1 <= x <= MAX_POINTS for x in row[:width - 2]) or not 1e-9 <= row[-2] < 1e6:
                    raise ValueError(f"costs.{name} holds a batch, a token count or seconds out of range")
            return value

        for b, m, s, _ in rows("target", 4):
            model.set_target(int(b), int(m), float(s))
        for b, s, _ in rows("plain", 3):
            model.set_plain(int(b), float(s))
        for b, s, _ in rows("draft", 3):
            model.set_draft(int(b), float(s))
        for name, samples in (("verify_s", model.verify), ("other_s", model.other)):
            value = d.get(name, 0.0)
            if not _number(value) or not 0 <= value < 1e6:
                raise ValueError(f"costs.{name} must be a number of seconds")
            if value > 0:
                samples.append(float(value))
        calibration_s = d.get("calibration_s", 0.0)  # what measuring these costs took, off the run's clock
        if not _number(calibration_s) or not 0 <= calibration_s < 1e6:
            raise ValueError("costs.calibration_s must be a number of seconds")
        model.calibration_s = float(calibration_s)
        return model


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
