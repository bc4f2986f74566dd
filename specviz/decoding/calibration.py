"""Calibration: a few timed target, draft and plain calls at the start of a run (`calibrate`), written into a
CostModel, and their on-disk cache per machine, models and batch size (~/.cache/specviz/costs)."""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from pathlib import Path
from typing import Callable

from specviz.cache import cache_dir
from specviz.decoding.cost import CostModel
from specviz.machine import describe as describe_machine
from specviz.native import source_digest

CALIBRATION_TOKENS = (1, 2, 3, 4, 6, 8, 12, 16)  # tokens per row scored in the calibration calls
CALIBRATION_REPEATS = 2  # timed calls per point (twice as many at one token), after one warm-up
CALIBRATION_VERSION = 3  # bump when what a calibration measures changes: older cached curves are ignored (v2:
# the plain step timed apart from the one-token forward; one noisy spell priced it at 1.5× that forward for good)
MAX_GAMMA = CALIBRATION_TOKENS[-1] - 1  # beyond the calibrated curve a γ would be priced by extrapolation


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
    key = json.dumps({**identity, "machine": describe_machine(), "kernels": source_digest(),
                      "version": CALIBRATION_VERSION}, sort_keys=True)  # new kernels: new prices
    return cache_dir() / "costs" / (hashlib.sha256(key.encode()).hexdigest()[:24] + ".json")


def _alternating(first: Callable[[], None], second: Callable[[], None], repeats: int) -> tuple[list[float], list[float]]:
    """Both calls timed `repeats` times each, in turns, after one warm-up of each."""
    first()
    second()
    a, b = [], []
    for _ in range(repeats):
        for call, out in ((first, a), (second, b)):
            t0 = time.perf_counter()
            call()
            out.append(time.perf_counter() - t0)
    return a, b


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
        # One token sets the level every other price is compared with, and a plain step is priced as its share of
        # it: those two alternate, so that a slow spell of the host falls on both (more repeats there).
        one, plain = _alternating(lambda: target_step(1), plain_step, 2 * CALIBRATION_REPEATS)
        costs.set_target(batch, 1, statistics.median(one))
        costs.set_plain(batch, statistics.median(plain))
        for m in CALIBRATION_TOKENS[1:]:
            costs.set_target(batch, m, statistics.median(_timed(lambda: target_step(m), CALIBRATION_REPEATS)))
        if draft_step is not None:
            costs.set_draft(batch, statistics.median(_timed(draft_step, CALIBRATION_REPEATS)))
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
