"""The page under load: several browser sessions at once against the real app, driven by gradio_client.

`python app.py` runs as a subprocess on a free loopback port; each gradio_client.Client is one browser
session (its own session hash, so its own gr.State). They call the same events the page's buttons fire
(found in the app's config by the buttons' element ids), all at once:

* RUNS sessions each run a short greedy text run of their own article on tiny local models; the run event
  has concurrency_limit=1, so all but one must wait in Gradio's queue and are told their position;
* UPLOADS sessions load a large trace file (a real exported trace padded with a long meta field);
* COMPARES sessions compare all modes (1 round) at the same time.

Every session must get its own, correct result: a run's output equals a solo run of the same article with
the same settings (greedy, so exactly), and its exported trace names its own article. The server must
survive with no traceback in its log. The wall time and the queue waits are printed as a table (pytest -s),
for docs/benchmarks.md.

The issue's 50 MB trace takes longer than a test should; run it by hand with
    SPECVIZ_LOAD_TRACE_MB=50 PYTHONPATH=. python -m pytest -q -s tests/test_load.py
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from gradio_client import Client, handle_file
from gradio_client.utils import Status

import app
from specviz import page
from specviz.settings import Settings

from conftest import save_tiny_pair

pytestmark = pytest.mark.load
ROOT = Path(__file__).resolve().parent.parent
RUNS, UPLOADS, COMPARES = 5, 2, 1  # 8 sessions at once
NEW_TOKENS = 12
TRACE_MB = float(os.environ.get("SPECVIZ_LOAD_TRACE_MB", "6"))  # the 50 MB: see the module docstring
START_S = 120  # the app's start (imports torch and gradio)
JOB_S = 150  # any one job, queue included
WAITING = {Status.STARTING, Status.JOINING_QUEUE, Status.QUEUE_FULL, Status.IN_QUEUE, Status.SENDING_DATA}


# ---- the server and its models ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> tuple[str, str]:
    """A tiny random draft/target pair saved as local checkpoints, typed into the page's model fields."""
    return save_tiny_pair(tmp_path_factory.mktemp("load-models"))


@dataclass
class AppServer:
    url: str
    proc: subprocess.Popen
    log: Path


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> AppServer:
    work = tmp_path_factory.mktemp("load-app")
    log = work / "app.log"
    port = _free_port()
    # The server's temp dir is the test's own: the 6 MB exports and uploads stay out of the shared /tmp, and
    # the export folder starts as a long-running server's does.
    temp = work / "tmp"
    _steady_export_folder(temp)
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "TMPDIR": str(temp)}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(ROOT / "app.py"), "--port", str(port)], cwd=work, stdout=out,
                                stderr=subprocess.STDOUT, env=env)
    try:
        _wait_until_up(f"http://127.0.0.1:{port}/", proc, log)
        yield AppServer(f"http://127.0.0.1:{port}/", proc, log)
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
    exports = temp / page.EXPORT_DIR.name
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


def _events(client: Client) -> Events:
    return Events(run=_event(client, "run-button", "click", app.RUN_INPUTS, app.SHOWN),
                  compare=_event(client, "compare-button", "click", app.COMPARE_INPUTS, app.COMPARE_OUTPUTS),
                  upload=_event(client, "trace-upload", "upload", ["trace_upload"], app.RESTORED))


def _client(server: AppServer, downloads: Path) -> Client:
    return Client(server.url, verbose=False, download_files=str(downloads))


def _settings(model_dirs: tuple[str, str]) -> dict[str, Any]:
    draft, target = model_dirs
    return Settings(decoding="greedy", max_new_tokens=NEW_TOKENS, draft=draft, target=target).to_dict()


def _article(session: int) -> str:
    """Twelve words of the tiny tokenizer's vocabulary, different for each session."""
    return " ".join(f"w{100 * (session + 1) + j}" for j in range(12))


def _run_values(article: str, model_dirs) -> dict[str, Any]:
    # measure off: the target-only reference would double every run and is not what is under test
    return {"article": article, "audio": None, "reference_summary": "", "reference_transcript": "",
            "measure": False, **_settings(model_dirs)}


def _compare_values(article: str, model_dirs) -> dict[str, Any]:
    return {"article": article, "audio": None, "rounds": 1, "with_hf": False, **_settings(model_dirs)}


def _submit(client: Client, event: Event, values: dict[str, Any]):
    return client.submit(*(values[name] for name in event.inputs), fn_index=event.fn_index)


def _named(event: Event, result: tuple) -> dict[str, Any]:
    return dict(zip(event.outputs, result))


