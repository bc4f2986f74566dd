"""Measurements behind the figures in docs/benchmarks.md (not tests: timings with warm-up and medians)."""

from __future__ import annotations

import statistics
from typing import Callable

import numpy as np

from .config import SpecConfig
from .trace import Trace


def _median_of(run: Callable[[], Trace], repeat: int) -> tuple[Trace, float]:
    """Median decode time (prefill excluded) over `repeat` runs, and the last run's trace."""
    times, trace = [], None
    for _ in range(repeat):
        trace = run()
        times.append(trace.total_s - trace.prefill_s)
    return trace, statistics.median(times)


def speech_draft_layers(pair, audio: np.ndarray, layer_sets: list[tuple[int, ...]], cfg: SpecConfig,
                        reference_text: str | None = None, repeat: int = 3) -> list[dict]:
    """Acceptance and speed of self-speculative drafts made of different subsets of the target's decoder layers."""
    from .asr import layer_draft, transcribe, word_error_rate

    transcribe(pair, audio, cfg, target_only=True)  # warm-up, untimed
    reference, reference_s = _median_of(lambda: transcribe(pair, audio, cfg, target_only=True), repeat)
    rows = [{"draft": "target-only", "decode_s": reference_s, "speedup": 1.0,
             "wer": word_error_rate(reference_text, reference.output_text) if reference_text else None}]
    original = pair.draft
    try:
        for layers in layer_sets:
            pair.draft = layer_draft(pair.target, layers)
            trace, seconds = _median_of(lambda: transcribe(pair, audio, cfg), repeat)
            s = trace.summary()
            rows.append({"draft": f"layers {list(layers)}", "alpha": s["alpha"], "acceptance_rate": s["acceptance_rate"],
                         "tokens_per_iteration": s["tokens_per_iteration"], "decode_s": seconds,
                         "speedup": reference_s / seconds, "equals_target_only": trace.output_ids == reference.output_ids})
    finally:
        pair.draft = original
    return rows
