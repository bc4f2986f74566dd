"""Running a sweep's cells: one model pair per worker, one record per finished cell appended to a results
file, serially or as Ray tasks on actors; an interrupted sweep resumes where it stopped."""

from __future__ import annotations

import json
import os
import statistics
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from specviz import machine
from specviz.evaluation.examples import Example
from specviz.runs.decode import run
from specviz.runs.tasks import task_of
from specviz.evaluation.sweep import Cell, Grid
from specviz.traces.trace import Trace

ATTEMPTS = 2  # a cell that fails twice (its worker died, or it raised) is recorded as failed
RESULTS_VERSION = 1


@dataclass(frozen=True)
class Models:
    """What a worker loads (once): the pair's names and how to load it, all plain values so that a Ray
    worker on another machine can load the same pair."""

    task: str
    draft: str
    target: str
    device: str | None = None
    dtype: str | None = None
    weights: str = "auto"
    quantized_draft: bool | None = None

    @property
    def name(self) -> str:
        return f"{self.draft} → {self.target}"


def load_models(models: Models):
    return task_of(models.task).load_pair(models.draft, models.target, device=models.device, dtype=models.dtype,
                                          quantized_draft=models.quantized_draft, weights=models.weights)


class CellRunner:
    """Runs cells on one loaded pair (loaded here, or the page's already loaded one). Not shared between
    threads: each worker owns one."""

    def __init__(self, models: Models, pair: Any = None):
        self.models = models
        self.pair = pair if pair is not None else load_models(models)
        self.names = f"{self.pair.draft_name} → {self.pair.target_name}"

    def source(self, example: Example, cfg):
        return task_of(example.task).source(self.pair, [(example.id, example.input)], cfg)

    def run(self, cell: Cell, grid: Grid) -> dict[str, Any]:
        cfg = grid.settings(cell.variant, cell.temperature, cell.seed).spec(cell.example.task)
        started = time.perf_counter()
        trace = run(self.source(cell.example, cfg), cfg, target_only=cell.target_only)
        return measurements(trace, cell, time.perf_counter() - started)


def measurements(trace: Trace, cell: Cell, seconds: float) -> dict[str, Any]:
    """What a results file keeps of one run."""
    s = trace.summary()
    metric, value = task_of(cell.example.task).score(cell.example.reference, trace.output_text)
    by_gamma: dict[int, list[float]] = {}
    for step in trace.steps:
        if step.gamma > 0:
            by_gamma.setdefault(step.gamma, []).append(step.verify_s)
    gap = s.get("sigmoid_gap") or {}
    return {
        "metric": metric, "score": value, "output": trace.output_text, "new_tokens": trace.new_tokens,
        "iterations": len(trace.steps), "tokens_per_s": trace.tokens_per_s,
        "decode_tokens_per_s": trace.decode_tokens_per_s, "alpha": s.get("alpha"),
        "acceptance_rate": s.get("acceptance_rate"), "tokens_per_iteration": s.get("tokens_per_iteration"),
        "verify_calls": sum(len(v) for v in by_gamma.values()), "verify_s": sum(sum(v) for v in by_gamma.values()),
        # Wagner's Figure 3: verification time per call against γ (medians, with how many calls each)
        "verify_by_gamma": {str(g): [statistics.median(v), len(v)] for g, v in sorted(by_gamma.items())},
        "sigmoid_tv": gap.get("mean_tv"), "seconds": seconds,
    }


def cell_record(cell: Cell, models: str, outcome: dict[str, Any], worker: str) -> dict[str, Any]:
    v = cell.variant
    return {"kind": "cell", "key": cell.key(models), "example": cell.example.id, "task": cell.example.task,
            "variant": v.name, "mode": v.mode, "gamma_policy": v.gamma_policy, "gamma_init": v.gamma_init,
            "sigmoid_alpha": v.sigmoid_alpha, "sigmoid_beta": v.sigmoid_beta, "temperature": cell.temperature,
            "seed": cell.seed, "worker": worker, **outcome}


class ResultsFile:
    """A JSONL file: a header line (machine, models, grid, data), then one line per finished cell.

    Each record is one write() of one line on a file opened for appending, flushed to disk before the
    next cell starts: a crash leaves at most a torn last line, which reading skips (and resuming reruns).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def finished(self) -> set[str]:
        """Keys of the cells recorded as done (ok); failed cells get another chance on resume."""
        from specviz.evaluation.results import read_records

        if not self.path.exists():
            return set()
        return {r["key"] for r in read_records(self.path).cells if r["status"] == "ok"}

    def start(self, header: dict[str, Any]) -> None:
        if not self.path.exists() or self.path.stat().st_size == 0:
            self.append({"kind": "sweep", "version": RESULTS_VERSION, **header})

    def append(self, record: dict[str, Any]) -> None:
        line = (json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            if os.fstat(fd).st_size and not _ends_with_newline(fd):
                os.write(fd, b"\n")  # a torn line from a crash stays alone on its line
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)


def _ends_with_newline(fd: int) -> bool:
    return os.pread(fd, 1, os.fstat(fd).st_size - 1) == b"\n"


@dataclass
class SweepProgress:
    """What a sweep reports as cells finish (the CLI's bar, the page's progress)."""

    total: int
    done: int = 0
    failed: int = 0
    skipped: int = 0  # already in the results file (a resumed sweep)
    retried: int = 0  # attempts that failed and ran again


def header(grid: Grid, models: Models, data: str, names: str, workers: int, threads: int) -> dict[str, Any]:
    return {"machine": machine.describe(), "models": names, "task": models.task,
            "data": data, "workers": workers, "threads_per_worker": threads, "grid": grid.to_dict(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S")}


def _failure(error: BaseException | str) -> dict[str, Any]:
    message = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return {"status": "failed", "error": message[:2000]}


def run_serial(cells: list[Cell], grid: Grid, models: Models, results: ResultsFile, data: str,
               on_cell: Callable[[SweepProgress, dict], None] = lambda p, r: None,
               should_stop: Callable[[], bool] = lambda: False, pair: Any = None) -> SweepProgress:
    """Every unfinished cell in this process, one after the other (on `pair` when given)."""
    todo = pending(cells, models.name, results.finished())
    progress = SweepProgress(total=len(cells), skipped=len(cells) - len(todo))
    if not todo:
        return progress
    runner = CellRunner(models, pair)
    results.start(header(grid, models, data, runner.names, 1, torch.get_num_threads()))
    for cell in todo:
        if should_stop():
            break
        record = None
        for attempt in range(ATTEMPTS):
            try:
                record = cell_record(cell, models.name, {"status": "ok", **runner.run(cell, grid)}, "serial")
                break
            except Exception as e:  # recorded, never dropped: the sweep goes on with the next cell
                progress.retried += attempt + 1 < ATTEMPTS
                if attempt + 1 == ATTEMPTS:
                    traceback.print_exc()
                    record = cell_record(cell, models.name, _failure(e), "serial")
        results.append(record)
        progress.done += 1
        progress.failed += record["status"] == "failed"
        on_cell(progress, record)
    return progress


def worker_threads(workers: int) -> int:
    """torch threads per worker: the machine's cores shared out, at least one."""
    return max(1, (os.cpu_count() or 1) // workers)


def pending(cells: Iterable[Cell], names: str, done: set[str]) -> list[Cell]:
    return [c for c in cells if c.key(names) not in done]


