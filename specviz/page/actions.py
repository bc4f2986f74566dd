"""What the page's runs do, without Gradio: stream a run with Stop, measure target-only once per input, compare
modes, draw and export a trace.

specviz.page.handlers call these; each browser session keeps its own trace (in the page's state); the models and
Stop flags sessions share are in specviz.page.sessions.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import queue
import secrets
import shutil
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

import torch

from specviz import native, openmp
from specviz.figures import report
from specviz.speech.audio import load_audio
from specviz.runs.compare import Row, compare, hf_assisted_runs, noise, source_runner
from specviz.config import MODES, REPLAY, SpecConfig
from specviz.decoding.source import Source
from specviz.figures.plots import (acceptance_figure, batch_figure, gamma_figure, theory_figure, timing_figure, verify_figure)
from specviz.models.loading import Progress, default_device
from specviz.text.prompts import InputError, check_article_size
from specviz.decoding.records import Iteration, Prefilling
from specviz.runs.replay import Schedule, replaying, schedule
from specviz.runs.decode import builder_for, records, run
from specviz.page.sessions import ModelCache, StopFlag
from specviz.runs.settings import TEXT, Settings, declaration
from specviz.runs.tasks import SUMMARIZE, TRANSCRIBE, Task
from specviz.figures.token_view import token_html
from specviz.traces.trace import Trace
from specviz.verify import kernels_active
from specviz.verify.cuda import use_kernels

def device_summary(device: str | None = None) -> str:
    """Where the page's models run (`device`; None: CUDA when present) and which verification path they get."""
    where = torch.device(device) if device is not None else default_device()
    if where.type == "cuda":
        kernels = "CuPy kernels active" if kernels_active() else "torch path (CuPy kernels unavailable)"
        return f"GPU: {torch.cuda.get_device_name(where)} · verification: {kernels}"
    passes = "exact's full-vocabulary passes in C++" if native.available() else "torch path"
    return f"CPU ({torch.get_num_threads()} threads) · verification: {passes}"


def verification(mode: str, cfg: SpecConfig, device: torch.device) -> dict[str, Any]:
    """Which path verifies a run's iterations (trace meta "verification"), as verify_batch chooses it for rows that
    drafted alike (a row that the draft-confidence stop ended early, beside longer ones, verifies on torch):
    'cuda kernels' (exact and sigmoid, sampled, on CUDA: specviz.verify.use_kernels), 'torch + C++ passes' (exact,
    sampled, on the CPU), 'torch', or for target-only and transformers' own runs 'none' and 'transformers'."""
    kernels = kernels_active() if device.type == "cuda" else False
    if mode not in MODES:
        path = "none" if mode == "target-only" else "transformers"
    elif mode == "baseline" or cfg.sampling.greedy:
        path = "torch"
    elif device.type == "cuda":
        try:
            path = "cuda kernels" if use_kernels(mode, cfg.sampling, torch.empty(0, device=device),
                                                 cfg.verify_backend) else "torch"
        except (RuntimeError, ValueError) as e:  # backend 'cuda' without the kernels: the run fails the same way
            path = f"none ({e})"
    else:
        path = "torch + C++ passes" if mode == "exact" and cfg.verify_backend == "auto" and native.available() \
            else "torch"
    return {"path": path, "backend": cfg.verify_backend, "device": str(device), "cuda_kernels_active": kernels}


@dataclass(frozen=True)
class _Failure:
    error: BaseException


class Frame(NamedTuple):
    """One update of a streamed run: the trace so far and whether it is finished. The page draws the tokens,
    output and summary of every frame (a few milliseconds) and the figures only once the run, and the target-only
    run it is measured against, are over: a browser drawing six figures on the cores that decode had slowed
    whichever run it overlapped by up to a third."""

    trace: Trace
    done: bool
    reading: Prefilling | None = None  # during the prefill: how far a model has read the input
    reference: Trace | None = None  # the target-only run timed alongside (stream_run's `with_reference`), when done


