"""What the Gradio page does, without Gradio: load models once, stream runs, render a trace, compare modes.

app.py lays the page out and wires events to these functions. Each browser session keeps its own trace
(in the page's state); models are shared read-only across sessions and loaded once per name.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from . import viz
from .audio import load_audio
from .compare import compare, text_runner
from .config import SamplingConfig, SpecConfig, default_sigmoid_range
from .engine import run_speculative
from .models import DEFAULT, ModelPair, Progress, load_pair
from .prompts import InputError, max_prompt_tokens, summarization_prompt
from .trace import IterationRecord, Trace
from .verify import kernels_active

TEXT, SPEECH = "summarize", "transcribe"


@dataclass(frozen=True)
class Settings:
    """The page's controls, as plain values."""

    mode: str = "exact"
    decoding: str = "greedy"  # greedy | sample
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    gamma_policy: str = "hf"
    gamma_init: int = 0  # 0: the policy's default
    max_new_tokens: int = 96
    seed: int = 0
    sigmoid_alpha: float | None = None  # None: Wagner et al.'s default for the task
    sigmoid_beta: float | None = None
    lenience: float = 1.0
    draft_confidence: float = 0.0
    draft: str = DEFAULT
    target: str = DEFAULT

    def spec(self, task: str) -> SpecConfig:
        scale = default_sigmoid_range(task == SPEECH)
        sampling = SamplingConfig() if self.decoding == "greedy" else SamplingConfig(
            self.temperature, int(self.top_k), self.top_p)
        return SpecConfig(
            mode=self.mode, sampling=sampling, gamma_policy=self.gamma_policy,
            gamma_init=int(self.gamma_init) or None, max_new_tokens=int(self.max_new_tokens), seed=int(self.seed),
            lenience=self.lenience, draft_confidence=self.draft_confidence,
            sigmoid_alpha=-scale if self.sigmoid_alpha is None else self.sigmoid_alpha,
            sigmoid_beta=scale if self.sigmoid_beta is None else self.sigmoid_beta,
        )


class ModelCache:
    """Loaded pairs by name, shared by all sessions; a lock keeps two sessions from loading one twice."""

    def __init__(self, loader: Callable[..., Any] = load_pair, speech_loader: Callable[..., Any] | None = None):
        self._text_loader, self._speech_loader = loader, speech_loader
        self._pairs: dict[tuple, Any] = {}
        self._lock = threading.Lock()

    def text(self, draft: str, target: str, progress: Progress) -> ModelPair:
        return self._get((TEXT, draft, target), lambda: self._text_loader(draft, target, progress=progress))

    def speech(self, draft: str, target: str, progress: Progress):
        from .asr import load_speech_pair

        loader = self._speech_loader or load_speech_pair
        return self._get((SPEECH, draft, target), lambda: loader(target, draft, dtype="fp32", progress=progress))

    def _get(self, key: tuple, load: Callable[[], Any]):
        with self._lock:
            if key not in self._pairs:
                self._pairs[key] = load()
            return self._pairs[key]


def device_summary() -> str:
    if torch.cuda.is_available():
        kernels = "CuPy kernels active" if kernels_active() else "torch path (CuPy kernels unavailable)"
        return f"GPU: {torch.cuda.get_device_name(0)} · verification: {kernels}"
    return f"CPU ({torch.get_num_threads()} threads) · verification: torch path"


def _text_prompt(pair: ModelPair, article: str, cfg: SpecConfig) -> list[int]:
    context = getattr(pair.target.config, "max_position_embeddings", 32768)
    return summarization_prompt(pair.tokenizer, article, max_prompt_tokens(context, cfg.max_new_tokens))


def _streamed(job: Callable[[Callable[[IterationRecord, Trace], None]], Trace]) -> Iterator[tuple[Trace, bool]]:
    """Run job(on_iteration) in a thread; yield (trace so far, finished) as iterations arrive."""
    updates: queue.Queue = queue.Queue()
    outcome: dict[str, Any] = {}

    def work() -> None:
        try:
            outcome["trace"] = job(lambda record, trace: updates.put(trace))
        except BaseException as e:  # re-raised in the caller's thread, where the page reports it
            outcome["error"] = e
        finally:
            updates.put(None)

    threading.Thread(target=work, daemon=True).start()
    while (item := updates.get()) is not None:
        yield item, False
    if "error" in outcome:
        raise outcome["error"]
    yield outcome["trace"], True


def stream_summary(models: ModelCache, article: str, settings: Settings, progress: Progress) -> Iterator[tuple[Trace, bool]]:
    if not article or not article.strip():
        raise InputError("the article is empty: paste some text or load the sample")
    cfg = settings.spec(TEXT)
    pair = models.text(settings.draft, settings.target, progress)
    prompt = _text_prompt(pair, article, cfg)
    return _streamed(lambda cb: run_speculative(pair, prompt, cfg, on_iteration=cb, meta={"task": TEXT, "input": article}))


