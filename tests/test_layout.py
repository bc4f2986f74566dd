"""The package's shape: imports point one way (down the layers below), no import cycle between modules (imports
inside functions included), at most 12 modules at specviz's top, every subpackage documented, and the old
module paths still importable. Read from the source with `ast`: nothing is imported to check it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "specviz"

# Low to high. A module may import its own package's modules and those of any lower layer; top-level modules
# (layer 0) are specviz's foundations and may import each other. Packages in one layer do not import each other (text/speech, page/cli).
LAYERS: list[set[str]] = [
    {"config", "machine", "cache", "memory", "native", "openmp", "theory", "speedup", "sampling", "paths", "_moved"},
    {"models", "verify"},
    {"decoding"},
    {"traces"},
    {"text", "speech"},
    {"runs"},
    {"figures"},
    {"evaluation", "bench"},
    {"page", "cli"},
    {"__main__", "__init__"},
]
LAYER = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The specviz modules `name` imports, anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            submodules = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
            targets = submodules or [base]
        for target in targets:
            while target and target not in known and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in known and target != name and target.startswith("specviz"):
                out.add(target)
    return out


def unit(name: str) -> str:
    parts = name.split(".")
    if len(parts) == 1:
        return "__init__"
    return parts[1]


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def test_every_module_has_a_layer():
    unplaced = sorted({unit(m) for m in modules()} - set(LAYER))
    assert not unplaced, f"place these in tests/test_layout.py's LAYERS: {unplaced}"


def test_imports_point_down():
    upward = []
    for name, targets in graph().items():
        for target in targets:
            a, b = unit(name), unit(target)
            if a == b or a == "__init__" and target in ("specviz.config", "specviz.verify", "specviz._moved"):
                continue
            if LAYER[b] > LAYER[a] or LAYER[b] == LAYER[a] and LAYER[a] != 0:
                upward.append(f"{name} imports {target} ({b} is not below {a})")
    assert not upward, "\n".join(sorted(upward))


def test_no_import_cycle():
    edges = graph()
    state: dict[str, int] = {}  # 1 on the current path, 2 finished
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycles.append(" → ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for start in sorted(edges):
        if start not in state:
            visit(start, [start])
    assert not cycles, "\n".join(cycles)


def test_top_level_is_small_and_packages_say_what_they_own():
    top = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert len(top) <= 12, top
    for init in PACKAGE.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")))
        assert doc and "import" in doc.lower() and len(doc) > 120, f"{init} must say what it owns and may import"


def test_old_paths_import_the_same_modules():
    code = ("import importlib, importlib.util\n"
            "import specviz._moved as moved\n"
            "for old, new in moved.MOVED.items():\n"
            "    then, now = importlib.import_module('specviz.' + old), importlib.import_module('specviz.' + new)\n"
            "    if then is not now:  # the old name is a package now: it forwards the old module's names\n"
            "        names = [n for n in vars(now) if not n.startswith('_') and n not in vars(then)\n"
            "                 and importlib.util.find_spec(then.__name__ + '.' + n) is None]\n"
            "        assert names and all(getattr(then, n) is getattr(now, n) for n in names), old\n"
            "from specviz.trace import Trace\n"
            "from specviz.traces.trace import Trace as Same\n"
            "from specviz.models import load_pair\n"
            "from specviz.runs import run\n"
            "assert Trace is Same and callable(load_pair) and callable(run)\n"
            "print(len(moved.MOVED))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert int(out.stdout.split()[-1]) >= 50
