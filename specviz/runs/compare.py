"""Run target-only and every verification mode on one input and seed, and tabulate them side by side."""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from specviz.config import MODES, SpecConfig
from specviz.decoding.source import Source
from specviz.models.loading import ModelPair
from specviz.traces.prediction import predict
from specviz import speedup
from specviz.runs.decode import DEFAULT_BATCH, run
from specviz.speedup import Speedup
from specviz.traces.trace import SequenceTrace, Trace


@dataclass(frozen=True)
class Row:
    """One run of a comparison, over its rounds: the median run's facts and the per-round speedups' spread."""

    name: str
    tokens_per_s: float  # median over rounds of all sequences' tokens over the run's wall time
    tokens_per_s_per_sequence: float  # mean over sequences of tokens over the time until it finished
    # Medians over rounds of the round's speedup.measured over target-only's in the same round (same input
    # and seed): end to end (prefill included), with its lowest and highest round, and decoding alone.
    speedup_end_to_end: float
    speedup_end_to_end_min: float
    speedup_end_to_end_max: float
    speedup_decode: float
    alpha: float | None
    tokens_per_iteration: float | None
    median_verify_ms: float | None
    equals_target_only: bool
    new_tokens: int
    total_s: float
    output_text: str
    tokens_per_s_runs: list[float]  # one per round, in round order
    decode_tokens_per_s: float  # the median run's tokens over its decoding time (prefill left out); the median
    # run (by wall time) also gives the row's α, tokens per iteration, verify time and output
    predicted_speedup: float | None = None  # what the median run's measured call costs predict (specviz.traces.prediction)

    def to_dict(self) -> dict:
        """For a results file (the CLI's --json)."""
        return dataclasses.asdict(self)


def _round_speedups(runs: list[Trace], references: list[Trace]) -> list[Speedup]:
    """Round r's run over target-only's round r; a round whose reference decoded nothing counts as 0."""
    out = []
    for t, ref in zip(runs, references):
        s = speedup.measured(t.decode_tokens_per_s, t.tokens_per_s, ref.decode_tokens_per_s, ref.tokens_per_s)
        out.append(s or Speedup(decode=0.0, end_to_end=0.0))
    return out


def _row(name: str, runs: list[Trace], references: list[Trace]) -> Row:
    """One row from a run's rounds."""
    trace = _median_trace(runs)
    s = trace.summary()
    rounds = _round_speedups(runs, references)
    end_to_end = sorted(r.end_to_end for r in rounds)
    reference = _median_trace(references)
    return Row(
        name=name,
        tokens_per_s=statistics.median(t.tokens_per_s for t in runs),
        tokens_per_s_per_sequence=trace.per_sequence_tokens_per_s(),
        speedup_end_to_end=statistics.median(end_to_end),
        speedup_end_to_end_min=end_to_end[0],
        speedup_end_to_end_max=end_to_end[-1],
        speedup_decode=statistics.median(r.decode for r in rounds),
        alpha=s.get("alpha"),
        tokens_per_iteration=s.get("tokens_per_iteration"),
        median_verify_ms=s.get("median_verify_ms"),
        equals_target_only=trace.outputs == reference.outputs,
        new_tokens=trace.new_tokens,
        total_s=trace.total_s,
        output_text=trace.output_text,
        tokens_per_s_runs=[t.tokens_per_s for t in runs],
        decode_tokens_per_s=trace.decode_tokens_per_s,
        predicted_speedup=_predicted(runs, references),
    )


def _predicted(runs: list[Trace], references: list[Trace]) -> float | None:
    """The median over rounds of what round r's costs and α predict against round r's target-only decoding speed:
    paired as the measured speedup is (the median of per-round ratios), since the host's speed drifts between
    rounds by more than the prediction's own error (a batch of 4: 0.86× predicted from the median run against
    the median reference, 1.03× measured; round by round the predictions were within 3%)."""
    predictions = [p.speedup for t, ref in zip(runs, references)
                   if (p := predict(t, ref.decode_tokens_per_s)) is not None]
    return statistics.median(predictions) if predictions else None


def noise(rows: list[Row]) -> float:
    """How noisy a comparison is: the largest (max − min) / median of tokens/s over rounds among its rows
    (0 with one round)."""
    spreads = [(max(r.tokens_per_s_runs) - min(r.tokens_per_s_runs)) / statistics.median(r.tokens_per_s_runs)
               for r in rows if r.tokens_per_s_runs and statistics.median(r.tokens_per_s_runs) > 0]
    return max(spreads, default=0.0)


