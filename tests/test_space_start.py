"""A Space restart, as a visitor meets it: an empty model cache, `python app.py` with SPACE_ID set (so the page
prepares the default pair at start and applies the shared page's limits), then the first Run and a Compare
through gradio_client. It must answer with the cache and the server's memory well inside a free Space (16 GB of
memory, an ephemeral disk); the times are printed (docs/benchmarks.md, "The page", has the measured ones).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from gradio_client import Client

from pageclient import app_server

ROOT = Path(__file__).resolve().parents[1]
CACHE_LIMIT_GB = 3.0
PEAK_LIMIT_GB = 8.0


def peak_rss_gb(pid: int) -> float:
    """The process's peak resident memory so far (Linux: VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / 1e9
    raise AssertionError("no VmHWM in /proc/<pid>/status")


def folder_gb(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 1e9


@pytest.mark.real
def test_a_space_restart_answers_its_first_run_and_compare_from_an_empty_cache(tmp_path):
    cache = tmp_path / "cache"
    env = {"SPACE_ID": "specviz/test", "SPECVIZ_CACHE": str(cache)}
    started = time.monotonic()
    with app_server(tmp_path, env=env) as server:
        up = time.monotonic() - started
        client = Client(server.url, verbose=False, download_files=str(tmp_path / "downloads"))
        article = (ROOT / "assets" / "sample_article.txt").read_text(encoding="utf-8")
        status, export, *_ = client.predict(article=article, api_name="/run")
        first_run = time.monotonic() - started
        assert "speedup measured" in status, status
        assert Path(export["value"]).stat().st_size > 0
        begun = time.monotonic()
        status, table, *_ = client.predict(article=article, rounds=1, max_new_tokens=32, api_name="/compare")
        compare_s = time.monotonic() - begun
        assert "Comparison done" in status, status
        peak = peak_rss_gb(server.proc.pid)
        log = server.log.read_text()
    size = folder_gb(cache)
    print(f"\nSpace restart: server up {up:.0f} s, first Run answered {first_run:.0f} s after start, Compare "
          f"(1 round, 32 tokens) {compare_s:.0f} s; cache {size:.2f} GB; server's peak memory {peak:.2f} GB")
    assert "preparing the default models" in log  # it started on the pair before the first visitor asked
    assert size <= CACHE_LIMIT_GB, f"the cache holds {size:.2f} GB"
    assert peak <= PEAK_LIMIT_GB, f"the server peaked at {peak:.2f} GB"
    assert not any(p.name == "model.safetensors" for p in cache.rglob("*")), "a dense copy was written"
    assert os.environ.get("SPACE_ID") is None  # the test's own environment is untouched
