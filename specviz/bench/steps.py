"""What one model call costs: prefill, and a decoding step scoring M tokens after it (docs/benchmarks.md).

A step is timed the way the driver makes it: the decoder's cache holds the prompt, M tokens are fed, the
logits of all M are kept (as verification keeps γ + 1), then the M slots are rolled back so that every
repeat sees the same cache. Warm-up first, then the median of `repeat` calls per M.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from specviz.bench.measure import _median_us
from specviz.bench.roofline import linear_modules, linear_time
from specviz.models.packed import PackedLinear
from specviz.text.source import CausalLMDecoder

_INT8_LINEAR = torch.ao.nn.quantized.dynamic.Linear  # the int8 draft's layers (specviz.models.quant)


@torch.inference_mode()
def step_costs(model, vocab: int, prompt: list[int], tokens: list[int], repeat: int = 5,
               warmup: int = 2) -> dict:
    """{"prefill_s": seconds for the prompt, "steps": [{"tokens": M, "seconds": median, "ratio": to M = 1,
    "linear_share": the fraction of a step inside the linear layers}]}."""
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
        seconds = _median_us(step, warmup, repeat) / 1e6
        with linear_time(model) as linear:  # a second pass, hooked: how much of a step the matmuls take
            t0 = time.perf_counter()
            for _ in range(repeat):
                step()
            hooked = time.perf_counter() - t0
        rows.append({"tokens": m, "seconds": seconds, "linear_share": linear[0] / hooked})
    base = next((r["seconds"] for r in rows if r["tokens"] == 1), rows[0]["seconds"])
    for r in rows:
        r["ratio"] = r["seconds"] / base
    return {"prefill_s": prefill_s, "prompt_tokens": len(prompt), "steps": rows}


def weight_bytes(model) -> int:
    """Bytes of linear-layer weights one step reads (packed blocks and scales, or dense/int8 tensors)."""
    total = 0
    for m in _own_linears(model):
        if isinstance(m, PackedLinear):
            total += m.packed().nbytes
        elif isinstance(m, _INT8_LINEAR):
            total += m.weight().numel()
        else:
            total += m.weight.numel() * m.weight.element_size()
    return total


def linear_params(model) -> int:
    """Multiply-adds per token in linear layers (the output head counted once per scored token)."""
    return sum(m.in_features * m.out_features for m in _own_linears(model))


def _own_linears(model) -> list[nn.Module]:
    """The model's linear layers (not the lean forward's fused copies: those hold views of the same weights)."""
    lean = getattr(model, "lean_forward", None)
    fused = set() if lean is None else {id(m) for layer in lean.layers for m in (layer.qkv, layer.gate_up)}
    return [m for m in linear_modules(model) if id(m) not in fused]
