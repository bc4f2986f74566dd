"""Where specviz's own files are: the bundled assets and the kernels' sources.

In a source checkout they are the top-level `assets/` and `kernels/` beside this package (the layout the
design card fixes); `pip install .` copies them into the package as `specviz/_assets` and `specviz/_kernels`
(pyproject.toml), so an installed specviz never depends on the working directory.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def _bundled(installed: str, checkout: str) -> Path:
    inside = _PACKAGE / installed
    return inside if inside.is_dir() else _PACKAGE.parent / checkout


ASSETS: Path = _bundled("_assets", "assets")
KERNELS: Path = _bundled("_kernels", "kernels")
