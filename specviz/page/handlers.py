"""The page's event handlers: named inputs in, named component updates out.

Each handler takes the page's shared `Server` and a dict of input values keyed by component name, and
returns (or yields) a dict keyed by component name holding only what changes; app.py maps names to
components and wires events. So every handler is importable and testable without a browser.
"""

from __future__ import annotations

import dataclasses
import html
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import gradio as gr
import pandas as pd

from specviz import openmp
from specviz.page import actions as page, sessions
from specviz.memory import release_freed_memory
from specviz.page.shelf import Ticket, TraceShelf, json_size
from specviz.runs.compare import Row
from specviz.decoding.records import Prefilling
from specviz.evaluation.data import describe, load_examples
from specviz.evaluation.figures import tradeoff_figure, verify_gamma_figure
from specviz.evaluation.results import Results, ResultsError, load_results, summarize, table1, table2
from specviz.evaluation.run import Models, ResultsFile, SweepProgress, run_serial
from specviz.text.prompts import ASSETS, InputError
from specviz.runs.replay import Schedule, rerun_request
from specviz.runs.settings import TEXT, Settings, page_names
from specviz.runs.tasks import SUMMARIZE, TASKS, TRANSCRIBE, Task, task_of, task_of_kind
from specviz.evaluation.sweep import Grid
from specviz.traces.trace import Trace, TraceFormatError
from specviz.traces.json_format import load_trace
from specviz.figures.plots import compare_figure
from specviz.figures.why_panel import why_html

Updates = dict[str, Any]
Values = Mapping[str, Any]
Progress = Callable[[str, "float | None"], None]

SAMPLE_AUDIO = TRANSCRIBE.sample_input()
SAMPLE_TRANSCRIPT = (ASSETS / "sample_speech.txt").read_text(encoding="utf-8").strip()
PLOTS = ("gamma", "acceptance", "timing", "verify", "theory", "batch")
TEXT_VIEW = ("output", "summary", "warning", "tokens")  # what a trace redraws in milliseconds
VIEW = (*TEXT_VIEW, *(f"{name}_plot" for name in PLOTS))  # all that a trace redraws
# short headers (the note under the table says what each is): medians over the rounds
COMPARE_COLUMNS = ("run", "decoding ×", "end to end ×", "end to end range", "tokens/s", "decoding tokens/s", "α",
                   "tokens/iter", "verify µs", "= target-only", "output")
COMPARE_WIDTHS = ("100px", "80px", "80px", "90px", "70px", "80px", "50px", "70px", "70px", "80px", "400px")


@dataclass(frozen=True)
class Caller:
    """Who triggered an event: the browser session (its runs, its Stop) and where progress goes."""

    session: str
    progress: Progress


@dataclass(frozen=True)
class Server:
    """What all sessions of one page share. Each member guards itself: models load once under a per-pair
    lock, the Stop table, the reference table and the trace shelf take their own locks."""

    models: sessions.ModelCache
    stops: sessions.Stops
    references: page.References
    traces: TraceShelf  # every session's traces; a session's "trace" state holds only its shelf.Ticket
    limits: sessions.VisitorLimits = sessions.VisitorLimits()  # SHARED_LIMITS where strangers share the page
    activity: sessions.Activity = dataclasses.field(default_factory=sessions.Activity)  # whose work is going on


def stamp(message: str) -> str:
    """Status lines carry the time, so a repeated message still reads as new."""
    return f'<span class="sv-status">[{time.strftime("%H:%M:%S")}] {message}</span>'


def error(e: Exception) -> str:
    return stamp(f'<span class="error">⚠ {type(e).__name__}: {html.escape(str(e))}</span>')


def settings_of(values: Values) -> Settings:
    return Settings.from_values({name: values[name] for name in page_names() if name in values})


def views(trace: Trace, upto: int | None = None, plots: bool = True) -> Updates:
    """Everything drawn from a trace (without `plots`: its text only); plots without content (a target-only
    run's γ) are hidden."""
    f = page.figures(trace, upto, plots)
    if not plots:
        return {name: f[name] for name in TEXT_VIEW}
    drafted = bool(trace.drafted())
    shown = {name: drafted or name == "timing" for name in PLOTS}
    shown["batch"] = len(trace.sequences) > 1
    return {"output": f["output"], "summary": f["summary"], "warning": f["warning"], "tokens": f["tokens"],
            **{f"{name}_plot": gr.Plot(f[name], visible=shown[name]) for name in PLOTS}}


