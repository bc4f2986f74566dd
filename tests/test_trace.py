"""Trace JSON: round trip, and clear refusals for what is not a trace this version can read."""

from __future__ import annotations

import json

import pytest

from specviz.config import SamplingConfig, SpecConfig
from specviz.engine import run_speculative
from specviz.trace import SCHEMA_VERSION, Trace, TraceFormatError


@pytest.fixture(scope="module")
def trace(tiny_pair, prompt_ids) -> Trace:
    cfg = SpecConfig(mode="exact", sampling=SamplingConfig(temperature=1.0, top_p=0.9), max_new_tokens=20, seed=5)
    return run_speculative(tiny_pair, prompt_ids, cfg, meta={"input": "ünïcode ✓ article"})


def test_round_trip_is_equal(trace, tmp_path):
    path = tmp_path / "t.json"
    trace.save(path)
    loaded = Trace.load(path)
    assert loaded == trace
    assert loaded.summary() == trace.summary()
    data = json.loads(path.read_text())
    assert data["schema_version"] == SCHEMA_VERSION
    assert data["summary"]["new_tokens"] == 20


def _write(tmp_path, payload) -> str:
    path = tmp_path / "bad.json"
    path.write_text(payload if isinstance(payload, str) else json.dumps(payload))
    return path


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.pop("schema_version"), "schema_version"),
        (lambda d: d.update(schema_version=SCHEMA_VERSION + 1), "newer"),
        (lambda d: d.update(schema_version="1"), "schema_version"),
        (lambda d: d.pop("output_ids"), "missing 'output_ids'"),
        (lambda d: d["iterations"][0].pop("uniform"), "iteration 0 is missing 'uniform'"),
        (lambda d: d["iterations"][0].update(gamma="five"), "'gamma' in iteration 0"),
        (lambda d: d["iterations"][0].update(q=[0.5]), "γ ="),
        (lambda d: d["iterations"][0].update(draft_ids=["a"] * len(d["iterations"][0]["draft_ids"])), "'draft_ids'"),
        (lambda d: d.update(iterations={}), "'iterations' must be a list"),
        (lambda d: d.update(total_s=True), "'total_s'"),
    ],
)
def test_malformed_trace_is_refused(trace, tmp_path, mutate, message):
    data = trace.to_dict()
    mutate(data)
    with pytest.raises(TraceFormatError, match=message):
        Trace.load(_write(tmp_path, data))


@pytest.mark.parametrize(
    "payload, message",
    [("{not json", "not valid JSON"), ("[1, 2]", "JSON object"), ("", "not valid JSON")],
)
def test_not_a_trace(tmp_path, payload, message):
    with pytest.raises(TraceFormatError, match=message):
        Trace.load(_write(tmp_path, payload))


def test_binary_file_is_refused(tmp_path):
    path = tmp_path / "noise.json"
    path.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(TraceFormatError, match="not a text file"):
        Trace.load(path)
