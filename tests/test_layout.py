"""The package's shape: imports point one way (down the layers below), no import cycle between modules (imports
inside functions included), at most 12 modules at specviz's top, every subpackage documented, and one map of
the house: every specviz import in the code and the tests names a module that is there, with no alias hook or
name forwarding behind it. Read from the source with `ast`: nothing is imported to check it (but the last test,
which imports a few paths from before the subpackages to see them fail)."""

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
    {"config", "machine", "cache", "memory", "native", "openmp", "theory", "speedup", "sampling", "paths"},
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
            if a == b or a == "__init__" and target in ("specviz.config", "specviz.verify"):
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


def _bound_names(path: Path) -> set[str]:
    """The names a module binds at its top level (definitions, assignments, imports)."""
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def test_every_import_names_a_real_module():
    """`import specviz.x.y` and `from specviz.x import name` resolve to files that are there, and a name taken from a
    package is its submodule or bound in its __init__ (no package forwards another module's names)."""
    known = modules()
    wrong = []
    for path in [*PACKAGE.rglob("*.py"), *(ROOT / "tests").rglob("*.py")]:
        where = path.relative_to(ROOT)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                wrong += [f"{where}:{node.lineno} import {a.name}" for a in node.names
                          if a.name.split(".")[0] == "specviz" and a.name not in known]
            elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "specviz":
                if node.module not in known:
                    wrong.append(f"{where}:{node.lineno} from {node.module}")
                    continue
                bound = _bound_names(known[node.module])
                wrong += [f"{where}:{node.lineno} from {node.module} import {a.name}" for a in node.names
                          if f"{node.module}.{a.name}" not in known and a.name not in bound and a.name != "*"]
    assert not wrong, "\n".join(wrong)


def test_no_second_map_of_the_house():
    """No module answers for another: no module-level __getattr__, no import hook, and the paths from before the
    subpackages (specviz.engine, specviz.trace, specviz.cli_common, ...) no longer import."""
    assert not (PACKAGE / "_moved.py").exists()
    hooks = []
    for name, path in modules().items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        hooks += [f"{name}: module __getattr__" for node in tree.body
                  if isinstance(node, ast.FunctionDef) and node.name == "__getattr__"]
        hooks += [f"{name}: sys.meta_path" for node in ast.walk(tree)
                  if isinstance(node, ast.Attribute) and node.attr in ("meta_path", "path_hooks")]
    assert not hooks, hooks
    code = ("import importlib\n"
            "for old in ('engine', 'trace', 'cli_common', 'packed', 'eval_run', 'why_panel', '_moved'):\n"
            "    try:\n"
            "        importlib.import_module('specviz.' + old)\n"
            "    except ModuleNotFoundError:\n"
            "        continue\n"
            "    raise SystemExit('specviz.' + old + ' still imports')\n"
            "import specviz.models, specviz.runs\n"
            "assert not hasattr(specviz.models, 'load_pair') and not hasattr(specviz.runs, 'builder_for')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
