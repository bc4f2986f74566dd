"""A sweep's results file read back (untrusted: every record checked, a message naming the line), and
Wagner et al.'s Table 1 (per mode) and Table 2 (per sigmoid range) computed from it."""

from __future__ import annotations

import html
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from specviz import speedup
from specviz.config import MODES
from specviz.runs.tasks import TASKS

MAX_RESULTS_BYTES = 64 << 20
MAX_LINE_CHARS = 1 << 20
TARGET_ONLY = "target-only"
BOOTSTRAP = 2000  # resamples for a confidence interval; seeded, so a report repeats exactly


class ResultsError(ValueError):
    """A results file that cannot be read; the message names the line."""


@dataclass
class Results:
    header: dict[str, Any]
    cells: list[dict[str, Any]]  # the latest record of each cell, in file order
    torn: int = 0  # lines cut short by a crash (skipped; resuming reruns their cells)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number")


def _finite(text: str) -> float:
    value = float(text)
    if len(text) > 64 or not math.isfinite(value) or abs(value) > 1e12:
        raise ValueError(f"{text[:40]} is not a finite number")
    return value


def _int(text: str) -> int:
    if len(text) > 18:
        raise ValueError(f"a number of {len(text)} digits")
    return int(text)


def _parse(line: str) -> Any:
    return json.loads(line, parse_constant=_no_constant, parse_float=_finite, parse_int=_int)


_NUMBER = (int, float)
_CELL_FIELDS: dict[str, tuple] = {
    "key": (str,), "example": (str,), "task": (str,), "variant": (str,), "mode": (str,), "gamma_policy": (str,),
    "gamma_init": (int,), "sigmoid_alpha": (*_NUMBER, type(None)), "sigmoid_beta": (*_NUMBER, type(None)),
    "temperature": _NUMBER, "seed": (int,), "worker": (str,), "status": (str,),
}
_OK_FIELDS: dict[str, tuple] = {
    "metric": (str,), "score": _NUMBER, "output": (str,), "new_tokens": (int,), "iterations": (int,),
    "tokens_per_s": _NUMBER, "decode_tokens_per_s": _NUMBER, "alpha": (*_NUMBER, type(None)),
    "acceptance_rate": (*_NUMBER, type(None)), "tokens_per_iteration": (*_NUMBER, type(None)),
    "verify_calls": (int,), "verify_s": _NUMBER, "verify_by_gamma": (dict,), "sigmoid_tv": (*_NUMBER, type(None)),
    "seconds": _NUMBER,
}


def _check_cell(r: dict, where: str) -> None:
    fields = {**_CELL_FIELDS, **(_OK_FIELDS if r.get("status") == "ok" else {"error": (str,)})}
    for name, types in fields.items():
        if name not in r:
            raise ResultsError(f"{where}: the cell record has no {name!r}")
        value = r[name]
        if isinstance(value, bool) or not isinstance(value, types):
            raise ResultsError(f"{where}: {name} is {type(value).__name__}, not {' or '.join(t.__name__ for t in types)}")
        if isinstance(value, str) and len(value) > 100_000:
            raise ResultsError(f"{where}: {name} is longer than 100,000 characters")
    if r["status"] not in ("ok", "failed"):
        raise ResultsError(f"{where}: status is {r['status'][:20]!r}, not ok or failed")
    if r["task"] not in TASKS or r["mode"] not in (TARGET_ONLY, *MODES):
        raise ResultsError(f"{where}: unknown task or mode ({r['task'][:20]!r}, {r['mode'][:20]!r})")
    if r["status"] == "ok":
        if r["metric"] not in ("rouge1", "wer") or r["verify_calls"] < 0 or r["verify_s"] < 0:
            raise ResultsError(f"{where}: metric {r['metric'][:20]!r} or a verification count is not one a sweep writes")
        for g, value in r["verify_by_gamma"].items():
            if not (g.isdigit() and isinstance(value, list) and len(value) == 2
                    and all(isinstance(x, _NUMBER) and not isinstance(x, bool) and x >= 0 for x in value)):
                raise ResultsError(f"{where}: verify_by_gamma[{g[:10]!r}] is not [seconds, calls]")