# ---- watching the jobs: when each left the queue, and the positions it was told ---------------------------


@dataclass
class Watched:
    kind: str
    session: int
    job: Any
    submitted: float
    started: float | None = None  # first status past the queue (processing, progress, or finished)
    ended: float | None = None
    ranks: list[int] = field(default_factory=list)  # queue positions reported while waiting
    result: dict[str, Any] | None = None  # the outputs by component name
    error: str | None = None  # the exception the client raised, or the ⚠ status line the page showed

    @property
    def queue_wait(self) -> float:
        return (self.started or self.ended or self.submitted) - self.submitted  # 0 for a job never seen to end


def _watch(jobs: list[Watched], stop: threading.Event) -> None:
    """Poll every job's latest status; a 10 ms poll is far finer than the waits it measures."""
    while not stop.is_set():
        now = time.perf_counter()
        for w in jobs:
            if w.ended is not None:
                continue
            status = w.job.status()
            if status.code == Status.IN_QUEUE and status.rank is not None:
                if not w.ranks or w.ranks[-1] != status.rank:
                    w.ranks.append(status.rank)
            if w.started is None and status.code not in WAITING:
                w.started = now
            if w.job.done():
                w.ended = now
        time.sleep(0.01)


# ---- the trace that two sessions upload ------------------------------------------------------------------


def _padded_trace(exported: Path, out: Path, megabytes: float) -> Path:
    """A real exported trace made large the way a long run's would be: many more bytes, same structure. The
    padding is an extra meta field (meta is free-form beyond the keys the page reads)."""
    data = json.loads(exported.read_text())
    line = "load test padding: " + "x" * 80
    data["meta"]["load_test_padding"] = [line] * int(megabytes * 1e6 / (len(line) + 4))
    out.write_text(json.dumps(data))
    return out


# ---- the sessions at once, and what each must get ---------------------------------------------------------


def _solo_runs(server, model_dirs, downloads: Path, sessions: list[int]) -> tuple[Events, dict[int, dict]]:
    """Each session's article run alone, one after another, in one session: the expected outputs (and the
    models' first load, which would otherwise weigh on the first queued run)."""
    client = _client(server, downloads)
    try:
        events = _events(client)
        solo = {}
        for s in sessions:
            result = _submit(client, events.run, _run_values(_article(s), model_dirs)).result(timeout=JOB_S)
            solo[s] = _named(events.run, result)
            assert "Done" in solo[s]["status"], solo[s]["status"]
        return events, solo
    finally:
        client.close()


def _export_path(shown: dict[str, Any]) -> Path:
    """The file the Export button offers (the client downloaded it); the button comes as an update that also
    turns it on."""
    export = shown["export"]
    return Path(export["value"] if isinstance(export, dict) else export)


def _trace_of(shown: dict[str, Any]) -> dict:
    return json.loads(_export_path(shown).read_text())


def _percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def _report(watched: list[Watched], wall: float) -> None:
    print(f"\nload: {RUNS} runs + {UPLOADS} uploads of a {TRACE_MB:g} MB trace + {COMPARES} compare, "
          f"{len(watched)} sessions at once, {NEW_TOKENS} greedy tokens per run, tiny models, loopback")
    print("queue wait: from submit (a file is sent first) to the job's start; total: to its result; "
          "position: the highest queue rank Gradio told a job (0 = next)")
    print(f"{'job':<8} {'count':>5} {'queue wait p50 s':>17} {'p95 s':>7} {'max s':>7} {'total p50 s':>12} "
          f"{'position':>9}")
    for kind in ("run", "upload", "compare", "all"):
        ws = [w for w in watched if kind in ("all", w.kind)]
        waits = [w.queue_wait for w in ws]
        totals = [(w.ended or w.submitted) - w.submitted for w in ws]
        print(f"{kind:<8} {len(ws):>5} {_percentile(waits, 50):>17.2f} {_percentile(waits, 95):>7.2f} "
              f"{max(waits):>7.2f} {_percentile(totals, 50):>12.2f} "
              f"{max((r for w in ws for r in w.ranks), default='-'):>9}")
    errors = sum(w.error is not None for w in watched)
    print(f"wall time (first submit to last result): {wall:.2f} s; errors: {errors}")


