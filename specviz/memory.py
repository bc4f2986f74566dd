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
