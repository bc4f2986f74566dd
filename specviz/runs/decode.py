"""The one entry point the CLI, the page and `compare` share: decode a source into a trace.

`records` starts the driver and hands out its records (with the metadata a trace needs); `run` consumes
them into a Trace in the caller's thread. The page runs `records` in a worker thread and builds its own
trace from the records it receives, so no trace object is shared between threads.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from specviz import native
from specviz.config import SpecConfig
from specviz.decoding.engine import generate
from specviz.decoding.records import Event
from specviz.decoding.source import Source
from specviz.traces.trace import Trace, TraceBuilder

DEFAULT_BATCH = 8  # sequences decoded together at most; more are decoded in consecutive groups


def trace_meta(source: Source, cfg: SpecConfig, *, target_only: bool, batch_size: int,
               extra: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"mode": "target-only" if target_only else cfg.mode, "config": cfg.to_dict(),
            "batch_size": min(batch_size, len(source.sequences)), **source.meta(), **(extra or {})}


def builder_for(source: Source, cfg: SpecConfig, *, target_only: bool = False, batch_size: int = DEFAULT_BATCH,
                meta: dict[str, Any] | None = None) -> TraceBuilder:
    return TraceBuilder(trace_meta(source, cfg, target_only=target_only, batch_size=batch_size, extra=meta),
                        source.sequences, source.detokenize)


def records(source: Source, cfg: SpecConfig, *, target_only: bool = False,
            batch_size: int = DEFAULT_BATCH) -> Iterator[Event]:
    # the C++ verification passes are built (first run on a machine) or loaded before the run's clock starts,
    # not inside its first verification
    native.available()
    return generate(source, cfg, target_only=target_only, batch_size=batch_size)


def run(source: Source, cfg: SpecConfig, *, target_only: bool = False, batch_size: int = DEFAULT_BATCH,
        meta: dict[str, Any] | None = None, on_event: Callable[[Event, Trace], None] | None = None) -> Trace:
    """Decode every sequence of `source`; on_event sees each record and the trace so far, in this thread."""
    builder = builder_for(source, cfg, target_only=target_only, batch_size=batch_size, meta=meta)
    for event in records(source, cfg, target_only=target_only, batch_size=batch_size):
        builder.add(event)
        if on_event:
            on_event(event, builder.trace)
    return builder.trace


def transcribe(pair, clips: list[tuple[str, Any]], cfg: SpecConfig, *, language: str | None = "en",
               target_only: bool = False, batch_size: int = DEFAULT_BATCH, meta: dict[str, Any] | None = None,
               on_event: Callable[[Event, Trace], None] | None = None) -> Trace:
    """Speech: (name, 16 kHz mono samples) per clip; every 30 s window is one sequence of the batch."""
    from specviz.speech.asr import SpeechSource

    return run(SpeechSource(pair, clips, language, cfg.draft_vocab), cfg, target_only=target_only, batch_size=batch_size, meta=meta,
               on_event=on_event)


def summarize(pair, articles: list[tuple[str, str]], cfg: SpecConfig, *, num_sequences: int = 1,
              target_only: bool = False, batch_size: int = DEFAULT_BATCH, meta: dict[str, Any] | None = None,
              on_event: Callable[[Event, Trace], None] | None = None) -> Trace:
    """Text: (label, article) per input, num_sequences samples each."""
    from specviz.text.source import article_source

    return run(article_source(pair, articles, cfg, num_sequences), cfg, target_only=target_only,
               batch_size=batch_size, meta=meta, on_event=on_event)
