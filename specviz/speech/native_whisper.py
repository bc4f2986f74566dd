"""A speech draft's decoder layers in one native call per step (kernels/cpu/decoder_cpu.cpp, specviz_whisper_layers).

Why: on the lean forward (speech.lean_decoder) the embedded 4-bit layer draft's step took 3.9 ms for ~1.4 ms of
bytes (its weights, head and the window's fp16 cross-attention keys and values): 41 kernel calls from Python,
~13 µs of wrapper each, and ~25 torch operations a layer (layer norms, GELU, views, cache writes). A draft's step
against the target's (c) is what decides whether speculation pays; with c at 0.4-0.5 speech barely did
(docs/benchmarks.md, "Speech").

Contract: drafts only. Batch-invariant bit for bit (each row by itself, the same operations whatever the call),
not transformers' bits: the layer norms reduce in their own order and GELU's erf is a polynomial within 1.5e-7,
so logits agree with the lean forward's to rounding (tests/test_asr.py measures it). A draft's numbers change how
often its tokens are accepted, never the output; the target keeps transformers' bits on the lean forward.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from specviz.models import cpu_kernels
from specviz.models.native_forward import Projection, claim_slots, projection
from specviz.models.packed import PackedLinear


class _WhisperLayer(ctypes.Structure):  # decoder_cpu.cpp's WhisperLayer: change both together
    _fields_ = [("norm_weight", ctypes.c_void_p * 3), ("norm_bias", ctypes.c_void_p * 3), ("eps", ctypes.c_double),
                ("q", Projection), ("k", Projection), ("v", Projection), ("o", Projection),
                ("cross_q", Projection), ("cross_o", Projection), ("fc1", Projection), ("fc2", Projection)]


def _projections(layer: nn.Module) -> list[nn.Module]:
    s, c = layer.self_attn, layer.encoder_attn
    return [s.q_proj, s.k_proj, s.v_proj, s.out_proj, c.q_proj, c.out_proj, layer.fc1, layer.fc2]


def _norms(layer: nn.Module) -> list[nn.LayerNorm]:
    return [layer.self_attn_layer_norm, layer.encoder_attn_layer_norm, layer.final_layer_norm]


def applies(model: nn.Module) -> bool:
    """Whether the native layers can run `model`'s decoder (a WhisperForConditionalGeneration on the lean forward):
    the build has them, every projection the layers use is packed for 8-bit activations, the norms are fp32 with
    one eps, and heads are a multiple of 8 wide."""
    decoder = model.model.decoder
    config = decoder.config
    if not (cpu_kernels.available() and bool(cpu_kernels.library().specviz_has_decoder())):
        return False
    if config.activation_function != "gelu" or (config.d_model // config.decoder_attention_heads) % 8:
        return False
    layers = list(decoder.layers)
    norms = [n for layer in layers for n in _norms(layer)]
    return (bool(layers) and all(isinstance(p, PackedLinear) and p.int8_activations
                                 for layer in layers for p in _projections(layer))
            and all(n.weight.dtype == torch.float32 and n.bias is not None for n in norms)
            and len({n.eps for n in norms}) == 1)


class NativeWhisperLayers:
    """A Whisper decoder's layers as decoder_cpu.cpp's array of WhisperLayer, pointing into the modules' tensors,
    which it holds. Read-only after construction: any thread may run it."""

    def __init__(self, model: nn.Module):
        decoder = model.model.decoder
        config = decoder.config
        self.hidden_size, self.heads = config.d_model, config.decoder_attention_heads
        self.head_dim = self.hidden_size // self.heads
        self.intermediate = decoder.layers[0].fc1.out_features
        self.scaling = decoder.layers[0].self_attn.scaling
        self.array = (_WhisperLayer * len(decoder.layers))()
        self._held: list[torch.Tensor] = []  # every tensor a pointer in `array` points into
        for entry, layer in zip(self.array, decoder.layers):
            norms = _norms(layer)
            weights = [n.weight.detach().contiguous() for n in norms]
            biases = [n.bias.detach().contiguous() for n in norms]
            self._held += weights + biases
            entry.norm_weight[:] = [w.data_ptr() for w in weights]
            entry.norm_bias[:] = [b.data_ptr() for b in biases]
            entry.eps = norms[0].eps
            projections = _projections(layer)
            for name, p in zip(("q", "k", "v", "o", "cross_q", "cross_o", "fc1", "fc2"), projections):
                setattr(entry, name, projection(p))
            self._held += [t for p in projections for t in (getattr(p, name) for name in PackedLinear.BUFFERS)
                           if t is not None]

    @property
    def layers(self) -> int:
        return len(self.array)

    def run(self, hidden: torch.Tensor, cache, past: int, sees: torch.Tensor,
            cross: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """hidden [B, W, E] fp32 contiguous, updated in place through every layer; cache: the BufferedCache of the
        self-attention holding `past` slots per layer, whose next W the layers write (fp32 or fp16, its kv_dtype);
        sees [B, W, past + W] uint8 contiguous; cross: each layer's window keys and values [B, H, frames, D], both
        fp16 or both fp32."""
        B, W, E = hidden.shape
        H, D = self.heads, self.head_dim
        frames = cross[0][0].shape[2]
        cross_dtype = cross[0][0].dtype
        if (E != self.hidden_size or hidden.dtype != torch.float32 or not hidden.is_contiguous()
                or sees.shape != (B, W, past + W) or sees.dtype != torch.uint8 or not sees.is_contiguous()
                or len(cross) != self.layers or cross_dtype not in (torch.float16, torch.float32)
                or any(t.shape != (B, H, frames, D) or t.dtype != cross_dtype or not t.is_contiguous()
                       for pair in cross for t in pair)):
            raise ValueError(f"a native Whisper call over hidden {tuple(hidden.shape)} {hidden.dtype}, mask "
                             f"{tuple(sees.shape)}, cross keys {tuple(cross[0][0].shape)} {cross_dtype} does not fit a "
                             f"decoder of width {self.hidden_size}, {H} heads, {self.layers} layers after {past} slots")
        kv_dtype = getattr(cache, "kv_dtype", torch.float32)
        keys, values, capacity = claim_slots(cache, self.layers, hidden.new_empty(B, H, W, D, dtype=kv_dtype), past)
        pointers = ctypes.c_void_p * self.layers
        cpu_kernels.library().specviz_whisper_layers(
            hidden.data_ptr(), self.array, self.layers, pointers(*keys), pointers(*values),
            int(kv_dtype == torch.float16), capacity, past, sees.data_ptr(),
            pointers(*(k.data_ptr() for k, _ in cross)), pointers(*(v.data_ptr() for _, v in cross)),
            int(cross_dtype == torch.float16), frames, B, W, E, H, D, self.intermediate,
            self.scaling, torch.get_num_threads())
