"""Giving memory back to the operating system after a large trace has been read and let go."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


def release_freed_memory() -> None:
    """Return the heap's free pages to the OS (glibc's malloc_trim; nothing elsewhere).

    Reading a 50 MB trace allocates ~80 MB of small objects in the page's worker thread; glibc keeps freed
    memory in that thread's arena for reuse, so the server stayed ~80 MB larger after every such upload
    (tests/test_soak.py). Trimming after the upload is handled costs a few milliseconds.
    """
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20  # blocks below this come from the heap: glibc's ceiling for its own moving threshold
TRIM_THRESHOLD = 64 << 20  # freed heap kept for reuse before any is given back


def reuse_freed_memory() -> bool:
    """Let freed blocks of up to 32 MB be reused instead of handed back to the OS (glibc only; whether it took).

    Every decoding step allocates and frees full-vocabulary tensors (0.6 MB a row at V = 151,936: logits, the
    sampler's and the why-panel's temporaries). With glibc's defaults such a block was mapped afresh or the
    heap's top trimmed after each free, so the next step wrote to new pages and took a page fault per 4 KB: on
    the 2-core EPYC, target-only decoding went 24–27 → 28–30 tokens/s with this, and the why-panel's work for a
    batch of 4 8.2 → 2.8 ms an iteration (docs/benchmarks.md). At most TRIM_THRESHOLD of freed heap per arena
    stays mapped; release_freed_memory still gives it all back where a caller asks. Process-wide, so it is the
    entry points' call (the CLI's main, the page's main), never a library import's."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
