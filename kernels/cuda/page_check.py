"""The page on a device, driven as its API clients drive it: start `python app.py` on a free loopback port with
`--device`, wait until it listens, then through gradio_client one Run (exact, temperature 0.8, a short article from
assets/) and one Compare (one round), and check what came back: the statuses, the outputs, and the exported traces'
meta (where the models ran, which path verified: "cuda kernels", "torch + C++ passes" or "torch").

    python kernels/cuda/page_check.py --target /tmp/models/target --draft /tmp/models/draft --json out/page.json

Writes {"page_run_ok": true/false, ...what it saw} to --json, stops the app whatever happened, and exits 1 when a
check failed. On a CUDA device the exact and sigmoid runs must have verified on the CUDA kernels (unless
--allow-torch). Needs gradio and gradio_client (the app's requirements) and the two model directories.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
ARTICLE = ROOT / "assets" / "sample_article.txt"
MODES = ("baseline", "exact", "sigmoid")  # the verification modes a Compare runs beside target-only


class CheckFailed(Exception):
    pass


def _check(condition: bool, what: str) -> None:
    if not condition:
        raise CheckFailed(what)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def start_app(device: str, work: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """app.py on a free loopback port, in `work` (its TMPDIR too: exports and Gradio's files stay there)."""
    port = _free_port()
    (work / "tmp").mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1", "TMPDIR": str(work / "tmp"),
           "PYTHONUNBUFFERED": "1"}
    env.pop("GRADIO_TEMP_DIR", None)
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(ROOT / "app.py"), "--port", str(port), "--device", device],
                                cwd=work, stdout=out, stderr=subprocess.STDOUT, env=env)
    return proc, f"http://127.0.0.1:{port}/"


