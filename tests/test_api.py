"""The README's gradio_client example, run as it is written against the running app on the embedded models."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest

from pageclient import app_server

ROOT = Path(__file__).resolve().parents[1]


def _readme_example() -> str:
    section = (ROOT / "README.md").read_text(encoding="utf-8").split("## The API", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.real
def test_the_readme_api_example_runs_a_summary_and_downloads_its_trace(tmp_path, monkeypatch):
    code = _readme_example()
    assert 'api_name="/run"' in code and "Client(" in code
    with app_server(tmp_path) as server:
        code = code.replace('"http://127.0.0.1:7860/"', repr(server.url))
        monkeypatch.chdir(ROOT)  # the example opens assets/ as a reader of this README in a checkout would
        printed = io.StringIO()
        scope: dict = {}
        with contextlib.redirect_stdout(printed):
            exec(compile(code, "README.md (The API)", "exec"), scope)  # noqa: S102 (our own README)
    assert "Done: 24 tokens" in scope["status"] and "speedup measured" in scope["status"], scope["status"]
    trace = json.loads(Path(scope["trace_file"]).read_text(encoding="utf-8"))
    assert trace["meta"]["task"] == "summarize" and trace["meta"]["config"]["max_new_tokens"] == 24
    assert sum(len(s["output_ids"]) for s in trace["sequences"]) == 24
    assert trace["meta"]["target_only"]["tokens_per_s"] > 0  # the speedup was measured, not only predicted
    assert scope["status"] in printed.getvalue()