def _replay_at_end(trace: Trace) -> gr.Slider:
    return gr.Slider(minimum=0, maximum=max(len(trace.steps), 1), value=len(trace.steps))


def _exported(server: Server, trace: Trace, ticket: Ticket | None = None) -> Updates:
    """Export the trace for download and hold it on the shelf at the size of its file."""
    path = page.export(trace)
    return {"export": gr.DownloadButton(value=path, interactive=True),
            "trace": server.traces.put(trace, Path(path).stat().st_size, ticket, file=Path(path))}


GONE = ("This trace is no longer held by the server (it keeps the most recent ones); open its exported file "
        "with “Load a trace” to see it again.")


STARTS = ("run_button", "compare_button", "eval_button", "rerun_button")  # what starts work in a session: one at a time


def busy(values: Values) -> Updates:
    """Run, Compare and Evaluate off, Stop on, while this session's work is queued or going."""
    return {"status": stamp("Queued: waiting for a free worker…"), "stop_button": gr.Button(interactive=True),
            **{name: gr.Button(interactive=False) for name in STARTS}}


def idle(values: Values) -> Updates:
    return {"stop_button": gr.Button(interactive=False), **{name: gr.Button(interactive=True) for name in STARTS}}


def task_and_input(values: Values) -> tuple[Task, str | None]:
    """The page's task, resolved here once and handed on as the Task (ValueError naming the choices for an unknown
    one), and its input: the article, or the audio file's path."""
    task = task_of(values["task"])
    return task, values[task.input_key]


def run(server: Server, values: Values, caller: Caller, gamma_schedule: Schedule | None = None) -> Iterator[Updates]:
    """Decode the input with the settings, streaming its tokens; then time target-only on the same input and
    settings (reused when an identical run measured it) and only then draw the figures, so that nothing the page
    draws shares the cores with either timed run. Any failure is shown in the status line. With a γ schedule, γ
    is read from it (rerun) instead of chosen by the policy."""
    stop = server.stops.start(caller.session)
    try:
        with server.activity.running(caller.session):
            yield from _run(server, values, caller, stop, gamma_schedule)
    except Exception as e:  # any failure is shown in the page, which stays usable
        yield {"status": error(e)}
    finally:
        server.stops.end(caller.session, stop)


def _run(server: Server, values: Values, caller: Caller, stop: sessions.StopFlag, gamma_schedule: Schedule | None
         ) -> Iterator[Updates]:
    progress = caller.progress
    task, source_input = task_and_input(values)
    settings = settings_of(values)
    server.limits.check_run(settings)
    yield {"status": stamp("Loading models and reading the input…"), "export": gr.DownloadButton(interactive=False),
           "results": gr.Tabs(selected="run-results")}
    measure = bool(values["measure"])
    timed_alongside = measure and server.references.get(page.References.key(task, source_input, settings)) is None
    stream = page.stream_run(server.models, task, source_input, settings, progress, stop, gamma_schedule,
                             with_reference=timed_alongside)
    yield {"status": stamp("Models ready. Prefill: the models read the whole input once (the longest wait before "
                           "the first iteration)…")}
    trace, ticket, reference = None, None, None
    alongside = " (target-only decodes in turns with it, to measure the speedup)" if timed_alongside else ""
    with server.activity.running(caller.session) as timed:  # the run and its reference: did another session's overlap?
        for trace, done, reading, reference in stream:
            if reading is not None:
                message = prefill_progress(reading)
                progress(message, reading.read / max(reading.total, 1))
                yield {"status": stamp(message)}
            elif not done:
                # still growing: held at no size until it is done and exported (the shelf counts finished traces)
                ticket = server.traces.put(trace, 0, ticket)
                yield {"status": stamp(f"Decoding… iteration {len(trace.steps)}, {trace.new_tokens} tokens{alongside}"),
                       "trace": ticket, "replay": _replay_at_end(trace), **views(trace, plots=False)}
    if trace is None:
        return
    if reference is not None and not reference.stopped:
        trace.meta["target_only"] = {**page.new_reference(server.references, task, source_input, settings, trace,
                                                          reference),
                                     "other_sessions_running": server.activity.overlapped(timed)}
    elif measure and not trace.stopped and (known := page.known_reference(server.references, task, source_input,
                                                                           settings, trace)) is not None:
        trace.meta["target_only"] = known
    page.score(trace, task, values["reference_" + task.reference_noun] or "")  # the page's reference boxes
    what = "Stopped" if trace.stopped else "Done"
    measured = "; speedup measured" if trace.target_only is not None else ""
    yield {"status": stamp(f"{what}: {trace.new_tokens} tokens in {len(trace.steps)} iterations{measured}."),
           **_exported(server, trace, ticket), "replay": _replay_at_end(trace), **views(trace)}