# Decoding pauses while the page builds a frame: the worker holds the engine at its last record until the page is
# done with it (below), so building a frame never shares the cores with decoding, and the engine's clock stands
# still meanwhile (decoding.clock). Frames are at least MIN_TEXT_GAP_S apart, and after a frame that took t seconds
# the next waits TEXT_WAIT t: a few percent of a run goes into them. A browser on the same cores redraws the token
# view at each frame: frames 0.4 s apart slowed both timed runs by 15-25% against none (docs/benchmarks.md). The worker waits at most HANDOFF_S for a
# record (a stalled stream slows the run, it cannot hold it), and ends within STOP_POLL_S of a stop.
TEXT_WAIT, MIN_TEXT_GAP_S, HANDOFF_S, STOP_POLL_S = 19, 0.8, 5.0, 0.05
# A run and the target-only run it is measured against take turns of about TURN_S seconds of decoding, in one
# thread: this host's speed drifts by 10-30% within seconds, and the browser draws on the same cores, so turns
# this short let both meet the same conditions; one thread keeps one OpenMP team (two live teams slow both).
TURN_S = 0.5
SHOWN, REFERENCE = "shown", "reference"


def _streamed(source: Source, cfg: SpecConfig, meta: dict[str, Any], stop: StopFlag, target_only: bool = False,
              with_reference: bool = False) -> Iterator[Frame]:
    """Decode in a worker thread; yield frames as iterations arrive. With `with_reference`, target-only decodes
    the same source too (a source only hands out fresh decoders), in turns with this run once the run has read its
    input (so the reference finds the input in the prompt cache); the last frame carries its trace.

    The worker only produces immutable records and puts them on a queue, one at a time: it waits until this
    generator, in the page's thread, is done with each (drawn it or not), so the two never run at once; a run
    waiting for its turn is suspended at a record, its clock stopped. The generator owns the TraceBuilders, so
    the traces it yields are never touched by another thread. When `stop` is set (or this generator is closed)
    the worker ends after the iteration it is in and releases the models' caches; the traces end there, marked
    stopped.
    """
    updates: queue.Queue = queue.Queue()  # (which run, record, its own "handled" event), then a _Failure or None
    builders = {SHOWN: builder_for(source, cfg, target_only=target_only, meta=meta)}
    if with_reference:
        builders[REFERENCE] = builder_for(source, cfg, target_only=True)

    def handed_over(handled: threading.Event) -> None:
        """Wait until the page is done with the record (the engine stays there, its clock stopped), a stop,
        or HANDOFF_S."""
        deadline = time.perf_counter() + HANDOFF_S
        while not handled.wait(STOP_POLL_S) and not stop.is_set() and time.perf_counter() < deadline:
            pass

    def work() -> None:
        runs = {SHOWN: records(source, cfg, target_only=target_only)}
        waiting = with_reference  # the reference starts once the run has read its input (or is over)
        turn, turn_ends = SHOWN, float("inf")
        iterations = 0

        def start_reference() -> None:
            nonlocal waiting, turn_ends
            runs[REFERENCE], waiting = records(source, cfg, target_only=True), False
            turn_ends = time.perf_counter() + TURN_S

        try:
            while runs:
                if stop.is_set():
                    print(f"specviz: run stopped after {iterations} iterations ({stop.reason})", file=sys.stderr,
                          flush=True)
                    break
                event = next(runs[turn], None)
                if event is None:  # this run is over: the other goes on alone
                    del runs[turn]
                    if waiting:  # a run with no iteration at all
                        start_reference()
                    turn, turn_ends = next(iter(runs), turn), float("inf")
                    continue
                if turn == SHOWN:
                    iterations += isinstance(event, Iteration)
                handled = threading.Event()
                updates.put((turn, event, handled))
                handed_over(handled)
                if waiting and isinstance(event, Iteration):  # the input is read: the reference's turns begin
                    start_reference()
                if len(runs) == 2 and time.perf_counter() >= turn_ends:
                    turn = REFERENCE if turn == SHOWN else SHOWN
                    turn_ends = time.perf_counter() + TURN_S
        except BaseException as e:  # re-raised in the page's thread, where the page reports it
            updates.put(_Failure(e))
        finally:
            for events in runs.values():
                events.close()  # drops the KV caches now, not when the generator is collected
            updates.put(None)  # the thread ends here, and its OpenMP team with it

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    ended = False
    next_frame = 0.0
    try:
        while (got := updates.get()) is not None:
            if isinstance(got, _Failure):
                raise got.error
            which, item, handled = got
            builders[which].add(item)
            now = time.perf_counter()
            if which == SHOWN and isinstance(item, Prefilling):  # a few per input, each after seconds of reading
                yield Frame(builders[SHOWN].trace, False, item)
            elif which == SHOWN and isinstance(item, Iteration) and now >= next_frame:
                yield Frame(builders[SHOWN].trace, False)
                end = time.perf_counter()
                next_frame = end + max(MIN_TEXT_GAP_S, TEXT_WAIT * (end - now))
            handled.set()
        ended = True
        worker.join(HANDOFF_S)  # its last item is in: the final frame waits until its thread (and team) is gone
        if stop.is_set():
            for builder in builders.values():
                builder.trace.meta["stopped"] = True
        done = builders[REFERENCE].trace if REFERENCE in builders else None
        yield Frame(builders[SHOWN].trace, True, reference=done)
    finally:
        if not ended:  # closed early (an error, or Gradio dropped the stream): the worker must not go on
            stop.stop("the page stopped reading the run")  # a worker waiting on a record sees it and leaves


