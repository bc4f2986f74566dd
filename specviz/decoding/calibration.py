"""Calibration: a few timed target, draft and plain calls at the start of a run (`calibrate`), written into a
CostModel, and their on-disk cache per machine, models and batch size (~/.cache/specviz/costs)."""

from __future__ import annotations

import hashlib
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Callable

from specviz.cache import cache_dir, write_json
from specviz.decoding.cost import CostModel
from specviz.machine import describe as describe_machine
from specviz.native import source_digest

CALIBRATION_TOKENS = (1, 2, 3, 4, 6, 8, 12, 16)  # tokens per row scored in the calibration calls
CALIBRATION_REPEATS = 3  # rounds of timed calls (every point once a round), after one warm-up
CALIBRATION_VERSION = 4  # bump when what a calibration measures changes: older cached curves are ignored (v2:
# the plain step timed apart from the one-token forward; one noisy spell priced it at 1.5× that forward for good;
# v4: every point in each round)
CHECK_TOKENS = 4  # a cached curve's shape is checked here, at a plain step and a draft forward, against one token
CHECK_TOLERANCE = 0.25
MAX_GAMMA = CALIBRATION_TOKENS[-1] - 1  # beyond the calibrated curve a γ would be priced by extrapolation
# A curve this process measured, or found to hold, this recently is taken as it is: the spot check costs ~16 calls
# (~0.5 s before a text run on the 2-core Zen 4, off the run's clock but not off the visitor's), and a run's own
# calls still scale the curve to the hour's level; what the check catches, a curve written in a busy spell, was
# ruled out minutes ago.
CHECK_INTERVAL_S = 600.0
# curve file -> _clock() at its last measurement or spot check that held, in this process. The page's
# sessions calibrate on threads of one process, so the dict is shared between them: guarded by _checked_lock.
_checked: dict[Path, float] = {}
_checked_lock = threading.Lock()
_clock = time.monotonic  # the memo's clock (a test moves it)


Step = Callable[[int], None]  # runs one call scoring M tokens per row (and undoes it)


def _cache_path(identity: dict) -> Path:
    key = json.dumps({**identity, "machine": describe_machine(), "kernels": source_digest(),
                      "version": CALIBRATION_VERSION}, sort_keys=True)  # new kernels: new prices
    return cache_dir() / "costs" / (hashlib.sha256(key.encode()).hexdigest()[:24] + ".json")


def _read_cached(path: Path) -> dict | None:
    try:
        d = json.loads(path.read_text())
        CostModel.from_dict(d)  # refuse a damaged file: measure again
        return d
    except (OSError, ValueError):
        return None


def timed_rounds(calls: dict[object, Callable[[], None]], repeats: int) -> dict[object, float]:
    """Median seconds of each call over `repeats` rounds that run every call once, after one warm-up of each: a
    slow spell of the host then falls on every point alike, so the curve's shape (what the policy weighs γ by)
    survives it; timed point after point, a spell at 3 tokens once priced them at 1.5× one for good on a Whisper
    target whose true ratio is 1.1×."""
    for call in calls.values():
        call()
    samples: dict[object, list[float]] = {key: [] for key in calls}
    for _ in range(repeats):
        for key, call in calls.items():
            t0 = time.perf_counter()
            call()
            samples[key].append(time.perf_counter() - t0)
    return {key: statistics.median(v) for key, v in samples.items()}


def _shape_holds(cached: CostModel, batch: int, target_step: Step, plain_step: Callable[[], None],
                 draft_step: Callable[[], None] | None) -> bool:
    """Whether this machine still prices CHECK_TOKENS tokens, a plain step and a draft forward against one token as
    the cached curve does (each within CHECK_TOLERANCE): a curve written while the host was busy, or before a change
    of its clocks, is measured again rather than steering every later run (a cached plain step at 1.23× a one-token
    forward, where the two cost the same, overpriced target-only and so every prediction of a Whisper run by ~20%;
    a batch of two windows' draft cached at 0.39 of a target step, 0.27 measured beside it, stepped plainly)."""
    calls = {1: lambda: target_step(1), "plain": plain_step, CHECK_TOKENS: lambda: target_step(CHECK_TOKENS)}
    one = cached.curve[(batch, 1)]
    expected = {CHECK_TOKENS: cached.curve[(batch, CHECK_TOKENS)] / one, "plain": cached.curve_plain[batch] / one}
    if draft_step is not None and batch in cached.curve_draft:
        calls["draft"] = draft_step
        expected["draft"] = cached.curve_draft[batch] / one
    timed = timed_rounds(calls, CALIBRATION_REPEATS)
    return all(abs(timed[key] / timed[1] / ratio - 1) <= CHECK_TOLERANCE for key, ratio in expected.items())


def _checked_lately(path: Path) -> bool:
    with _checked_lock:
        at = _checked.get(path)
    return at is not None and _clock() - at < CHECK_INTERVAL_S


def _mark_checked(path: Path) -> None:
    with _checked_lock:
        _checked[path] = _clock()


def calibrate(costs: CostModel, identity: dict, batch: int, target_step: Step, draft_step: Callable[[], None] | None,
              plain_step: Callable[[], None]) -> None:
    """Measure the target at CALIBRATION_TOKENS per row, a draft forward and a plain step for this batch size,
    or take them from the cache file of this machine, models and batch size where a spot check of its shape
    agrees (no check where this process measured or checked that file within CHECK_INTERVAL_S). Each step undoes
    itself."""
    path = _cache_path({**identity, "batch": batch})
    t0 = time.perf_counter()
    cached = _read_cached(path)
    model = CostModel.from_dict(cached) if cached is not None else None
    if model is not None and not ((batch, 1) in model.curve and (batch, CHECK_TOKENS) in model.curve
                                  and batch in model.curve_plain):
        model = None
    if model is not None and not _checked_lately(path):
        if _shape_holds(model, batch, target_step, plain_step, draft_step):
            _mark_checked(path)
        else:
            model = None
    if model is None:
        # every point in each round (see timed_rounds); the plain step beside the one-token forward it is priced against
        calls: dict[object, Callable[[], None]] = {1: lambda: target_step(1), "plain": plain_step}
        calls.update({m: (lambda m=m: target_step(m)) for m in CALIBRATION_TOKENS[1:]})
        if draft_step is not None:
            calls["draft"] = draft_step
        timed = timed_rounds(calls, CALIBRATION_REPEATS)
        for m in CALIBRATION_TOKENS:
            costs.set_target(batch, m, timed[m])
        costs.set_plain(batch, timed["plain"])
        if draft_step is not None:
            costs.set_draft(batch, timed["draft"])
        write_json(path, {"target": [[batch, m, costs.curve[(batch, m)], 0] for m in CALIBRATION_TOKENS],
                      "plain": [[batch, costs.curve_plain[batch], 0]],
                      "draft": [[batch, costs.curve_draft[batch], 0]] if batch in costs.curve_draft else []})
        _mark_checked(path)
    else:
        costs.curve.update(model.curve)
        costs.curve_plain.update(model.curve_plain)
        costs.curve_draft.update(model.curve_draft)
    costs.calibration_s += time.perf_counter() - t0
    costs.calibrated_from_cache = model is not None

