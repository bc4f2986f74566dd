"""The two tasks, each one object: summarizing an article (text) and transcribing a clip (speech).

What differs between the tasks lives here once: the names traces record, the bundled evaluation set, the nouns
reports use, the measured defaults, how a model pair loads, how inputs become the driver's Source, how an output
is scored, and the sample input. The CLI, the page, sweeps and benchmarks look a task up (`task_of`) instead of
branching on its name.

Speech imports Whisper and text imports transformers' tokenizers: both are imported where they are used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from specviz.config import DraftDefaults, SpecConfig, default_sigmoid_range, draft_defaults
from specviz.decoding.source import Source
from specviz.models.loading import DEFAULT, Progress, _silent
from specviz.paths import ASSETS

TEXT, SPEECH = "summarize", "transcribe"  # what traces and results files record: keep these strings


@dataclass(frozen=True)
class Task:
    """One task: its plain facts as fields, its behaviour as the functions below (held, not overridden, so
    that a task stays one frozen value)."""

    name: str  # "summarize" | "transcribe": a trace's and a results file's task
    kind: str  # "text" | "speech": the bundled evaluation set's folder, the page's and the CLI's word for it
    input_noun: str  # "article" | "audio clip": what reports count
    reference_noun: str  # "summary" | "transcript": a manifest's reference key, the page's reference box
    input_key: str  # "article" | "audio": a manifest's input key, the page's input control
    input_is_file: bool  # the page and the CLI take a file path (a trace keeps its name), not the input itself
    batches: bool  # `sequences` samples of one input decode as one batch (BASS); else one sequence an input
    speech: bool  # for config's per-task measurements (sigmoid range, draft defaults)
    _load: Callable[..., Any] = field(repr=False, compare=False)
    _source: Callable[..., Source] = field(repr=False, compare=False)
    _score: Callable[[str, str], tuple[str, float]] = field(repr=False, compare=False)
    _sample: Callable[[], str] = field(repr=False, compare=False)

    @property
    def bundled(self) -> Path:
        """The bundled evaluation set (a manifest folder)."""
        return ASSETS / "eval" / self.kind

    @property
    def sigmoid_range(self) -> float:
        """Wagner et al.'s |α| = β for this task (config.default_sigmoid_range)."""
        return default_sigmoid_range(self.speech)

    @property
    def draft_defaults(self) -> DraftDefaults:
        return draft_defaults(self.speech)

    def batch(self, sequences: int) -> int:
        """Sequences decoded together for one input."""
        return sequences if self.batches else 1

    def shown(self, source_input: str) -> str:
        """What a trace keeps as its input: the article itself, a clip's file name (not its audio)."""
        return Path(source_input).name if self.input_is_file else source_input

    def load_pair(self, draft: str = DEFAULT, target: str = DEFAULT, *, device: Any = None, dtype: Any = None,
                  quantized_draft: bool | None = None, weights: str = "auto", progress: Progress = _silent) -> Any:
        """The draft/target pair, with the task's loader and its dtype default."""
        return self._load(draft, target, device=device, dtype=dtype, quantized_draft=quantized_draft, weights=weights,
                          progress=progress)

    def source(self, pair: Any, inputs: Sequence[tuple[str, Any]], cfg: SpecConfig, sequences: int = 1,
               language: str | None = "en") -> Source:
        """The driver's Source for (label, input) pairs: an article's text; a clip's path or 16 kHz samples."""
        return self._source(pair, list(inputs), cfg, sequences, language)

    def score(self, reference: str, output: str) -> tuple[str, float]:
        """(the metric's name, its value): 'rouge1' (F-measure, stemmed) for a summary, 'wer' for a transcript."""
        return self._score(reference, output)

    def sample_input(self) -> str:
        """The bundled sample: an article's text, a clip's path."""
        return self._sample()


def _load_text(draft: str, target: str, *, weights: str, **kwargs: Any) -> Any:
    from specviz.models.loading import load_pair

    return load_pair(draft, target, weights=weights, **kwargs)


def _load_speech(draft: str, target: str, *, dtype: Any, weights: str, **kwargs: Any) -> Any:
    from specviz.speech.asr import load_speech_pair

    # Whisper's loader takes the target first and loads fp32 unless told, as the CLI and the page always have;
    # `weights` picks the text target's packed GGUF blocks, which Whisper has none of
    return load_speech_pair(target, draft, dtype=dtype or "fp32", **kwargs)


def _text_source(pair: Any, inputs: list[tuple[str, Any]], cfg: SpecConfig, sequences: int,
                 language: str | None) -> Source:
    from specviz.text.source import article_source

    return article_source(pair, inputs, cfg, sequences)


def _speech_source(pair: Any, inputs: list[tuple[str, Any]], cfg: SpecConfig, sequences: int,
                   language: str | None) -> Source:
    from specviz.speech.asr import SpeechSource
    from specviz.speech.audio import load_audio

    clips = [(label, audio if isinstance(audio, np.ndarray) else load_audio(audio)) for label, audio in inputs]
    return SpeechSource(pair, clips, language, cfg.draft_vocab)


def _rouge1(reference: str, output: str) -> tuple[str, float]:
    from rouge_score import rouge_scorer

    scores = rouge_scorer.RougeScorer(["rouge1"], use_stemmer=True).score(reference, output)
    return "rouge1", scores["rouge1"].fmeasure


def _wer(reference: str, output: str) -> tuple[str, float]:
    from specviz.speech.asr import word_error_rate

    return "wer", word_error_rate(reference, output)


def _sample_article() -> str:
    from specviz.text.prompts import sample_article

    return sample_article()


SUMMARIZE = Task(TEXT, "text", "article", "summary", "article", input_is_file=False, batches=True, speech=False,
                 _load=_load_text, _source=_text_source, _score=_rouge1, _sample=_sample_article)
TRANSCRIBE = Task(SPEECH, "speech", "audio clip", "transcript", "audio", input_is_file=True, batches=False,
                  speech=True, _load=_load_speech, _source=_speech_source, _score=_wer,
                  _sample=lambda: str(ASSETS / "sample_speech.flac"))

TASKS: dict[str, Task] = {task.name: task for task in (SUMMARIZE, TRANSCRIBE)}
BY_KIND: dict[str, Task] = {task.kind: task for task in TASKS.values()}


def task_of(name: str) -> Task:
    """The task named `name` ("summarize", "transcribe"); ValueError naming the choices otherwise."""
    try:
        return TASKS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown task {name!r}; choose one of {', '.join(TASKS)}") from None


def task_of_kind(kind: str) -> Task:
    """The task whose evaluation data is `kind` ("text", "speech")."""
    try:
        return BY_KIND[kind]
    except (KeyError, TypeError):
        raise ValueError(f"unknown kind of data {kind!r}; choose one of {', '.join(BY_KIND)}") from None
