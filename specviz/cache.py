"""Where specviz keeps what it builds once per machine: converted models and compiled CPU kernels."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from typing import Callable

CACHE_ENV = "SPECVIZ_CACHE"


def cache_dir() -> Path:
    """$SPECVIZ_CACHE, else the user's cache directory."""
    root = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "specviz"
    )
    return Path(root)


MARKER = "specviz-converted.json"  # written last into a converted directory: its presence means "complete"


def seal(directory: Path, info: dict) -> None:
    """Mark a converted directory complete: `info` (what it was made from) and every file's size, each file
    flushed to disk first, so a later start can tell a whole conversion from one cut short."""
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MARKER):
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
        files[path.relative_to(directory).as_posix()] = path.stat().st_size
    with open(directory / MARKER, "w", encoding="utf-8") as handle:
        json.dump({**info, "files": files}, handle)
        handle.flush()
        os.fsync(handle.fileno())


def damage(directory: Path, info: dict) -> str | None:
    """None when `directory` holds a complete conversion made from `info`; otherwise why it cannot be trusted
    ("" when nothing was converted there)."""
    try:
        marker = json.loads((directory / MARKER).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return ""
    except (OSError, ValueError):
        return "its marker file is unreadable"
    if not isinstance(marker, dict):
        return "its marker file is unreadable"
    for key, value in info.items():
        if marker.get(key) != value:
            return f"it was made from another {key}"
    files = marker.get("files")
    if files is None:
        return None  # sealed before sizes were recorded: trusted, as it was then
    if not isinstance(files, dict):
        return "its marker file is unreadable"
    for name, size in files.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} is {path.stat().st_size:,} bytes, not {size:,}"
    return None


def trusted(directory: Path, info: dict, name: str, progress: Callable[[str, float | None], None]) -> bool:
    """Whether the conversion in `directory` can be used as it is; when one is there but damaged, says so
    through `progress` (it will be converted again)."""
    reason = damage(directory, info)
    if reason:  # a start killed mid-write, a full disk, a file changed since: never trusted, rebuilt
        progress(f"the converted {name} in the cache cannot be trusted ({reason}); converting it again", None)
    return reason is None


def write_json(path: Path, d: dict) -> None:
    """Atomically (a reader never sees half a file); a read-only or full cache only costs a later start the
    measurement it would have read."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(d))
        os.replace(tmp, path)
    except OSError:
        pass


def disk_full(error: OSError) -> bool:
    return error.errno in (errno.ENOSPC, errno.EDQUOT)


def work_dir(name: str) -> Path:
    """Where a conversion of `name` is built before it is sealed and renamed into place: named by the
    process, so two starts converting at once do not share one."""
    return cache_dir() / f".{name}.partial-{os.getpid()}"


def remove_dead_work(name: str) -> None:
    """Delete the work directories of conversions whose process is gone: one killed mid-way (SIGKILL, OOM)
    never ran its `finally`, and its directory (0.3 GB for Whisper, over 1 GB for a text model) was
    otherwise kept forever."""
    for work in cache_dir().glob(f".{name}.partial-*"):
        pid = work.name.rpartition("-")[2]
        if pid.isdigit() and not _running(int(pid)):
            shutil.rmtree(work, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
