"""A lean forward for Whisper's encoder: transformers' numbers (under autocast for bf16 products) without its costs
around the products.

Why: transformers' encoder adds the positions to the convolution's output as it comes, channel-first, and the sum
keeps those strides; so does every residual after it, each add and layer norm then a strided walk over the window
(2.8 ms an add of 1,500 × 512 numbers where a contiguous one takes 0.4). Under autocast (speech.encoder's bf16
path) every product's fp32 weights are also rounded to bf16 again on every call (no autocast cache under inference
mode). Made contiguous first and with its weights rounded once, a window of the embedded base model with bf16
products fell 239 → 177 ms on the 2-core Xeon, the same bits.

Same bits (tests/test_asr.py): a layout changes no element-wise result; autocast rounds every floating input of a
product (input, weight, bias) to bf16 and calls the kernels these calls reach; its mixed fp32 + bf16 adds compute
in fp32 from exactly widened operands, as `x + y.float()` does; its layer norms run in fp32, as here; the
attention is the interface the encoder's config names (speech.encoder's for bf16 products).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from specviz.speech.lean_decoder import layer_norm  # in x's dtype: fp32 under autocast, as autocast runs it


Product = tuple[torch.Tensor, torch.Tensor | None]  # a product's weight and bias (None: none), as F.linear / F.conv1d take them


def _cast(linear: nn.Module, dtype: torch.dtype) -> Product:
    """A product's weight and bias as autocast gives them to its kernel (the tensors themselves where no cast)."""
    bias = linear.bias.detach().to(dtype) if linear.bias is not None else None
    return linear.weight.detach().to(dtype), bias


@dataclass(frozen=True)
class _Layer:
    """One encoder layer's modules (norms, attention) and its products' weights and biases as the forward uses them."""

    layer: nn.Module
    attention: nn.Module
    heads: int
    scaling: float
    q: Product
    k: Product
    v: Product
    out: Product
    fc1: Product
    fc2: Product


class LeanWhisperEncoder:
    """The forward of one Whisper encoder (a WhisperEncoder module), its products in `products` (bf16: autocast's
    numbers; None: the model's own dtype, transformers' numbers). A bf16 one holds bf16 copies of the linear and
    convolution weights (half their fp32 bytes: 40 MB for base), any holds references to the rest; read-only after
    construction, so one instance serves any number of threads."""

    def __init__(self, encoder: nn.Module, attention: Callable, products: torch.dtype | None = None):
        """attention: transformers' attention interface the encoder's config names, (module, q, k, v, mask,
        dropout=, scaling=) -> (out [B, frames, H, D], weights)."""
        self.attention = attention
        self.residual = encoder.embed_positions.weight.dtype  # the residual stream's dtype, as transformers keeps it
        self.products = dtype = products or self.residual
        self.conv1, self.conv2 = encoder.conv1, encoder.conv2
        self.conv_weights = [_cast(encoder.conv1, dtype), _cast(encoder.conv2, dtype)]
        self.positions = encoder.embed_positions.weight  # [frames, d]
        self.norm = encoder.layer_norm
        self.layers = [
            _Layer(layer, layer.self_attn, layer.self_attn.num_heads, layer.self_attn.scaling,
                   _cast(layer.self_attn.q_proj, dtype), _cast(layer.self_attn.k_proj, dtype),
                   _cast(layer.self_attn.v_proj, dtype), _cast(layer.self_attn.out_proj, dtype),
                   _cast(layer.fc1, dtype), _cast(layer.fc2, dtype))
            for layer in encoder.layers]

    def _conv(self, x: torch.Tensor, conv: nn.Conv1d, weights: Product) -> torch.Tensor:
        return F.conv1d(x, weights[0], weights[1], conv.stride, conv.padding, conv.dilation, conv.groups)

    def __call__(self, features: torch.Tensor) -> torch.Tensor:
        """features [B, mel bins, 3000] -> the final norm's output [B, frames, d], in the residual's dtype."""
        products, residual = self.products, self.residual
        x = F.gelu(self._conv(features.to(products), self.conv1, self.conv_weights[0]))
        x = F.gelu(self._conv(x, self.conv2, self.conv_weights[1]))  # [B, d, frames]
        # contiguous before the sum: else the sum keeps the convolution's channel-first strides, and so does every
        # residual after it, each a strided walk (2.8 ms an add where 0.4 is contiguous; the layer norms copy too)
        hidden = x.permute(0, 2, 1).contiguous().to(residual) + self.positions  # [B, frames, d]
        B, frames, _ = hidden.shape
        for w in self.layers:
            shape = (B, frames, w.heads, -1)
            x = layer_norm(hidden, w.layer.self_attn_layer_norm).to(products)
            # [B, H, frames, D] views of the projections' [B, frames, H·D]: the attention reads them in place
            q = (F.linear(x, *w.q) * w.scaling).view(shape).transpose(1, 2)
            k = F.linear(x, *w.k).view(shape).transpose(1, 2)
            v = F.linear(x, *w.v).view(shape).transpose(1, 2)
            out, _ = self.attention(w.attention, q, k, v, None, dropout=0.0, scaling=1.0)  # [B, frames, H, D]
            hidden = hidden + F.linear(out.reshape(B, frames, -1).contiguous().to(products), *w.out).to(residual)
            x = layer_norm(hidden, w.layer.final_layer_norm).to(products)
            hidden = hidden + F.linear(F.gelu(F.linear(x, *w.fc1)), *w.fc2).to(residual)
            if hidden.dtype == torch.float16:  # as transformers' layer keeps fp16 finite
                bound = torch.finfo(torch.float16).max - 1000
                hidden = hidden.clamp(-bound, bound)
        return layer_norm(hidden, self.norm)
