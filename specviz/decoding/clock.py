"""The run's clock: seconds of decoding, CUDA-synchronized, stopped while display-only work runs."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator, TypeVar

import torch

T = TypeVar("T")


class Stopwatch:
    """Run-time seconds; synchronizes CUDA first so that queued kernels are counted where they run.

    `paused()` stops the clock for work that only serves the display (recording the why-panel's
    distributions) and `stopped()` while a consumer holds a yielded record (drawing it, say), so every time
    the trace reports is the time decoding itself took.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.excluded = 0.0  # seconds spent paused so far

    def _wall(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def now(self) -> float:
        return self._wall() - self.excluded

    def paused(self, work: Callable[[], T]) -> tuple[T, float]:
        """Run work with the clock stopped; returns its result and the seconds it took."""
        t0 = self._wall()
        result = work()
        seconds = self._wall() - t0
        self.excluded += seconds
        return result, seconds

    @contextmanager
    def stopped(self) -> Iterator[None]:
        """The clock stands still inside the block (a generator's yield: the consumer's time with a record)."""
        t0 = self._wall()
        try:
            yield
        finally:
            self.excluded += self._wall() - t0
