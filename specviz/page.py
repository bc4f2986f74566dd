"""What the Gradio page does, without Gradio: load models once, stream runs, render a trace, compare modes.

app.py lays the page out and wires events to these functions. Each browser session keeps its own trace
(in the page's state); models are shared read-only across sessions and loaded once per name.
"""

from __future__ import annotations

import dataclasses
import html
import json
import os
import queue
import re
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from . import viz
from .audio import load_audio
from .compare import compare, source_runner
from .config import SamplingConfig, SpecConfig, default_sigmoid_range, draft_defaults
from .engine import Source
from .gamma import default_policy
from .models import DEFAULT, ModelLoadError, ModelPair, Progress, load_pair
from .prompts import InputError, check_article_size
from .records import Iteration
from .runs import builder_for, records
from .text import article_source
from .trace import Trace
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
    gamma_policy: str = "auto"  # auto: bass for a batch, hf for one sequence
    gamma_init: int = 0  # 0: the policy's default
    max_new_tokens: int = 96
    seed: int = 0
    sigmoid_alpha: float | None = None  # None: Wagner et al.'s default for the task
    sigmoid_beta: float | None = None
    lenience: float = 1.0
    draft_confidence: float = 0.0
    draft: str = DEFAULT
    target: str = DEFAULT
    sequences: int = 1  # samples of the article decoded together (text only)
    draft_kind: str = "auto"  # auto: the task's measured default (config.draft_defaults)
    draft_vocab: str = "auto"  # "auto", or a token count ("0": the whole vocabulary)
    lookup_ngram: int = 0  # 0: the task's default

    def spec(self, task: str) -> SpecConfig:
        scale = default_sigmoid_range(task == SPEECH)
        drafts = draft_defaults(task == SPEECH)
        sampling = SamplingConfig() if self.decoding == "greedy" else SamplingConfig(
            self.temperature, int(self.top_k), self.top_p)
        batch = self.sequences if task == TEXT else 1
        policy = default_policy(batch) if self.gamma_policy == "auto" else self.gamma_policy
        return SpecConfig(
            mode=self.mode, sampling=sampling, gamma_policy=policy,
            gamma_init=int(self.gamma_init) or None, max_new_tokens=int(self.max_new_tokens), seed=int(self.seed),
            lenience=self.lenience, draft_confidence=self.draft_confidence,
            sigmoid_alpha=-scale if self.sigmoid_alpha is None else self.sigmoid_alpha,
            sigmoid_beta=scale if self.sigmoid_beta is None else self.sigmoid_beta,
            draft_kind=drafts.draft_kind if self.draft_kind == "auto" else self.draft_kind,
            draft_vocab=drafts.draft_vocab if self.draft_vocab == "auto" else int(self.draft_vocab),
            lookup_ngram=int(self.lookup_ngram) or drafts.lookup_ngram,
        )


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


@dataclass(frozen=True)
class ModelAccess:
    """Which model names the page takes from its visitors.

    On localhost the visitor is the operator: any hub id or local path. On a public address local paths are
    accepted only under directories the operator named (--models-dir), and the refusal reads the same
    whether or not the path exists, so the page cannot be used to probe the server's disk.
    """

    allowed_dirs: tuple[Path, ...] | None = None  # None: any local path

    def check(self, name: str, role: str) -> None:
        if name == DEFAULT or (role == "draft" and name.startswith("layers:")) or self.allowed_dirs is None:
            return
        if _HUB_ID.match(name) and ".." not in name and not Path(name).expanduser().exists():
            return  # a hub id, which transformers resolves from its own cache or the hub
        real = Path(name).expanduser().resolve()
        if not any(real == d or d in real.parents for d in self.allowed_dirs):
            raise ModelLoadError(f"the {role} model {name!r} is not accepted here: this server takes the default "
                                 "models, hub ids, and local models under the directories it was started with "
                                 "(--models-dir)")


class ModelCache:
    """Loaded pairs by name, shared read-only by all sessions.

    One lock per pair keeps two sessions from loading the same pair twice without making a session that
    wants another pair wait for a slow load; the short dictionary lock only guards the lock table.
    """

    def __init__(self, loader: Callable[..., Any] = load_pair, speech_loader: Callable[..., Any] | None = None,
                 access: ModelAccess = ModelAccess()):
        self._text_loader, self._speech_loader, self.access = loader, speech_loader, access
        self._pairs: dict[tuple, Any] = {}
        self._key_locks: dict[tuple, threading.Lock] = {}
        self._table_lock = threading.Lock()

    def text(self, draft: str, target: str, progress: Progress) -> ModelPair:
        self.access.check(draft, "draft")
        self.access.check(target, "target")
        return self._get((TEXT, draft, target), lambda: self._text_loader(draft, target, progress=progress))

    def speech(self, draft: str, target: str, progress: Progress):
        from .asr import load_speech_pair

        self.access.check(draft, "draft")
        self.access.check(target, "target")
        loader = self._speech_loader or load_speech_pair
        return self._get((SPEECH, draft, target), lambda: loader(target, draft, dtype="fp32", progress=progress))

    def _get(self, key: tuple, load: Callable[[], Any]):
        with self._table_lock:
            key_lock = self._key_locks.setdefault(key, threading.Lock())
        with key_lock:
            if key not in self._pairs:
                self._pairs[key] = load()
            return self._pairs[key]


