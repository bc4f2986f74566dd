"""The OpenMP thread teams that torch and the CPU kernels share, and giving a thread's team back.

libgomp keeps a team of worker threads for every OS thread that has run a parallel region, for as long as
that thread lives. While it manages more threads than the machine has cores, it stops letting idle workers
spin and puts them to sleep after every region, so every region of every team then pays a wake-up. On two
cores one idle team is enough: after the main thread had loaded the models, the same decoding in another
thread ran 1.2-1.9x slower (docs/history.md, "A thread's idle OpenMP team"). The page decodes in worker
threads while Gradio's handler threads load models and compare modes, so a thread that computed and lives
on hands its team back when it is done; the next region it runs builds a new one (tens of microseconds).
"""

from __future__ import annotations

import ctypes
import functools
from contextlib import contextmanager
from typing import Iterator

_PAUSE_SOFT = 1  # omp_pause_soft: the runtime frees this thread's team; no state a later region needs is lost


@functools.cache
def _runtime() -> ctypes.CDLL | None:
    """The libgomp already in this process (torch's, which the kernels resolve to), never a second copy."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/libgomp" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        if hasattr(lib, "omp_pause_resource_all"):  # OpenMP 5.0; an older runtime keeps its teams
            lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
            return lib
    return None


def release_team() -> bool:
    """Free the calling thread's OpenMP team (its idle worker threads). False where there is no libgomp with
    OpenMP 5.0's pause (another OpenMP runtime, or torch built without one): nothing is done there."""
    lib = _runtime()
    return lib is not None and lib.omp_pause_resource_all(_PAUSE_SOFT) == 0


@contextmanager
def team_released() -> Iterator[None]:
    """Run a block of work in a thread that outlives it (a page handler), giving the team back after."""
    try:
        yield
    finally:
        release_team()
