"""specviz page: layout and event wiring. Everything decoding-related lives in the specviz package."""

from __future__ import annotations

import argparse
import dataclasses
import html
import os
import time
from pathlib import Path

import gradio as gr
import pandas as pd

from specviz import page
from specviz.config import MODES
from specviz.models import cache_dir
from specviz.prompts import ASSETS, sample_article
from specviz.trace import Trace, TraceFormatError
from specviz.viz import TOKEN_CSS, WHY_CSS, compare_figure, why_html

SAMPLE_AUDIO = str(ASSETS / "sample_speech.flac")
SAMPLE_TRANSCRIPT = (ASSETS / "sample_speech.txt").read_text(encoding="utf-8").strip()
CSS = TOKEN_CSS + WHY_CSS + """
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
COMPARE_COLUMNS = {"name": "run", "tokens_per_s": "tokens/s (median)", "speedup": "speedup (median)",
                   "speedup_range": "speedup min–max", "decode_tokens_per_s": "decoding tokens/s", "alpha": "α",
                   "tokens_per_iteration": "tokens / iteration", "median_verify_ms": "verify µs (median)",
                   "equals_target_only": "= target-only", "output_text": "output"}
POLICY_CHOICES = [
    ("auto: bass for a batch, else hf", "auto"),
    ("constant: always the initial γ", "constant"),
    ("hf: +2 after all accepted, −1 otherwise (transformers)", "hf"),
    ("bass: grows when any sequence kept all, shrinks on misses (BASS)", "bass"),
    ("optimal: the γ that maximizes Leviathan's predicted speedup from measured α and c", "optimal"),
    ("cost: the γ with the best expected tokens/s from this machine's measured call costs; 0 (a plain target "
     "step) when no γ pays", "cost"),
]
INTRO = ("A small **draft** model proposes a few tokens, the large **target** model checks them all in one pass, and "
         "the **verifier** keeps a prefix so that the output still follows the target's distribution. The sample "
         "article is loaded: press **Run**, then click any token (red: rejected) to see why.")


def _progress_adapter(progress: gr.Progress):
    # fraction None: Gradio shows the message without a made-up percentage
    return lambda message, fraction: progress(fraction, desc=message)


def _stamp(message: str) -> str:
    """Status lines carry the time, so a repeated message still reads as new."""
    return f'<span class="sv-status">[{time.strftime("%H:%M:%S")}] {message}</span>'


def _error(e: Exception) -> str:
    return _stamp(f'<span class="error">⚠ {type(e).__name__}: {html.escape(str(e))}</span>')


def _compare_table(rows: list[dict]) -> pd.DataFrame:
    table = pd.DataFrame([{**r, "speedup_range": f"{r['speedup_min']:.2f}–{r['speedup_max']:.2f}",
                           "median_verify_ms": None if r["median_verify_ms"] is None else 1e3 * r["median_verify_ms"]}
                          for r in rows])
    return table[list(COMPARE_COLUMNS)].rename(columns=COMPARE_COLUMNS).round(3)


def build(models: page.ModelCache) -> gr.Blocks:
    stops = page.Stops()  # the current run of each browser session, for Stop and for closed tabs
    references = page.References()  # target-only runs, reused for the measured speedup of identical inputs
    with gr.Blocks(title="specviz: speculative decoding you can watch") as demo:
        trace_state = gr.State(None)  # per browser session: nobody sees another user's trace
        compare_state = gr.State({})  # the session's last comparison: name -> its median run's trace
        task_state = gr.State(page.TEXT)

        gr.Markdown("# specviz · speculative decoding you can watch")
        gr.Markdown(INTRO, elem_id="intro")
        gr.Markdown(page.device_summary(), elem_id="device-info")

        with gr.Row(equal_height=False):
            with gr.Column(scale=2, min_width=340):
                with gr.Tabs():
                    with gr.Tab("Summarize", id="tab-summarize", elem_id="tab-summarize") as tab_text:
                        article = gr.Textbox(sample_article(), label="Article", lines=4, max_lines=8,
                                             elem_id="article-input", placeholder="Paste an article to summarize…")
                        with gr.Row():
                            sample_text_btn = gr.Button("Load the sample article", elem_id="sample-article-button",
                                                        size="sm")
                            sequences = gr.Slider(1, 8, value=1, step=1, elem_id="num-sequences",
                                                  label="Sequences (samples decoded together as one batch)")
                    with gr.Tab("Transcribe", id="tab-transcribe", elem_id="tab-transcribe") as tab_speech:
                        audio = gr.Audio(label="Audio", type="filepath", sources=["upload", "microphone"],
                                         elem_id="audio-input")
                        with gr.Row():
                            sample_audio_btn = gr.Button("Load the sample clip", elem_id="sample-audio-button",
                                                         size="sm")
                            reference_transcript = gr.Textbox(label="Reference transcript (optional, for WER)",
                                                              lines=1, elem_id="reference-transcript", scale=2)
                with gr.Row():
                    run_btn = gr.Button("Run", variant="primary", elem_id="run-button")
                    stop_btn = gr.Button("Stop", variant="stop", interactive=False, elem_id="stop-button")
                    compare_btn = gr.Button("Compare all modes", elem_id="compare-button")
                mode = gr.Radio(list(MODES), value="exact", label="Verification mode", elem_id="mode-select",
                                info="exact and baseline keep the target's distribution (baseline: transformers' "
                                     "algorithm); sigmoid is Wagner et al.'s faster approximation")
                with gr.Row():
                    decoding = gr.Radio(["sample", "greedy"], value="sample", label="Decoding", elem_id="decoding-select")
                    temperature = gr.Slider(0.05, 2.0, value=0.8, label="Temperature", elem_id="temperature")
                with gr.Row():
                    top_k = gr.Number(0, precision=0, label="Top-k (0 = off)", elem_id="top-k", min_width=90)
                    top_p = gr.Slider(0.05, 1.0, value=1.0, label="Top-p", elem_id="top-p")
                    seed = gr.Number(0, precision=0, label="Seed", elem_id="seed", min_width=90)
                with gr.Row():
                    policy = gr.Dropdown(POLICY_CHOICES, value="auto", label="γ policy: how many tokens to draft next",
                                         elem_id="gamma-policy")
                    gamma_init = gr.Number(0, precision=0, label="Initial γ (0 = the policy's)", elem_id="gamma-init",
                                           min_width=90)
                max_new = gr.Slider(8, 256, value=96, step=8, label="Max new tokens", elem_id="max-new-tokens")
                measure = gr.Checkbox(True, elem_id="measure-speedup",
                                      label="Measure the speedup against target-only (runs it once per input and "
                                            "settings, then reuses it)")
                with gr.Row():
                    rounds = gr.Slider(1, 5, value=3, step=1, label="Compare: interleaved rounds",
                                       elem_id="compare-rounds")
                    with_hf = gr.Checkbox(False, label="Compare: add transformers' assisted generation (text, one "
                                                       "sequence)", elem_id="compare-hf")
                with gr.Accordion("More: sigmoid range, lenience, drafts, models, references", open=False,
                                  elem_id="more-settings"):
                    with gr.Row():
                        reference_summary = gr.Textbox(label="Reference summary (optional, for ROUGE-1)", lines=1,
                                                       elem_id="reference-summary")
                    with gr.Row():
                        alpha = gr.Number(None, label="sigmoid range low (Wagner's α; 0: −10⁴ text, −10³ speech)",
                                          elem_id="sigmoid-alpha")
                        beta = gr.Number(None, label="sigmoid range high (Wagner's β; 0: 10⁴ text, 10³ speech)",
                                         elem_id="sigmoid-beta")
                    with gr.Row():
                        lenience = gr.Slider(0.05, 1.0, value=1.0, label="Lenience l (1 = exact)", elem_id="lenience")
                        confidence = gr.Slider(0.0, 0.95, value=0.0, step=0.05, elem_id="draft-confidence",
                                               label="Stop drafting below this draft probability (0 = off)")
                    with gr.Row():
                        draft_kind = gr.Dropdown(
                            [("auto (the fastest measured for the task)", "auto"), ("draft model", "model"),
                             ("prompt lookup (no draft model)", "lookup"),
                             ("prompt lookup, else the draft model", "lookup+model")],
                            value="auto", label="Who drafts", elem_id="draft-kind")
                        draft_vocab = gr.Dropdown(
                            [("auto", "auto"), ("all tokens", "0"), *[(f"{int(k):,} + specials + prompt", k)
                                                                      for k in page.DRAFT_VOCAB_CHOICES[2:]]],
                            value="auto", label="Draft head vocabulary (q = 0 elsewhere; stays exact)",
                            elem_id="draft-vocab")
                        lookup_ngram = gr.Slider(0, 5, value=0, step=1, elem_id="lookup-ngram",
                                                 label="Prompt lookup: shortest match before the model (0 = auto)")
                    with gr.Row():
                        draft = gr.Textbox("default", label="Draft (default, hub id, local path; speech: layers:0,1,2,4,5)",
                                           elem_id="draft-model")
                        target = gr.Textbox("default", label="Target (default, hub id, local path)", elem_id="target-model")
                with gr.Row():
                    export_btn = gr.DownloadButton("Export trace (JSON)", value=None, interactive=False,
                                                   elem_id="export-button")
                    trace_upload = gr.File(label="Load a trace (JSON): redraws it and restores its settings",
                                           file_types=[".json"], elem_id="trace-upload", height=90)

            with gr.Column(scale=3, min_width=340):
                status = gr.HTML('<span class="sv-status">Ready: press Run.</span>', elem_id="status")
                with gr.Tabs(selected="run-results") as results:
                    with gr.Tab("This run", id="run-results"):
                        warning = gr.HTML(elem_id="sigmoid-warning")
                        summary = gr.Markdown(elem_id="run-summary")
                        output = gr.Textbox(label="Output", lines=3, interactive=False, elem_id="output-text")
                        replay = gr.Slider(0, 1, value=0, step=1, elem_id="replay-slider",
                                           label="Replay: iterations shown (drag to step through the run)")
                        gr.Markdown("Each line is one iteration: accepted drafts green, the rejected draft red and "
                                    "struck through, the verifier's resampled token blue, the bonus token purple, drafts "
                                    "after a rejection grey. **Click a token** for the distributions behind its fate.")
                        with gr.Row(equal_height=False):  # side by side when wide, stacked on a phone
                            with gr.Column(scale=3, min_width=320):
                                token_view = gr.HTML(elem_id="token-view", min_height=120)
                            with gr.Column(scale=2, min_width=300):
                                why_panel = gr.HTML('<div class="sv-why">Run, then click a token to see the '
                                                    'distributions behind its fate.</div>', elem_id="why-panel")
                        why_select = gr.Textbox(elem_id="why-select", show_label=False, container=False)
                        # hidden until there is a run to draw: empty plot frames only push the results down
                        gamma_plot = gr.Plot(elem_id="gamma-plot", show_label=False, visible=False)
                        timing_plot = gr.Plot(elem_id="timing-plot", show_label=False, visible=False)
                        verify_plot = gr.Plot(elem_id="verify-plot", show_label=False, visible=False)
                        acceptance_plot = gr.Plot(elem_id="acceptance-plot", show_label=False, visible=False)
                        theory_plot = gr.Plot(elem_id="theory-plot", show_label=False, visible=False)
                        batch_plot = gr.Plot(elem_id="batch-plot", show_label=False, visible=False)
                    with gr.Tab("Compare modes", id="compare-results"):
                        compare_note = gr.Markdown("Press **Compare all modes**: target-only, baseline, exact and "
                                                   "sigmoid on the same input and seed, in interleaved rounds.",
                                                   elem_id="compare-note")
                        compare_table = gr.Dataframe(headers=list(COMPARE_COLUMNS.values()), interactive=False,
                                                     wrap=True, elem_id="compare-table")
                        compare_plot = gr.Plot(elem_id="compare-plot", show_label=False)
                        with gr.Row():
                            compare_pick = gr.Dropdown([], label="A run of this comparison", elem_id="compare-trace-select")
                            open_btn = gr.Button("Open it in “This run” (then export it there)",
                                                 elem_id="open-compare-trace")

        settings_inputs = [mode, decoding, temperature, top_k, top_p, policy, gamma_init, max_new, seed, alpha, beta,
                           lenience, confidence, draft, target, sequences, draft_kind, draft_vocab, lookup_ngram]
        view_outputs = [output, summary, warning, token_view, gamma_plot, acceptance_plot, timing_plot, verify_plot,
                        theory_plot, batch_plot]
        buttons = [run_btn, compare_btn, stop_btn]

        def settings_from(values) -> page.Settings:
            (m, dec, temp, k, p, pol, g0, mx, sd, a, b, l, conf, d, t, n, dk, dv, ng) = values
            return page.Settings(m, dec, temp, int(k or 0), p, pol, int(g0 or 0), int(mx), int(sd or 0),
                                 None if a in (None, "", 0) else float(a), None if b in (None, "", 0) else float(b), l,
                                 float(conf or 0), d.strip() or "default", t.strip() or "default", int(n or 1),
                                 dk or "auto", dv or "auto", int(ng or 0))

        def views(trace: Trace, upto: int | None = None) -> list:
            f = page.figures(trace, upto)
            drafted = bool(trace.drafted())  # a target-only run has no γ, acceptance or verification to plot
            plots = [gr.Plot(f[k], visible=drafted or k == "timing")
                     for k in ("gamma", "acceptance", "timing", "verify", "theory")]
            return [f["output"], f["summary"], f["warning"], f["tokens"], *plots,
                    gr.Plot(f["batch"], visible=len(trace.sequences) > 1)]

        def replay_at_end(trace: Trace):
            n = len(trace.steps)
            return gr.Slider(minimum=0, maximum=max(n, 1), value=n)

        def busy():
            """Run and Compare off, Stop on, while this session's run is queued or going."""
            return [_stamp("Queued: waiting for a free worker…"), gr.Button(interactive=False),
                    gr.Button(interactive=False), gr.Button(interactive=True)]

        def idle():
            return [gr.Button(interactive=True), gr.Button(interactive=True), gr.Button(interactive=False)]

        # Gradio injects the request and the progress tracker only into positional parameters before *inputs.
        def on_run(request: gr.Request, progress=gr.Progress(), *inputs):
            task, article_text, audio_path, ref_summary, ref_transcript, measure_it, *values = inputs
            stop = stops.start(request.session_hash)
            try:
                settings = settings_from(values)
                loader = _progress_adapter(progress)
                source_input = article_text if task == page.TEXT else audio_path
                yield [_stamp("Loading models and reading the input…"), gr.skip(), gr.DownloadButton(interactive=False),
                       gr.Tabs(selected="run-results"), gr.skip(), *[gr.skip()] * len(view_outputs)]
                stream = page.stream_run(models, task, source_input, settings, loader, stop)
                yield [_stamp("Models ready. Prefill: the models read the whole input once (the longest wait "
                              "before the first iteration)…"), *[gr.skip()] * (4 + len(view_outputs))]
                trace = None
                for trace, done in stream:
                    if done:
                        page.score(trace, task, (ref_summary if task == page.TEXT else ref_transcript) or "")
                    note = (("Stopped" if trace.meta.get("stopped") else "Done") +
                            f": {trace.new_tokens} tokens in {len(trace.steps)} iterations." if done else
                            f"Decoding… iteration {len(trace.steps)}, {trace.new_tokens} tokens")
                    download = gr.DownloadButton(value=page.export(trace), interactive=True) if done else gr.skip()
                    yield [_stamp(note), trace, download, gr.skip(), replay_at_end(trace), *views(trace)]
                if trace is None or trace.meta.get("stopped") or not measure_it:
                    return
                yield [_stamp("Done. Measuring target-only on the same input and settings for the speedup…"),
                       *[gr.skip()] * (4 + len(view_outputs))]
                reference = page.measure_reference(models, references, task, source_input, settings, loader, stop)
                if reference is None:
                    yield [_stamp("Done (the target-only reference was stopped: speedup not measured)."),
                           *[gr.skip()] * (4 + len(view_outputs))]
                    return
                trace.meta["target_only"] = reference
                yield [_stamp(f"Done: {trace.new_tokens} tokens in {len(trace.steps)} iterations; speedup measured."),
                       trace, gr.DownloadButton(value=page.export(trace), interactive=True), gr.skip(), gr.skip(),
                       *views(trace)]
            except Exception as e:  # any failure is shown in the page, which stays usable
                yield [_error(e), *[gr.skip()] * (4 + len(view_outputs))]
            finally:
                stops.end(request.session_hash, stop)

        run_btn.click(busy, None, [status, *buttons], queue=False).then(
            on_run, [task_state, article, audio, reference_summary, reference_transcript, measure, *settings_inputs],
            [status, trace_state, export_btn, results, replay, *view_outputs], concurrency_limit=1,
        ).then(idle, None, buttons, queue=False)

        def on_stop(request: gr.Request):
            if stops.stop(request.session_hash, "Stop pressed"):
                return _stamp("Stopping after the current iteration…")
            return gr.skip()

        stop_btn.click(on_stop, None, status, queue=False)
        def on_unload(request: gr.Request) -> None:
            stops.stop(request.session_hash, "the browser session closed")

        demo.unload(on_unload)

        def on_compare(progress=gr.Progress(), *inputs):
            task, article_text, audio_path, n_rounds, hf, *values = inputs
            try:
                settings = settings_from(values)
                source = article_text if task == page.TEXT else audio_path
                yield [_stamp("Comparing: loading models…"), gr.Tabs(selected="compare-results"),
                       *[gr.skip()] * 5]
                stages = []

                def on_stage(name: str) -> None:
                    stages.append(name)
                    progress(None, desc=f"running {name} (run {len(stages)})")

                rows, traces, note = page.compare_modes(models, task, source, settings, _progress_adapter(progress),
                                                        on_stage, rounds=int(n_rounds), with_hf=bool(hf))
                names = list(traces)
                yield [_stamp(f"Comparison done: {int(n_rounds)} round(s), same input and seed for every run."),
                       gr.skip(), _compare_table(rows), note, compare_figure(rows), traces,
                       gr.Dropdown(choices=names, value=names[0] if names else None)]
            except Exception as e:
                yield [_error(e), *[gr.skip()] * 6]

        compare_btn.click(busy, None, [status, *buttons], queue=False).then(
            on_compare, [task_state, article, audio, rounds, with_hf, *settings_inputs],
            [status, results, compare_table, compare_note, compare_plot, compare_state, compare_pick],
            concurrency_limit=1,
        ).then(idle, None, buttons, queue=False)

        def opened(trace: Trace, how: str) -> list:
            """Show a trace in the main view with its settings and input restored, ready to export."""
            settings = page.Settings.from_meta(trace.meta)
            text = trace.meta.get("input") if trace.meta.get("task") == page.TEXT else None
            return [_stamp(how), trace, gr.DownloadButton(value=page.export(trace), interactive=True),
                    gr.Tabs(selected="run-results"), replay_at_end(trace), *views(trace),
                    *[getattr(settings, f.name) for f in dataclasses.fields(page.Settings)],
                    text if isinstance(text, str) and text.strip() else gr.skip()]

        opened_outputs = [status, trace_state, export_btn, results, replay, *view_outputs, *settings_inputs, article]

        def on_upload(file):
            if file is None:
                return [gr.skip()] * len(opened_outputs)
            path = file if isinstance(file, str) else file.name
            try:
                trace = Trace.load(path)
                views(trace)  # a trace that loads but cannot be drawn is refused too
            except (TraceFormatError, OSError, ValueError, TypeError, KeyError, ZeroDivisionError) as e:
                return [_error(e), *[gr.skip()] * (len(opened_outputs) - 1)]
            name = html.escape(Path(path).name)
            return opened(trace, f"Loaded trace {name} ({len(trace.steps)} iterations; no model was run; its settings "
                                 f"are restored).")

        trace_upload.upload(on_upload, [trace_upload], opened_outputs)

        def on_open(traces: dict, name: str):
            if not traces or name not in traces:
                return [_stamp("Run a comparison first, then pick one of its runs."),
                        *[gr.skip()] * (len(opened_outputs) - 1)]
            return opened(traces[name], f"Opened the {html.escape(name)} run of the comparison.")

        open_btn.click(on_open, [compare_state, compare_pick], opened_outputs)

        def on_replay(trace: Trace | None, upto):
            if trace is None:
                return [gr.skip()] * len(view_outputs)
            return views(trace, int(upto))

        replay.input(on_replay, [trace_state, replay], view_outputs, show_progress="hidden")
        replay.release(on_replay, [trace_state, replay], view_outputs, show_progress="hidden")

        def on_why(trace: Trace | None, picked: str):
            parts = (picked or "").split(",")
            try:
                step, seq, pos = (int(x) for x in parts[:3])
            except ValueError:
                return gr.skip()
            return why_html(trace, step, seq, pos) if trace is not None else gr.skip()

        why_select.change(on_why, [trace_state, why_select], why_panel, show_progress="hidden")

        sample_text_btn.click(lambda: sample_article(), None, article)
        sample_audio_btn.click(lambda: (SAMPLE_AUDIO, SAMPLE_TRANSCRIPT), None, [audio, reference_transcript])
        tab_text.select(lambda: page.TEXT, None, task_state)
        tab_speech.select(lambda: page.SPEECH, None, task_state)
    return demo


