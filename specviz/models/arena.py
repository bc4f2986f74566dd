"""One block of memory for a model's packed weights, backed by 2 MB pages where the kernel allows it.

Why: a decoding step reads every weight once, in order, and with 4 KB pages that is a TLB miss every 4 KB
(~340,000 per target step). Linux gives 2 MB pages to anonymous memory marked MADV_HUGEPAGE before it is
first touched (transparent huge pages in `madvise` mode, the common default). Measured on a 2-core AMD EPYC
(Zen 4), weights streamed from DRAM, the q4 gate projection: 0.478 → 0.447 ms at one row and 0.553 → 0.486 ms
at four (docs/history.md). Elsewhere (another OS, THP off) the arena is ordinary memory: nothing changes
but the copy.
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64  # each tensor starts on a cache line
_MADV_HUGEPAGE = 14


def _advise_huge_pages(address: int, length: int) -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None)
        libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), _MADV_HUGEPAGE)  # advice: failure is harmless
    except (OSError, AttributeError):
        pass


def footprint(tensors: list[torch.Tensor]) -> int:
    """Bytes an arena needs to hold `tensors`, each starting on a cache line."""
    return sum(n + (-n) % ALIGN for n in (t.numel() * t.element_size() for t in tensors))


class Arena:
    """Fixed-size memory that tensors are copied into, one after another (`place`); the tensors it returns
    keep the arena alive. Not thread-safe: filled once, at load, by one thread."""

    def __init__(self, nbytes: int):
        size = nbytes + HUGE_PAGE  # room to start on a 2 MB boundary
        self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        whole = torch.frombuffer(self._map, dtype=torch.uint8)
        start = (-whole.data_ptr()) % HUGE_PAGE  # the first 2 MB boundary: whole huge pages from there
        _advise_huge_pages(whole.data_ptr() + start, size - start)
        self._bytes = whole[start: start + nbytes]
        self._used = 0

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of `t` (CPU) in the arena, contiguous, same shape and dtype."""
        n = t.numel() * t.element_size()
        if self._used + n > self._bytes.numel():
            raise ValueError(f"the arena is full: {n} more bytes after {self._used} of {self._bytes.numel()}")
        out = self._bytes[self._used: self._used + n].view(t.dtype).view(t.shape)
        out.copy_(t)
        self._used += n + (-n) % ALIGN
        return out