def _all_at_once(clients, plan, events: Events, model_dirs, big: Path) -> tuple[list[Watched], float]:
    """Submit every session's job at once (from its own thread, as browsers would), wait for all."""
    def submit(i: int) -> Watched:
        kind, s = plan[i]
        if kind == "run":
            values = _run_values(_article(s), model_dirs)
        elif kind == "compare":
            values = _compare_values(_article(s), model_dirs)
        else:
            values = {"trace_upload": handle_file(str(big))}
        submitted = time.perf_counter()
        return Watched(kind, s, _submit(clients[i], getattr(events, kind), values), submitted)

    start = time.perf_counter()
    with ThreadPoolExecutor(len(plan)) as pool:
        watched = list(pool.map(submit, range(len(plan))))
    stop = threading.Event()
    watcher = threading.Thread(target=_watch, args=(watched, stop), daemon=True)
    watcher.start()
    try:
        for w in watched:
            _collect(w, events, deadline=start + JOB_S)
    finally:
        stop.set()
        watcher.join(timeout=5)
    return watched, max(w.ended or time.perf_counter() for w in watched) - start


def _collect(w: Watched, events: Events, deadline: float) -> None:
    """Wait for the job (to the shared deadline); keep its outputs, or what went wrong, for the report."""
    try:
        w.result = _named(getattr(events, w.kind), w.job.result(timeout=max(1.0, deadline - time.perf_counter())))
    except Exception as e:  # a timeout or the app's error: a failed session, reported with the others
        w.error = f"{type(e).__name__}: {e}"
        return
    if "⚠" in str(w.result.get("status")):
        w.error = w.result["status"]


def _check_run(shown: dict, solo: dict, article: str) -> None:
    assert "Done" in shown["status"] and "⚠" not in shown["status"], shown["status"]
    assert shown["output"] == solo["output"], (article, shown["output"], solo["output"])
    trace, solo_trace = _trace_of(shown), _trace_of(solo)
    assert trace["meta"]["input"] == article  # this session's own article, not a neighbour's
    assert [s["output_ids"] for s in trace["sequences"]] == [s["output_ids"] for s in solo_trace["sequences"]]


def _check_upload(shown: dict, solo: dict, big: Path) -> None:
    assert "Loaded trace" in shown["status"] and big.name in shown["status"], shown["status"]
    assert shown["output"] == solo["output"] and shown["article"] == _article(0)  # its input and settings back
    assert shown["max_new_tokens"] == NEW_TOKENS and shown["decoding"] == "greedy"
    # read whole: the page's own export of it carries every line of the padding
    padding = json.loads(big.read_text())["meta"]["load_test_padding"]
    assert _trace_of(shown)["meta"]["load_test_padding"] == padding


def _check_compare(shown: dict, solo: dict) -> None:
    assert "Comparison done" in shown["status"], shown["status"]
    table = shown["compare_table"]
    rows = {row[0]: dict(zip(table["headers"], row)) for row in table["data"]}
    assert {"target-only", "exact", "baseline"} <= set(rows), rows.keys()
    assert rows["exact"]["output"] == solo["output"], (rows["exact"]["output"], solo["output"])


def _check_server_survived(server: AppServer) -> None:
    assert server.proc.poll() is None, f"app.py died under load: {server.log.read_text()[-3000:]}"
    log = server.log.read_text()
    assert "Traceback" not in log, log[-5000:]


def test_eight_sessions_at_once_each_get_their_own_result(server, model_dirs, tmp_path):
    run_sessions = list(range(RUNS))
    compare_sessions = list(range(RUNS, RUNS + COMPARES))
    events, solo = _solo_runs(server, model_dirs, tmp_path / "solo", run_sessions + compare_sessions)
    outputs = [solo[s]["output"] for s in run_sessions]
    assert len(set(outputs)) == len(outputs), f"articles should decode differently, or mixing goes unseen: {outputs}"
    big = _padded_trace(_export_path(solo[0]), tmp_path / "big-trace.json", TRACE_MB)

    plan = [("run", s) for s in run_sessions] + [("upload", s) for s in range(UPLOADS)] + \
        [("compare", s) for s in compare_sessions]
    clients = [_client(server, tmp_path / f"session-{i}") for i in range(len(plan))]
    try:
        watched, wall = _all_at_once(clients, plan, events, model_dirs, big)
    finally:
        for c in clients:
            c.close()

    _report(watched, wall)
    errors = [(w.kind, w.session, w.error) for w in watched if w.error]
    assert not errors, f"sessions failed under load: {errors}"
    for w in watched:
        if w.kind == "run":
            _check_run(w.result, solo[w.session], _article(w.session))
        elif w.kind == "upload":
            _check_upload(w.result, solo[0], big)
        else:
            _check_compare(w.result, solo[w.session])
    queued = [w for w in watched if w.kind == "run" and any(r >= 1 for r in w.ranks)]
    assert queued, f"no run was told a queue position: {[(w.session, w.ranks) for w in watched]}"
    _check_server_survived(server)
