"""A lean forward for Whisper's decoder on the CPU kernels: one function walks the layers with explicit state, as
models/lean.py does for the text models, instead of transformers' modules.

Why: with its linear layers on the kernels, transformers' per-layer plumbing (module calls, keyword arguments,
mask and cache bookkeeping, ~2,800 op dispatches a step) was a large share of a Whisper step; without it, side by
side, the embedded target's step fell 9.6 → 8.4 ms and its 4-bit draft's 4.9 → 3.9 ms (docs/benchmarks.md).

Every number is computed by the same operations in the same order as transformers' Whisper decoder on the same
modules (the positional and token embeddings' sum, pre-norm layers, queries scaled before attention, the
batch-invariant attention with scale 1, GELU, residuals, the final norm), so the logits are the same bits
(tests/test_asr.py). Only the head differs in what it is given: the last `keep` rows instead of all of them,
which the batch-invariant kernels score row by row. Used only where every decoder linear layer is on specviz's
kernels and the decoder's attention is the batch-invariant one (speech.asr.kernel_decoder); else transformers'.
A quantized draft walks its layers in one native call instead (speech.native_whisper), once its cross-attention
keys and values are in its cache: its own numbers, equal to these up to rounding.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from specviz.models import cpu_attention, cpu_kernels
from specviz.models.half_linear import HalfLinear
from specviz.models.packed import PackedLinear
from specviz.speech import native_whisper

_KERNEL_LINEARS = (HalfLinear, PackedLinear)


def layer_linears(layer: nn.Module) -> list[nn.Module]:
    """A Whisper decoder layer's ten linear layers (self- and cross-attention's q, k, v, out; fc1, fc2)."""
    s, c = layer.self_attn, layer.encoder_attn
    return [s.q_proj, s.k_proj, s.v_proj, s.out_proj, c.q_proj, c.k_proj, c.v_proj, c.out_proj, layer.fc1, layer.fc2]


def supports(model: nn.Module) -> bool:
    """Whether `model` (a WhisperForConditionalGeneration) is one this forward runs: its decoder's attention the
    batch-invariant one and every decoder linear layer and the head on specviz's kernels."""
    decoder = model.model.decoder
    if decoder.config._attn_implementation != cpu_attention.NAME or not cpu_kernels.has_attention():
        return False
    if decoder.config.activation_function != "gelu" or (decoder.config.d_model // decoder.config.decoder_attention_heads) % 8:
        return False  # the attention kernel takes head widths in multiples of 8
    return isinstance(model.proj_out, _KERNEL_LINEARS) and all(
        isinstance(m, _KERNEL_LINEARS) for layer in decoder.layers for m in layer_linears(layer))


def layer_norm(x: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:  # nn.LayerNorm's forward (the encoder's too)
    return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)


# torch's element-wise GELU splits a call over threads above this many elements and finishes a thread's share with
# scalar erf where it is no whole number of vectors: a row's bits could then depend on what else is in the call.
# Calls of at most this many elements run on one thread from their first element.
_ONE_THREAD_ELEMENTS = 16384
_VECTOR = 32  # ATen's loop takes two vectors at a time (2 × 16 floats on AVX-512, 2 × 8 on AVX2), the rest scalar


def _gelu(x: torch.Tensor) -> torch.Tensor:
    """F.gelu, each row (last dimension) computed by the same operations whatever else is in the call: rows of a
    multiple of 32 in groups small enough for one thread (so every element is vector work), else one by one."""
    rows = x.reshape(-1, x.shape[-1])
    width = rows.shape[1]
    if rows.numel() <= _ONE_THREAD_ELEMENTS and width % _VECTOR == 0:
        return F.gelu(x)
    group = max(1, _ONE_THREAD_ELEMENTS // width) if width % _VECTOR == 0 else 1
    return torch.cat([F.gelu(rows[i:i + group]) for i in range(0, len(rows), group)]).reshape(x.shape)


def cross_kv(model: nn.Module, encoder_out: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """Every decoder layer's cross-attention keys and values [B, H, frames, D] for encoder_out [B, frames, d], fp32,
    a window's once (a layer draft made of these layers reads them too, speech.asr.SpeechSource.decoders); None
    unless the decoder is on the fp16-weight kernel (asr.kernel_decoder): elsewhere transformers' forward computes
    them. Each window's frames go through torch's GEMM on the layers' own weights (fp16 values, exact in fp32): at
    1,500 rows it runs at ~80 GMAC/s where the fp16-weight kernel, built for a few decoder rows, ran 42 (the
    embedded target's six layers 111 → ~60 ms a window on the 2-core EPYC). One window per GEMM, so every call has
    one shape and a window's keys never depend on which windows share its batch. Not the bits of a first decoder
    call's own projection: a source gives both decoders of a run these, target-only runs included."""
    decoder = model.model.decoder
    projections = [(layer.encoder_attn.k_proj, layer.encoder_attn.v_proj) for layer in decoder.layers]
    if not all(isinstance(m, HalfLinear) for pair in projections for m in pair):
        return None
    B = encoder_out.shape[0]
    heads = decoder.config.decoder_attention_heads
    shape = (B, -1, heads, decoder.config.d_model // heads)

    def project(linear: HalfLinear) -> torch.Tensor:  # -> [B, H, frames, D]
        weight = linear.weight.float()
        out = torch.empty((B, shape[2], encoder_out.shape[1], shape[3]), dtype=torch.float32)
        for b in range(B):  # each window's GEMM copied once into its heads' layout (a stack first: 3 ms a window)
            out[b] = F.linear(encoder_out[b], weight, linear.bias).view(shape[1:]).transpose(0, 1)
        return out

    return [(project(k), project(v)) for k, v in projections]


def _in_half_range(x: torch.Tensor) -> bool:
    """Whether every number of x is finite and within fp16's largest (so its fp16 copy is finite): fp32's minimum and
    maximum in one pass, 0.1 ms for a layer's 3 MB of keys where fp16 copies' isfinite took 1.4 (NaN fails both
    comparisons)."""
    lo, hi = torch.aminmax(x)
    return bool(lo >= -_HALF_MAX) and bool(hi <= _HALF_MAX)


_HALF_MAX = torch.finfo(torch.float16).max


class LeanWhisperDecoder:
    """The decoder forward of one supported model. Holds references to the model's own modules; read-only after
    construction, so one instance serves any number of decoders and threads."""

    def __init__(self, model: nn.Module, cross_kv: torch.dtype = torch.float32, native: bool = False):
        """cross_kv: how the cross-attention keys and values are kept. fp16 (a draft's choice: a draft's
        approximations change acceptance, never the output) halves what every step reads of them, 30 MB a step
        for the embedded layer draft; fp32 keeps transformers' bits. native (a draft's choice too): its layers in
        one native call a step where native_whisper.applies (rounding-close to this forward, not its bits)."""
        decoder = model.model.decoder
        self.native = native_whisper.NativeWhisperLayers(model) if native and native_whisper.applies(model) else None
        self.cross_dtype = cross_kv
        self.embed = decoder.embed_tokens.weight  # [V, d]
        self.positions = decoder.embed_positions.weight  # [max positions, d]
        self.layers = list(decoder.layers)
        self.norm = decoder.layer_norm
        self.heads = decoder.config.decoder_attention_heads
        self.head_dim = decoder.config.d_model // self.heads

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, sees: torch.Tensor) -> torch.Tensor:
        """q [B, W, d] (scaled), keys/values [B, H, S, D] -> [B, W, d]"""
        B, W, _ = q.shape
        q = q.view(B, W, self.heads, self.head_dim).transpose(1, 2).contiguous()  # [B, H, W, D]
        return cpu_kernels.attention(q, keys, values, sees, 1.0).reshape(B, W, -1).contiguous()

    def kept(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross-attention keys and values as this decoder keeps them (__init__'s cross_kv): fp16 copies where
        asked and in range, else the fp32 ones."""
        if self.cross_dtype == torch.float16 and _in_half_range(k) and _in_half_range(v):  # else this layer keeps fp32
            return k.half(), v.half()
        return k, v

    def _cross(self, i: int, layer: nn.Module, cache, encoder_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's cross-attention keys and values [B, H, frames, D]: read from the cache, where a window's first
        call (or its decoder's set-up) put them, as transformers' Whisper does."""
        cross = cache.cross_attention_cache
        if cache.is_updated.get(i):
            return cross.layers[i].keys, cross.layers[i].values
        shape = (encoder_out.shape[0], -1, self.heads, self.head_dim)
        a = layer.encoder_attn
        k, v = self.kept(a.k_proj(encoder_out).view(shape).transpose(1, 2).contiguous(),
                         a.v_proj(encoder_out).view(shape).transpose(1, 2).contiguous())
        cache.is_updated[i] = True
        return cross.update(k, v, i)

    def hidden(self, input_ids: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor, cache,
               encoder_out: torch.Tensor, keep: int) -> torch.Tensor:
        """input_ids, positions [B, W]; valid [B, L + W] bool, the self-attention cache's slots and the new ones
        (True: a real token); cache: an EncoderDecoderCache whose self-attention part holds L slots, to which
        the W new ones are appended; encoder_out [B, frames, d] -> the final norm's output [B, keep, d]."""
        B, W = input_ids.shape
        past = cache.self_attention_cache.get_seq_length()
        slots = past + W
        # the mask transformers' sdpa_mask builds: key j is seen by new column i when it is a real token no later
        # than i's own slot; cross-attention sees every frame
        causal = torch.arange(slots)[None, :] <= (past + torch.arange(W))[:, None]  # [W, L + W]
        sees = (valid[:, None, :] & causal[None]).to(torch.uint8).contiguous()  # [B, W, L + W]
        hidden = F.embedding(input_ids, self.embed) + self.positions[positions]  # [B, W, d]
        if self.native is not None and all(cache.is_updated.get(i) for i in range(len(self.layers))):
            cross = cache.cross_attention_cache  # every layer's, given at the decoder's set-up
            hidden = hidden.contiguous()
            self.native.run(hidden, cache.self_attention_cache, past, sees,
                            [(cross.layers[i].keys.contiguous(), cross.layers[i].values.contiguous())
                             for i in range(len(self.layers))])
            return layer_norm(hidden[:, -keep:], self.norm)
        sees_all = torch.ones((B, W, encoder_out.shape[1]), dtype=torch.uint8)
        for i, layer in enumerate(self.layers):
            a = layer.self_attn
            x = layer_norm(hidden, layer.self_attn_layer_norm)
            q = a.q_proj(x) * a.scaling
            k = a.k_proj(x).view(B, W, self.heads, self.head_dim).transpose(1, 2).contiguous()
            v = a.v_proj(x).view(B, W, self.heads, self.head_dim).transpose(1, 2).contiguous()
            keys, values = cache.self_attention_cache.update(k, v, i)  # views [B, H, L + W, D]
            hidden = hidden + a.out_proj(self._attend(q, keys, values, sees))
            c = layer.encoder_attn
            x = layer_norm(hidden, layer.encoder_attn_layer_norm)
            keys, values = self._cross(i, layer, cache, encoder_out)
            hidden = hidden + c.out_proj(self._attend(c.q_proj(x) * c.scaling, keys, values, sees_all))
            x = layer_norm(hidden, layer.final_layer_norm)
            hidden = hidden + layer.fc2(_gelu(layer.fc1(x)))
        return layer_norm(hidden[:, -keep:], self.norm)


def attach(model: nn.Module, cross_kv: torch.dtype = torch.float32, native: bool = False) -> nn.Module:
    """Give `model` its lean decoder as `model.lean_decoder` where `supports(model)`, else None there (set either
    way: a layer draft is a copy of its target and must not inherit the target's). Returns the model."""
    model.lean_decoder = LeanWhisperDecoder(model, cross_kv, native) if supports(model) else None
    return model
