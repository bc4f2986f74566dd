"""What one model call costs: prefill, and a decoding step scoring M tokens after it (docs/benchmarks.md).

A step is timed the way the driver makes it: the decoder's cache holds the prompt, M tokens are fed, the
logits of all M are kept (as verification keeps γ + 1), then the M slots are rolled back so that every
repeat sees the same cache. Warm-up first, then the median of `repeat` calls per M.
"""

from __future__ import annotations

import time

import torch

from specviz.bench.measure import _median_us
from specviz.bench.roofline import INT8_LINEAR, linear_time, model_linears
from specviz.models import native_forward
from specviz.decoding.drafts import SubsetHead
from specviz.models.packed import PackedLinear
from specviz.text.source import CausalLMDecoder



@torch.inference_mode()
def step_costs(model, vocab: int, prompt: list[int], tokens: list[int], repeat: int = 5,
               warmup: int = 2, head: SubsetHead | None = None, kv_dtype: torch.dtype = torch.float32) -> dict:
    """{"prefill_s": seconds for the prompt, "steps": [{"tokens": M, "seconds": median, "ratio": to M = 1,
    "linear_share": the fraction of a step inside the linear layers, "outside": {kind: fraction of a step} for
    the rest where the native layers time it (norm, rotary_cache, attention, swiglu, residual, and "other": the
    embedding, mask, final norm and Python)}]}. kv_dtype: the keys and values a run keeps (a draft's: fp16)."""
    decoder = CausalLMDecoder(model, vocab, 1, head, kv_dtype=kv_dtype)
    t0 = time.perf_counter()
    decoder.prefill([prompt])
    prefill_s = time.perf_counter() - t0
    fed = decoder.fed(0)
    feed = prompt[-1:] + prompt[:max(tokens)]  # real tokens, so attention and the head see ordinary input

    rows = []
    for m in tokens:
        def step(m=m):
            decoder.forward([feed[:m]], m)
            decoder.rollback([fed])
        seconds = _median_us(step, warmup, repeat) / 1e6
        # a second pass, timed inside: how much of a step the matmuls take (module hooks on the linear layers
        # called from Python; the native layers' own stage clocks for the rest)
        beside = [] if head is None else [head.linear]  # a reduced head is called beside the model, not in it
        with linear_time(model, beside) as linear, native_forward.stage_seconds() as stages:
            t0 = time.perf_counter()
            for _ in range(repeat):
                step()
            hooked = time.perf_counter() - t0
        inside = linear[0] + sum(stages[k] for k in native_forward.MATMUL_STAGES)
        row = {"tokens": m, "seconds": seconds, "linear_share": inside / hooked}
        if any(stages.values()):
            outside = {k: v / hooked for k, v in stages.items() if k not in native_forward.MATMUL_STAGES}
            row["outside"] = {**outside, "other": 1 - inside / hooked - sum(outside.values())}
        rows.append(row)
    base = next((r["seconds"] for r in rows if r["tokens"] == 1), rows[0]["seconds"])
    for r in rows:
        r["ratio"] = r["seconds"] / base
    return {"prefill_s": prefill_s, "prompt_tokens": len(prompt), "steps": rows}


def _linear_bytes(m) -> int:
    if isinstance(m, PackedLinear):
        return m.nbytes
    if isinstance(m, INT8_LINEAR):
        return m.weight().numel()
    return m.weight.numel() * m.weight.element_size()


def weight_bytes(model, head: SubsetHead | None = None) -> int:
    """Bytes of linear-layer weights one step reads (packed blocks and scales, or dense/int8 tensors); with a
    reduced head, its rows in place of the model's output head."""
    total = sum(_linear_bytes(m) for m in model_linears(model))
    if head is not None:
        total += _linear_bytes(head.linear) - _linear_bytes(model.get_output_embeddings())
    return total


def linear_params(model, head: SubsetHead | None = None) -> int:
    """Multiply-adds per token in linear layers (the output head counted once per scored token; with a reduced
    head, its rows instead)."""
    total = sum(m.in_features * m.out_features for m in model_linears(model))
    if head is not None:
        full = model.get_output_embeddings()
        total += head.linear.in_features * head.size - full.in_features * full.out_features
    return total
