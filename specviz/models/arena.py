"""Memory backed by 2 MB pages where the kernel allows it: one block for a model's packed weights (Arena), chunks
for the buffers of KV caches (Pool).

Why: a decoding step reads every weight once, in order, and with 4 KB pages that is a TLB miss every 4 KB
(~340,000 per target step). Linux gives 2 MB pages to anonymous memory marked MADV_HUGEPAGE before it is
first touched (transparent huge pages in `madvise` mode, the common default). Measured on a 2-core AMD EPYC
(Zen 4), weights streamed from DRAM, the q4 gate projection: 0.478 → 0.447 ms at one row and 0.553 → 0.486 ms
at four (docs/history.md). Elsewhere (another OS, THP off) the arena is ordinary memory: nothing changes
but the copy.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import sys
import threading
import weakref

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


def _mapping(nbytes: int) -> mmap.mmap:
    """Anonymous memory for nbytes from a 2 MB boundary on (with room to reach one)."""
    return mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def _on_huge_pages(mapping: mmap.mmap, nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] of `mapping` from its first 2 MB boundary on, marked for 2 MB pages (again on a reused
    mapping: the advice is idempotent); the tensor holds the mapping (torch.frombuffer)."""
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = (-whole.data_ptr()) % HUGE_PAGE  # the first 2 MB boundary: whole huge pages from there
    _advise_huge_pages(whole.data_ptr() + start, nbytes)
    return whole[start: start + nbytes]


def huge_page_bytes(nbytes: int) -> torch.Tensor:
    """Fresh zeroed memory, uint8 [nbytes], from a 2 MB boundary on, marked for 2 MB pages; unmapped when no
    tensor of it is left."""
    return _on_huge_pages(_mapping(nbytes), nbytes)


def footprint(tensors: list[torch.Tensor]) -> int:
    """Bytes an arena needs to hold `tensors`, each starting on a cache line."""
    return sum(n + (-n) % ALIGN for n in (t.numel() * t.element_size() for t in tensors))


class Arena:
    """Fixed-size memory that tensors are copied into, one after another (`place`); the tensors it returns
    keep the arena alive. Not thread-safe: filled once, at load, by one thread."""

    def __init__(self, nbytes: int):
        self._bytes = huge_page_bytes(nbytes)
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


class _IdleChunks:
    """Chunks of 2 MB pages that no tensor uses any more, kept for the next pool, up to KEEP bytes. A fresh 2 MB page
    comes from the kernel's free lists, and where those are fragmented it waits on compaction: on the 2-core Xeon a
    4-row run's caches took 0.2–0.5 s more to fill on fresh chunks than on reused ones (0.03 s). Shared by every
    thread's pools (the page decodes each session in its own thread) and given chunks back by the garbage
    collector's finalizers, so a lock guards the list."""

    KEEP = 512 << 20

    def __init__(self) -> None:
        self._lock = threading.RLock()  # re-entrant: a finalizer may run in a thread that holds it
        self._idle: list[mmap.mmap] = []

    def take(self) -> torch.Tensor:
        """A chunk: uint8 [Pool.CHUNK] from a 2 MB boundary on, given back here once no tensor of it is left."""
        with self._lock:
            mapping = self._idle.pop() if self._idle else None
        if mapping is None:
            mapping = _mapping(Pool.CHUNK)
        chunk = _on_huge_pages(mapping, Pool.CHUNK)
        # the storage outlives every view of it (torch keeps one Python object per storage): its end is the chunk's
        weakref.finalize(chunk.untyped_storage(), self._give_back, mapping)
        return chunk

    def _give_back(self, mapping: mmap.mmap) -> None:
        with self._lock:
            if (len(self._idle) + 1) * Pool.CHUNK <= self.KEEP:
                self._idle.append(mapping)  # otherwise dropped here: unmapped with its last reference


_IDLE = _IdleChunks()


class Pool:
    """Empty tensors carved one after another from chunks of 2 MB pages, for buffers that are read again and again
    (a decoding KV cache: attention reads every layer's keys and values at every step). Measured on the 2-core
    Xeon, the target's 28 layers over 900 keys at 4 rows: 12.7 → 10.3 ms a one-token step, 18.8 → 14.9 ms at 2
    tokens a row; the draft's 24 at 4 rows × 2 tokens 7.7 → 6.5 ms (docs/benchmarks.md). Chunks are reused across
    pools once free (_IdleChunks). A tensor larger than a chunk gets memory of its own. Not thread-safe: its owner
    (one cache) allocates from one thread."""

    CHUNK = 32 << 20

    def __init__(self) -> None:
        self._free = torch.empty(0, dtype=torch.uint8)  # the current chunk's unused end

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized CPU tensor of `shape` and `dtype`, contiguous, starting on a cache line."""
        n = math.prod(shape) * dtype.itemsize
        if n > self.CHUNK:
            return huge_page_bytes(n).view(dtype).view(shape)
        if self._free.numel() < n:
            self._free = _IDLE.take()
        out = self._free[:n].view(dtype).view(shape)
        self._free = self._free[min(n + (-n) % ALIGN, self._free.numel()):]
        return out