def _article_source(models: ModelCache, article: str | None, settings: Settings, cfg: SpecConfig,
                    progress: Progress) -> Source:
    if not article or not article.strip():
        raise InputError("the article is empty: paste some text or load the sample")
    check_article_size(article)  # before minutes go into loading models
    low, high = declaration("sequences").page_range
    if not low <= settings.sequences <= high:
        raise InputError(f"the page decodes {low:g} to {high:g} sequences at once, not {settings.sequences}")
    pair = models.text(settings.draft, settings.target, progress)
    return SUMMARIZE.source(pair, [("article", article)], cfg, settings.sequences)


def _speech_source(models: ModelCache, audio_path: str | None, settings: Settings, cfg: SpecConfig,
                   progress: Progress) -> Source:
    if not audio_path:
        raise InputError("no audio: upload or record a clip, or load the sample")
    audio = load_audio(audio_path)  # a bad clip is refused before minutes go into loading models
    pair = models.speech(settings.draft, settings.target, progress)
    return TRANSCRIBE.source(pair, [(TRANSCRIBE.shown(audio_path), audio)], cfg)


# What the page checks of each task's input before it loads models, and how it builds the source
_SOURCES: dict[str, Callable[..., Source]] = {SUMMARIZE.name: _article_source, TRANSCRIBE.name: _speech_source}


def _source(models: ModelCache, task: Task, source_input: str | None, settings: Settings, cfg: SpecConfig,
            progress: Progress) -> Source:
    """Built in the handler's thread, which lives on while a worker decodes: it gives its OpenMP team back."""
    with openmp.team_released():
        return _SOURCES[task.name](models, source_input, settings, cfg, progress)


def stream_run(models: ModelCache, task: Task, source_input: str | None, settings: Settings, progress: Progress,
               stop: StopFlag, gamma_schedule: Schedule | None = None, with_reference: bool = False
               ) -> Iterator[Frame]:
    """One run of the page: text (source_input is the article) or speech (a path to the audio); on a trace's
    γ schedule when one is given (specviz.runs.replay); `with_reference`: target-only on the same input and
    settings timed in turns with it (the last frame's `reference`)."""
    cfg = settings.spec(task)
    if gamma_schedule:
        cfg = replaying(cfg, gamma_schedule)
    source = _source(models, task, source_input, settings, cfg, progress)
    meta = {"input": task.shown(source_input), "page_settings": settings.to_dict(),
            "verification": verification(cfg.mode, cfg, source.device)}
    return _streamed(source, cfg, meta, stop, with_reference=with_reference)


class References:
    """Target-only runs by input and settings, kept so that a run's measured speedup reuses the reference
    of an identical earlier run instead of decoding it again. Shared by all sessions: the lock guards the
    table, and a stored trace is never modified afterwards."""

    def __init__(self, capacity: int = 16):
        self._lock = threading.Lock()
        self._runs: OrderedDict[tuple, tuple[Trace, float]] = OrderedDict()
        self.capacity = capacity

    @staticmethod
    def key(task: Task, source_input: str | None, settings: Settings) -> tuple:
        """What target-only's output and speed depend on (nothing about the draft or verification)."""
        if task.input_is_file:
            stat = Path(source_input or "").stat()
            what = (str(Path(source_input or "").resolve()), stat.st_size, stat.st_mtime_ns)
        else:
            what = hashlib.sha256((source_input or "").encode("utf-8", "replace")).hexdigest()
        sampling = settings.spec(task).sampling
        return (task.name, what, settings.target, sampling, settings.max_new_tokens, settings.seed, settings.sequences)

    def get(self, key: tuple) -> tuple[Trace, float] | None:
        with self._lock:
            if key in self._runs:
                self._runs.move_to_end(key)
            return self._runs.get(key)

    def put(self, key: tuple, trace: Trace) -> float:
        at = time.time()
        with self._lock:
            self._runs[key] = (trace, at)
            while len(self._runs) > self.capacity:
                self._runs.popitem(last=False)
        return at