def read_records(path: str | Path) -> Results:
    """Every record checked; a torn last line (a crash mid-write) is skipped and counted."""
    path = Path(path)
    try:
        if path.stat().st_size > MAX_RESULTS_BYTES:
            raise ResultsError(f"{path.name} is larger than {MAX_RESULTS_BYTES >> 20} MB; not a results file")
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ResultsError(f"{path.name} is not UTF-8 text; not a results file") from None
    lines = text.split("\n")
    header: dict[str, Any] | None = None
    latest: dict[str, dict] = {}
    torn = 0
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path.name} line {number}"
        if len(line) > MAX_LINE_CHARS:
            raise ResultsError(f"{where}: longer than {MAX_LINE_CHARS:,} characters")
        try:
            record = _parse(line)
        except (ValueError, RecursionError) as e:
            if number == len(lines) or (number == len(lines) - 1 and not lines[-1]) or not line.endswith("}"):
                torn += 1  # cut short by a crash: resuming runs that cell again
                continue
            raise ResultsError(f"{where}: not a JSON record ({e})") from None
        if not isinstance(record, dict) or record.get("kind") not in ("sweep", "cell"):
            raise ResultsError(f"{where}: not a sweep or cell record")
        if record["kind"] == "sweep":
            if header is None:
                header = record
            continue
        _check_cell(record, where)
        latest.pop(record["key"], None)
        latest[record["key"]] = record
    if header is None:
        raise ResultsError(f"{path.name} has no sweep header line; not a specviz results file")
    return Results(header, list(latest.values()), torn)


def load_results(path: str | Path) -> Results:
    try:
        return read_records(path)
    except OSError as e:
        raise ResultsError(f"cannot read {Path(path).name}: {e.strerror or e}") from None


