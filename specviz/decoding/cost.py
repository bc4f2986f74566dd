"""What an iteration costs here, measured, and what each γ is expected to buy (Leviathan et al. §3 with a
measured cost curve in place of their flat one).

Leviathan's speedup E[tokens] / (γc + 1) assumes a target call costs the same whatever the number of
tokens it scores. On a CPU it does not (8 tokens cost ~2.5× one on the embedded pair), so the expected
speedup of γ for a batch of B rows is

    Σ_rows E_r[tokens | γ] · T_plain(B) / B  /  (γ · T_draft(B) + T_target(B, γ + 1) + T_verify + T_other)

with T_plain(B) = T_target(B, 1) plus drawing the token: one step of target-only decoding, and γ = 0 a
plain target step (speedup 1 by definition). E_r comes from the acceptance by draft position
(`expected_tokens`), not from one α.

The curve is measured: a few calls at the start of a run (`calibrate`, cached on disk per machine, models
and batch size) and every call of the run after that (`CostModel.observe`), the last RECENT samples per
point, so it follows the machine's load.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import time
from collections import deque
from pathlib import Path
from typing import Callable, Sequence

from specviz.cache import cache_dir
from specviz.machine import describe as describe_machine

CALIBRATION_TOKENS = (1, 2, 3, 4, 6, 8, 12, 16)  # tokens per row scored in the calibration calls
CALIBRATION_REPEATS = 2  # timed calls per point (twice as many at one token), after one warm-up
CALIBRATION_VERSION = 2  # bump when what a calibration measures changes: older cached curves are ignored
MAX_GAMMA = CALIBRATION_TOKENS[-1] - 1  # beyond the calibrated curve a γ would be priced by extrapolation
RECENT = 16  # samples kept per point: old enough to smooth noise, recent enough to follow the load
MAX_POINTS = 4096  # a trace's cost table is refused beyond this many entries (untrusted input)


def _median(samples: Sequence[float]) -> float:
    return statistics.median(samples)


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
    def _add(self, table: dict, key, seconds: float) -> bool:
        """Keep a sample, except a run's first call of each kind and shape: it pays one-off setup (a fresh
        cache, first allocations; a Whisper draft's first call measured twice its step)."""
        if not (seconds > 0 and math.isfinite(seconds)):
            return False
        if (id(table), key) not in self._seen:
            self._seen.add((id(table), key))
            return False
        table.setdefault(key, deque(maxlen=RECENT)).append(seconds)
        return True

    def observe(self, batch: int, gamma: int, scored: int, draft_forwards: int, draft_s: float, target_s: float,
                verify_s: float, other_s: float, draft_caught_up: bool) -> None:
        """One iteration of the run: γ = 0 is a plain step; otherwise the target scored `scored` tokens per
        row and the draft made `draft_forwards` forwards. A draft that first caught up on many tokens (after
        plain steps) is not a sample of its step."""
        if gamma == 0:
            self._add(self.plain, batch, target_s)
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

    def target_s(self, batch: int, tokens: int) -> float:
        """Seconds of a target forward scoring `tokens` per row of a batch of `batch` rows."""
        return self.target_curve(batch, tokens)[tokens - 1]

    def target_curve(self, batch: int, most: int) -> list[float]:
        """target_s(batch, m) for m = 1..most, reading the tables once (the policy asks every iteration)."""
        calibrated = self._calibrated(batch)
        level = _mean(self.level[batch]) if self.level.get(batch) else 1.0
        called = {m: _mean(s) for (b, m), s in self.target.items() if b == batch}
        if not calibrated and not called:
            raise LookupError("no target call measured yet")
        out = []
        for m in range(1, most + 1):
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
        if own and len(own) >= self.TRUST:
            return _mean(own)
        near = self._nearest(batch, self.curve_plain)
        if near is not None and (near, 1) in self.curve:
            return self.curve_plain[near] / self.curve[(near, 1)] * self.target_s(batch, 1)
        return self.target_s(batch, 1)

    def draft_s(self, batch: int) -> float:
        """Seconds of one draft forward; 0 when no draft model has run (prompt lookup costs ~nothing)."""
        own = self.draft.get(batch)
        if own and (len(own) >= self.TRUST or batch not in self.curve_draft):
            return _mean(own)
        near = self._nearest(batch, self.curve_draft)
        if near is not None:
            return self.curve_draft[near]
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
        return model


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# ---- expectations ------------------------------------------------------------------------------

def expected_tokens(alphas: Sequence[float], gamma: int) -> float:
    """Expected tokens an iteration appends when the draft at position k passes with probability alphas[k]
    given that every earlier one passed: Σ_{k=0..γ} Π_{j<k} α_j (the last α repeats beyond the list).
    With one α this is Leviathan's (1 - α^{γ+1}) / (1 - α)."""
    total, reach = 1.0, 1.0
    for k in range(gamma):
        a = alphas[min(k, len(alphas) - 1)] if alphas else 0.0
        reach *= min(max(a, 0.0), 1.0)
        total += reach
    return total


def expected_speedup(costs: CostModel, batch: int, gamma: int, alphas_by_row: Sequence[Sequence[float]]) -> float:
    """Tokens per second with γ over target-only's, for a batch of len(alphas_by_row) rows."""
    return speedups(costs, batch, alphas_by_row, gamma)[gamma]


