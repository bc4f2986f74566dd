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


def speech_draft_layers(pair, clips: list[tuple[str, np.ndarray]], layer_sets: list[tuple[int, ...]], cfg: SpecConfig,
                        reference_text: str | None = None, repeat: int = 3) -> list[dict]:
    """Acceptance and speed of self-speculative drafts made of different subsets of the target's decoder layers."""
    from .asr import layer_draft, word_error_rate
    from .runs import transcribe

    transcribe(pair, clips, cfg, target_only=True)  # warm-up, untimed
    reference, reference_s = _median_of(lambda: transcribe(pair, clips, cfg, target_only=True), repeat)
    rows = [{"draft": "target-only", "decode_s": reference_s, "speedup": 1.0,
             "wer": word_error_rate(reference_text, reference.output_text) if reference_text else None}]
    original = pair.draft
    try:
        for layers in layer_sets:
            pair.draft = layer_draft(pair.target, layers)
            trace, seconds = _median_of(lambda: transcribe(pair, clips, cfg), repeat)
            s = trace.summary()
            rows.append({"draft": f"layers {list(layers)}", "alpha": s["alpha"], "acceptance_rate": s["acceptance_rate"],
                         "tokens_per_iteration": s["tokens_per_iteration"], "decode_s": seconds,
                         "speedup": reference_s / seconds, "equals_target_only": trace.outputs == reference.outputs})
    finally:
        pair.draft = original
    return rows


def _time_call(fn: Callable[[], object], device: "torch.device", warmup: int, iters: int) -> float:
    """Median microseconds per call: CUDA events on a GPU, perf_counter on the CPU; warm-up excluded."""
    import time

    import torch

    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def verify_microbench(device: "torch.device", vocabs=(51_865, 151_936, 256_000), gammas=(1, 5, 10, 20),
                      batches=(1, 8), dtypes=("fp16", "fp32"), warmup: int = 10, iters: int = 50,
                      on_case: Callable[[dict], None] | None = None) -> list[dict]:
    """µs per verification call for each mode and path (torch; CuPy kernels where they run), with the byte
    floor (γ+1)·V·s + γ·V·s and the bandwidth that time implies."""
    import torch

    from .config import SamplingConfig
    from .verify import kernels_active, verify

    sampling = SamplingConfig(temperature=1.0)
    backends = ["torch"] + (["cuda"] if device.type == "cuda" and kernels_active() else [])
    rows = []
    for V in vocabs:
        for B in batches:
            for gamma in gammas:
                for dt in dtypes:
                    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dt]
                    g = torch.Generator(device=device).manual_seed(0)
                    target = torch.randn(B, gamma + 1, V, device=device, generator=g).to(dtype) * 3
                    draft = (target[:, :gamma].float() + torch.randn(B, gamma, V, device=device, generator=g)).to(dtype)
                    tokens = torch.randint(0, V, (B, gamma), device=device, generator=g)
                    floor = (2 * gamma + 1) * V * B * target.element_size()
                    for mode in ("baseline", "exact", "sigmoid"):
                        for backend in backends:
                            if mode == "baseline" and backend == "cuda":
                                continue
                            us = _time_call(lambda: verify(mode, tokens, draft, target, sampling, g, backend=backend),
                                            device, warmup, iters)
                            row = {"V": V, "B": B, "gamma": gamma, "dtype": dt, "mode": mode,
                                   "path": "kernel" if backend == "cuda" else "torch", "median_us": us,
                                   "floor_bytes": floor, "achieved_GBps": floor / us / 1e3}
                            rows.append(row)
                            if on_case:
                                on_case(row)
    return rows


def _batch_metrics(trace: Trace) -> dict:
    """What one batched run achieved, prefill included and excluded (prefill is the same work either way)."""
    s = trace.summary()
    decode_s = trace.total_s - trace.prefill_s
    per_seq = [len(q.output_ids) / (q.finished_s - trace.prefill_s) for q in trace.sequences
               if q.finished_s > trace.prefill_s and q.output_ids]
    return {
        "new_tokens": trace.new_tokens, "total_s": trace.total_s, "prefill_s": trace.prefill_s, "decode_s": decode_s,
        "tokens_per_s": trace.tokens_per_s, "decode_tokens_per_s": trace.new_tokens / decode_s if decode_s > 0 else 0.0,
        "tokens_per_s_per_sequence": trace.per_sequence_tokens_per_s(),
        "decode_tokens_per_s_per_sequence": statistics.mean(per_seq) if per_seq else 0.0,
        "target_calls": len(trace.steps), "median_target_ms": s.get("median_target_ms"),
        "alpha": s.get("alpha"), "acceptance_rate": s.get("acceptance_rate"),
        "tokens_per_iteration_per_sequence": s.get("tokens_per_iteration"), "mean_gamma": s.get("mean_gamma"),
        "draft_s": s.get("draft_s"), "target_s": s.get("target_s"), "verify_s": s.get("verify_s"),
        "padding_fraction": trace.padding_fraction(), "cache_hole_fraction": trace.hole_fraction(),
    }


def batch_scaling(pair, article: str, batches: list[int], cfg: SpecConfig, repeat: int = 3,
                  policy: str | None = None, on_run: Callable[[str], None] | None = None) -> list[dict]:
    """Batched speculative vs batched target-only decoding of B samples of one article, for each B.

    Per B: one short untimed warm-up, then `repeat` interleaved rounds (target-only, speculative); each side
    reports its median run by decode time. Same seed, same batch, same sampling on both sides.
    """
    import dataclasses

    from .gamma import default_policy
    from .runs import run
    from .text import article_source

    rows = []
    for b in batches:
        c = dataclasses.replace(cfg, gamma_policy=policy or default_policy(b))
        source = article_source(pair, [("article", article)], c, num_sequences=b)
        run(source, dataclasses.replace(c, max_new_tokens=4))  # first calls at a new batch shape: not timed
        runs: dict[str, list[Trace]] = {"target-only": [], "speculative": []}
        for r in range(repeat):  # interleaved, so that drifts in machine speed hit both alike
            for name in runs:
                if on_run:
                    on_run(f"B={b} {name} ({r + 1}/{repeat})")
                runs[name].append(run(source, c, target_only=name == "target-only"))
        chosen = {name: sorted(ts, key=lambda t: t.total_s - t.prefill_s)[(len(ts) - 1) // 2] for name, ts in runs.items()}
        target, spec = (_batch_metrics(chosen[n]) for n in ("target-only", "speculative"))
        rows.append({
            "batch": b, "gamma_policy": c.gamma_policy, "target_only": target, "speculative": spec,
            "speedup_total": spec["tokens_per_s"] / target["tokens_per_s"],
            "speedup_decode_per_sequence": spec["decode_tokens_per_s_per_sequence"] / target["decode_tokens_per_s_per_sequence"],
            "speedup_per_sequence": spec["tokens_per_s_per_sequence"] / target["tokens_per_s_per_sequence"],
            "decode_times_s": {n: [round(t.total_s - t.prefill_s, 3) for t in ts] for n, ts in runs.items()},
        })
    return rows
