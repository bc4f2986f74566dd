"""Whether a hub id can be fetched: the model hub is asked once, with a deadline of a few seconds, so a
machine without a network refuses an uncached hub id at once instead of waiting out transformers' retries."""

from __future__ import annotations

import os
import re
import socket
import threading
import time
from urllib.parse import urlparse

from specviz.models.errors import ModelLoadError

REACH_TIMEOUT_S = 3.0
REMEMBER_S = 60.0  # a network that came or went is noticed within a minute

_lock = threading.Lock()  # guards _known: page sessions may load models at the same time
_known: tuple[float, bool] | None = None  # (when asked, reachable)


def _endpoint() -> tuple[str, int]:
    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    return url.hostname or "", url.port or (80 if url.scheme == "http" else 443)


def _connects(host: str, port: int, timeout: float) -> bool:
    """A TCP connection within `timeout`; name resolution runs in a thread because it has no timeout of its
    own and hangs for long on some offline machines."""
    result: list[bool] = []

    def attempt() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            result.append(True)
        except OSError:
            result.append(False)

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(timeout)
    return bool(result and result[0])


def reachable(timeout: float = REACH_TIMEOUT_S) -> bool:
    global _known
    with _lock:
        if _known is not None and time.monotonic() - _known[0] < REMEMBER_S:
            return _known[1]
    host, port = _endpoint()
    ok = bool(host) and _connects(host, port, timeout)
    with _lock:
        _known = (time.monotonic(), ok)
    return ok


def offline_by_choice() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")


def cached(name: str, file: str = "config.json") -> bool:
    """Whether the local Hugging Face cache holds `file` of the hub id `name`."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(name, file), str)
    except Exception:  # a name the hub library refuses is not in the cache
        return False


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")  # "name" or "owner/name"


def sources(name: str, role: str) -> dict:
    """from_pretrained's keyword arguments for a hub id: from the local cache only when the hub cannot be
    reached; a ModelLoadError at once when it cannot be reached and the cache does not hold the model."""
    if offline_by_choice() or not HUB_ID.match(name):
        return {}  # transformers reads the cache alone and says so; a missing path is refused without a network
    if reachable():
        return {}
    if cached(name):
        return {"local_files_only": True}
    raise ModelLoadError(f"the {role} model {name!r} is not in the local Hugging Face cache and the model hub cannot "
                         f"be reached from this machine (no connection within {REACH_TIMEOUT_S:g} s): fetch it "
                         "where there is a network, or give a local directory")