def prefill_progress(reading: Prefilling) -> str:
    """The status line while a model reads the input: which one, how far, and why the wait."""
    if reading.read >= reading.total:
        return f"Prefill: the {reading.model} has read the input ({reading.total} tokens)."
    return (f"Prefill: the {reading.model} has read {reading.read} of {reading.total} tokens of the input "
            "(each model reads it once before the first iteration).")


def rerun(server: Server, values: Values, caller: Caller) -> Iterator[Updates]:
    """Decode the session's loaded (or last) summary trace again exactly: its settings, its article, its γ
    schedule, so a run whose γ followed another machine's costs repeats here decision for decision."""
    trace = server.traces.get(values["trace"]) if values["trace"] is not None else None
    if trace is None:
        yield {"status": stamp("Load a trace first (or run one)." if values["trace"] is None else GONE)}
        return
    try:
        settings, article, gammas = rerun_request(trace)
    except InputError as e:
        yield {"status": error(e)}
        return
    expected = trace.outputs
    again = {"task": TEXT, "article": article, "audio": None, "reference_summary": "", "reference_transcript": "",
             "measure": False, **settings.to_dict()}
    ticket = None
    for updates in run(server, again, caller, gammas):
        ticket = updates.get("trace", ticket)
        yield updates
    rerun_trace = server.traces.get(ticket) if ticket is not None else None
    if rerun_trace is not None and not rerun_trace.stopped:
        same = rerun_trace.outputs == expected
        yield {"status": stamp(f"Ran again on the trace's {len(gammas)}-iteration γ schedule: "
                               + ("the output is the trace's, token for token." if same else
                                  "the output differs from the trace's (other models, or logits that are not the "
                                  "same bits on this machine)."))}


def stop(server: Server, values: Values, caller: Caller) -> Updates:
    if server.stops.stop(caller.session, "Stop pressed"):
        return {"status": stamp("Stopping after the current iteration…")}
    return {}


def unload(server: Server, session: str) -> None:
    server.stops.stop(session, "the browser session closed")


def compare_table(rows: list[Row]) -> pd.DataFrame:
    """The Compare tab's table: both speedups, named apart (compare.Row)."""
    def cells(r: Row) -> tuple:
        verify_us = None if r.median_verify_ms is None else 1e3 * r.median_verify_ms
        return (r.name, r.speedup_decode, r.speedup_end_to_end,
                f"{r.speedup_end_to_end_min:.2f}–{r.speedup_end_to_end_max:.2f}", r.tokens_per_s,
                r.decode_tokens_per_s, r.alpha, r.tokens_per_iteration, verify_us, r.equals_target_only, r.output_text)

    return pd.DataFrame([cells(r) for r in rows], columns=list(COMPARE_COLUMNS)).round(2)


def compare(server: Server, values: Values, caller: Caller) -> Iterator[Updates]:
    """Every mode and target-only on the same input and seed, in interleaved rounds; on one γ schedule unless the
    page says otherwise ("same_schedule")."""
    try:
        with server.activity.running(caller.session) as timed:  # loading, then every timed run
            yield from _compare(server, values, caller, timed)
    except Exception as e:
        yield {"status": error(e)}


