"""The page's layout and event wiring (app.py and `specviz-page` start it); what the events do is in
specviz.page.handlers, and nothing here decodes."""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable, Mapping

import gradio as gr
import torch

from specviz.page import handlers, actions as page, sessions, shelf, zerogpu
from specviz.runs import settings
from specviz.page.handlers import COMPARE_COLUMNS, COMPARE_WIDTHS, VIEW, Server
from specviz import memory
from specviz.models.loading import cache_dir
from specviz.text.prompts import ASSETS, sample_article
from specviz.figures.token_view import TOKEN_CSS
from specviz.figures.why_panel import WHY_CSS
from specviz.figures.report import GLANCE_CSS

CSS = TOKEN_CSS + WHY_CSS + GLANCE_CSS + """
#status { min-height: 2.2em; }
#status .error { color: #cf222e; font-weight: 600; }
.sv-warning { background: #fff8c5; border: 1px solid #d4a72c; border-radius: 6px; padding: 8px 12px; }
.sv-note { color: #57606a; font-size: 13px; }
#why-select { display: none !important; }
#compare-table table { font-size: 13px; }
@media (max-width: 600px) {
  #compare-table th, #compare-table td { white-space: nowrap; }
  #compare-table { overflow-x: auto; }
}
"""
# A click on a token writes "step,sequence,position,nonce" into the hidden #why-select box; its change event
# asks the server for that token's explanation (the nonce makes a second click on the same token count).
CLICK_JS = """() => {
  document.addEventListener('click', (event) => {
    // on a phone the results sit below the controls: bring the status line into view when a run starts
    if (event.target.closest('#run-button, #compare-button') && window.innerWidth < 700) {
      setTimeout(() => document.querySelector('#status')?.scrollIntoView({behavior: 'smooth'}), 100);
    }
    const token = event.target.closest('.sv-click');
    const box = document.querySelector('#why-select textarea, #why-select input');
    if (!token || !box) return;
    document.querySelectorAll('.sv-selected').forEach((t) => t.classList.remove('sv-selected'));
    token.classList.add('sv-selected');
    box.value = [token.dataset.step, token.dataset.seq, token.dataset.pos, Date.now()].join(',');
    box.dispatchEvent(new Event('input', {bubbles: true}));
  });
}"""
# Gradio refuses bigger uploads before specviz sees them: 30 minutes of CD-quality WAV (the audio loader's own
# duration cap) is 318 MB; traces are capped at 64 MB by their loader.
MAX_UPLOAD = "512mb"
INTRO = ("A small **draft** model proposes a few tokens, the large **target** model checks them all in one pass, and "
         "the **verifier** keeps a prefix so that the output still follows the target's distribution. The sample "
         "article is loaded: press **Run**, then click any token (red: rejected) to see why.")


def control(name: str, **layout: Any) -> gr.Component:
    """A setting's control, built from its declaration (specviz.runs.settings)."""
    s = settings.declaration(name)
    default = settings.FIELDS[name].default
    common = {"label": s.label, "elem_id": settings.elem_id(name), **layout}
    if s.control == "radio":
        return gr.Radio(list(s.choices), value=default, info=s.help if s.info else None, **common)
    if s.control == "dropdown":
        return gr.Dropdown(list(s.choices), value=default, **common)
    if s.control == "slider":
        low, high = s.page_range or (s.low, s.high)
        return gr.Slider(low, high, value=default, **({"step": s.step} if s.step else {}), **common)
    if s.control == "number":
        whole = isinstance(default, int)
        return gr.Number(default, precision=0 if whole else None, **({"min_width": 90} if whole else {}), **common)
    if s.control == "text":
        return gr.Textbox(default, **common)
    raise ValueError(f"{name} has no page control ({s.control})")