def speedups(costs: CostModel, batch: int, alphas_by_row: Sequence[Sequence[float]],
             max_gamma: int = MAX_GAMMA) -> list[float]:
    """expected_speedup for every γ in 0..max_gamma (index γ), reading the costs once: the cost-aware policy
    decides every iteration, and on a 20 ms Whisper step the naive loop cost a few percent."""
    plain, draft = costs.plain_s(batch), costs.draft_s(batch)
    fixed = costs.verify_s() + costs.other_s()
    target = costs.target_curve(batch, max_gamma + 1)
    tokens = [0.0] * (max_gamma + 1)
    for alphas in alphas_by_row:
        total = reach = 1.0
        tokens[0] += 1.0
        for k in range(max_gamma):
            a = alphas[min(k, len(alphas) - 1)] if alphas else 0.0
            reach *= min(max(a, 0.0), 1.0)
            total += reach
            tokens[k + 1] += total
    return [1.0] + [tokens[g] * plain / (batch * (g * draft + target[g] + fixed)) for g in range(1, max_gamma + 1)]


def best_gamma(costs: CostModel, batch: int, alphas_by_row: Sequence[Sequence[float]],
               max_gamma: int = MAX_GAMMA) -> tuple[int, float]:
    """The γ in 0..max_gamma with the highest expected speedup (ties: the smaller γ), and that speedup."""
    table = speedups(costs, batch, alphas_by_row, max_gamma)
    gamma = max(range(max_gamma + 1), key=lambda g: (table[g], -g))
    return gamma, table[gamma]


def break_even_alpha(costs: CostModel, batch: int, gamma: int) -> float | None:
    """The α (the same at every position) at which γ neither gains nor loses; None when even α = 1 loses."""
    if gamma == 0 or expected_speedup(costs, batch, gamma, [[1.0]] * batch) < 1.0:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        if expected_speedup(costs, batch, gamma, [[mid]] * batch) < 1.0:
            lo = mid
        else:
            hi = mid
    return hi


class RunningAcceptance:
    """α by draft position, per sequence and for the batch, recent iterations weighted most.

    Each examined draft's min(1, p/q) is the chance its context accepts a draft sample, so their mean at
    position k estimates the chance of passing k given that 0..k-1 passed. Position k's estimate leans on
    position k-1's (and position 0's on PRIOR) by a few pseudo-observations, and a sequence's on the
    batch's: a position seen twice is not trusted like one seen fifty times, and a position never reached
    is priced like the one before it, not like the batch's average over deeper, harder positions."""

    PRIOR = 0.8  # before anything is seen: a draft worth trying (a pessimistic prior would never draft)
    PRIOR_WEIGHT = 1.0  # position 0 hears from every iteration that drafts: let it learn fast
    SHRINK = 3.0

    def __init__(self, decay: float = 0.95):
        self.decay = decay  # per iteration that examined something: ~20 iterations of memory
        self.stats: dict[tuple[int | None, int], list[float]] = {}  # (sequence or None, k) → [Σ weight·a, Σ weight]

    def add(self, examined: dict[int, Sequence[float]]) -> None:
        """examined: sequence → min(1, p/q) of its examined drafts, in position order."""
        if not any(examined.values()):
            return
        for entry in self.stats.values():
            entry[0] *= self.decay
            entry[1] *= self.decay
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


# ---- calibration -------------------------------------------------------------------------------

Step = Callable[[int], None]  # runs one call scoring M tokens per row (and undoes it)


def _timed(call: Callable[[], None], repeats: int) -> list[float]:
    call()  # warm-up: first calls allocate
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        out.append(time.perf_counter() - t0)
    return out


def _cache_path(identity: dict) -> Path:
    key = json.dumps({**identity, "machine": describe_machine(), "version": CALIBRATION_VERSION}, sort_keys=True)
    return cache_dir() / "costs" / (hashlib.sha256(key.encode()).hexdigest()[:24] + ".json")


def _read_cached(path: Path) -> dict | None:
    try:
        d = json.loads(path.read_text())
        CostModel.from_dict(d)  # refuse a damaged file: measure again
        return d
    except (OSError, ValueError):
        return None


def calibrate(costs: CostModel, identity: dict, batch: int, target_step: Step, draft_step: Callable[[], None] | None,
              plain_step: Callable[[], None]) -> None:
    """Measure the target at CALIBRATION_TOKENS per row, a draft forward and a plain step for this batch size,
    or take them from the cache file of this machine, models and batch size. Each step undoes itself."""
    path = _cache_path({**identity, "batch": batch})
    t0 = time.perf_counter()
    cached = _read_cached(path)
    if cached is None:
        for m in CALIBRATION_TOKENS:
            # one token sets the level every other price is compared with: more repeats there
            costs.set_target(batch, m, _median(_timed(lambda: target_step(m), 2 * CALIBRATION_REPEATS if m == 1
                                                      else CALIBRATION_REPEATS)))
        costs.set_plain(batch, _median(_timed(plain_step, 2 * CALIBRATION_REPEATS)))
        if draft_step is not None:
            costs.set_draft(batch, _median(_timed(draft_step, CALIBRATION_REPEATS)))
        _write(path, {"target": [[batch, m, costs.curve[(batch, m)], 0] for m in CALIBRATION_TOKENS],
                      "plain": [[batch, costs.curve_plain[batch], 0]],
                      "draft": [[batch, costs.curve_draft[batch], 0]] if batch in costs.curve_draft else []})
    else:
        model = CostModel.from_dict(cached)
        costs.curve.update(model.curve)
        costs.curve_plain.update(model.curve_plain)
        costs.curve_draft.update(model.curve_draft)
    costs.calibration_s += time.perf_counter() - t0
    costs.calibrated_from_cache = cached is not None


def _write(path: Path, d: dict) -> None:
    """Atomically: a reader never sees half a file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(d))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache only costs the next run its calibration
