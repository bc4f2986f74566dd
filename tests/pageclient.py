"""The running page as its users reach it: `python app.py` as a server process on a free loopback port, and
gradio_client sessions calling the events its buttons fire. Shared by the load test and the soak."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest
from gradio_client import Client

from specviz.page import app
from specviz.page import actions as page
from specviz.runs.settings import TEXT, Settings

ROOT = Path(__file__).resolve().parent.parent
START_S = 120  # the app's start (imports torch and gradio)


# ---- the server ------------------------------------------------------------------------------------------


@dataclass
class AppServer:
    url: str
    proc: subprocess.Popen
    log: Path
    temp: Path  # the server's TMPDIR: its exports and Gradio's cache of uploads and files live under it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def app_server(work: Path, env: dict[str, str] | None = None) -> Iterator[AppServer]:
    """app.py running in `work`, its temp dir the test's own (big exports and uploads stay out of the shared
    /tmp, and what it leaves there can be counted); the export folder starts as a long-running server's does;
    `env`: more environment for the server."""
    log = work / "app.log"
    port = _free_port()
    temp = work / "tmp"
    _steady_export_folder(temp)
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "TMPDIR": str(temp), **(env or {})}
    env.pop("GRADIO_TEMP_DIR", None)  # Gradio's cache goes under TMPDIR too
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(ROOT / "app.py"), "--port", str(port)], cwd=work, stdout=out,
                                stderr=subprocess.STDOUT, env=env)
    try:
        _wait_until_up(f"http://127.0.0.1:{port}/", proc, log)
        yield AppServer(f"http://127.0.0.1:{port}/", proc, log, temp)
    finally:  # the server never outlives the test, whatever failed
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _steady_export_folder(temp: Path) -> None:
    """A server that has run a while holds page.EXPORTS_KEPT export folders and prunes the oldest on every
    export; a fresh one prunes nothing. Under load the steady state is the one that matters."""
    exports = temp / "gradio" / page.EXPORT_DIR.name
    for i in range(page.EXPORTS_KEPT):
        (exports / f"earlier-{i:03d}").mkdir(parents=True)
        os.utime(exports / f"earlier-{i:03d}", (1e9 + i, 1e9 + i))  # older than anything the test exports


def _wait_until_up(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"app.py exited: {log.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"app.py did not start within {START_S} s: {log.read_text()[-3000:]}")


def check_server_survived(server: AppServer) -> None:
    assert server.proc.poll() is None, f"app.py died: {server.log.read_text()[-3000:]}"
    log = server.log.read_text()
    assert "Traceback" not in log, log[-5000:]


# ---- the page's events, as a session calls them -----------------------------------------------------------


@dataclass(frozen=True)
class Event:
    """One of the page's events: its fn_index and its input and output component names in order (those the
    client sends and returns, i.e. without gr.State and layout components)."""

    fn_index: int
    inputs: list[str]
    outputs: list[str]


def _dependency(client: Client, elem_id: str, trigger: str) -> dict:
    """The event that `trigger` on the component `elem_id` fires; for a button wired busy → work → idle,
    the work (the `.then` after the click)."""
    config = client.config
    component = next(c["id"] for c in config["components"] if c.get("props", {}).get("elem_id") == elem_id)
    deps = config["dependencies"]
    first = next(d for d in deps if [component, trigger] in d["targets"])
    then = [d for d in deps if d.get("trigger_after") == first["id"] and d["inputs"]]
    return then[0] if then else first


def _event(client: Client, elem_id: str, trigger: str, inputs: list[str], outputs: list[str]) -> Event:
    dep = _dependency(client, elem_id, trigger)
    # the names come from app.py; the lengths prove we found the event that takes them
    assert len(dep["inputs"]) == len(inputs) and len(dep["outputs"]) == len(outputs), (elem_id, dep)
    endpoint = client.endpoints[dep["id"]]
    sent = [n for n, t in zip(inputs, endpoint.input_component_types) if not t.is_state]
    returned = [n for n, t in zip(outputs, endpoint.output_component_types) if not t.skip]
    return Event(dep["id"], sent, returned)


@dataclass(frozen=True)
class Events:
    run: Event
    compare: Event
    upload: Event


def events(client: Client) -> Events:
    return Events(run=_event(client, "run-button", "click", app.RUN_INPUTS, app.SHOWN),
                  compare=_event(client, "compare-button", "click", app.COMPARE_INPUTS, app.COMPARE_OUTPUTS),
                  upload=_event(client, "trace-upload", "upload", ["trace_upload"], app.RESTORED))


def client(server: AppServer, downloads: Path) -> Client:
    """One browser session (its own session hash, so its own gr.State)."""
    return Client(server.url, verbose=False, download_files=str(downloads))


def submit(session: Client, event: Event, values: dict[str, Any]):
    return session.submit(*(values[name] for name in event.inputs), fn_index=event.fn_index)


def named(event: Event, result: tuple) -> dict[str, Any]:
    return dict(zip(event.outputs, result))


# ---- what the sessions send ------------------------------------------------------------------------------


def settings(model_dirs: tuple[str, str], new_tokens: int) -> dict[str, Any]:
    draft, target = model_dirs
    return Settings(decoding="greedy", max_new_tokens=new_tokens, draft=draft, target=target).to_dict()


def article(session: int) -> str:
    """Twelve words of the tiny tokenizer's vocabulary, different for each session."""
    return " ".join(f"w{100 * (session + 1) + j}" for j in range(12))


def run_values(text: str, model_dirs: tuple[str, str], new_tokens: int) -> dict[str, Any]:
    # measure off: the target-only reference would double every run and is not what is under test
    return {"task": TEXT, "article": text, "audio": None, "reference_summary": "", "reference_transcript": "",
            "measure": False, **settings(model_dirs, new_tokens)}


def compare_values(text: str, model_dirs: tuple[str, str], new_tokens: int) -> dict[str, Any]:
    return {"task": TEXT, "article": text, "audio": None, "rounds": 1, "with_hf": False, "same_schedule": True,
            **settings(model_dirs, new_tokens)}


def export_path(shown: dict[str, Any]) -> Path:
    """The file the Export button offers (the client downloaded it); the button comes as an update that also
    turns it on."""
    export = shown["export"]
    return Path(export["value"] if isinstance(export, dict) else export)


def trace_of(shown: dict[str, Any]) -> dict:
    return json.loads(export_path(shown).read_text())


def padded_trace(exported: Path, out: Path, megabytes: float) -> Path:
    """A real exported trace made large the way a long run's would be: many more bytes, same structure. The
    padding is an extra meta field (meta is free-form beyond the keys the page reads)."""
    data = json.loads(exported.read_text())
    line = "load test padding: " + "x" * 80
    data["meta"]["load_test_padding"] = [line] * int(megabytes * 1e6 / (len(line) + 4))
    out.write_text(json.dumps(data))
    return out