def _model_access(host: str, dirs: list[str] | None) -> page.ModelAccess:
    """Any local path when only this machine can reach the page; named directories otherwise."""
    if host in ("127.0.0.1", "localhost", "::1") and not dirs:
        return page.ModelAccess()
    return page.ModelAccess(tuple(Path(d).expanduser().resolve() for d in (dirs or [str(cache_dir())])))


def main() -> None:
    parser = argparse.ArgumentParser(description="Start the specviz page.")
    parser.add_argument("--host", default=os.environ.get("SPECVIZ_HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("SPECVIZ_PORT", "7860")))
    parser.add_argument("--models-dir", action="append", default=None, metavar="DIR",
                        help="on a non-local address, local model paths are accepted only under these directories "
                             "(repeatable; default: the specviz model cache)")
    args = parser.parse_args()
    demo = build(page.ModelCache(access=_model_access(args.host, args.models_dir)))
    # allowed_paths: the sample clip is served from the assets folder wherever the app is started from
    demo.queue(default_concurrency_limit=4).launch(server_name=args.host, server_port=args.port, css=CSS, js=CLICK_JS,
                                                   show_error=True, max_file_size=MAX_UPLOAD,
                                                   allowed_paths=[str(ASSETS)])


if __name__ == "__main__":
    main()