def _compare(server: Server, values: Values, caller: Caller, timed: sessions.Activity.Entry) -> Iterator[Updates]:
    task, source_input = task_and_input(values)
    settings = settings_of(values)
    rounds = int(values["rounds"])
    server.limits.check_compare(settings, rounds)
    yield {"status": stamp("Comparing: loading models…"), "results": gr.Tabs(selected="compare-results")}
    stages: list[str] = []

    def on_stage(name: str) -> None:
        stages.append(name)
        caller.progress(f"running {name} (run {len(stages)})", None)

    rows, traces, note = page.compare_modes(server.models, task, source_input, settings, caller.progress, on_stage,
                                            rounds=rounds, with_hf=bool(values["with_hf"]),
                                            same_schedule=bool(values.get("same_schedule", True)))
    if server.activity.overlapped(timed):
        note += ("  \n**Measured while another session was working on this server**: its runs shared the cores "
                 "with these, so the figures may be off.")
    names = list(traces)
    tickets = {name: server.traces.put(trace, json_size(trace)) for name, trace in traces.items()}
    yield {"status": stamp(f"Comparison done: {rounds} round(s), same input and seed for every run."),
           "compare_table": compare_table(rows), "compare_note": note, "compare_plot": compare_figure(rows),
           "compare_state": tickets, "compare_pick": gr.Dropdown(choices=names, value=names[0] if names else None)}


def opened(server: Server, trace: Trace, how: str) -> Updates:
    """Show a trace in the main view with its settings and input restored, ready to export."""
    task = TASKS.get(trace.task)
    text = trace.meta.get("input") if task is not None and not task.input_is_file else None
    restored = Settings.from_meta(trace.meta).to_dict()
    updates = {"status": stamp(how), **_exported(server, trace),
               "results": gr.Tabs(selected="run-results"), "replay": _replay_at_end(trace), **views(trace),
               **{name: restored[name] for name in page_names()}}
    if isinstance(text, str) and text.strip():
        updates["article"] = text
    return updates


def upload(server: Server, values: Values) -> Updates:
    """Load a trace file: redraw it and restore its settings; a file that cannot be drawn is refused."""
    file = values["trace_upload"]
    if file is None:
        return {}
    path = file if isinstance(file, str) else file.name
    try:
        trace = load_trace(path)
        views(trace)  # a trace that loads but cannot be drawn is refused too
        return opened(server, trace, f"Loaded trace {html.escape(Path(path).name)} ({len(trace.steps)} iterations; no "
                                     "model was run; its settings are restored).")
    except (TraceFormatError, OSError, ValueError, TypeError, KeyError, ZeroDivisionError) as e:
        return {"status": error(e)}  # unreadable, undrawable, or its export could not be written (a full disk)
    finally:
        trace = None  # the shelf keeps it if it fits the budget; what reading it took goes back to the OS
        release_freed_memory()


def open_compared(server: Server, values: Values) -> Updates:
    tickets, name = values["compare_state"], values["compare_pick"]
    if not tickets or name not in tickets:
        return {"status": stamp("Run a comparison first, then pick one of its runs.")}
    trace = server.traces.get(tickets[name])
    if trace is None:
        return {"status": stamp(GONE)}
    return opened(server, trace, f"Opened the {html.escape(name)} run of the comparison.")


def export(server: Server, values: Values) -> Updates:
    """The session's current trace written as a file to download (the API's `export`: an API client has no
    Export button, which already holds the file a run or a load wrote)."""
    trace = server.traces.get(values["trace"]) if values["trace"] is not None else None
    if trace is None:
        return {"status": stamp("Run something or load a trace first." if values["trace"] is None else GONE)}
    return {"status": stamp("Exported."), **_exported(server, trace, values["trace"])}


def replay(server: Server, values: Values) -> Updates:
    if values["trace"] is None:
        return {}
    trace = server.traces.get(values["trace"])
    return {"status": stamp(GONE)} if trace is None else views(trace, int(values["replay"]))


def why(server: Server, values: Values) -> Updates:
    """The why-panel for the token the page's script wrote as "step,sequence,position,nonce"."""
    try:
        step, seq, pos = (int(x) for x in (values["why_select"] or "").split(",")[:3])
    except ValueError:
        return {}
    if values["trace"] is None:
        return {}
    trace = server.traces.get(values["trace"])
    return {"status": stamp(GONE)} if trace is None else {"why_panel": why_html(trace, step, seq, pos)}


def sample_text(values: Values) -> Updates:
    return {"article": SUMMARIZE.sample_input()}


def sample_audio(values: Values) -> Updates:
    return {"audio": SAMPLE_AUDIO, "reference_transcript": SAMPLE_TRANSCRIPT}


PAGE_SWEEP_TOKENS = 32  # a sweep from the page stays short: the CLI (or Ray) runs the real ones
PAGE_SWEEP_EXAMPLES = 4


