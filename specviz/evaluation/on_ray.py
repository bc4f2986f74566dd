"""A sweep's cells as Ray tasks on actors that each load the model pair once: a local Ray on this machine's
cores by default, an existing cluster with an address; a dead worker's cell is retried on a new one."""

from __future__ import annotations

import os
from collections import Counter, deque
from pathlib import Path
from typing import Any, Callable

import torch

from specviz.evaluation.run import (ATTEMPTS, CellRunner, Models, SweepProgress, ResultsFile, _failure, cell_record, header, pending)
from specviz.evaluation.sweep import Cell, Grid

REPO = Path(__file__).resolve().parents[1]  # workers import specviz from the same checkout


class RayUnavailable(RuntimeError):
    pass


class Worker:
    """One Ray actor: a CellRunner on its own pair, with its share of the cores."""

    def __init__(self, models: Models, threads: int):
        torch.set_num_threads(threads)
        self.runner = CellRunner(models)

    def names(self) -> str:
        return self.runner.names

    def pid(self) -> int:
        return os.getpid()

    def run(self, cell: Cell, grid: Grid) -> dict[str, Any]:
        return self.runner.run(cell, grid)


def _ray():
    try:
        import ray
    except ImportError:
        raise RayUnavailable("running a sweep on Ray needs Ray installed (pip install ray); without --ray or "
                             "--address the sweep runs in this process") from None
    return ray


def start(workers: int, address: str | None) -> bool:
    """Connect to Ray (an existing cluster, or a local one with `workers` CPUs); True if started here."""
    ray = _ray()
    if ray.is_initialized():
        return False
    env = {"env_vars": {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}}
    if address:
        ray.init(address=address, runtime_env=env, log_to_driver=False)
    else:
        # the object store only carries cells and results: a small one leaves the memory to the models
        ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False, runtime_env=env,
                 object_store_memory=256 << 20)
    return True


def run_ray(cells: list[Cell], grid: Grid, models: Models, results: ResultsFile, data: str, *, workers: int,
            threads: int, address: str | None = None, on_cell: Callable[[SweepProgress, dict], None] = lambda p, r: None,
            should_stop: Callable[[], bool] = lambda: False, on_workers: Callable[[list], None] = lambda a: None
            ) -> SweepProgress:
    """Every unfinished cell, `workers` at a time. Each finished cell is appended as soon as it returns."""
    ray = _ray()
    todo = deque(pending(cells, models.name, results.finished()))
    progress = SweepProgress(total=len(cells), skipped=len(cells) - len(todo))
    if not todo:
        return progress
    started_here = start(workers, address)
    actor = ray.remote(num_cpus=1, max_restarts=0)(Worker)
    actors: list = []
    try:
        # The first worker loads (and, the first time, converts) the models alone: two processes would
        # otherwise both write the same converted files.
        actors.append(actor.remote(models, threads))
        names = ray.get(actors[0].names.remote())
        actors += [actor.remote(models, threads) for _ in range(workers - 1)]
        on_workers(actors)
        results.start(header(grid, models, data, names, workers, threads))
        attempts: Counter = Counter()
        in_flight: dict = {}

        def submit(i: int) -> None:
            cell = todo.popleft()
            in_flight[actors[i].run.remote(cell, grid)] = (i, cell)

        for i in range(len(actors)):
            if todo:
                submit(i)
        while in_flight:
            (ref,), _ = ray.wait(list(in_flight), num_returns=1)
            i, cell = in_flight.pop(ref)
            record = None
            try:
                record = cell_record(cell, models.name, {"status": "ok", **ray.get(ref)}, f"ray-{i}")
            except ray.exceptions.RayActorError as e:  # the worker died: a new one takes its place
                actors[i] = actor.remote(models, threads)
                on_workers(actors)
                error: BaseException | str = f"its worker died ({type(e).__name__})"
            except ray.exceptions.RayTaskError as e:
                error = e.cause if e.cause is not None else e
            if record is None:
                attempts[cell.key(models.name)] += 1
                if attempts[cell.key(models.name)] < ATTEMPTS:
                    todo.appendleft(cell)
                    progress.retried += 1
                else:
                    record = cell_record(cell, models.name, _failure(error), f"ray-{i}")
            if record is not None:
                results.append(record)
                progress.done += 1
                progress.failed += record["status"] == "failed"
                on_cell(progress, record)
            if todo and not should_stop():
                submit(i)
        return progress
    finally:
        for a in actors:
            ray.kill(a)
        if started_here:
            ray.shutdown()
