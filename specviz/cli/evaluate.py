"""`python -m specviz eval`: a sweep over a data set (serially, or as Ray tasks), and its report."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tqdm import tqdm

from specviz.evaluation.data import BUNDLED_SPEECH, BUNDLED_TEXT, describe, load_examples
from specviz.evaluation.results import load_results, report_markdown, summarize
from specviz.evaluation.run import Models, ResultsFile, run_serial, worker_threads
from specviz.models.loading import WEIGHTS
from specviz.text.prompts import InputError
from specviz.runs.settings import Settings, add_flags
from specviz.evaluation.sweep import make_grid

BUNDLED = {"text": BUNDLED_TEXT, "speech": BUNDLED_SPEECH}


def _columns(spec: str | None) -> dict[str, str] | None:
    if not spec:
        return None
    pairs = [part.partition("=") for part in spec.split(",")]
    if any(not ours or not sep or not theirs for ours, sep, theirs in pairs):
        raise InputError(f"--columns takes OURS=THEIRS[,...] (e.g. input=document,reference=highlights), got {spec!r}")
    return {ours.strip(): theirs.strip() for ours, _, theirs in pairs}


def _ranges(scales: list[str] | None) -> list[str] | None:
    """--sigmoid-scales 1e3 default -> ['-1e3:1e3', 'default']."""
    if scales is None:
        return None
    for s in scales:
        try:
            ok = s == "default" or float(s) > 0
        except ValueError:
            ok = False
        if not ok:
            raise InputError(f"--sigmoid-scales takes 'default' or positive numbers S (the range -S to S), got {s!r}")
    return [s if s == "default" else f"-{s}:{s}" for s in scales]


def cmd_eval(args: argparse.Namespace) -> int:
    if args.report:
        return _report(args)
    data = BUNDLED.get(args.data, args.data)
    examples = load_examples(data, _columns(args.columns), limit=args.limit)
    task = examples[0].task
    grid = make_grid(Settings.from_args(args), modes=args.modes, policies=args.policies, sigmoid=_ranges(args.sigmoid_scales),
                     temperatures=args.temperatures, seeds=args.seeds, file=args.grid)
    cells = grid.cells(examples)
    models = Models(task, args.draft, args.target, args.device, args.dtype, args.weights, args.quantized_draft)
    results = ResultsFile(args.results)
    where = describe(data, examples=examples)
    workers = args.workers or (2 if args.ray or args.address else 1)
    if workers < 1 or (args.threads is not None and args.threads < 1):
        raise InputError("--workers and --threads must be >= 1")
    print(f"specviz eval: {len(cells)} cells ({len(examples)} examples × {len(grid.variants())} runs × "
          f"{len(grid.temperatures)} temperatures × {len(grid.seeds)} seeds) from {where}; results in {args.results}",
          file=sys.stderr)
    with tqdm(total=len(cells), desc="eval", unit="cell", file=sys.stderr) as bar:
        def on_cell(progress, record) -> None:
            bar.n = progress.skipped + progress.done
            bar.set_postfix_str(f"{record['example']} · {record['variant']}"
                                + (f" · {progress.failed} failed" if progress.failed else ""))
            bar.refresh()

        if args.ray or args.address:
            from specviz.evaluation.on_ray import run_ray

            progress = run_ray(cells, grid, models, results, where, workers=workers,
                               threads=args.threads or worker_threads(workers), address=args.address,
                               on_cell=on_cell)
        else:
            progress = run_serial(cells, grid, models, results, where, on_cell=on_cell)
    if progress.skipped:
        print(f"specviz eval: {progress.skipped} cells were already in {args.results} (resumed)", file=sys.stderr)
    print(report_markdown(load_results(args.results)))
    return 1 if progress.failed else 0


def _report(args: argparse.Namespace) -> int:
    results = load_results(args.report)
    print(report_markdown(results))
    if args.json:
        rows = [s.__dict__ | {"gamma_verify_us": {str(g): v for g, v in s.gamma_verify_us.items()}}
                for s in summarize(results)]
        Path(args.json).write_text(json.dumps({"header": results.header, "rows": rows}, indent=2, ensure_ascii=False))
        print(f"summary written to {args.json}", file=sys.stderr)
    return 0


def add_command(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser("eval", help="a sweep over a data set: Wagner's Table 1 (per mode) and Table 2 (per sigmoid "
                                    "range), serially or on Ray")
    e.add_argument("data", nargs="?", default="text", metavar="DATA",
                   help="a folder with manifest.jsonl, a .jsonl manifest, a Hugging Face datasets folder "
                        "(save_to_disk) or parquet file(s); 'text' or 'speech' for the bundled sets (default: text)")
    e.add_argument("--columns", help="the data set's column names, e.g. input=document,reference=highlights,id=id")
    e.add_argument("--limit", type=int, default=None, help="the first N examples only")
    e.add_argument("--report", metavar="RESULTS", help="print the tables of a results file and stop (no models run)")
    e.add_argument("--json", metavar="FILE", help="with --report: the table rows as JSON")
    g = e.add_argument_group("grid (or --grid FILE.toml with the same keys)")
    g.add_argument("--grid", metavar="FILE", help="TOML: modes, policies, sigmoid, temperatures, seeds, max_new_tokens")
    g.add_argument("--modes", nargs="+", help="verification modes (default: baseline exact sigmoid)")
    g.add_argument("--policies", nargs="+", metavar="POLICY[:γ]", help="γ policies (default: auto)")
    g.add_argument("--sigmoid-scales", nargs="+", metavar="S",
                   help="sigmoid ranges (-S, S) as in Wagner's Table 2, e.g. default 1e3 10 ('default': Wagner's "
                        "for the task; asymmetric ranges: sigmoid = [\"ALPHA:BETA\", ...] in a --grid file)")
    g.add_argument("--temperatures", nargs="+", type=float, help="0 = greedy (default: 0)")
    g.add_argument("--seeds", nargs="+", type=int, help="default: 0")
    add_flags(g, ["max_new_tokens"])
    r = e.add_argument_group("where it runs")
    r.add_argument("--results", default="eval-results.jsonl",
                   help="results file: one line per finished cell, appended as cells finish; an interrupted sweep "
                        "resumes from it (default: eval-results.jsonl)")
    r.add_argument("--ray", action="store_true", help="run cells as Ray tasks on a local Ray (this machine's cores)")
    r.add_argument("--address", help="an existing Ray cluster's address (implies --ray)")
    r.add_argument("--workers", type=int, default=None, help="Ray actors, each loading the models once (default 2)")
    r.add_argument("--threads", type=int, default=None, help="torch threads per Ray worker (default: cores / workers)")
    m = e.add_argument_group("models and drafting")
    add_flags(m, ["draft", "target"])
    m.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"])
    m.add_argument("--weights", default="auto", choices=WEIGHTS)
    m.add_argument("--device", default=None)
    m.add_argument("--quantized-draft", action=argparse.BooleanOptionalAction, default=None)
    add_flags(m, ["draft_kind", "draft_vocab", "lookup_ngram", "lenience", "draft_confidence", "top_k", "top_p",
                  "verify_backend"])
    e.set_defaults(func=cmd_eval)
