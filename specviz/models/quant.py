"""Quantized draft weights on the CPU: 4-bit blocks for specviz's kernels, or int8 (fbgemm).

Decoding on a CPU is bound by reading weights, so a quantized draft lowers Leviathan et al.'s cost ratio c.
Only the draft is quantized: verification keeps the output distributed exactly as the target's, whatever
q the draft proposes. The 4-bit draft (`quantize_draft_q4`) re-quantizes every linear weight to the q4
format the target's Q4_K blocks use, groups of 32 with their own scale and minimum, and runs on the same
kernels with 8-bit activations: the embedded draft's GGUF holds mostly Q5_0/Q8_0 (its 896 columns are no
multiple of k-quants' 256), which the kernels read as 8-bit, ~9 bits per weight with scales, against 5
here (fp16 scale and minimum per 32). The int8 draft (`quantize_draft_int8`, dynamic quantization: int8
weights, activations quantized per call) is the fallback where the kernels do not build.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from specviz.models.gguf_pack import Packed
from specviz.models.half_linear import HalfLinear
from specviz.models.packed import PackedLinear, apply_packed


def quantize_draft_int8(model: nn.Module) -> nn.Module:
    """Every nn.Linear of `model` (output head included) becomes an int8 dynamic-quantized linear, in place."""
    model.float()  # the quantized linears take fp32 activations
    with warnings.catch_warnings():
        # torch.ao.quantization is deprecated in favour of torchao, which this project does not depend on;
        # it works in the pinned torch and is measured (README, "Measured figures").
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8, inplace=True)


def _fp16_at_least(t: torch.Tensor) -> torch.Tensor:
    """The least fp16 value ≥ each of t (fp32), as fp32."""
    h = t.half()
    return torch.where(h.float() < t, torch.nextafter(h, torch.full_like(h, float("inf"))), h).float()


def q4_blocks(weight: torch.Tensor) -> Packed:
    """weight [N, K] (K a multiple of 64) as the kernels' q4 format: per group of 32 along K, w ≈ scale · q −
    minv with q in 0 … 15 spanning the group's range (minv = −min, scale = (max + minv) / 15, both rounded up to
    fp16), q rounded to the nearest level: llama.cpp's Q4_1 in spirit. (Searching narrower ranges by squared
    error, as k-quants do, moved the draft's agreement with the target by less than its noise here.)"""
    N, K = weight.shape
    groups = weight.detach().float().reshape(N, K // 32, 32)
    low, high = groups.amin(-1), groups.amax(-1)  # [N, K/32]
    # scale and minimum rounded up to fp16 first (the kernels then read 2 bytes each, not 4; up, so that the levels
    # still span the group), q rounded against them
    minv = _fp16_at_least(-low)
    scale = _fp16_at_least((high + minv) / 15)
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    q = ((groups + minv[..., None]) * inverse[..., None]).round().clamp(0, 15).to(torch.uint8).reshape(N, K)
    nibbles = q[:, 0::2] | (q[:, 1::2] << 4)  # element 2i in the low nibble, 2i + 1 in the high one
    return Packed("q4", nibbles.contiguous(), scale.contiguous(), minv.contiguous(), "Q4 (re-quantized by specviz)")


def quantize_draft_q4(model: nn.Module) -> nn.Module:
    """Every nn.Linear of `model` (output head included) re-quantized to 4 bits per weight in groups of 32
    for the CPU kernels with 8-bit activations, in place (the draft only: its weights change acceptance,
    never the output's distribution)."""
    blocks = {name: q4_blocks(m.weight) for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    return apply_packed(model, blocks, int8_activations=True)


def q4_linears(module: nn.Module) -> nn.Module:
    """Every linear layer under `module` (nn.Linear or HalfLinear) as a PackedLinear of its q4_blocks with 8-bit
    activations, in place: quantize_draft_q4 for a part of a model (Whisper's layer draft), with no attention or
    config of its own to change."""
    for name, child in list(module.named_children()):
        if isinstance(child, (nn.Linear, HalfLinear)):
            setattr(module, name, PackedLinear(q4_blocks(child.weight.float()), child.bias, int8_activations=True))
        else:
            q4_linears(child)
    return module
