"""Trace JSON: round trip of batched (version 2) traces, version-1 files still read, and clear refusals for
what is not a trace this version can read."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from specviz.page import actions as page
from specviz.figures import report
from specviz.config import SamplingConfig, SpecConfig
from specviz.figures.plots import batch_figure
from specviz.page.actions import figures
from specviz.figures.token_view import token_html
from specviz.traces.trace import SCHEMA_VERSION, Trace, TraceFormatError
from specviz.traces.json_format import load_trace, loads_trace

from conftest import decode

V1_TRACE = {
    "schema_version": 1,
    "meta": {"mode": "exact", "config": {"gamma_policy": "hf"}, "draft": "d", "target": "t", "device": "cpu",
             "dtype": "float32", "input": "an article"},
    "prompt_ids": [1, 2, 3], "output_ids": [7, 8, 9, 10], "output_text": "w7 w8 w9 w10",
    "iterations": [
        {"index": 0, "gamma": 3, "draft_ids": [7, 8, 5], "draft_text": ["w7", "w8", "w5"], "q": [0.5, 0.4, 0.3],
         "p": [0.6, 0.4, 0.1], "accept_prob": [1.0, 1.0, 0.333], "uniform": [0.2, 0.9, 0.7],
         "outcome": ["accepted", "accepted", "rejected"], "n_accepted": 2, "next_id": 9, "next_text": "w9",
         "next_kind": "resampled", "emitted": 3, "draft_s": 0.01, "target_s": 0.05, "verify_s": 0.001},
        {"index": 1, "gamma": 1, "draft_ids": [10], "draft_text": ["w10"], "q": [0.9], "p": [0.95],
         "accept_prob": [1.0], "uniform": [0.5], "outcome": ["accepted"], "n_accepted": 1, "next_id": 11,
         "next_text": "w11", "next_kind": "bonus", "emitted": 1, "draft_s": 0.01, "target_s": 0.05, "verify_s": 0.001},
    ],
    "prefill_s": 0.5, "total_s": 0.7, "summary": {},
}


@pytest.fixture(scope="module")
def trace(tiny_pair, batch_prompts) -> Trace:
    cfg = SpecConfig(mode="exact", sampling=SamplingConfig(temperature=1.0, top_p=0.9), max_new_tokens=20, seed=5)
    return decode(tiny_pair, batch_prompts, cfg, meta={"input": "ünïcode ✓ article"})


def test_round_trip_is_equal(trace, tmp_path):
    path = tmp_path / "t.json"
    trace.save(path)
    loaded = load_trace(path)
    assert loaded == trace
    assert loaded.summary() == trace.summary()
    data = json.loads(path.read_text())
    assert data["schema_version"] == SCHEMA_VERSION == 3
    assert data["summary"]["new_tokens"] == 60
    assert [len(s["output_ids"]) for s in data["sequences"]] == [20, 20, 20]
    assert {"output_text", "decisions", "label"} <= set(data["sequences"][0])
    assert {"draft_s", "target_s", "verify_s", "pad_tokens", "cache_holes"} <= set(data["steps"][0])


def test_version_1_traces_still_load_and_draw(tmp_path):
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(V1_TRACE))
    trace = load_trace(path)
    assert trace.outputs == [[7, 8, 9, 10]] and trace.output_text == "w7 w8 w9 w10"
    assert [d.n_accepted for d in trace.decisions()] == [2, 1] and len(trace.steps) == 2
    assert trace.summary()["acceptance_rate"] == pytest.approx(3 / 4)
    drawn = figures(trace)
    assert drawn["tokens"].count("sv-line sv-lane") == 2 and "s1 γ" not in drawn["tokens"]
    trace.save(tmp_path / "again.json")  # exports as version 2
    assert load_trace(tmp_path / "again.json") == trace


def test_batched_trace_draws_lanes(trace):
    html = token_html(trace)
    assert html.count("one target call for") == len(trace.steps)
    assert "s1 γ" in html and "s3 γ" in html
    fig = batch_figure(trace)
    assert len(fig.data[0].y) == 3  # one heatmap row per sequence


def _write(tmp_path, payload) -> str:
    path = tmp_path / "bad.json"
    path.write_text(payload if isinstance(payload, str) else json.dumps(payload))
    return path


def _decision(d):
    return d["sequences"][0]["decisions"][0]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.pop("schema_version"), "schema_version"),
        (lambda d: d.update(schema_version=SCHEMA_VERSION + 1), "newer"),
        (lambda d: d.update(schema_version="1"), "schema_version"),
        (lambda d: d.pop("sequences"), "'sequences' is empty"),
        (lambda d: d["sequences"][0].pop("output_ids"), "sequence 0 is missing 'output_ids'"),
        (lambda d: _decision(d).pop("uniform"), "decision 0 of sequence 0 is missing 'uniform'"),
        (lambda d: _decision(d).update(gamma="five"), "'gamma' in decision 0 of sequence 0 should be an integer, got a string"),
        (lambda d: d.update(prefill_s=1e300), r"'prefill_s' in trace should be a finite number \(\|x\| ≤ 1e12\)"),
        (lambda d: _decision(d).update(q=[0.5] * 40), "γ ="),
        (lambda d: _decision(d).update(draft_ids=["a"] * len(_decision(d)["draft_ids"])), "'draft_ids'"),
        (lambda d: _decision(d).update(outcome=['" onmouseover="alert(1)'] * len(_decision(d)["outcome"])), "outcome"),
        (lambda d: _decision(d).update(next_kind="<img>"), "next_kind"),
        (lambda d: _decision(d).update(n_accepted=99), "n_accepted 99"),
        (lambda d: _decision(d).update(step=10_000), "refers to step"),
        (lambda d: d["steps"][0].update(sequences=[7]), "names a sequence"),
        (lambda d: d["steps"][0].update(sequences=[]), "scores no sequence"),
        (lambda d: d["steps"][0].update(cache_holes=10**9), "more holes than slots"),
        (lambda d: d.update(steps={}), "'steps' in trace must be a list"),
        (lambda d: d.update(total_s=True), r"'total_s' in trace should be a finite number .* got a boolean"),
        (lambda d: d["sequences"][0].update(finish="<b>"), "finish"),
    ],
)
def test_malformed_trace_is_refused(trace, tmp_path, mutate, message):
    data = trace.to_dict()
    mutate(data)
    with pytest.raises(TraceFormatError, match=message):
        load_trace(_write(tmp_path, data))


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.pop("output_ids"), "missing 'output_ids'"),
        (lambda d: d["iterations"][0].pop("uniform"), "iteration 0 is missing 'uniform'"),
        (lambda d: d["iterations"][0].update(q=[0.5]), "γ ="),
        (lambda d: d.update(iterations={}), "'iterations' in trace must be a list"),
    ],
)
def test_malformed_version_1_trace_is_refused(tmp_path, mutate, message):
    data = json.loads(json.dumps(V1_TRACE))
    mutate(data)
    with pytest.raises(TraceFormatError, match=message):
        load_trace(_write(tmp_path, data))


@pytest.mark.parametrize(
    "payload, message",
    [("{not json", "not valid JSON"), ("[1, 2]", "JSON object"), ("", "not valid JSON"),
     ("[" * 100_000 + "]" * 100_000, "nests too deeply|JSON object")],
)
def test_not_a_trace(tmp_path, payload, message):
    with pytest.raises(TraceFormatError, match=message):
        load_trace(_write(tmp_path, payload))


def test_binary_file_is_refused(tmp_path):
    path = tmp_path / "noise.json"
    path.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(TraceFormatError, match="not a text file"):
        load_trace(path)


def test_export_is_complete_or_absent(trace, monkeypatch, tmp_path):
    """Exports land whole under a readable name; a failing export leaves no partial file; old ones are pruned."""
    from specviz.page import actions as page

    monkeypatch.setattr(page, "EXPORT_DIR", tmp_path / "exports")
    monkeypatch.setattr(page, "EXPORTS_KEPT", 3)
    path = Path(page.export(trace))
    assert load_trace(path) == trace
    assert re.fullmatch(r"specviz-summarize-exact-\d{8}-\d{4}\.json", path.name), path.name
    assert path.read_text().startswith('{\n  "meta"')  # pretty-printed for people who open it
    broken = Trace(meta={"mode": "exact", "bad": object()}, sequences=trace.sequences, steps=trace.steps)
    with pytest.raises(TypeError):
        page.export(broken)
    hostile = Trace(meta={"mode": "../../x y", "task": "<b>"}, sequences=trace.sequences, steps=trace.steps)
    assert Path(page.export(hostile)).name.startswith("specviz-b-xy-")
    for _ in range(5):
        page.export(trace)
    folders = list((tmp_path / "exports").iterdir())
    assert len(folders) == 3 and all([f.suffix for f in d.iterdir()] == [".json"] for d in folders)
    # and the oldest beyond the size bound: room for two of these exports, plus the one being written
    monkeypatch.setattr(page, "EXPORTS_KEPT", 64)
    monkeypatch.setattr(page, "EXPORT_MB_KEPT", 2.5 * len(trace.to_json().encode()) / 1e6)
    newest = [Path(page.export(trace)) for _ in range(4)]
    assert sorted((tmp_path / "exports").iterdir()) == sorted(p.parent for p in newest[1:])


def test_loads_refuses_what_cannot_be_written_back(trace):
    data = trace.to_dict()
    text = json.dumps(data)
    assert loads_trace(text) == trace
    with pytest.raises(TraceFormatError, match="not a number"):
        loads_trace(text.replace('"total_s": ', '"total_s": NaN, "x": ', 1))
    data["meta"]["note"] = "\ud800"
    with pytest.raises(TraceFormatError, match="not valid Unicode"):
        loads_trace(json.dumps(data))
    deep: object = "deep"
    for _ in range(40):
        deep = [deep]
    data["meta"]["note"] = deep
    with pytest.raises(TraceFormatError, match="nests deeper"):
        loads_trace(json.dumps(data))
    data["meta"]["note"] = "fine"
    data["meta"]["wer"] = "0.1"
    with pytest.raises(TraceFormatError, match="meta.wer"):
        loads_trace(json.dumps(data))


def _v1_text(edit=None, text_edit=None) -> str:
    data = copy.deepcopy(V1_TRACE)
    if edit:
        edit(data)
    text = json.dumps(data)
    return text_edit(text) if text_edit else text


def _all_discarded(data):
    for it in data["iterations"]:
        it.update(outcome=["discarded"] * len(it["outcome"]), n_accepted=0, emitted=1, next_kind="resampled")


@pytest.mark.parametrize("text, message", [
    (_v1_text(text_edit=lambda t: t.replace('"total_s": ', '"total_s": ' + "1" * 5000 + ', "x": ', 1)), "5,000 digits"),
    (_v1_text(text_edit=lambda t: t.replace('"total_s": ', '"total_s": 1e309, "x": ', 1)), "1e309 is not a finite"),
    (_v1_text(lambda d: d["meta"].update(wer=0.5), lambda t: t.replace('"wer": 0.5', '"wer": -1e309')), "-1e309"),
    (_v1_text(text_edit=lambda t: t.replace('"total_s": ', '"total_s": 5e-324, "x": ', 1)), "works out to inf"),
    (_v1_text(lambda d: d["meta"].update(target_only={"decode_tokens_per_s": 5e-324, "tokens_per_s": 1.0})),
     "target_only.decode_tokens_per_s"),
    (_v1_text(_all_discarded), "one rejected and the rest discarded"),
], ids=["5000-digit number", "1e309", "-1e309 in meta", "subnormal total_s", "subnormal reference rate",
        "every outcome discarded"])
def test_reported_v1_traces_are_refused_with_a_message(text, message):
    with pytest.raises(TraceFormatError, match=message):
        loads_trace(text)


def test_null_meta_values_are_absent_values():
    """meta.config: null once raised AttributeError in the checks; null now means the key is absent."""
    trace = loads_trace(_v1_text(lambda d: d["meta"].update(config=None, target_only=None, wer=None)))
    assert "config" not in trace.meta and "target_only" not in trace.meta
    page.figures(trace, None)
    report.summary_markdown(trace)
    json.dumps(trace.to_dict(), allow_nan=False)


def test_exports_from_many_sessions_and_processes_at_once_never_fail(monkeypatch, tmp_path):
    """Issue 22 (found by tests/test_load.py): pruning the export folder while other sessions, or another
    process sharing it, prune it too must skip what vanished instead of raising FileNotFoundError."""
    import subprocess
    import sys
    import threading

    from specviz.page import actions as page

    monkeypatch.setattr(page, "EXPORT_DIR", tmp_path / "exports")
    for _ in range(page.EXPORTS_KEPT):
        page.download_folder()
    other = subprocess.Popen([sys.executable, "-c", (
        "import sys; from pathlib import Path; from specviz.page import actions as page; page.EXPORT_DIR = Path(sys.argv[1]); "
        "[page.download_folder() for _ in range(300)]"), str(tmp_path / "exports")],
        cwd=Path(__file__).resolve().parents[1])
    errors: list[BaseException] = []

    def export_many() -> None:
        for _ in range(40):
            try:
                page.download_folder()
            except BaseException as e:
                errors.append(e)

    threads = [threading.Thread(target=export_many) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert other.wait(timeout=120) == 0 and errors == []
    assert len(list((tmp_path / "exports").iterdir())) <= page.EXPORTS_KEPT + 2  # pruned, give or take a race


def test_median_verify_time_counts_only_iterations_that_verified(trace):
    """The page labels it "µs per verify call": plain steps (γ = 0) call no verification, and where the cost
    policy steps plainly in most iterations a median over every step read 0."""
    import dataclasses
    import statistics

    drafting = [s for s in trace.steps if s.gamma > 0]
    assert drafting
    plain = [dataclasses.replace(s, index=len(trace.steps) + i, gamma=0, verify_s=0.0)
             for i, s in enumerate(drafting * 2)]  # twice as many plain steps as verifying ones
    mixed = dataclasses.replace(trace, steps=trace.steps + plain)
    expected = 1e3 * statistics.median(s.verify_s for s in drafting)
    assert mixed.summary()["median_verify_ms"] == pytest.approx(expected)
    assert expected > 0