def layout(limits: sessions.VisitorLimits = sessions.VisitorLimits(), device: str | None = None) -> dict[str, Any]:
    """The page's components by name (each setting under its own name); `device`: where the models run (None: CUDA
    when present). Call inside gr.Blocks."""
    c: dict[str, Any] = {}
    # Per browser session, so nobody sees another user's trace; the states hold shelf tickets, the traces are on
    # the server's shelf (Gradio keeps a closed session's state for an hour).
    c["trace"] = gr.State(None)  # the trace shown
    c["compare_state"] = gr.State({})  # the session's last comparison: name -> its median run's ticket
    # which tab is open; a hidden radio rather than a State so that API clients can ask for a transcription too
    c["task"] = gr.Radio([settings.TEXT, settings.SPEECH], value=settings.TEXT, visible=False, elem_id="task")
    gr.Markdown("# specviz · speculative decoding you can watch")
    gr.Markdown(INTRO, elem_id="intro")
    gr.Markdown(page.device_summary(device), elem_id="device-info")
    if limits.shared:
        gr.Markdown(f"This page is shared: runs wait their turn in one queue (the progress shows your place and the "
                    f"expected wait), and each visitor's work is capped: a Run at {limits.max_new_tokens} tokens and "
                    f"{limits.sequences} sequences, a Compare at {limits.compare_rounds} rounds of "
                    f"{limits.compare_tokens} tokens, an evaluation at {limits.eval_examples} examples.",
                    elem_id="shared-limits", elem_classes="sv-note")
    with gr.Row(equal_height=False):
        with gr.Column(scale=2, min_width=340):
            _inputs(c)
            _settings(c)
            with gr.Row():
                c["export"] = gr.DownloadButton("Export trace (JSON)", value=None, interactive=False,
                                                elem_id="export-button")
                c["trace_upload"] = gr.File(label="Load a trace (JSON): redraws it and restores its settings",
                                            file_types=[".json"], elem_id="trace-upload", height=90)
            c["rerun_button"] = gr.Button("Run the loaded trace again exactly (its settings, input and γ schedule)",
                                          elem_id="rerun-button", size="sm")
            # the API's `export` (the browser downloads through the button above, which already holds the file)
            c["export_api"] = gr.Button("export", visible=False, elem_id="export-api")
        with gr.Column(scale=3, min_width=340):
            c["status"] = gr.HTML('<span class="sv-status">Ready: press Run.</span>', elem_id="status")
            with gr.Tabs(selected="run-results") as c["results"]:
                with gr.Tab("This run", id="run-results"):
                    _run_results(c)
                with gr.Tab("Compare modes", id="compare-results"):
                    _compare_results(c)
                with gr.Tab("Evaluate", id="eval-results"):
                    _eval_results(c)
    return c


def _inputs(c: dict[str, Any]) -> None:
    with gr.Tabs():
        with gr.Tab("Summarize", id="tab-summarize", elem_id="tab-summarize") as c["tab_text"]:
            c["article"] = gr.Textbox(sample_article(), label="Article", lines=4, max_lines=8, elem_id="article-input",
                                      placeholder="Paste an article to summarize…")
            with gr.Row():
                c["sample_text_button"] = gr.Button("Load the sample article", elem_id="sample-article-button",
                                                    size="sm")
                c["sequences"] = control("sequences")
        with gr.Tab("Transcribe", id="tab-transcribe", elem_id="tab-transcribe") as c["tab_speech"]:
            c["audio"] = gr.Audio(label="Audio", type="filepath", sources=["upload", "microphone"],
                                  elem_id="audio-input")
            with gr.Row():
                c["sample_audio_button"] = gr.Button("Load the sample clip", elem_id="sample-audio-button", size="sm")
                c["reference_transcript"] = gr.Textbox(label="Reference transcript (optional, for WER)", lines=1,
                                                       elem_id="reference-transcript", scale=2)
    with gr.Row():
        c["run_button"] = gr.Button("Run", variant="primary", elem_id="run-button")
        c["stop_button"] = gr.Button("Stop", variant="stop", interactive=False, elem_id="stop-button")
        c["compare_button"] = gr.Button("Compare all modes", elem_id="compare-button")


