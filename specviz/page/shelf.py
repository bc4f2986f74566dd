"""The traces the page's sessions are looking at, held once per server within a memory budget.

A session's gr.State holds a Ticket; the trace itself is on the TraceShelf. Gradio keeps a session's state for
an hour after its tab closes, and for good for an API client that never says goodbye, so traces kept in the
state itself grew the server by ~80 MB per 50 MB upload, none of it given back. Here the least recently used
traces beyond the budget are written to disk and dropped from memory, and a trace larger than the whole
budget is never held: every look reads it back (about a second for a 50 MB one). The folder keeps the newest
`kept` files within `disk_bytes`: a trace older than those is gone, and the page says so.
"""

from __future__ import annotations

import os
import secrets
import tempfile
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from specviz.traces.trace import Trace, TraceFormatError
from specviz.traces.json_format import load_trace

MEMORY_ENV = "SPECVIZ_PAGE_TRACES_MB"
DEFAULT_MEMORY_MB = 64  # dozens of ordinary traces (25 kB to a few MB each); one or two very large ones
DEFAULT_KEPT = 256
DEFAULT_DISK_MB = 1000


@dataclass(frozen=True)
class Ticket:
    """What a session's state holds in place of its trace."""

    key: str


@dataclass
class _Held:
    trace: Trace
    size: int  # bytes of its trace file (the budget's unit; in memory a trace takes ~1.5× that)
    written: bool  # its file on disk is up to date: dropping it needs no write
    file: Path | None = None  # a file already holding this very version (its export): dropping it links that


def json_size(trace: Trace) -> int:
    """The size of a trace's file (Trace.save), for a trace not read from or written to one."""
    return len(trace.to_json().encode("utf-8"))


def default_shelf() -> "TraceShelf":
    budget_mb = float(os.environ.get(MEMORY_ENV, DEFAULT_MEMORY_MB))
    return TraceShelf(Path(tempfile.gettempdir()) / "specviz-traces", int(budget_mb * 1e6), DEFAULT_KEPT,
                      int(DEFAULT_DISK_MB * 1e6))


class TraceShelf:
    """Traces by ticket: in memory within `memory_bytes`, the rest in `folder` (the newest `kept` files, at
    most `disk_bytes` in all).

    Every handler thread of the page shares one shelf. The lock guards the table and is held while a trace
    is written out, so a trace is always in memory or on disk, never between; reading one back happens
    outside it (the slow part of a look at an evicted trace does not hold up other sessions).
    """

    def __init__(self, folder: Path, memory_bytes: int, kept: int = DEFAULT_KEPT,
                 disk_bytes: int = int(DEFAULT_DISK_MB * 1e6)):
        self.folder, self.memory_bytes, self.kept, self.disk_bytes = folder, memory_bytes, kept, disk_bytes
        self._held: OrderedDict[str, _Held] = OrderedDict()  # least recently used first
        self._total = 0  # the sizes of the traces in _held
        self._lock = threading.Lock()

    def put(self, trace: Trace, size: int, ticket: Ticket | None = None, file: Path | None = None) -> Ticket:
        """Hold `trace` (a new ticket, or a new version of the trace behind `ticket`: a run still streaming).
        `file`: a trace file already holding this version (its export), linked rather than written again
        when the trace is dropped from memory."""
        ticket = ticket or Ticket(secrets.token_hex(16))
        with self._lock:
            self._hold(ticket.key, _Held(trace, size, written=False, file=file))
            self._evict()
        return ticket

    def get(self, ticket: Ticket | None) -> Trace | None:
        """The trace behind `ticket`; None when there is none, or it is no longer kept."""
        if ticket is None:
            return None
        with self._lock:
            held = self._held.get(ticket.key)
            if held is not None:
                self._held.move_to_end(ticket.key)
                return held.trace
        path = self._path(ticket)
        try:
            trace, size = load_trace(path), path.stat().st_size
        except (OSError, TraceFormatError):  # pruned, or (never by us) damaged: gone either way
            return None
        with self._lock:
            if ticket.key not in self._held:  # another thread may have read it back or put a newer version
                self._hold(ticket.key, _Held(trace, size, written=True))
            self._held.move_to_end(ticket.key)
            trace = self._held[ticket.key].trace
            self._evict()
            return trace

    def held_bytes(self) -> int:
        with self._lock:
            return self._total

    def _path(self, ticket: Ticket) -> Path:
        return self.folder / f"{ticket.key}.json"

    def _hold(self, key: str, held: _Held) -> None:
        old = self._held.pop(key, None)
        self._total += held.size - (old.size if old else 0)
        self._held[key] = held  # the most recently used

    def _evict(self) -> None:
        """Drop the least recently used traces until within budget (the one just touched too, when it alone
        is larger than the budget: its caller still holds it for this look)."""
        wrote = False
        while self._total > self.memory_bytes and self._held:
            key, held = self._held.popitem(last=False)
            if not held.written:
                self._write(key, held)
                wrote = True
            self._total -= held.size
        if wrote:
            self._prune()

    def _write(self, key: str, held: _Held) -> None:
        """The trace's file on the shelf: a link to its export when that still exists, else written."""
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self._path(Ticket(key))
        if held.file is not None:
            partial = path.with_name(f".{path.name}.{secrets.token_hex(4)}.part")
            try:
                os.link(held.file, partial)  # exports are never rewritten, so the link stays this version
                os.replace(partial, path)
                return
            except OSError:  # pruned meanwhile, or another file system: write it
                partial.unlink(missing_ok=True)
        held.trace.save(path)

    def _prune(self) -> None:
        """Delete the oldest files beyond `kept` or `disk_bytes` (never one whose trace is held, as
        written: dropping it later would not write it again). Other servers may share the folder and prune
        it too."""
        files = sorted(f for p in self.folder.glob("*.json") if (f := _stat(p)) is not None)
        total = sum(size for _, size, _ in files)
        for i, (_, size, path) in enumerate(files):
            if len(files) - i <= self.kept and total <= self.disk_bytes:
                break
            if path.stem not in self._held:
                path.unlink(missing_ok=True)
                total -= size


def _stat(path: Path) -> tuple[float, int, Path] | None:
    try:
        st = path.stat()
    except OSError:  # removed by another server since the listing
        return None
    return st.st_mtime, st.st_size, path