def device_summary() -> str:
    if torch.cuda.is_available():
        kernels = "CuPy kernels active" if kernels_active() else "torch path (CuPy kernels unavailable)"
        return f"GPU: {torch.cuda.get_device_name(0)} · verification: {kernels}"
    return f"CPU ({torch.get_num_threads()} threads) · verification: torch path"


def _streamed(source: Source, cfg: SpecConfig, meta: dict[str, Any]) -> Iterator[tuple[Trace, bool]]:
    """Decode in a worker thread; yield (trace so far, finished) as iterations arrive.

    The worker only produces immutable records and puts them on a queue; this generator, in the page's
    thread, owns the TraceBuilder, so the trace it yields is never touched by another thread.
    """
    updates: queue.Queue = queue.Queue()
    builder = builder_for(source, cfg, meta=meta)

    def work() -> None:
        try:
            for event in records(source, cfg):
                updates.put(event)
        except BaseException as e:  # re-raised in the page's thread, where the page reports it
            updates.put(_Failure(e))
        finally:
            updates.put(None)

    threading.Thread(target=work, daemon=True).start()
    while (item := updates.get()) is not None:
        if isinstance(item, _Failure):
            raise item.error
        builder.add(item)
        if isinstance(item, Iteration):
            yield builder.trace, False
    yield builder.trace, True


@dataclass(frozen=True)
class _Failure:
    error: BaseException


def _article_source(models: ModelCache, article: str, settings: Settings, cfg: SpecConfig,
                    progress: Progress) -> Source:
    if not article or not article.strip():
        raise InputError("the article is empty: paste some text or load the sample")
    check_article_size(article)  # before minutes go into loading models
    if not 1 <= settings.sequences <= 8:
        raise InputError(f"the page decodes 1 to 8 sequences at once, not {settings.sequences}")
    pair = models.text(settings.draft, settings.target, progress)
    return article_source(pair, [("article", article)], cfg, settings.sequences)


def _speech_source(models: ModelCache, audio_path: str | None, settings: Settings, cfg: SpecConfig,
                   progress: Progress) -> Source:
    from .asr import SpeechSource

    if not audio_path:
        raise InputError("no audio: upload or record a clip, or load the sample")
    audio = load_audio(audio_path)
    pair = models.speech(settings.draft, settings.target, progress)
    return SpeechSource(pair, [(Path(audio_path).name, audio)], draft_vocab=cfg.draft_vocab)


def stream_summary(models: ModelCache, article: str, settings: Settings, progress: Progress) -> Iterator[tuple[Trace, bool]]:
    cfg = settings.spec(TEXT)
    source = _article_source(models, article, settings, cfg, progress)
    return _streamed(source, cfg, {"input": article})


def stream_transcript(models: ModelCache, audio_path: str | None, settings: Settings, progress: Progress,
                      reference: str = "") -> Iterator[tuple[Trace, bool]]:
    from .asr import word_error_rate

    cfg = settings.spec(SPEECH)
    source = _speech_source(models, audio_path, settings, cfg, progress)
    for trace, done in _streamed(source, cfg, {"input": Path(audio_path).name}):
        if done and reference.strip():
            trace.meta["reference"] = reference
            trace.meta["wer"] = word_error_rate(reference, trace.output_text)
        yield trace, done


def compare_modes(models: ModelCache, task: str, source: str | None, settings: Settings, progress: Progress,
                  on_stage: Callable[[str], None]) -> tuple[list[dict], dict[str, Trace]]:
    """Target-only, baseline, exact and sigmoid on the same input, batch and seed."""
    cfg = settings.spec(task)
    if task == TEXT:
        decoded = _article_source(models, source, settings, cfg, progress)
    else:
        decoded = _speech_source(models, source, settings, cfg, progress)
    rows, traces = compare(source_runner(decoded), dataclasses.replace(cfg, mode="exact"), on_stage=on_stage)
    return [r.as_dict() for r in rows], traces


def sigmoid_drift(rows: list[dict], traces: dict[str, Trace]) -> str:
    """How far sigmoid strays from exact on this input: output agreement and acceptance inflation."""
    exact, sigmoid = traces.get("exact"), traces.get("sigmoid")
    if not exact or not sigmoid:
        return ""
    a_ids = [t for ids in exact.outputs for t in ids]
    b_ids = [t for ids in sigmoid.outputs for t in ids]
    same = sum(a == b for a, b in zip(a_ids, b_ids))
    n = max(len(a_ids), len(b_ids), 1)
    first_diff = next((i for i, (a, b) in enumerate(zip(a_ids, b_ids)) if a != b), None)
    ra, rb = exact.acceptance_rate() or 0.0, sigmoid.acceptance_rate() or 0.0
    return (f"**sigmoid vs exact**: {same}/{n} output tokens identical"
            + (f" (first difference at token {first_diff})" if first_diff is not None else "")
            + f"; acceptance rate {rb:.3f} vs {ra:.3f} ({rb - ra:+.3f}).")