def known_reference(references: References, task: Task, source_input: str | None, settings: Settings, run: Trace
                    ) -> dict[str, Any] | None:
    """What `run` keeps (meta["target_only"]) about an identical earlier run's target-only reference, or None."""
    known = references.get(References.key(task, source_input, settings))
    if known is None:
        return None
    return report.reference_meta(known[0], reused=True, measured_at=known[1], prefill_s=report.prefill_without_draft(run))


def new_reference(references: References, task: Task, source_input: str | None, settings: Settings, run: Trace,
                  reference: Trace) -> dict[str, Any]:
    """What `run` keeps about the target-only run timed with it (kept for identical later runs), its end to end
    counting the run's own prefill without the draft's reading (report.reference_meta)."""
    at = references.put(References.key(task, source_input, settings), reference)
    return report.reference_meta(reference, reused=False, measured_at=at, prefill_s=report.prefill_without_draft(run))


def compare_modes(models: ModelCache, task: Task, source_input: str | None, settings: Settings, progress: Progress,
                  on_stage: Callable[[str], None], rounds: int = 3, with_hf: bool = False, same_schedule: bool = True
                  ) -> tuple[list[Row], dict[str, Trace], str]:
    """Target-only, baseline, exact and sigmoid (and transformers' assisted generation when asked, text
    with one sequence) on the same input, batch and seed, in `rounds` interleaved rounds; with `same_schedule`,
    every mode on the γ schedule of one untimed exact run (the cost policy reacts to each mode's own costs, so
    otherwise the modes also differ in γ). Returns the rows, the median run of each, and a note on what the
    numbers mean and how noisy they were."""
    if not 1 <= rounds <= 10:
        raise InputError(f"a comparison runs 1 to 10 rounds, not {rounds}")
    if with_hf and (task.name != TEXT or settings.sequences != 1):  # said before any model or input is loaded
        raise InputError("transformers' assisted generation is compared on text with one sequence")
    with openmp.team_released():  # compared in the handler's thread, which outlives the comparison
        return _compare_modes(models, task, source_input, settings, progress, on_stage, rounds, with_hf, same_schedule)


def _compare_modes(models: ModelCache, task: Task, source_input: str | None, settings: Settings, progress: Progress,
                   on_stage: Callable[[str], None], rounds: int, with_hf: bool, same_schedule: bool
                   ) -> tuple[list[Row], dict[str, Trace], str]:
    cfg = settings.spec(task)
    decoded = _source(models, task, source_input, settings, cfg, progress)
    schedule_note = "each mode chose its own γ (its policy)"
    if same_schedule and cfg.gamma_policy != REPLAY:
        on_stage("exact, for the γ schedule every mode replays (not timed)")
        plan = schedule(run(decoded, dataclasses.replace(cfg, mode="exact")))
        cfg = replaying(cfg, plan)
        schedule_note = (f"every mode on one γ schedule (an untimed exact run's, {len(plan)} iterations), so the "
                         "verifier is the only difference")
    extra = {}
    if with_hf:
        pair = models.text(settings.draft, settings.target, progress)
        extra = {"hf-assisted": hf_assisted_runs(pair, decoded.sequences[0].prompt_ids, cfg)["hf-assisted"]}
    rows, traces = compare(source_runner(decoded), dataclasses.replace(cfg, mode="exact"), extra=extra,
                           repeat=rounds, on_stage=on_stage)
    for trace in traces.values():
        trace.meta.setdefault("page_settings", dataclasses.replace(
            settings, mode=trace.mode if trace.mode in MODES else settings.mode).to_dict())
        trace.meta.setdefault("input", task.shown(source_input))
        trace.meta.setdefault("verification", verification(trace.mode, cfg, decoded.device))
    decoding = "greedy" if cfg.sampling.greedy else f"sampling at temperature {cfg.sampling.temperature:g}"
    note = report.compare_note(rounds, noise(rows), decoding) + f"  \nγ: {schedule_note}."
    drift = report.sigmoid_drift(traces)
    return rows, traces, note + ("  \n" + drift if drift else "")