def _settings(c: dict[str, Any]) -> None:
    """Every setting's control (but sequences, beside the article), in rows; the rarely changed ones folded."""
    c["mode"] = control("mode")
    for row in (("decoding", "temperature"), ("top_k", "top_p", "seed"), ("gamma_policy", "gamma_init")):
        with gr.Row():
            c.update({name: control(name) for name in row})
    c["max_new_tokens"] = control("max_new_tokens")
    c["measure"] = gr.Checkbox(True, elem_id="measure-speedup",
                               label="Measure the speedup against target-only (runs it once per input and settings, "
                                     "then reuses it)")
    with gr.Row():
        c["rounds"] = gr.Slider(1, 5, value=3, step=1, label="Compare: interleaved rounds", elem_id="compare-rounds")
        c["with_hf"] = gr.Checkbox(False, label="Compare: add transformers' assisted generation (text, one sequence)",
                                   elem_id="compare-hf")
        c["same_schedule"] = gr.Checkbox(True, elem_id="compare-same-schedule",
                                         label="Compare: every mode on one γ schedule (exact's), so that the verifier "
                                               "is the only difference")
    with gr.Accordion("More: sigmoid range, lenience, drafts, models, references", open=False,
                      elem_id="more-settings"):
        with gr.Row():
            c["reference_summary"] = gr.Textbox(label="Reference summary (optional, for ROUGE-1)", lines=1,
                                                elem_id="reference-summary")
        for row in (("sigmoid_alpha", "sigmoid_beta"), ("lenience", "draft_confidence"),
                    ("draft_kind", "draft_vocab", "lookup_ngram"), ("draft", "target")):
            with gr.Row():
                c.update({name: control(name) for name in row})
    missing = set(settings.page_names()) - set(c)
    assert not missing, f"settings without a control on the page: {missing}"


def _run_results(c: dict[str, Any]) -> None:
    c["warning"] = gr.HTML(elem_id="sigmoid-warning")
    c["summary"] = gr.Markdown(elem_id="run-summary")
    c["output"] = gr.Textbox(label="Output", lines=3, interactive=False, elem_id="output-text")
    c["replay"] = gr.Slider(0, 1, value=0, step=1, elem_id="replay-slider",
                            label="Replay: iterations shown (drag to step through the run)")
    gr.Markdown("Each line is one iteration: accepted drafts green, the rejected draft red and struck through, the "
                "verifier's resampled token blue, the bonus token purple, drafts after a rejection grey. **Click a "
                "token** for the distributions behind its fate.")
    with gr.Row(equal_height=False):  # side by side when wide, stacked on a phone
        with gr.Column(scale=3, min_width=320):
            c["tokens"] = gr.HTML(elem_id="token-view", min_height=120)
        with gr.Column(scale=2, min_width=300):
            c["why_panel"] = gr.HTML('<div class="sv-why">Run, then click a token to see the distributions behind its '
                                     'fate.</div>', elem_id="why-panel")
    c["why_select"] = gr.Textbox(elem_id="why-select", show_label=False, container=False)
    # hidden until there is a run to draw: empty plot frames only push the results down
    for name in ("gamma", "timing", "verify", "acceptance", "theory", "batch"):
        c[f"{name}_plot"] = gr.Plot(elem_id=f"{name}-plot", show_label=False, visible=False)


def _compare_results(c: dict[str, Any]) -> None:
    c["compare_note"] = gr.Markdown("Press **Compare all modes**: target-only, baseline, exact and sigmoid on the same "
                                    "input and seed, in interleaved rounds.", elem_id="compare-note")
    # one line a row (no wrapping: the output text scrolls in its cell), every mode in view at once
    c["compare_table"] = gr.Dataframe(headers=list(COMPARE_COLUMNS), interactive=False, wrap=False,
                                      column_widths=[*COMPARE_WIDTHS], elem_id="compare-table")
    c["compare_plot"] = gr.Plot(elem_id="compare-plot", show_label=False)
    with gr.Row():
        c["compare_pick"] = gr.Dropdown([], label="A run of this comparison", elem_id="compare-trace-select")
        c["open_button"] = gr.Button("Open it in “This run” (then export it there)", elem_id="open-compare-trace")


def _eval_results(c: dict[str, Any]) -> None:
    gr.Markdown("A sweep over a data set: every mode and target-only on each example, Wagner et al.'s Table 1 (per "
                "mode) and Table 2 (sigmoid's range). Load a results file from `python -m specviz eval`, or run a "
                f"small sweep here on the bundled set with the settings on the left (at most "
                f"{handlers.PAGE_SWEEP_EXAMPLES} examples, {handlers.PAGE_SWEEP_TOKENS} tokens each).",
                elem_id="eval-intro")
    with gr.Row():
        c["eval_data"] = gr.Radio([("articles", "text"), ("speech clips", "speech")], value="text",
                                  label="Bundled set", elem_id="eval-data")
        c["eval_examples"] = gr.Slider(1, handlers.PAGE_SWEEP_EXAMPLES, value=2, step=1, label="Examples",
                                       elem_id="eval-examples")
    with gr.Row():
        c["eval_button"] = gr.Button("Evaluate", elem_id="eval-button")
        c["eval_download"] = gr.DownloadButton("Download results (JSONL)", value=None, interactive=False,
                                               elem_id="eval-download")
    c["eval_upload"] = gr.File(label="Load a results file (JSONL)", file_types=[".jsonl"], elem_id="eval-upload",
                               height=90)
    c["eval_note"] = gr.Markdown(elem_id="eval-note")
    c["eval_table1"] = gr.Markdown(elem_id="eval-table1")
    c["eval_table2"] = gr.Markdown(elem_id="eval-table2")
    c["eval_tradeoff_plot"] = gr.Plot(elem_id="eval-tradeoff-plot", show_label=False, visible=False)
    c["eval_gamma_plot"] = gr.Plot(elem_id="eval-gamma-plot", show_label=False, visible=False)