def _number(meta: dict, key: str) -> float | None:
    value = meta.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def summary_markdown(trace: Trace) -> str:
    s = trace.summary()
    lines = [f"**{html.escape(str(s['mode']))}** · {s['new_tokens']} tokens in {s['total_s']:.2f} s "
             f"(prefill {s['prefill_s']:.2f} s) · **{s['tokens_per_s']:.2f} tokens/s** · "
             f"{s['target_forward_passes']} target forward passes"]
    if s["sequences"] > 1:
        line = (f"{s['sequences']} sequences, batch of {trace.batch_size} · {s['tokens_per_s_per_sequence']:.2f} tokens/s "
                f"per sequence (each sequence's tokens over the time until it finished)")
        if s.get("padding_fraction") is not None:
            line += (f" · raggedness: {100 * s['padding_fraction']:.1f}% of the tokens fed were padding, "
                     f"{100 * (s.get('cache_hole_fraction') or 0):.1f}% of KV-cache entries were masked holes")
        lines.append(line)
    if "alpha" in s:
        lines.append(f"α ≈ {s['alpha']:.3f} · acceptance rate {s['acceptance_rate']:.3f} · tokens/iteration per sequence "
                     f"{s['tokens_per_iteration']:.2f} (Leviathan predicts {s['predicted_tokens_per_iteration']:.2f}) · "
                     f"median verify {s['median_verify_ms']:.2f} ms")
    if (wer := _number(trace.meta, "wer")) is not None:
        lines.append(f"WER against the reference: {wer:.3f}")
    if (rouge := _number(trace.meta, "rouge1")) is not None:
        lines.append(f"ROUGE-1 F against the reference: {rouge:.3f}")
    names = {k: html.escape(str(trace.meta.get(k)))[:200] for k in ("draft", "target", "device", "dtype")}
    lines.append(f"draft {names['draft']} → target {names['target']} on {names['device']}, {names['dtype']}")
    if "alpha" in s:
        lines.append(draft_line(trace, s))
    return "  \n".join(lines)


def draft_line(trace: Trace, s: dict[str, Any]) -> str:
    """Which draft ran, the vocabulary its head scored, and what a draft step cost against a target call."""
    config = trace.meta.get("config", {})
    kind = str(config.get("draft_kind", "model"))
    vocab, size = _number(trace.meta, "vocab_size"), _number(trace.meta, "draft_vocab_size")
    parts = [f"drafted by {html.escape(kind)[:40]}"]
    if s.get("lookup_share") and kind != "lookup":
        parts.append(f"prompt lookup drafted {100 * s['lookup_share']:.0f}% of the proposals")
    if kind != "lookup" and size is not None and vocab is not None:
        parts.append(f"draft head over {int(size):,} of {int(vocab):,} tokens" if size < vocab
                     else f"draft head over all {int(vocab):,} tokens")
    if s.get("cost_ratio") is not None:
        parts.append(f"measured c = {s['cost_ratio']:.2f} (seconds per draft step / per target call)")
    return " · ".join(parts)


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
        "batch": viz.batch_figure(trace),
        "summary": summary_markdown(trace),
        "output": trace.output_text,
    }


EXPORT_DIR = Path(tempfile.gettempdir()) / "specviz-exports"
EXPORTS_KEPT = 64  # the newest exports stay downloadable; older ones are deleted so the disk does not fill


def export(trace: Trace) -> str:
    """Write the trace as indented JSON for a download, named after its mode and time; returns the path.

    Written to a temporary name and renamed when complete, so a failed export leaves no partial file.
    """
    EXPORT_DIR.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    mode = "".join(c for c in str(trace.meta.get("mode", "run")) if c.isalnum() or c == "-")[:20] or "run"
    handle = tempfile.NamedTemporaryFile("w", suffix=".part", prefix=f"specviz-{mode}-{stamp}-", dir=EXPORT_DIR,
                                         delete=False, encoding="utf-8")
    try:
        with handle:
            json.dump(trace.to_dict(), handle, ensure_ascii=False, allow_nan=False, indent=1)
        final = Path(handle.name).with_suffix(".json")
        os.replace(handle.name, final)
    except BaseException:
        Path(handle.name).unlink(missing_ok=True)
        raise
    old = sorted(EXPORT_DIR.glob("specviz-*.json"), key=lambda p: p.stat().st_mtime)[:-EXPORTS_KEPT]
    for path in old:
        path.unlink(missing_ok=True)
    return str(final)