@torch.inference_mode()
def run_hf_assisted(pair: ModelPair, prompt_ids: list[int], cfg: SpecConfig, confidence_threshold: float) -> Trace:
    """transformers' generate(assistant_model=...) on the same pair, γ start and schedule, timed like ours."""
    assistant_config = copy.deepcopy(pair.draft.generation_config)
    gc = pair.draft.generation_config
    gc.num_assistant_tokens = cfg.gamma_init or 5
    gc.num_assistant_tokens_schedule = "heuristic" if cfg.gamma_policy == "hf" else "constant"
    gc.assistant_confidence_threshold = confidence_threshold
    try:
        return _run_hf_generate(pair, prompt_ids, cfg, {"mode": "hf-assisted", "confidence_threshold": confidence_threshold},
                                assistant_model=pair.draft)
    finally:
        pair.draft.generation_config = assistant_config


@torch.inference_mode()
def run_hf_prompt_lookup(pair: ModelPair, prompt_ids: list[int], cfg: SpecConfig, tokens: int = 10) -> Trace:
    """transformers' prompt lookup decoding (generate(prompt_lookup_num_tokens=...)): n-gram drafts, no draft
    model; its own defaults otherwise (matches of up to 2 tokens)."""
    return _run_hf_generate(pair, prompt_ids, cfg, {"mode": "hf-prompt-lookup", "prompt_lookup_num_tokens": tokens},
                            prompt_lookup_num_tokens=tokens)


def _run_hf_generate(pair: ModelPair, prompt_ids: list[int], cfg: SpecConfig, meta: dict, **generate_kwargs) -> Trace:
    sampling = cfg.sampling
    kwargs = dict(do_sample=False) if sampling.greedy else dict(
        do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k or None, top_p=sampling.top_p)
    input_ids = torch.tensor([prompt_ids], device=pair.device)
    torch.manual_seed(cfg.seed)
    t0 = time.perf_counter()
    out = pair.target.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=cfg.max_new_tokens,
                               min_new_tokens=0, **kwargs, **generate_kwargs)
    if pair.device.type == "cuda":
        torch.cuda.synchronize()
    total = time.perf_counter() - t0
    new = out[0, len(prompt_ids):].tolist()
    text = pair.tokenizer.decode(new, skip_special_tokens=True)
    sequence = SequenceTrace(0, "input", "input", {}, list(prompt_ids), new, text, finished_s=total)
    return Trace(meta=meta, sequences=[sequence], total_s=total)


Runner = Callable[[SpecConfig, bool], Trace]  # (config, target_only) -> trace


def source_runner(source: Source, batch_size: int = DEFAULT_BATCH) -> Runner:
    """Every run of a comparison decodes the same sequences in the same batches."""
    def run_once(cfg: SpecConfig, target_only: bool) -> Trace:
        return run(source, cfg, target_only=target_only, batch_size=batch_size)
    return run_once


def compare(
    run: Runner,
    cfg: SpecConfig,
    *,
    modes: tuple[str, ...] = MODES,
    extra: dict[str, Callable[[], Trace]] | None = None,
    repeat: int = 1,
    on_stage: Callable[[str], None] | None = None,
) -> tuple[list[Row], dict[str, Trace]]:
    """Target-only, then each mode on the same input and seed, then any extra runs (e.g. transformers'),
    after one short untimed warm-up run."""
    stage = on_stage or (lambda name: None)
    stage("warm-up")
    run(dataclasses.replace(cfg, max_new_tokens=4), False)  # first calls pay one-off kernel setup: not timed
    jobs: dict[str, Callable[[], Trace]] = {"target-only": lambda: run(cfg, True)}
    for mode in modes:
        jobs[mode] = lambda mode=mode: run(dataclasses.replace(cfg, mode=mode), False)
    jobs.update(extra or {})
    traces: dict[str, list[Trace]] = {}
    for r in range(repeat):  # rounds interleave the runs so that drifts in machine speed hit all alike
        for name, job in jobs.items():
            stage(name if repeat == 1 else f"{name} ({r + 1}/{repeat})")
            traces.setdefault(name, []).append(job())
    chosen = {name: _median_trace(runs) for name, runs in traces.items()}
    rows = [_row(name, runs, traces["target-only"]) for name, runs in traces.items()]
    return rows, chosen


def _median_trace(runs: list[Trace]) -> Trace:
    """The run with the median wall time (the lower middle one for an even count)."""
    return sorted(runs, key=lambda t: t.total_s)[(len(runs) - 1) // 2]


def hf_assisted_runs(pair: ModelPair, prompt_ids: list[int], cfg: SpecConfig) -> dict[str, Callable[[], Trace]]:
    """transformers' assisted generation with our γ schedule, with its default confidence threshold too, and
    its prompt lookup decoding."""
    return {
        "hf-assisted": lambda: run_hf_assisted(pair, prompt_ids, cfg, 0.0),
        "hf-assisted (confidence 0.4)": lambda: run_hf_assisted(pair, prompt_ids, cfg, 0.4),
        "hf-prompt-lookup": lambda: run_hf_prompt_lookup(pair, prompt_ids, cfg),
    }
