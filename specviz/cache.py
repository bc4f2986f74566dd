"""Where specviz keeps what it builds once per machine: converted models and compiled CPU kernels."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "SPECVIZ_CACHE"


def cache_dir() -> Path:
    """$SPECVIZ_CACHE, else the user's cache directory."""
    root = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "specviz"
    )
    return Path(root)