def stream_transcript(models: ModelCache, audio_path: str | None, settings: Settings, progress: Progress,
                      reference: str = "") -> Iterator[tuple[Trace, bool]]:
    from .asr import transcribe, word_error_rate

    if not audio_path:
        raise InputError("no audio: upload or record a clip, or load the sample")
    audio = load_audio(audio_path)
    cfg = settings.spec(SPEECH)
    pair = models.speech(settings.draft, settings.target, progress)

    def job(cb):
        trace = transcribe(pair, audio, cfg, on_iteration=cb, meta={"input": Path(audio_path).name})
        if reference.strip():
            trace.meta["reference"] = reference
            trace.meta["wer"] = word_error_rate(reference, trace.output_text)
        return trace

    return _streamed(job)


def compare_modes(models: ModelCache, task: str, source: str | None, settings: Settings, progress: Progress,
                  on_stage: Callable[[str], None]) -> tuple[list[dict], dict[str, Trace]]:
    """Target-only, baseline, exact and sigmoid on the same input and seed."""
    cfg = settings.spec(task)
    if task == TEXT:
        if not source or not source.strip():
            raise InputError("the article is empty: paste some text or load the sample")
        pair = models.text(settings.draft, settings.target, progress)
        run = text_runner(pair, _text_prompt(pair, source, cfg))
    else:
        from .asr import transcribe

        if not source:
            raise InputError("no audio: upload or record a clip, or load the sample")
        audio = load_audio(source)
        pair = models.speech(settings.draft, settings.target, progress)
        run = lambda c, target_only: transcribe(pair, audio, c, target_only=target_only)  # noqa: E731
    rows, traces = compare(run, dataclasses.replace(cfg, mode="exact"), on_stage=on_stage)
    return [r.as_dict() for r in rows], traces


def sigmoid_drift(rows: list[dict], traces: dict[str, Trace]) -> str:
    """How far sigmoid strays from exact on this input: output agreement and acceptance inflation."""
    exact, sigmoid = traces.get("exact"), traces.get("sigmoid")
    if not exact or not sigmoid:
        return ""
    same = sum(a == b for a, b in zip(exact.output_ids, sigmoid.output_ids))
    n = max(len(exact.output_ids), len(sigmoid.output_ids), 1)
    first_diff = next((i for i, (a, b) in enumerate(zip(exact.output_ids, sigmoid.output_ids)) if a != b), None)
    ra, rb = exact.acceptance_rate() or 0.0, sigmoid.acceptance_rate() or 0.0
    return (f"**sigmoid vs exact**: {same}/{n} output tokens identical"
            + (f" (first difference at token {first_diff})" if first_diff is not None else "")
            + f"; acceptance rate {rb:.3f} vs {ra:.3f} ({rb - ra:+.3f}).")


def summary_markdown(trace: Trace) -> str:
    s = trace.summary()
    lines = [f"**{s['mode']}** · {s['new_tokens']} tokens in {s['total_s']:.2f} s · **{s['tokens_per_s']:.2f} tokens/s** · "
             f"{s['target_forward_passes']} target forward passes"]
    if "alpha" in s:
        lines.append(f"α ≈ {s['alpha']:.3f} · acceptance rate {s['acceptance_rate']:.3f} · tokens/iteration "
                     f"{s['tokens_per_iteration']:.2f} (Leviathan predicts {s['predicted_tokens_per_iteration']:.2f}) · "
                     f"median verify {s['median_verify_ms']:.2f} ms")
    if "wer" in trace.meta:
        lines.append(f"WER against the reference: {trace.meta['wer']:.3f}")
    if "rouge1" in trace.meta:
        lines.append(f"ROUGE-1 F against the reference: {trace.meta['rouge1']:.3f}")
    lines.append(f"draft `{trace.meta.get('draft')}` → target `{trace.meta.get('target')}` on {trace.meta.get('device')}, "
                 f"{trace.meta.get('dtype')}")
    return "  \n".join(lines)


def rouge1(reference: str, summary: str) -> float:
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rouge1"], use_stemmer=True).score(reference, summary)["rouge1"].fmeasure


def figures(trace: Trace) -> dict[str, Any]:
    return {
        "tokens": viz.token_html(trace),
        "gamma": viz.gamma_figure(trace),
        "acceptance": viz.acceptance_figure(trace),
        "timing": viz.timing_figure(trace),
        "theory": viz.theory_figure(trace),
        "summary": summary_markdown(trace),
        "output": trace.output_text,
    }


def export(trace: Trace) -> str:
    """Write the trace to a fresh temporary JSON file and return its path (for a download)."""
    handle = tempfile.NamedTemporaryFile("w", suffix=".json", prefix="specviz-trace-", delete=False, encoding="utf-8")
    with handle:
        json.dump(trace.to_dict(), handle, ensure_ascii=False, allow_nan=False)
    return handle.name
