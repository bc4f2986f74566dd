"""The torch operations a GPU decoding step's kernels replace (specviz/models/fused.py, fused_linear.py), in
transformers' operation order and rounding: the references the kernels are checked against, and the path that
runs on the CPU and wherever a kernel is not used."""

from __future__ import annotations

from typing import Callable

import torch
from torch.nn import functional as F


def add_rms_norm_ref(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """x, delta [R, N] (delta None: no add) -> (x + delta, transformers' RMSNorm of it: in fp32, back to the dtype,
    times the weight)."""
    if delta is not None:
        x = x + delta
    return x, weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def rope_store_ref(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: torch.Tensor, W: int,
                   heads: int, kv_heads: int, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """qkv [B·W, (heads + 2·kv_heads)·D] (rows b·W + w); cos, sin [B·W, D]; start LongTensor[1]: the slot of column
    0; keys, values [B, kv_heads, C, D], written at slots start … start + W − 1 -> q rotated, grouped by key head:
    [B, kv_heads, G·W, D], query g·W + w of key head k being head k·G + g."""
    D = cos.shape[-1]
    B = qkv.shape[0] // W
    G = heads // kv_heads
    q, k, v = qkv.view(B, W, heads + 2 * kv_heads, D).split((heads, kv_heads, kv_heads), dim=2)
    c, s = cos.view(B, 1, W, D), sin.view(B, 1, W, D)
    q = _rotate(q.transpose(1, 2), c, s)  # [B, H, W, D]
    slots = start + torch.arange(W, device=qkv.device)
    keys.index_copy_(2, slots, _rotate(k.transpose(1, 2), c, s))
    values.index_copy_(2, slots, v.transpose(1, 2))
    return q.reshape(B, kv_heads, G * W, D)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # x [B, heads, W, D]
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def attend_ref(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scale: float,
               W: int) -> torch.Tensor:
    """q [B, Hkv, G·W, D] (query g·W + w of key head k is head k·G + g) over keys, values [B, Hkv, C, D] with the
    additive mask bias [B, 1, G·W, C] -> [B·W, H·D], the layout the output projection reads: two batched matrix
    products around a softmax, as transformers' eager attention (scores in the dtype, softmax in fp32)."""
    B, Hkv, M, D = q.shape
    C = keys.shape[2]
    scores = torch.baddbmm(bias.expand(B, Hkv, M, C).reshape(B * Hkv, M, C), q.reshape(B * Hkv, M, D),
                           keys.reshape(B * Hkv, C, D).transpose(1, 2), alpha=scale)
    out = torch.bmm(torch.softmax(scores, dim=-1), values.reshape(B * Hkv, C, D))  # [B·Hkv, G·W, D]
    return out.view(B, Hkv, M // W, W, D).permute(0, 3, 1, 2, 4).reshape(B * W, Hkv * (M // W) * D)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:  # gate_up [R, 2·I] -> [R, I]
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# ---- a projection stage, as fused_linear's kernel computes it (the cuBLAS composition) ---------------------

def norm_linear_ref(x: torch.Tensor, delta: torch.Tensor | None, norm: torch.Tensor, eps: float, weight: torch.Tensor,
                    bias: torch.Tensor | None, silu: bool,
                    add_rms_norm: Callable | None = None, silu_mul: Callable | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """x, delta [R, K] (delta None: no residual add); norm [K]; weight [N, K] (silu: [2·I, K], gate rows then up
    rows) -> (x + delta, linear(RMSNorm(x + delta)) [R, N], or SiLU(gate)·up [R, I] when `silu`). The norm and
    SiLU·up stages are the caller's (fused.py's kernels, or these references)."""
    x, h = (add_rms_norm or add_rms_norm_ref)(x, delta, norm, eps)
    y = F.linear(h, weight, bias)
    return x, ((silu_mul or silu_mul_ref)(y) if silu else y)


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [R, K], weight [N, K] -> x · weightᵀ + bias [R, N] (cuBLAS on a GPU)."""
    return F.linear(x, weight, bias)
