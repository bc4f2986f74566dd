"""What one model call costs: prefill, and a decoding step scoring M tokens after it (docs/benchmarks.md).

A step is timed the way the driver makes it: the decoder's cache holds the prompt, M tokens are fed, the
logits of all M are kept (as verification keeps γ + 1), then the M slots are rolled back so that every
repeat sees the same cache. Warm-up first, then the median of `repeat` calls per M.
"""

from __future__ import annotations

import statistics
import time

import torch

from .text import CausalLMDecoder


def _median_s(fn, warmup: int, repeat: int) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


@torch.inference_mode()
def step_costs(model, vocab: int, prompt: list[int], tokens: list[int], repeat: int = 5,
               warmup: int = 2) -> dict:
    """{"prefill_s": seconds for the prompt, "steps": [{"tokens": M, "seconds": median, "ratio": to M = 1}]}."""
    decoder = CausalLMDecoder(model, vocab, 1)
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
        rows.append({"tokens": m, "seconds": _median_s(step, warmup, repeat)})
    base = next((r["seconds"] for r in rows if r["tokens"] == 1), rows[0]["seconds"])
    for r in rows:
        r["ratio"] = r["seconds"] / base
    return {"prefill_s": prefill_s, "prompt_tokens": len(prompt), "steps": rows}


def weight_bytes(model) -> int:
    """Bytes of linear-layer weights one step reads (packed blocks and scales, or dense/int8 tensors)."""
    from torch import nn

    from .packed import PackedLinear

    total = 0
    for m in model.modules():
        if isinstance(m, PackedLinear):
            total += m.packed().nbytes
        elif isinstance(m, nn.Linear):
            total += m.weight.numel() * m.weight.element_size()
        elif type(m).__name__ == "Linear" and hasattr(m, "weight") and callable(m.weight):  # dynamic int8
            total += m.weight().numel()
    return total


def linear_params(model) -> int:
    """Multiply-adds per token in linear layers (the output head counted once per scored token)."""
    from torch import nn

    from .packed import PackedLinear

    total = 0
    for m in model.modules():
        if isinstance(m, (PackedLinear, nn.Linear)):
            total += m.in_features * m.out_features
        elif type(m).__name__ == "Linear" and hasattr(m, "in_features"):
            total += m.in_features * m.out_features
    return total