def _progress(progress: gr.Progress) -> handlers.Progress:
    # fraction None: Gradio shows the message without a made-up percentage
    return lambda message, fraction: progress(fraction, desc=message)


class Wiring:
    """Connects handlers that take and return dicts keyed by component name to the components."""

    def __init__(self, components: dict[str, Any]):
        self.c = components

    def named(self, updates: dict[str, Any]) -> dict[Any, Any]:
        return {self.c[name]: value for name, value in updates.items()}

    def connect(self, event: Callable, handler: Callable, inputs: list[str], outputs: list[str], *,
                caller: bool = False, **options: Any):
        """event(...) with named inputs and outputs: the handler gets {name: value} (and, with `caller`, the
        browser session and a progress callback as a handlers.Caller) and returns or yields {name: update}
        for some of `outputs`."""
        def args(values: dict, request: gr.Request | None, progress: gr.Progress | None) -> tuple:
            return (values, handlers.Caller(request.session_hash, _progress(progress))) if caller else (values,)

        # Inputs go by keyword (inputs_kwargs): the API's parameters are named as the components are (`article`,
        # `max_new_tokens`, ...). Gradio injects the request and the progress tracker by annotation and default,
        # and tracks progress only where it is asked for.
        if inspect.isgeneratorfunction(handler):
            def call(request: gr.Request, progress=gr.Progress(), **values):
                for updates in handler(*args(values, request, progress)):
                    yield self.named(updates)
        elif caller:
            def call(request: gr.Request, **values):
                return self.named(handler(*args(values, request, None)))
        else:
            def call(**values):
                return self.named(handler(*args(values, None, None)))
        # Every input optional for API clients (the page always sends all): unset ones take the component's value
        # where it has one, else None, which the handlers read as "not given" (e.g. no audio for a summary).
        signature = inspect.signature(call)
        call.__signature__ = signature.replace(parameters=[
            *(p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD),
            *(inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None) for n in inputs)])
        return event(call, None, [self.c[n] for n in outputs], inputs_kwargs={n: self.c[n] for n in inputs},
                     **options)


BUTTONS = [*handlers.STARTS, "stop_button"]
RUN_INPUTS = ["task", "article", "audio", "reference_summary", "reference_transcript", "measure", *settings.page_names()]
COMPARE_INPUTS = ["task", "article", "audio", "rounds", "with_hf", "same_schedule", *settings.page_names()]
COMPARE_OUTPUTS = ["status", "results", "compare_table", "compare_note", "compare_plot", "compare_state", "compare_pick"]
EVAL_INPUTS = ["eval_data", "eval_examples", *settings.page_names()]
EVAL_SHOWN = ["status", "results", "eval_note", "eval_table1", "eval_table2", "eval_tradeoff_plot", "eval_gamma_plot"]
SHOWN = ["status", "trace", "export", "results", "replay", *VIEW]  # a run, or a trace opened
RESTORED = [*SHOWN, *settings.page_names(), "article"]  # an opened trace also restores its settings and input


PRIVATE = {"api_visibility": "private"}
API_DESCRIPTIONS = {
    "run": "Summarize an article or transcribe audio speculatively; streams the status and figures, and ends with "
           "the run's trace as a JSON file (`export`) and its summary.",
    "compare": "Target-only and every verification mode on the same input and seed, in interleaved rounds.",
    "evaluate": "A capped sweep over the bundled evaluation set with these settings; the results file downloads.",
    "stop": "End this session's run after the iteration in flight; the partial trace is kept.",
    "load_trace": "Open a trace JSON file: redraw it and restore its settings (no model runs).",
    "export": "This session's current trace as a JSON file.",
    "rerun": "Decode this session's loaded summary trace again exactly: its settings, article and γ schedule.",
    "load_results": "Open an evaluation results file (JSONL) and tabulate it.",
    "open_compared": "Open one run of the last comparison in the main view.",
    "why": "The why-panel for one token, named as 'iteration,sequence,position'.",
}


