"""Benchmark (not a test): does the speedup the page shows match what a careful benchmark measures?

The page as a visitor uses it: `python app.py` on the embedded pair, headless Chromium drawing it on the same
cores, the page's defaults, a Run on each document (after one warm-up Run that loads the models) and a Compare
of three rounds; then, with the page closed, `specviz compare --repeat 3` on the same documents and settings.
Writes one JSON file with both sides, the wall time of each Run from the click until the page is idle, and the
machine.

    python tests/bench_page_truth.py docs/results/inputs/heat_pumps.txt docs/results/inputs/tidal_locks.txt \\
        --json docs/results/page-truth.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from pageclient import _free_port, _wait_until_up  # noqa: E402

from specviz.machine import describe as machine_summary  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
TIMEOUT_MS = 600_000


def _status(pg) -> str:
    return pg.inner_text("#status .sv-status")


def _click_and_wait(pg, button: str, pattern: str) -> tuple[str, float]:
    before = _status(pg)
    started = time.perf_counter()
    pg.click(button)
    pg.wait_for_function(
        "([old, pat]) => { const s = document.querySelector('#status .sv-status');"
        " return s && s.innerText !== old && new RegExp(pat).test(s.innerText); }",
        arg=[before, pattern], timeout=TIMEOUT_MS)
    pg.wait_for_function(f"() => !document.querySelector('{button}').disabled", timeout=TIMEOUT_MS)
    return _status(pg), time.perf_counter() - started


def _summary_numbers(pg) -> dict:
    text = pg.inner_text("#run-summary")
    measured = re.search(r"Measured: ([0-9.]+)× target-only's decoding speed", text)
    reference = re.search(r"target-only decoded ([0-9.]+) tokens/s", text)
    return {"measured_decode_speedup": float(measured.group(1)) if measured else None,
            "target_only_decode_tokens_per_s": float(reference.group(1)) if reference else None}


def _compare_table(pg) -> dict[str, dict[str, str]]:
    """The table as the page shows it, cells by header (Gradio's grid: rows and cells by their roles)."""
    from specviz.page.handlers import COMPARE_COLUMNS

    rows = pg.evaluate("""() => [...document.querySelectorAll('#compare-table tr, #compare-table [role=row]')]
        .map(row => [...row.querySelectorAll('td, [role=gridcell]')].map(cell => cell.innerText.trim()))
        .filter(cells => cells.length > 0)""")
    return {cells[0]: dict(zip(COMPARE_COLUMNS[1:], cells[1:])) for cells in rows}


def page_side(documents: list[Path], compare_document: Path, env: dict, greedy: bool) -> dict:
    from playwright.sync_api import sync_playwright

    port = _free_port()
    log = Path("/tmp/bench-page-truth-app.log")
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(ROOT / "app.py"), "--port", str(port)], stdout=out,
                                stderr=subprocess.STDOUT, env=env)
    try:
        _wait_until_up(f"http://127.0.0.1:{port}/", proc, log)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"])
            pg = browser.new_context(viewport={"width": 1400, "height": 1800}).new_page()
            pg.goto(f"http://127.0.0.1:{port}/")
            pg.wait_for_selector("#run-button")
            pg.wait_for_timeout(1500)
            if greedy:
                pg.locator("#decoding-select input[value=greedy]").check()
            _, load_s = _click_and_wait(pg, "#run-button", "Done|⚠")  # the sample article: loads the models
            runs = {}
            for doc in documents:
                pg.fill("#article-input textarea", doc.read_text(encoding="utf-8"))
                status, wall = _click_and_wait(pg, "#run-button", "Done|⚠")
                runs[doc.name] = {"status": status, "click_to_idle_s": wall, **_summary_numbers(pg)}
                print(doc.name, runs[doc.name], flush=True)
            pg.fill("#article-input textarea", compare_document.read_text(encoding="utf-8"))
            pg.locator("#compare-same-schedule input").uncheck()  # each mode its own γ, as the CLI's compare
            status, wall = _click_and_wait(pg, "#compare-button", "Comparison done|⚠")
            table = _compare_table(pg)
            # the plot's bar labels, in the table's order: "1.54× end to end · 1.55× decoding"
            labels = re.findall(r"([0-9.]+)× end to end · ([0-9.]+)× decoding", pg.inner_text("#compare-plot"))
            decoding = dict(zip(("target-only", "baseline", "exact", "sigmoid"), (float(d) for _, d in labels)))
            print("compare", table, decoding, flush=True)
            browser.close()
        return {"first_run_with_loading_s": load_s, "runs": runs,
                "compare": {"document": compare_document.name, "status": status, "click_to_idle_s": wall,
                            "table": table, "speedup_decode": decoding}}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def benchmark_side(document: Path, modes: list[str], env: dict, out: Path, greedy: bool) -> dict:
    cmd = [sys.executable, "-m", "specviz", "compare", str(document), "--max-new-tokens", "96", "--temperature",
           "0" if greedy else "0.8",
           "--seed", "0", "--repeat", "3", "--modes", *modes, "--json", str(out)]
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    rows = json.loads(out.read_text())
    rows = rows["rows"] if isinstance(rows, dict) else rows
    return {r["name"]: {"speedup_decode": r["speedup_decode"], "speedup_end_to_end": r["speedup_end_to_end"],
                        "decode_tokens_per_s": r["decode_tokens_per_s"]} for r in rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("documents", nargs="+", type=Path)
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--greedy", action="store_true", help="greedy decoding (default: the page's T = 0.8)")
    args = parser.parse_args()
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False"}
    page = page_side(args.documents, args.documents[-1], env, args.greedy)
    bench = {}
    for doc in args.documents:
        modes = ["baseline", "exact", "sigmoid"] if doc == args.documents[-1] else ["exact"]
        bench[doc.name] = benchmark_side(doc, modes, env, Path(f"/tmp/bench-page-truth-{doc.stem}.json"), args.greedy)
        print(doc.name, bench[doc.name], flush=True)
    result = {"machine": machine_summary(), "date": time.strftime("%Y-%m-%d"), "greedy": args.greedy, "page": page,
              "compare_repeat_3": bench}
    for doc in args.documents:
        shown, measured = page["runs"][doc.name]["measured_decode_speedup"], bench[doc.name]["exact"]["speedup_decode"]
        print(f"{doc.name}: page {shown}× · compare --repeat 3 {measured:.2f}× · ratio {shown / measured:.2f} · "
              f"Run click to idle {page['runs'][doc.name]['click_to_idle_s']:.1f} s")
    last = args.documents[-1].name
    for mode, shown in page["compare"]["speedup_decode"].items():
        if mode in bench[last]:
            print(f"Compare {mode} on {last}: page {shown}× · compare --repeat 3 {bench[last][mode]['speedup_decode']:.2f}×")
    args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
