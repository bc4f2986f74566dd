"""specviz page: layout and event wiring. Everything decoding-related lives in the specviz package."""

from __future__ import annotations

import argparse
import html
import os
import time
from pathlib import Path

import gradio as gr
import pandas as pd

from specviz import page
from specviz.config import GAMMA_POLICIES, MODES
from specviz.models import cache_dir
from specviz.prompts import ASSETS, sample_article
from specviz.trace import Trace, TraceFormatError
from specviz.viz import TOKEN_CSS

SAMPLE_AUDIO = str(ASSETS / "sample_speech.flac")
SAMPLE_TRANSCRIPT = (ASSETS / "sample_speech.txt").read_text(encoding="utf-8").strip()
CSS = TOKEN_CSS + """
#status { min-height: 2.2em; }
#status .error { color: #cf222e; font-weight: 600; }
"""
# Gradio refuses bigger uploads before specviz sees them: 30 minutes of CD-quality WAV (the audio loader's own
# duration cap) is 318 MB; traces are capped at 64 MB by their loader.
MAX_UPLOAD = "512mb"
COMPARE_COLUMNS = ["name", "tokens_per_s", "tokens_per_s_per_sequence", "speedup", "alpha", "tokens_per_iteration",
                   "median_verify_ms", "equals_target_only", "output_text"]


def _progress_adapter(progress: gr.Progress):
    return lambda message, fraction: progress(fraction if fraction is not None else 0.0, desc=message)


def _stamp(message: str) -> str:
    """Status lines carry the time, so a repeated message still reads as new."""
    return f'<span class="sv-status">[{time.strftime("%H:%M:%S")}] {message}</span>'


def _error(e: Exception) -> str:
    return _stamp(f'<span class="error">⚠ {type(e).__name__}: {html.escape(str(e))}</span>')