def build(models: sessions.ModelCache, limits: sessions.VisitorLimits = sessions.VisitorLimits()) -> gr.Blocks:
    server = Server(models, sessions.Stops(), page.References(), shelf.default_shelf(), limits)
    gpu = zerogpu.decorator(models.device)  # spaces.GPU on a ZeroGPU Space decoding on CUDA; else None

    def decoding(name: str, handler: Callable) -> Callable:  # a handler that runs models, held on the GPU there
        return zerogpu.on_gpu(partial(handler, server), name, gpu)

    # delete_cache: uploads (and exports, which the page prunes itself) older than a day are deleted hourly;
    # without it every file ever uploaded stays on disk until the server stops.
    with gr.Blocks(title="specviz: speculative decoding you can watch", delete_cache=(3600, 86400)) as demo:
        c = layout(limits, models.device)
        wire = Wiring(c)
        # api_name: the page's stable API for gradio_client (README, "The API"); what only the browser needs
        # (button states, the sample loaders, tab switches, replay) stays private.
        for button, name, handler, inputs, outputs in (
                (c["run_button"], "run", decoding("run", handlers.run), RUN_INPUTS, SHOWN),
                (c["compare_button"], "compare", decoding("compare", handlers.compare), COMPARE_INPUTS,
                 COMPARE_OUTPUTS),
                (c["eval_button"], "evaluate", decoding("evaluate", handlers.evaluate), EVAL_INPUTS,
                 [*EVAL_SHOWN, "eval_download"]),
                (c["rerun_button"], "rerun", decoding("rerun", handlers.rerun), ["trace"], SHOWN)):
            busy = wire.connect(button.click, handlers.busy, [], ["status", *BUTTONS], queue=False, **PRIVATE)
            # progress on the status line only: Gradio's overlay (with its running timer) on every output kept the
            # browser redrawing ~20 components on the cores that decode, throughout a timed run
            going = wire.connect(busy.then, handler, inputs, outputs, caller=True, concurrency_limit=1,
                                 show_progress_on=[c["status"]], api_name=name, api_description=API_DESCRIPTIONS[name])
            wire.connect(going.then, handlers.idle, [], BUTTONS, queue=False, **PRIVATE)
        wire.connect(c["stop_button"].click, partial(handlers.stop, server), [], ["status"], caller=True, queue=False,
                     api_name="stop", api_description=API_DESCRIPTIONS["stop"])

        def on_unload(request: gr.Request) -> None:
            handlers.unload(server, request.session_hash)

        demo.unload(on_unload)
        wire.connect(c["trace_upload"].upload, partial(handlers.upload, server), ["trace_upload"], RESTORED,
                     api_name="load_trace", api_description=API_DESCRIPTIONS["load_trace"])
        wire.connect(c["export_api"].click, partial(handlers.export, server), ["trace"], ["status", "export", "trace"],
                     api_name="export", api_description=API_DESCRIPTIONS["export"])
        wire.connect(c["eval_upload"].upload, handlers.evaluate_upload, ["eval_upload"], [*EVAL_SHOWN, "eval_upload"],
                     api_name="load_results", api_description=API_DESCRIPTIONS["load_results"])
        wire.connect(c["open_button"].click, partial(handlers.open_compared, server), ["compare_state", "compare_pick"],
                     RESTORED, api_name="open_compared", api_description=API_DESCRIPTIONS["open_compared"])
        for event in (c["replay"].input, c["replay"].release):
            wire.connect(event, partial(handlers.replay, server), ["trace", "replay"], ["status", *VIEW],
                         show_progress="hidden", **PRIVATE)
        wire.connect(c["why_select"].change, partial(handlers.why, server), ["trace", "why_select"],
                     ["status", "why_panel"], show_progress="hidden", api_name="why",
                     api_description=API_DESCRIPTIONS["why"])
        wire.connect(c["sample_text_button"].click, handlers.sample_text, [], ["article"], **PRIVATE)
        wire.connect(c["sample_audio_button"].click, handlers.sample_audio, [], ["audio", "reference_transcript"],
                     **PRIVATE)
        c["tab_text"].select(lambda: settings.TEXT, None, c["task"], **PRIVATE)
        c["tab_speech"].select(lambda: settings.SPEECH, None, c["task"], **PRIVATE)
    return demo


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def shared_by_strangers(host: str) -> bool:
    """A page others can reach: a non-local address, or a Space (which sets SPACE_ID)."""
    return host not in LOOPBACK or bool(os.environ.get("SPACE_ID"))


