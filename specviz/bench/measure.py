"""Measurements behind the figures in docs/benchmarks.md (not tests: timings with warm-up and medians)."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Callable

import numpy as np

from specviz.config import SpecConfig
from specviz.traces.trace import Trace

if TYPE_CHECKING:
    import torch


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
    from specviz.speech import lean_decoder
    from specviz.speech.asr import layer_draft, word_error_rate
    from specviz.runs.decode import transcribe

    transcribe(pair, clips, cfg, target_only=True)  # warm-up, untimed
    reference, reference_s = _median_of(lambda: transcribe(pair, clips, cfg, target_only=True), repeat)
    rows = [{"draft": "target-only", "decode_s": reference_s, "speedup": 1.0,
             "wer": word_error_rate(reference_text, reference.output_text) if reference_text else None}]
    original = pair.draft
    try:
        for layers in layer_sets:
            pair.draft = lean_decoder.attach(layer_draft(pair.target, layers))
            trace, seconds = _median_of(lambda: transcribe(pair, clips, cfg), repeat)
            s = trace.summary()
            rows.append({"draft": f"layers {list(layers)}", "alpha": s["alpha"], "acceptance_rate": s["acceptance_rate"],
                         "tokens_per_iteration": s["tokens_per_iteration"], "decode_s": seconds,
                         "speedup": reference_s / seconds, "equals_target_only": trace.outputs == reference.outputs})
    finally:
        pair.draft = original
    return rows


def _median_us(fn: Callable[[], object], warmup: int, iters: int) -> float:
    """Median wall microseconds per call (perf_counter); `fn` must leave nothing pending that it owns."""
    import time

    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def _median_gpu_us(run: Callable[[tuple], object], warmup: int, iters: int) -> float:
    """Median GPU microseconds between two CUDA events that `run((start, end))` records around its kernels."""
    import torch

    for _ in range(warmup):
        run((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
    samples = []
    for _ in range(iters):
        events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        run(events)
        events[1].synchronize()
        samples.append(events[0].elapsed_time(events[1]) * 1e3)
    return statistics.median(samples)


def verify_microbench(device: "torch.device", vocabs=(51_865, 151_936, 256_000), gammas=(1, 5, 10, 20),
                      batches=(1, 8), dtypes=("fp16", "fp32"), warmup: int = 10, iters: int = 50, top_k: int = 0, top_p: float = 1.0,
                      on_case: Callable[[dict], None] | None = None) -> list[dict]:
    """µs per verification for each mode and path (torch; the CuPy kernels where they run).

    Every timing is the wall time until the results are on the host (`verify(...).host()`), which is what
    the engine waits for. Per row:
    - call_us: that wall time (kernel path: its input checks on, i.e. the one readback that raises on bad
      logits / tokens; torch path: its own checks and syncs included);
    - nocheck_us (kernel path): the kernels alone with check=False (no readback, no errors) until the
      stream is idle, uniforms drawn beforehand;
    - gpu_us (kernel path): CUDA events right around the kernel launches: GPU time only;
    - host_us: the host's share of a call. Kernel path: call_us - gpu_us (Python, launches, uniforms,
      readback). Torch and cpp paths (cpp: `exact` with its two full-vocabulary passes in C++, the CPU's
      default), where all of it runs on the host: the same call at V = 16 and the same B, γ and mode, i.e.
      the per-call cost that does not grow with the vocabulary (Python, dispatch, small ops);
    - speedup: the baseline's call_us over this row's (same V, B, γ, dtype);
    - floor_bytes = (2γ+1)·V·B·s and achieved_GBps = floor / gpu_us (call_us where there is no gpu_us).
    top_k > 0 and top_p < 1 add those filters to the sampling (temperature 1); the kernel path applies them
    inside the kernels (top_k ≤ kernels.MAX_TOPK).
    """
    import torch

    from specviz.config import SamplingConfig
    from specviz import native
    from specviz.verify import kernels_active, project_kernels, verify

    sampling = SamplingConfig(temperature=1.0, top_k=top_k, top_p=top_p)
    kernels_on = device.type == "cuda" and kernels_active()
    # on the CPU, 'auto' is exact's C++ passes (path "cpp"); 'torch' keeps everything in torch
    backends = ["torch"] + (["cuda"] if kernels_on else ["auto"] if device.type == "cpu" and native.available() else [])
    path_name = {"torch": "torch", "cuda": "kernel", "auto": "cpp"}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
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
                    baseline_us = None
                    for mode in ("baseline", "exact", "sigmoid"):
                        for backend in backends:
                            if backend == "cuda" and mode == "baseline" or backend == "auto" and mode != "exact":
                                continue  # no kernel for transformers' algorithm; the C++ passes are exact's

                            def call():
                                verify(mode, tokens, draft, target, sampling, g, backend=backend).host()

                            sync()
                            row = {"V": V, "B": B, "gamma": gamma, "dtype": dt, "top_k": top_k, "top_p": top_p, "mode": mode,
                                   "path": path_name[backend],
                                   "call_us": _median_us(call, warmup, iters), "nocheck_us": None, "gpu_us": None,
                                   "host_us": None, "floor_bytes": floor}
                            if backend == "cuda":
                                row.update(_kernel_split(project_kernels(), mode, sampling, tokens, draft, target,
                                                         g, warmup, iters))
                                row["host_us"] = row["call_us"] - row["gpu_us"]
                            else:
                                small = (tokens % 16, draft[..., :16].contiguous(), target[..., :16].contiguous())
                                row["host_us"] = _median_us(
                                    lambda: verify(mode, small[0], small[1], small[2], sampling, g, backend=backend).host(),
                                    warmup, iters)
                            if mode == "baseline":
                                baseline_us = row["call_us"]
                            row["speedup"] = baseline_us / row["call_us"] if baseline_us else None
                            row["achieved_GBps"] = floor / (row["gpu_us"] or row["call_us"]) / 1e3
                            rows.append(row)
                            if on_case:
                                on_case(row)
    return rows


def _kernel_split(kernels, mode, sampling, tokens, draft, target, g, warmup, iters) -> dict:
    """The kernel path without its readback (check=False, then a stream sync), and its GPU time alone."""
    import torch

    from specviz.verify import kernel_args

    draft, target, u, u_res, options = kernel_args(mode, tokens, draft, target, sampling, g)
    opts = dict(options, sigmoid_alpha=-1e4, sigmoid_beta=1e4)
    stream = torch.cuda.current_stream()

    def nocheck():
        kernels.launch(mode, tokens, draft, target, u, u_res, check=False, **opts)
        stream.synchronize()

    return {
        "nocheck_us": _median_us(nocheck, warmup, iters),
        "gpu_us": _median_gpu_us(lambda ev: kernels.launch(mode, tokens, draft, target, u, u_res, check=False,
                                                           events=ev, **opts), warmup, iters),
    }


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

    from specviz.runs.decode import run
    from specviz.text.source import article_source

    rows = []
    for b in batches:
        c = dataclasses.replace(cfg, gamma_policy=policy or ("bass" if b > 1 else "hf"))  # the BASS paper's setting
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