def build(models: page.ModelCache) -> gr.Blocks:
    with gr.Blocks(title="specviz: speculative decoding you can watch") as demo:
        trace_state = gr.State(None)  # per browser session: nobody sees another user's trace
        task_state = gr.State(page.TEXT)

        gr.Markdown("# specviz · speculative decoding you can watch")
        gr.Markdown(page.device_summary(), elem_id="device-info")

        with gr.Tabs():
            with gr.Tab("Summarize", id="tab-summarize", elem_id="tab-summarize") as tab_text:
                article = gr.Textbox(label="Article", lines=8, elem_id="article-input",
                                     placeholder="Paste an article to summarize…")
                with gr.Row():
                    sample_text_btn = gr.Button("Load the sample article", elem_id="sample-article-button")
                    sequences = gr.Slider(1, 8, value=1, step=1, label="Sequences (samples decoded together as one "
                                          "batch; more than 1 needs sampling)", elem_id="num-sequences")
                    reference_summary = gr.Textbox(label="Reference summary (optional, for ROUGE-1)", lines=2,
                                                   elem_id="reference-summary")
            with gr.Tab("Transcribe", id="tab-transcribe", elem_id="tab-transcribe") as tab_speech:
                audio = gr.Audio(label="Audio", type="filepath", sources=["upload", "microphone"], elem_id="audio-input")
                with gr.Row():
                    sample_audio_btn = gr.Button("Load the sample clip", elem_id="sample-audio-button")
                    reference_transcript = gr.Textbox(label="Reference transcript (optional, for WER)", lines=2,
                                                      elem_id="reference-transcript")

        with gr.Row():
            mode = gr.Radio(list(MODES), value="exact", label="Verification mode", elem_id="mode-select")
            decoding = gr.Radio(["greedy", "sample"], value="greedy", label="Decoding", elem_id="decoding-select")
            policy = gr.Dropdown([("auto (bass for a batch, else hf)", "auto"), *[(p, p) for p in GAMMA_POLICIES]],
                                 value="auto", label="γ policy", elem_id="gamma-policy")
            gamma_init = gr.Number(0, precision=0, label="Initial γ (0 = policy default)", elem_id="gamma-init")
            max_new = gr.Slider(8, 256, value=96, step=8, label="Max new tokens", elem_id="max-new-tokens")
        with gr.Accordion("Sampling, sigmoid, lenience, drafts, models", open=False):
            with gr.Row():
                temperature = gr.Slider(0.05, 2.0, value=1.0, label="Temperature", elem_id="temperature")
                top_k = gr.Number(0, precision=0, label="Top-k (0 = off)", elem_id="top-k")
                top_p = gr.Slider(0.05, 1.0, value=1.0, label="Top-p", elem_id="top-p")
                seed = gr.Number(0, precision=0, label="Seed", elem_id="seed")
            with gr.Row():
                alpha = gr.Number(None, label="sigmoid α (0: −10⁴ text, −10³ speech)", elem_id="sigmoid-alpha")
                beta = gr.Number(None, label="sigmoid β (0: 10⁴ text, 10³ speech)", elem_id="sigmoid-beta")
                lenience = gr.Slider(0.05, 1.0, value=1.0, label="Lenience l (1 = exact)", elem_id="lenience")
                confidence = gr.Slider(0.0, 0.95, value=0.0, step=0.05, elem_id="draft-confidence",
                                       label="Stop drafting below this draft probability (0 = off)")
            with gr.Row():
                draft_kind = gr.Dropdown(
                    [("auto (the fastest measured for the task)", "auto"), ("draft model", "model"),
                     ("prompt lookup (no draft model)", "lookup"), ("prompt lookup, else the draft model", "lookup+model")],
                    value="auto", label="Who drafts", elem_id="draft-kind")
                draft_vocab = gr.Dropdown(
                    [("auto", "auto"), ("all tokens", "0"), *[(f"{k:,} + specials + prompt", str(k))
                                                              for k in (4096, 8192, 16384, 32768, 65536)]],
                    value="auto", label="Draft head vocabulary (q = 0 elsewhere; stays exact)", elem_id="draft-vocab")
                lookup_ngram = gr.Slider(0, 5, value=0, step=1, elem_id="lookup-ngram",
                                         label="Prompt lookup: shortest match before the model (0 = auto)")
            with gr.Row():
                draft = gr.Textbox("default", label="Draft (default, hub id, local path; speech: layers:0,1,2,4,5)",
                                   elem_id="draft-model")
                target = gr.Textbox("default", label="Target (default, hub id, local path)", elem_id="target-model")

        with gr.Row():
            run_btn = gr.Button("Run", variant="primary", elem_id="run-button")
            compare_btn = gr.Button("Compare all modes", elem_id="compare-button")
        status = gr.HTML('<span class="sv-status">Ready.</span>', elem_id="status")
        output = gr.Textbox(label="Output", lines=3, interactive=False, elem_id="output-text")
        summary = gr.Markdown(elem_id="run-summary")
        gr.Markdown("Each line is one iteration: accepted drafts in green, the rejected draft struck through in red, "
                    "the verifier's resampled token in blue, the bonus token in purple. Hover a token for p(x), q(x), "
                    "its acceptance probability and the uniform drawn.")
        token_view = gr.HTML(elem_id="token-view")
        with gr.Row():
            gamma_plot = gr.Plot(elem_id="gamma-plot", show_label=False)
            timing_plot = gr.Plot(elem_id="timing-plot", show_label=False)
        acceptance_plot = gr.Plot(elem_id="acceptance-plot", show_label=False)
        batch_plot = gr.Plot(elem_id="batch-plot", show_label=False)
        theory_plot = gr.Plot(elem_id="theory-plot", show_label=False)

        gr.Markdown("## Compare modes")
        compare_table = gr.Dataframe(headers=COMPARE_COLUMNS, interactive=False, wrap=True, elem_id="compare-table")
        compare_note = gr.Markdown(elem_id="compare-note")
        compare_plot = gr.Plot(elem_id="compare-plot", show_label=False)

        gr.Markdown("## Traces")
        with gr.Row():
            export_btn = gr.DownloadButton("Export trace (JSON)", value=None, interactive=False, elem_id="export-button")
            trace_upload = gr.File(label="Load a trace (JSON) to redraw it without any model", file_types=[".json"],
                                   elem_id="trace-upload")

        settings_inputs = [mode, decoding, temperature, top_k, top_p, policy, gamma_init, max_new, seed, alpha, beta,
                           lenience, confidence, draft, target, sequences, draft_kind, draft_vocab, lookup_ngram]
        view_outputs = [output, summary, token_view, gamma_plot, acceptance_plot, timing_plot, theory_plot, batch_plot]

        def settings_from(values) -> page.Settings:
            (m, dec, temp, k, p, pol, g0, mx, sd, a, b, l, conf, d, t, n, dk, dv, ng) = values
            return page.Settings(m, dec, temp, int(k or 0), p, pol, int(g0 or 0), int(mx), int(sd or 0),
                                 None if a in (None, "", 0) else float(a), None if b in (None, "", 0) else float(b), l,
                                 float(conf or 0), d.strip() or "default", t.strip() or "default", int(n or 1),
                                 dk or "auto", dv or "auto", int(ng or 0))

        def views(trace: Trace):
            f = page.figures(trace)
            return [f["output"], f["summary"], f["tokens"], f["gamma"], f["acceptance"], f["timing"], f["theory"],
                    f["batch"]]

        def on_run(task, article_text, audio_path, ref_summary, ref_transcript, *values, progress=gr.Progress()):
            try:
                settings = settings_from(values)
                loader = _progress_adapter(progress)
                yield [_stamp("Loading models and reading the input…"), gr.skip(), gr.DownloadButton(interactive=False),
                       *[gr.skip()] * len(view_outputs)]
                if task == page.TEXT:
                    stream = page.stream_summary(models, article_text, settings, loader)
                else:
                    stream = page.stream_transcript(models, audio_path, settings, loader, ref_transcript or "")
                for trace, done in stream:
                    if done and task == page.TEXT and (ref_summary or "").strip():
                        trace.meta["rouge1"] = page.rouge1(ref_summary, trace.output_text)
                    note = (f"Done: {trace.new_tokens} tokens in {len(trace.steps)} iterations." if done else
                            f"Decoding… iteration {len(trace.steps)}, {trace.new_tokens} tokens")
                    download = gr.DownloadButton(value=page.export(trace), interactive=True) if done else gr.DownloadButton()
                    yield [_stamp(note), trace, download, *views(trace)]
            except Exception as e:  # any failure is shown in the page, which stays usable
                yield [_error(e), gr.State(), gr.DownloadButton(), *[gr.skip()] * len(view_outputs)]

        # Not queued: says at once that the run waits for a worker (the queue may hold other sessions' runs).
        queued = lambda: _stamp("Queued: waiting for a free worker…")  # noqa: E731
        run_btn.click(queued, None, status, queue=False).then(on_run, [task_state, article, audio, reference_summary, reference_transcript, *settings_inputs],
                      [status, trace_state, export_btn, *view_outputs], concurrency_limit=1)

        def on_compare(task, article_text, audio_path, *values, progress=gr.Progress()):
            try:
                settings = settings_from(values)
                source = article_text if task == page.TEXT else audio_path
                stages = ["warm-up", "target-only", *MODES]
                rows, traces = page.compare_modes(
                    models, task, source, settings, _progress_adapter(progress),
                    on_stage=lambda name: progress(stages.index(name) / len(stages), desc=f"running {name}"))
                table = pd.DataFrame(rows)[COMPARE_COLUMNS].round(3)
                from specviz.viz import compare_figure

                return [_stamp("Comparison done (same input and seed for every run)."), table,
                        page.sigmoid_drift(rows, traces), compare_figure(rows)]
            except Exception as e:
                return [_error(e), gr.skip(), gr.skip(), gr.skip()]

        compare_btn.click(queued, None, status, queue=False).then(on_compare, [task_state, article, audio, *settings_inputs],
                          [status, compare_table, compare_note, compare_plot], concurrency_limit=1)

        def on_upload(file):
            if file is None:
                return [gr.skip()] * (2 + len(view_outputs))
            path = file if isinstance(file, str) else file.name
            try:
                trace = Trace.load(path)
                drawn = views(trace)  # inside the try: a trace that loads but cannot be drawn is refused too
            except (TraceFormatError, OSError, ValueError, TypeError, KeyError, ZeroDivisionError) as e:
                return [_error(e), gr.skip(), *[gr.skip()] * len(view_outputs)]
            name = Path(path).name
            return [_stamp(f"Loaded trace {html.escape(name)} ({len(trace.steps)} iterations; no model was run)."), trace,
                    *drawn]

        trace_upload.upload(on_upload, [trace_upload], [status, trace_state, *view_outputs])

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
    demo.queue(default_concurrency_limit=4).launch(server_name=args.host, server_port=args.port, css=CSS,
                                                   show_error=True, max_file_size=MAX_UPLOAD)


if __name__ == "__main__":
    main()
