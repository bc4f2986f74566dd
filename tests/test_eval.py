"""`specviz eval`: the grid, the results file (append, resume, torn lines, untrusted input), the tables, and
the same sweep serially and on a local Ray cluster with 2 workers (one of them killed mid-run)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from specviz.cli import commands as cli
from specviz.evaluation.data import load_examples
from specviz.evaluation.examples import Example
from specviz.evaluation.results import ResultsError, load_results, report_markdown, summarize
from specviz.evaluation.run import Models, ResultsFile, run_serial
from specviz.runs.settings import TEXT, Settings
from specviz.evaluation.sweep import Grid, GridError, make_grid

from conftest import save_tiny_pair

ARTICLES = {"a1": ("w5 w9 w13 w2 w7 w5 w9 w13 w4 w11", "w5 w9 w13"),
            "a2": ("w21 w3 w3 w8 w21 w3 w8 w40 w41", "w21 w3 w8"),
            "a3": ("w100 w101 w102 w103 w100 w101 w102", "w100 w102")}


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> Models:
    return Models(TEXT, *save_tiny_pair(tmp_path_factory.mktemp("eval-models")))


@pytest.fixture(scope="module")
def manifest(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("eval-data")
    rows = [{"id": k, "article": a, "summary": s} for k, (a, s) in ARTICLES.items()]
    (folder / "manifest.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return folder


# hf, not the default cost policy: on the tiny pair drafting does not pay, so cost would mostly step plainly
# (nothing verified to report), and the serial and the Ray sweep compare acceptance, which must not follow the
# measured time of each process
GRID = Grid(base=Settings(max_new_tokens=8), policies=("hf",))


def _serial(tmp_path: Path, manifest: Path, models: Models, grid: Grid = GRID, name: str = "serial.jsonl"):
    examples = load_examples(manifest)
    results = ResultsFile(tmp_path / name)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each of the 2 Ray workers on 2 cores: the same arithmetic, the same counts
    try:
        progress = run_serial(grid.cells(examples), grid, models, results, str(manifest))
    finally:
        torch.set_num_threads(threads)
    return progress, results


def test_the_grid_runs_target_only_once_per_example_and_every_variant():
    grid = make_grid(Settings(max_new_tokens=8), modes=["exact", "sigmoid"], policies=["hf", "constant:3"],
                     sigmoid=["-1e3:1e3", "default"], temperatures=[0, 0.8], seeds=[0, 1])
    names = [v.name for v in grid.variants()]
    assert names[0] == "target-only" and len(names) == 1 + 2 + 2 * 2
    assert "sigmoid · γ constant:3 · α=-1000 β=1000" in names
    examples = [Example("x", TEXT, "w1 w2", "w1")]
    assert len(grid.cells(examples)) == len(names) * 2 * 2
    cell = next(c for c in grid.cells(examples) if c.variant.gamma_init == 3 and c.temperature == 0.8)
    cfg = grid.settings(cell.variant, cell.temperature, cell.seed).spec(TEXT)
    assert (cfg.gamma_policy, cfg.gamma_init, cfg.sampling.temperature, cfg.max_new_tokens) == ("constant", 3, 0.8, 8)


@pytest.mark.parametrize("kwargs, message", [
    ({"modes": ["fastest"]}, "unknown mode 'fastest'"),
    ({"policies": ["hf:0"]}, "POLICY\\[:γ\\]"),
    ({"sigmoid": ["1e3:-1e3"]}, "α < β"),
    ({"sigmoid": ["wide"]}, "ALPHA:BETA"),
    ({"temperatures": [11.0]}, "temperature: 11.0 is outside"),
])
def test_a_grid_that_cannot_run_is_refused_before_anything_loads(kwargs, message):
    with pytest.raises(GridError, match=message):
        make_grid(Settings(), **kwargs)


def test_cli_sigmoid_scales_are_symmetric_ranges(capsys):
    from specviz.cli.evaluate import _ranges

    assert _ranges(["default", "1e3", "10"]) == ["default", "-1e3:1e3", "-10:10"]
    assert cli.main(["eval", "text", "--sigmoid-scales", "wide"]) == 2
    assert "positive numbers" in capsys.readouterr().err


def test_a_toml_grid(tmp_path):
    path = tmp_path / "grid.toml"
    path.write_text('modes = ["sigmoid"]\nsigmoid = ["-1e4:1e4", "-10:10"]\nseeds = [3]\nmax_new_tokens = 16\n')
    grid = make_grid(Settings(), file=path)
    assert [v.sigmoid_alpha for v in grid.variants()[1:]] == [-1e4, -10] and grid.seeds == (3,)
    assert grid.base.max_new_tokens == 16
    path.write_text('modes = ["exact"]\nrounds = 3\n')
    with pytest.raises(GridError, match="unknown grid key 'rounds'"):
        make_grid(Settings(), file=path)


def test_a_serial_sweep_writes_resumes_and_reports(tmp_path, manifest, tiny_models):
    progress, results = _serial(tmp_path, manifest, tiny_models)
    assert (progress.done, progress.failed, progress.skipped) == (12, 0, 0)
    lines = results.path.read_text().splitlines()
    assert json.loads(lines[0])["kind"] == "sweep" and len(lines) == 13
    loaded = load_results(results.path)
    by_key = {(r["example"], r["mode"]): r for r in loaded.cells}
    for example in ARTICLES:  # greedy: every mode's output is target-only's
        outputs = {by_key[(example, m)]["output"] for m in ("target-only", "baseline", "exact", "sigmoid")}
        assert len(outputs) == 1
    report = report_markdown(loaded)
    assert "**Table 1**" in report and "**Table 2**" in report and "ROUGE-1 (95% CI)" in report
    rows = {s.variant: s for s in summarize(loaded)}
    assert rows["exact · γ hf"].verify_reduction_pct is not None and rows["baseline · γ hf"].verify_reduction_pct == 0
    assert rows["target-only"].alpha is None and rows["exact · γ hf"].alpha is not None
    # resume: nothing left to run, nothing appended
    again, _ = _serial(tmp_path, manifest, tiny_models)
    assert (again.done, again.skipped) == (0, 12) and results.path.read_text().splitlines() == lines
    # a crash mid-write leaves a torn last line: reading skips it, resuming reruns that cell only
    torn = lines[:-1] + [lines[-1][: len(lines[-1]) // 2]]
    results.path.write_text("\n".join(torn))
    assert load_results(results.path).torn == 1 and len(load_results(results.path).cells) == 11
    resumed, _ = _serial(tmp_path, manifest, tiny_models)
    assert (resumed.done, resumed.skipped) == (1, 11)
    assert len(load_results(results.path).cells) == 12


def test_a_failing_cell_is_retried_then_recorded_with_its_message(tmp_path, tiny_models, monkeypatch):
    folder = tmp_path / "speech-less"
    folder.mkdir()
    (folder / "manifest.jsonl").write_text(json.dumps({"id": "only", "article": "w1 w2 w3", "summary": "w1"}) + "\n")
    from specviz.evaluation import run as eval_run

    calls = []
    real = eval_run.CellRunner.run

    def flaky(self, cell, grid):
        calls.append(cell.variant.name)
        if cell.variant.mode == "exact":
            raise RuntimeError("the verifier fell over")
        return real(self, cell, grid)

    monkeypatch.setattr(eval_run.CellRunner, "run", flaky)
    progress, results = _serial(tmp_path, folder, tiny_models)
    assert (progress.done, progress.failed, progress.retried) == (4, 1, 1)
    assert calls.count("exact · γ hf") == 2
    failed = [r for r in load_results(results.path).cells if r["status"] == "failed"]
    assert len(failed) == 1 and "RuntimeError: the verifier fell over" in failed[0]["error"]
    assert "Failed cells" in report_markdown(load_results(results.path))


@pytest.mark.parametrize("line, message", [
    ('{"kind": "cell", "key": "k"}', "line 2: the cell record has no 'example'"),
    ('[1, 2]', "line 2: not a sweep or cell record"),
    ('{"kind": "cell", "x": NaN}', "line 2: not a JSON record"),
    ('{"kind": "cell", "x": 1e999}', "line 2: not a JSON record"),
])
def test_a_malformed_results_file_names_its_line(tmp_path, line, message):
    path = tmp_path / "r.jsonl"
    path.write_text('{"kind": "sweep", "version": 1}\n' + line + '\n{"kind": "sweep"}\n')
    with pytest.raises(ResultsError, match=message):
        load_results(path)


def test_strings_from_a_results_file_reach_the_tables_escaped(tmp_path, manifest, tiny_models):
    _, results = _serial(tmp_path, manifest, tiny_models, name="hostile.jsonl")
    lines = results.path.read_text().splitlines()
    header = json.loads(lines[0])
    header["models"] = "<script>alert(1)</script>"
    cell = json.loads(lines[1])
    cell.update(variant="<img src=x onerror=alert(1)>|x", status="failed", error="<b>boom</b>\n| row")
    for key in ("metric", "score"):
        cell.pop(key, None)
    results.path.write_text("\n".join([json.dumps(header), *lines[2:], json.dumps(cell)]) + "\n")
    report = report_markdown(load_results(results.path))
    assert "<script>" not in report and "<img" not in report and "<b>" not in report
    assert "&lt;img src=x onerror=alert(1)&gt;\\|x" in report and "&lt;script&gt;" in report


def test_a_results_file_without_header_or_as_binary_is_refused(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ResultsError, match="not UTF-8"):
        load_results(path)
    path.write_text("")
    with pytest.raises(ResultsError, match="no sweep header"):
        load_results(path)


def test_the_cli_reports_a_results_file(tmp_path, manifest, tiny_models, capsys):
    _, results = _serial(tmp_path, manifest, tiny_models, name="cli.jsonl")
    assert cli.main(["eval", "--report", str(results.path), "--json", str(tmp_path / "rows.json")]) == 0
    out = capsys.readouterr().out
    assert "| exact · γ hf | 0 | 3 |" in out
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    assert {r["variant"] for r in rows} == {"target-only", "baseline · γ hf", "exact · γ hf", "sigmoid · γ hf"}
    assert cli.main(["eval", "--report", str(tmp_path / "missing.jsonl")]) == 2


def test_ray_with_two_workers_equals_the_serial_sweep_and_loses_no_cell_when_a_worker_dies(
        tmp_path, manifest, tiny_models):
    ray = pytest.importorskip("ray")
    from specviz.evaluation.on_ray import run_ray

    _, serial = _serial(tmp_path, manifest, tiny_models, GRID)
    examples = load_examples(manifest)
    results = ResultsFile(tmp_path / "ray.jsonl")
    actors: list = []
    killed: list[int] = []

    def on_cell(progress, record):
        if not killed:  # kill the other worker while it runs a cell
            other = actors[1] if record["worker"] == "ray-0" else actors[0]
            pid = ray.get(other.pid.remote())
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    progress = run_ray(GRID.cells(examples), GRID, tiny_models, results, str(manifest), workers=2, threads=1,
                       on_cell=on_cell, on_workers=lambda a: actors.__setitem__(slice(None), a))
    assert killed and progress.failed == 0 and progress.done == 12 and progress.retried >= 1
    mine = {r["key"]: r for r in load_results(results.path).cells}
    theirs = {r["key"]: r for r in load_results(serial.path).cells}
    assert set(mine) == set(theirs) and all(r["status"] == "ok" for r in mine.values())
    for key, r in theirs.items():  # the deterministic parts: greedy outputs and acceptance
        assert (mine[key]["output"], mine[key]["acceptance_rate"], mine[key]["tokens_per_iteration"]) == (
            r["output"], r["acceptance_rate"], r["tokens_per_iteration"])
    assert not ray.is_initialized()  # the sweep shut down the Ray it started