def _model_access(host: str, dirs: list[str] | None) -> sessions.ModelAccess:
    """Any local path when only this machine can reach the page; named directories otherwise."""
    if host in LOOPBACK and not dirs:
        return sessions.ModelAccess()
    return sessions.ModelAccess(tuple(Path(d).expanduser().resolve() for d in (dirs or [str(cache_dir())])))


SESSIONS_KEPT = 64  # beyond these, the least recently active sessions start afresh (an exported trace reloads)


def sessions_kept(environ: Mapping[str, str]) -> int:
    """How many sessions' page state Gradio keeps: $SPECVIZ_SESSIONS_KEPT where set (the soak test fills a small
    bound before it measures), else SESSIONS_KEPT. A value that is no whole number ≥ 1 stops the start, saying so."""
    raw = environ.get("SPECVIZ_SESSIONS_KEPT", "").strip()
    if not raw:
        return SESSIONS_KEPT
    if not raw.isdigit() or int(raw) < 1:
        raise SystemExit(f"SPECVIZ_SESSIONS_KEPT must be a whole number of sessions, at least 1; got {raw!r}")
    return int(raw)


def prepares_at_start(flag: bool | None, env: Mapping[str, str]) -> bool:
    """--prepare / --no-prepare, else on a Space (SPACE_ID) or with SPECVIZ_PREPARE=1."""
    if flag is not None:
        return flag
    return bool(env.get("SPACE_ID")) or env.get("SPECVIZ_PREPARE") == "1"


def _log_progress(what: str) -> Callable[[str, "float | None"], None]:
    """Progress as log lines (a Space's log): each new message once, with the time since start."""
    start, last = time.monotonic(), [""]

    def say(message: str, fraction: float | None) -> None:
        if message != last[0]:
            last[0] = message
            print(f"specviz: {what}: {time.monotonic() - start:5.1f} s: {message}", file=sys.stderr, flush=True)
    return say


def _device(name: str) -> str:
    """--device checked at the start: a device torch names, and CUDA only where there is one."""
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{name}: this machine has no CUDA device")
    return name


def main() -> None:
    parser = argparse.ArgumentParser(description="Start the specviz page.")
    parser.add_argument("--host", default=os.environ.get("SPECVIZ_HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("SPECVIZ_PORT", "7860")))
    parser.add_argument("--device", default=os.environ.get("SPECVIZ_DEVICE") or None, type=_device,
                        help="where the models run: cpu, cuda or cuda:N, as the CLI's --device (default: "
                             "$SPECVIZ_DEVICE, else cuda when present)")
    parser.add_argument("--models-dir", action="append", default=None, metavar="DIR",
                        help="on a non-local address, local model paths are accepted only under these directories "
                             "(repeatable; default: the specviz model cache)")
    parser.add_argument("--prepare", action=argparse.BooleanOptionalAction, default=None,
                        help="load the default text pair in the background at start (default: on a Space, or with "
                             "SPECVIZ_PREPARE=1), so the first Run does not wait for a cold cache")
    args = parser.parse_args()
    memory.reuse_freed_memory()
    limits = sessions.SHARED_LIMITS if shared_by_strangers(args.host) else sessions.VisitorLimits()
    models = sessions.ModelCache(access=_model_access(args.host, args.models_dir), device=args.device)
    if prepares_at_start(args.prepare, os.environ):
        models.prepare(_log_progress("preparing the default models"))
    demo = build(models, limits)
    # allowed_paths: the sample clip is served from the assets folder wherever the app is started from
    # state_session_capacity: Gradio keeps a copy of the page's component state for each session (~0.9-3 MB
    # here) until it has seen this many newer ones; an API client's sessions never close.
    kept = sessions_kept(os.environ)
    demo.queue(default_concurrency_limit=4).launch(server_name=args.host, server_port=args.port, css=CSS, js=CLICK_JS,
                                                   show_error=True, max_file_size=MAX_UPLOAD,
                                                   allowed_paths=[str(ASSETS)], state_session_capacity=kept)


if __name__ == "__main__":
    main()