@dataclass(frozen=True)
class Summary:
    """One row of the tables: a variant at a temperature, over every example and seed it ran."""

    variant: str
    task: str
    mode: str
    gamma_policy: str
    sigmoid_alpha: float | None
    sigmoid_beta: float | None
    temperature: float
    cells: int
    failed: int
    metric: str
    score: float | None
    score_ci: tuple[float, float] | None  # 95% bootstrap interval over cells
    alpha: float | None
    acceptance_rate: float | None
    tokens_per_iteration: float | None
    verify_us_per_call: float | None
    verify_reduction_pct: float | None  # Wagner's Δ% profiling time: 1 − verify time / baseline's, in %
    # decoding tokens/s (prefill left out: a sweep's later runs of an example reuse its prompt cache, so end
    # to end would favour whichever ran second), and the median paired ratio to target-only's, − 1, in %
    decode_tokens_per_s: float | None
    decode_change_pct: float | None
    sigmoid_tv: float | None
    gamma_verify_us: dict[int, float] = field(default_factory=dict)  # median µs per call by γ (Figure 3)


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def bootstrap_ci(values: list[float], resamples: int = BOOTSTRAP, seed: int = 0) -> tuple[float, float] | None:
    """Percentile interval of the mean; None with fewer than two values."""
    if len(values) < 2:
        return None
    data = np.asarray(values, dtype=np.float64)
    picks = np.random.default_rng(seed).integers(0, len(data), size=(resamples, len(data)))
    means = data[picks].mean(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def _pair_key(r: dict) -> tuple:
    return r["example"], r["temperature"], r["seed"]


def _verify_per_call(cells: list[dict]) -> float | None:
    calls = sum(r["verify_calls"] for r in cells)
    return 1e6 * sum(r["verify_s"] for r in cells) / calls if calls else None


def summarize(results: Results) -> list[Summary]:
    ok = [r for r in results.cells if r["status"] == "ok"]
    groups: dict[tuple, list[dict]] = {}
    for r in results.cells:
        groups.setdefault((r["variant"], r["temperature"]), []).append(r)
    reference = {_pair_key(r): r for r in ok if r["mode"] == TARGET_ONLY}
    baselines = {(r["gamma_policy"], r["gamma_init"], *_pair_key(r)): r for r in ok if r["mode"] == "baseline"}
    rows = []
    for (variant, temperature), cells in groups.items():
        good = [r for r in cells if r["status"] == "ok"]
        first = cells[0]
        scores = [r["score"] for r in good]
        paired = [(r, baselines.get((r["gamma_policy"], r["gamma_init"], *_pair_key(r)))) for r in good]
        mine = [r for r, b in paired if b is not None]
        base = [b for _, b in paired if b is not None]
        verify, verify_base = _verify_per_call(mine), _verify_per_call(base)
        ratios = [s.decode for r in good if _pair_key(r) in reference and (s := speedup.measured(
            r["decode_tokens_per_s"], r["tokens_per_s"], reference[_pair_key(r)]["decode_tokens_per_s"],
            reference[_pair_key(r)]["tokens_per_s"])) is not None]
        by_gamma: dict[int, list[float]] = {}
        for r in good:
            for g, (seconds, _) in r["verify_by_gamma"].items():
                by_gamma.setdefault(int(g), []).append(1e6 * seconds)
        rows.append(Summary(
            variant=variant, task=first["task"], mode=first["mode"], gamma_policy=first["gamma_policy"],
            sigmoid_alpha=first["sigmoid_alpha"], sigmoid_beta=first["sigmoid_beta"], temperature=temperature,
            cells=len(cells), failed=len(cells) - len(good), metric=good[0]["metric"] if good else "",
            score=_mean(scores), score_ci=bootstrap_ci(scores), alpha=_mean([r["alpha"] for r in good]),
            acceptance_rate=_mean([r["acceptance_rate"] for r in good]),
            tokens_per_iteration=_mean([r["tokens_per_iteration"] for r in good]),
            verify_us_per_call=_verify_per_call(good),
            verify_reduction_pct=100 * (1 - verify / verify_base) if verify and verify_base else None,
            decode_tokens_per_s=_mean([r["decode_tokens_per_s"] for r in good]),
            decode_change_pct=100 * (statistics.median(ratios) - 1) if ratios else None,
            sigmoid_tv=_mean([r["sigmoid_tv"] for r in good]),
            gamma_verify_us={g: statistics.median(v) for g, v in sorted(by_gamma.items())},
        ))
    order = {m: i for i, m in enumerate((TARGET_ONLY, *MODES))}
    # sigmoid's rows: the task's default range first, then the widest to the narrowest (Wagner's Table 2)
    return sorted(rows, key=lambda s: (s.temperature, order[s.mode], s.gamma_policy, s.sigmoid_beta is not None,
                                       -abs(s.sigmoid_beta or 0.0), s.variant))


def _text(value: object, limit: int = 120) -> str:
    """A string from the (untrusted) results file, safe in Markdown and in the page's HTML."""
    return html.escape(str(value)[:limit]).replace("|", "\\|").replace("\n", " ")


def _f(x: float | None, spec: str, suffix: str = "") -> str:
    return "–" if x is None else format(x, spec) + suffix


def _score(s: Summary) -> str:
    ci = f" ({s.score_ci[0]:.3f}–{s.score_ci[1]:.3f})" if s.score_ci else ""
    return _f(s.score, ".3f") + ci


def _metric_name(rows: list[Summary]) -> str:
    names = {s.metric for s in rows if s.metric}
    return {"rouge1": "ROUGE-1", "wer": "WER"}.get(names.pop(), "score") if len(names) == 1 else "score"


def table1(rows: list[Summary]) -> str:
    """Per mode (sigmoid at its first range): Wagner's Table 1 with α, speed and the interval."""
    first_range = next(((s.sigmoid_alpha, s.sigmoid_beta) for s in rows if s.mode == "sigmoid"), None)
    shown = [s for s in rows if s.mode != "sigmoid" or (s.sigmoid_alpha, s.sigmoid_beta) == first_range]
    head = (f"| run | T | cells | {_metric_name(shown)} (95% CI) | α | acceptance | tokens / iteration | "
            "verify µs / call (mean) | Δ% verify time vs baseline | decoding tokens/s (mean) | "
            "Δ% decoding tokens/s vs target-only (median) | "
            "TV(p̂, p) |")
    lines = [head, "|" + " --- |" * 12]
    for s in shown:
        failed = f" ({s.failed} failed)" if s.failed else ""
        lines.append(f"| {_text(s.variant)} | {s.temperature:g} | {s.cells}{failed} | {_score(s)} | {_f(s.alpha, '.3f')} | "
                     f"{_f(s.acceptance_rate, '.3f')} | {_f(s.tokens_per_iteration, '.2f')} | "
                     f"{_f(s.verify_us_per_call, '.0f')} | {_f(s.verify_reduction_pct, '+.1f', '%')} | "
                     f"{_f(s.decode_tokens_per_s, '.2f')} | {_f(s.decode_change_pct, '+.1f', '%')} | "
                     f"{_f(s.sigmoid_tv, '.3f')} |")
    return "\n".join(lines)


def table2(rows: list[Summary]) -> str:
    """Per sigmoid range (α, β): Wagner's Table 2, with exact beside it for the metric's change."""
    sig = [s for s in rows if s.mode == "sigmoid"]
    if not sig:
        return "(no sigmoid runs in this sweep)"
    exact = {(s.gamma_policy, s.temperature): s for s in rows if s.mode == "exact"}
    lines = [f"| α | β | γ policy | T | cells | {_metric_name(sig)} (95% CI) | vs exact | Δ% verify time vs baseline | "
             "TV(p̂, p) | α (acceptance) |", "|" + " --- |" * 10]
    for s in sig:
        e = exact.get((s.gamma_policy, s.temperature))
        change = s.score - e.score if e is not None and e.score is not None and s.score is not None else None
        scale = TASKS[s.task].sigmoid_range  # a checked record's task (read_records)
        low = f"{s.sigmoid_alpha:g}" if s.sigmoid_alpha is not None else f"{-scale:g} (default)"
        high = f"{s.sigmoid_beta:g}" if s.sigmoid_beta is not None else f"{scale:g} (default)"
        lines.append(f"| {low} | {high} | {_text(s.gamma_policy)} | "
                     f"{s.temperature:g} | {s.cells} | {_score(s)} | {_f(change, '+.3f')} | "
                     f"{_f(s.verify_reduction_pct, '+.1f', '%')} | {_f(s.sigmoid_tv, '.3f')} | {_f(s.alpha, '.3f')} |")
    return "\n".join(lines)


def report_markdown(results: Results) -> str:
    h = results.header
    rows = summarize(results)
    failed = [r for r in results.cells if r["status"] == "failed"]
    workers, threads = h.get("workers"), h.get("threads_per_worker")
    where = _text(h.get("machine", "?"), 200) + (f" · {workers} worker(s) × {threads} torch thread(s)"
                                                 if isinstance(workers, int) and isinstance(threads, int) else "")
    notes = [f"{_text(h.get('data', '?'), 200)} · {_text(h.get('models', '?'), 200)} · {where}",
             f"{len(results.cells)} cells ({len(failed)} failed)" + (f"; {results.torn} torn line(s) skipped"
                                                                   if results.torn else "")]
    out = [" · ".join(str(n) for n in notes), "", "**Table 1** (per mode)", "", table1(rows), "",
           "**Table 2** (sigmoid's range)", "", table2(rows)]
    if failed:
        out += ["", "Failed cells:"] + [f"- {_text(r['example'])} · {_text(r['variant'])} · seed {r['seed']}: "
                                        f"{_text(r['error'], 200)}"
                                        for r in failed[:20]]
    return "\n".join(out)