def score(trace: Trace, task: Task, reference: str) -> None:
    """Against a reference the user typed: ROUGE-1 for a summary, WER for a transcript (kept in meta)."""
    if not reference.strip():
        return
    trace.meta["reference"] = reference
    name, value = task.score(reference, trace.output_text)
    trace.meta[name] = value


def figures(trace: Trace, upto: int | None = None, plots: bool = True) -> dict[str, Any]:
    """Everything the page draws from a trace; `upto`: as it stood after that many iterations (replay).
    Without `plots`, only the text parts (tokens, summary, output): milliseconds instead of ~0.17 s."""
    shown = trace.until(upto)
    text = {"tokens": token_html(trace, upto=upto), "summary": report.summary_markdown(shown),
            "warning": report.sigmoid_warning(shown), "output": shown.output_text}
    if not plots:
        return text
    measured = report.measured_speedup(trace) if shown is trace else None
    return {
        **text,
        "gamma": gamma_figure(trace, upto=upto),
        "acceptance": acceptance_figure(trace, upto=upto),
        "timing": timing_figure(trace, upto=upto),
        "verify": verify_figure(trace, upto=upto),
        "theory": theory_figure(trace, upto=upto, measured_speedup=measured.decode if measured else None),
        "batch": batch_figure(trace, upto=upto),
    }


# Inside Gradio's upload folder (its rule: $GRADIO_TEMP_DIR, else <tmp>/gradio), so Gradio serves an export where
# it is; from any other folder it copied every export into its own, kept until the server stops.
EXPORT_DIR = Path(os.environ.get("GRADIO_TEMP_DIR") or Path(tempfile.gettempdir()) / "gradio").resolve() / \
    "specviz-exports"
EXPORTS_KEPT = 64  # the newest exports stay downloadable; older ones are deleted so the disk does not fill,
EXPORT_MB_KEPT = 1000  # as are the oldest beyond this many MB (a 50 MB trace uploaded 64 times is 3.4 GB)


def export_name(trace: Trace) -> str:
    """specviz-<task>-<mode>-<YYYYmmdd-HHMM>.json, from the trace's own (untrusted) meta, made safe."""
    def safe(value: Any, fallback: str) -> str:
        return "".join(c for c in str(value) if c.isalnum() or c == "-")[:20] or fallback

    return f"specviz-{safe(trace.task, 'run')}-{safe(trace.mode, 'run')}-" \
           f"{time.strftime('%Y%m%d-%H%M')}.json"


_PRUNING = threading.Lock()  # sessions export at once; one prunes at a time within this process


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:  # pruned meanwhile by another process sharing the folder
        return None


def _bytes(folder: Path) -> int:
    """The bytes of the files in one export folder (0 for those removed meanwhile)."""
    total = 0
    for path in folder.glob("*"):
        try:
            total += path.stat().st_size
        except OSError:
            pass
    return total


def download_folder() -> Path:
    """A fresh folder for one download (an export, a sweep's results), so that two in one minute keep their
    readable names; the oldest beyond EXPORTS_KEPT, or beyond EXPORT_MB_KEPT in all, are deleted so the disk
    does not fill. Another process may prune the same folder at the same time: entries that vanish meanwhile
    are skipped."""
    EXPORT_DIR.mkdir(parents=True, exist_ok=True)
    with _PRUNING:
        dated = sorted((m, d) for d in EXPORT_DIR.iterdir() if (m := _mtime(d)) is not None and d.is_dir())
        sizes = [_bytes(d) for _, d in dated]
        total = sum(sizes)
        for i, (_, path) in enumerate(dated):
            if len(dated) - i < EXPORTS_KEPT and total <= EXPORT_MB_KEPT * 1e6:
                break
            shutil.rmtree(path, ignore_errors=True)
            total -= sizes[i]
        folder = EXPORT_DIR / secrets.token_hex(8)
        folder.mkdir()
    return folder


def export(trace: Trace) -> str:
    """Write the trace for a download (Trace.save: atomic, indented); returns the path. A failed export
    leaves nothing behind."""
    folder = download_folder()
    final = folder / export_name(trace)
    try:
        trace.save(final)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return str(final)