def wait_until_up(url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if proc.poll() is not None:
            raise CheckFailed(f"app.py exited with {proc.returncode} before listening:\n{_tail(log)}")
        try:
            urllib.request.urlopen(url, timeout=2)
            return time.monotonic() - start
        except OSError:
            time.sleep(0.5)
    raise CheckFailed(f"app.py did not listen within {timeout_s:g} s:\n{_tail(log)}")


def stop_app(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _file(value: Any) -> Path:
    """A file output as gradio_client hands it back (a path, or an update dict holding one)."""
    return Path(value["value"] if isinstance(value, dict) else value)


def _trace(value: Any) -> dict:
    return json.loads(_file(value).read_text(encoding="utf-8"))


def _seen(trace: dict) -> dict[str, Any]:
    """What one exported trace says about its run."""
    meta = trace["meta"]
    return {"mode": meta.get("mode"), "device": meta.get("device"), "dtype": meta.get("dtype"),
            "verification": meta.get("verification"),
            "temperature": meta.get("config", {}).get("sampling", {}).get("temperature"),
            "new_tokens": sum(len(s.get("output_ids", [])) for s in trace.get("sequences", [])),
            "iterations": len(trace.get("steps", []))}


def _call(client, api_name: str, timeout_s: float, **values: Any) -> dict[str, Any]:
    """The endpoint's answer by component kind ("html": the status line, "downloadbutton": the export, ...): the
    first output of each kind, in the order the API lists them."""
    result = client.submit(api_name=api_name, **values).result(timeout=timeout_s)
    result = result if isinstance(result, tuple) else (result,)
    returns = client.view_api(return_format="dict", print_info=False)["named_endpoints"][api_name]["returns"]
    named: dict[str, Any] = {}
    for output, value in zip(returns, result):
        named.setdefault(output["component"].lower(), value)
    return named


def drive(url: str, args: argparse.Namespace, downloads: Path, seen: dict[str, Any]) -> None:
    from gradio_client import Client

    client = Client(url, verbose=False, download_files=str(downloads))
    device_info = next((c.get("props", {}).get("value") for c in client.config["components"]
                        if c.get("props", {}).get("elem_id") == "device-info"), None)
    seen["device_info"] = device_info
    article = ARTICLE.read_text(encoding="utf-8")
    models = {"draft": args.draft, "target": args.target}

    start = time.monotonic()
    answer = _call(client, "/run", args.call_timeout, article=article, mode="exact", decoding="sample",
                   temperature=0.8, max_new_tokens=args.tokens, **models)
    status = answer["html"]
    seen["run"] = {"status": status, "seconds": round(time.monotonic() - start, 2)}
    _check("Done:" in status, f"the Run did not finish: {status}")
    run = _seen(_trace(answer["downloadbutton"]))
    seen["run"].update(run)
    _check(run["mode"] == "exact" and run["temperature"] == 0.8, f"the Run's trace is not the one asked for: {run}")
    _check(0 < run["new_tokens"] <= args.tokens, f"the Run made {run['new_tokens']} tokens (asked {args.tokens})")

    start = time.monotonic()
    answer = _call(client, "/compare", args.call_timeout, article=article, rounds=1, decoding="sample",
                   temperature=0.8, max_new_tokens=args.compare_tokens, **models)
    status, table, pick = answer["html"], answer["dataframe"], answer["dropdown"]
    seen["compare"] = {"status": status, "seconds": round(time.monotonic() - start, 2)}
    _check("Comparison done" in status, f"the Compare did not finish: {status}")
    rows = {row[0]: dict(zip(table["headers"], row)) for row in table["data"]}
    seen["compare"]["rows"] = {name: {k: row[k] for k in ("tokens/s", "α", "verify µs", "= target-only")
                                      if k in row} for name, row in rows.items()}
    _check({"target-only", *MODES} <= set(rows), f"the Compare's table lacks runs: {sorted(rows)}")
    choices = [c[0] if isinstance(c, (list, tuple)) else c for c in pick.get("choices", [])] \
        if isinstance(pick, dict) else []
    seen["compare"]["runs"] = {}
    for mode in MODES:  # each run's trace, opened in the session as the page's "Open it" does
        _check(mode in choices, f"the Compare offers no {mode} run to open: {choices}")
        opened = _call(client, "/open_compared", args.call_timeout, compare_pick=mode)
        run = _seen(_trace(opened["downloadbutton"]))
        seen["compare"]["runs"][mode] = run
        _check(run["mode"] == mode and run["new_tokens"] > 0, f"the Compare's {mode} trace: {run}")


def verification_ok(seen: dict[str, Any], device: str, allow_torch: bool) -> tuple[bool, list[str]]:
    """On CUDA the sampled exact and sigmoid runs verify on the CUDA kernels; the traces must say so."""
    paths = {"run exact": (seen.get("run", {}).get("verification") or {}).get("path")}
    for mode, run in seen.get("compare", {}).get("runs", {}).items():
        paths[f"compare {mode}"] = (run.get("verification") or {}).get("path")
    problems = [f"{what}: no verification recorded" for what, path in paths.items() if path is None]
    if device.startswith("cuda") and not allow_torch:
        problems += [f"{what} verified on {path!r}, not the CUDA kernels" for what, path in paths.items()
                     if path is not None and "baseline" not in what and path != "cuda kernels"]
    return not problems, problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="the target model's directory (or hub id)")
    parser.add_argument("--draft", required=True, help="the draft model's directory (or hub id)")
    parser.add_argument("--device", default="cuda", help="the app's --device (default cuda)")
    parser.add_argument("--json", type=Path, default=None, help="write what was seen here")
    parser.add_argument("--tokens", type=int, default=48, help="the Run's max new tokens")
    parser.add_argument("--compare-tokens", type=int, default=32, help="each Compare run's max new tokens")
    parser.add_argument("--start-timeout", type=float, default=300, help="seconds for the app to listen")
    parser.add_argument("--call-timeout", type=float, default=300, help="seconds for each call to answer")
    parser.add_argument("--allow-torch", action="store_true",
                        help="on CUDA, accept exact/sigmoid verified on torch (no CuPy kernels)")
    parser.add_argument("--log", type=Path, default=None, help="keep the app's log here (default: beside --json)")
    args = parser.parse_args(argv)

    seen: dict[str, Any] = {"page_run_ok": False, "device": args.device, "target": args.target, "draft": args.draft}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="specviz-page-check-") as tmp:
        work = Path(tmp)
        log = args.log or (args.json.with_suffix(".app.log") if args.json else work / "app.log")
        log.parent.mkdir(parents=True, exist_ok=True)
        proc = None
        try:
            proc, url = start_app(args.device, work, log)
            seen["start_seconds"] = round(wait_until_up(url, proc, log, args.start_timeout), 2)
            drive(url, args, work / "downloads", seen)
            _check(proc.poll() is None, f"app.py died:\n{_tail(log)}")
            traces = [line for line in _tail(log, 200_000).splitlines() if "Traceback" in line]
            _check(not traces, f"the app's log has a traceback:\n{_tail(log)}")
            seen["verification_ok"], seen["verification_problems"] = verification_ok(seen, args.device,
                                                                                      args.allow_torch)
            seen["page_run_ok"] = seen["verification_ok"]
        except Exception as e:  # any failure is reported in the JSON, with the app's log
            seen["error"] = f"{type(e).__name__}: {e}"
            if not isinstance(e, CheckFailed):
                seen["traceback"] = traceback.format_exc()[-4000:]
            seen["app_log_tail"] = _tail(log)
        finally:
            if proc is not None:
                stop_app(proc)
        seen["seconds"] = round(time.monotonic() - started, 2)
        seen["app_log"] = str(log)
    text = json.dumps(seen, indent=2, default=str)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    print(text)
    return 0 if seen["page_run_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