def evaluation(results: Results) -> Updates:
    """A sweep's tables and figures."""
    rows = summarize(results)
    h = results.header
    failed = sum(r["status"] == "failed" for r in results.cells)
    note = (f"{len(results.cells)} cells ({failed} failed) · {html.escape(str(h.get('data', '?')))[:200]} · "
            f"{html.escape(str(h.get('models', '?')))[:200]} · {html.escape(str(h.get('machine', '?')))[:200]}")
    return {"eval_note": note, "eval_table1": table1(rows), "eval_table2": table2(rows),
            "eval_tradeoff_plot": gr.Plot(tradeoff_figure(rows), visible=True),
            "eval_gamma_plot": gr.Plot(verify_gamma_figure(rows), visible=True)}


def evaluate_upload(values: Values) -> Updates:
    """Show a results file (untrusted: load_results checks every record and names a bad line)."""
    file = values["eval_upload"]
    if file is None:
        return {}
    path = file if isinstance(file, str) else file.name
    cleared = {"eval_upload": None}  # the box is ready for the next file
    try:
        results = load_results(path)
    except ResultsError as e:
        return {"status": error(e), **cleared}
    return {"status": stamp(f"Loaded the sweep {html.escape(Path(path).name)}: no model was run."),
            "results": gr.Tabs(selected="eval-results"), **evaluation(results), **cleared}


def evaluate(server: Server, values: Values, caller: Caller) -> Iterator[Updates]:
    """A small sweep on the bundled set with the page's settings: every mode, target-only as the reference,
    at most PAGE_SWEEP_EXAMPLES examples and PAGE_SWEEP_TOKENS tokens; Stop ends it after the cell in flight."""
    stop = server.stops.start(caller.session)
    try:
        with server.activity.running(caller.session):  # its runs share the cores with any other session's timing
            yield from _evaluate(server, values, caller, stop)
    except Exception as e:
        yield {"status": error(e)}
    finally:
        server.stops.end(caller.session, stop)


def _evaluate(server: Server, values: Values, caller: Caller, stop: sessions.StopFlag) -> Iterator[Updates]:
    settings = settings_of(values)
    task = task_of_kind(values["eval_data"])
    count = int(values["eval_examples"])
    if not 1 <= count <= PAGE_SWEEP_EXAMPLES:
        raise InputError(f"the page evaluates 1 to {PAGE_SWEEP_EXAMPLES} examples; the CLI runs whole data sets")
    server.limits.check_evaluation(count)
    data = task.bundled
    examples = load_examples(data, limit=count)
    base = dataclasses.replace(settings, max_new_tokens=min(settings.max_new_tokens, PAGE_SWEEP_TOKENS))
    grid = Grid(policies=(settings.gamma_policy,), sigmoid_ranges=((settings.sigmoid_alpha, settings.sigmoid_beta),),
                temperatures=(0.0 if settings.greedy else settings.temperature,), seeds=(settings.seed,), base=base)
    cells = grid.cells(examples)
    yield {"status": stamp(f"Evaluating: {len(cells)} runs on {len(examples)} bundled example(s); loading models…"),
           "results": gr.Tabs(selected="eval-results")}
    load = getattr(server.models, task.kind)  # ModelCache loads (and keeps) each kind's pairs: text, speech
    pair = load(settings.draft, settings.target, caller.progress)
    path = page.download_folder() / f"specviz-eval-{task.name}-{time.strftime('%Y%m%d-%H%M')}.jsonl"

    def on_cell(progress: SweepProgress, record: dict) -> None:
        caller.progress(f"run {progress.done} of {progress.total}: {record['example']} · {record['variant']}",
                        progress.done / progress.total)

    models = Models(task.name, settings.draft, settings.target)
    with openmp.team_released():  # evaluated in the handler's thread, which outlives the sweep
        done = run_serial(cells, grid, models, ResultsFile(path), describe(data, examples=examples),
                          on_cell=on_cell, should_stop=stop.is_set, pair=pair)
    what = "Stopped" if stop.is_set() else "Done"
    yield {"status": stamp(f"{what}: {done.done} of {done.total} runs ({done.failed} failed)."),
           "eval_download": gr.DownloadButton(value=str(path), interactive=True),
           **evaluation(load_results(path))}
