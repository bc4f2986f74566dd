"""A lean forward for a Qwen2/Llama-family model on the CPU kernels: one function walks the layers with explicit
state, as gpt-fast's `generate.py` does, instead of transformers' modules.

Why: on two cores the packed target's step was ~72 ms, of which ~10 ms was neither a matmul nor attention
but transformers' per-layer plumbing (modules, keyword arguments, mask and cache bookkeeping: ~4,000 op
and call dispatches per step), and each of its 7 linear calls per layer paid a Python and ctypes toll. Here
the attention mask is built once per call, q/k/v are one kernel call and gate/up another (their packed rows
concatenated where they share a format), attention goes straight to the batch-invariant kernel.

Two paths, one per model (a run and its target-only reference always decode through the same one):
- native (models/native_forward.py, kernels/cpu/decoder_cpu.cpp): where every projection has 8-bit activations,
  all layers in one native call per step. Batch-invariant bit for bit; transformers' logits up to rounding.
- torch: otherwise. Every number is computed by the same operations in the same order as transformers'
  Qwen2 forward on the same modules (norms, rotary, residuals, SiLU; a fused projection's columns are
  computed exactly as each layer's own, since the kernels compute every output column alone), so the logits
  are the same bits (tests/test_lean.py), and batch invariance carries over.
Used only for packed linear layers, the batch-invariant attention, full attention (no sliding window) and a SiLU
MLP; everything else keeps transformers' forward.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from specviz.models import cpu_attention, cpu_kernels, native_forward
from specviz.models.arena import Arena, footprint
from specviz.models.packed import PackedLinear, fuse

_FAMILIES = ("qwen2", "llama")  # decoder layers of exactly this shape (q/k/v/o, gate/up/down, two RMS norms)


def supports(model: nn.Module) -> bool:
    """Whether `model` is one this forward runs (else transformers'): its torch path reproduces transformers' bits
    there, its native path the same model batch-invariantly (see the module's text)."""
    cfg = model.config
    if cfg.model_type not in _FAMILIES or cfg._attn_implementation != cpu_attention.NAME:
        return False
    if getattr(cfg, "use_sliding_window", False) or cfg.hidden_act != "silu":
        return False
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
        return False
    layers = model.model.layers
    return all(isinstance(m, PackedLinear) for layer in layers
               for m in (*_attention_linears(layer), *_mlp_linears(layer)))


def _attention_linears(layer: nn.Module) -> tuple[nn.Module, ...]:
    a = layer.self_attn
    return a.q_proj, a.k_proj, a.v_proj, a.o_proj


def _mlp_linears(layer: nn.Module) -> tuple[nn.Module, ...]:
    return layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # x [..., hidden]
    # transformers' Qwen2RMSNorm, operation for operation (fp32 models: its dtype casts are no-ops)
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # x [B, heads, W, D]
    half = x.shape[-1] // 2
    return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)


class _Layer:
    """One decoder layer's weights: fused projections where the formats allow, else the layer's own; every
    packed tensor placed by `place`."""

    def __init__(self, layer: nn.Module, place):
        q, k, v, self.o = _attention_linears(layer)
        gate, up, self.down = _mlp_linears(layer)
        self.qkv = fuse([q, k, v], place)  # one module, or None where q/k/v differ in format
        self.q, self.k, self.v = q, k, v
        self.gate_up = fuse([gate, up], place)
        for group, fused in (((q, k, v), self.qkv), ((gate, up), self.gate_up)):
            if fused is None:
                for m in group:
                    m.relocate(place)
        for m in (self.o, self.down):
            m.relocate(place)
        self.gate, self.up = gate, up
        self.norm1, self.eps1 = layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon
        self.norm2, self.eps2 = layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon
        self.widths = (q.out_features, k.out_features, v.out_features)
        self.intermediate = gate.out_features

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.qkv is not None:
            return self.qkv(x).split(self.widths, dim=-1)
        return self.q(x), self.k(x), self.v(x)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            gate, up = self.gate_up(x).split((self.intermediate, self.intermediate), dim=-1)
        else:
            gate, up = self.gate(x), self.up(x)
        return self.down(F.silu(gate) * up)


class LeanForward:
    """The forward of one supported model (see `supports`). Holds references to the model's own weights,
    fused projections besides (their packed rows are copied once; the model's layers then read views of
    them, so memory does not double). Every packed tensor moves into one arena of 2 MB pages
    (models/arena.py). Read-only after construction: one instance serves any number of decoders and threads."""

    ROTARY_TABLE_POSITIONS = 32768  # longer contexts compute their rotary per call past this

    def __init__(self, model: nn.Module):
        cfg = model.config
        self.model = model
        packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
        arena = Arena(footprint([t for m in packed for t in (getattr(m, n) for n in PackedLinear.BUFFERS)
                                 if t is not None]))
        self.embed = model.model.embed_tokens.weight
        self.rotary = model.model.rotary_emb
        self.layers = [_Layer(layer, arena.place) for layer in model.model.layers]
        if isinstance(model.lm_head, PackedLinear):
            model.lm_head.relocate(arena.place)
        self.norm, self.eps = model.model.norm.weight, model.model.norm.variance_epsilon
        self.head = model.lm_head
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scaling = model.model.layers[0].self_attn.scaling
        projections = [m for layer in model.model.layers for m in (*_attention_linears(layer), *_mlp_linears(layer))]
        norms = [w for layer in self.layers for w in (layer.norm1, layer.norm2)] + [model.model.norm.weight]
        self.native = (native_forward.NativeLayers(self.layers, cfg.hidden_size, self.heads, self.kv_heads,
                                                   self.head_dim, self.layers[0].intermediate, self.scaling)
                       if native_forward.applies(projections, norms) else None)
        self.norm = self.norm.contiguous()
        # The native path's rotary tables for every position, made once (rotary's ~10 small operations a call
        # become two lookups; 2 · positions · head_dim fp32: 16-32 MB for the embedded pair). Only where the
        # rotation does not depend on the call's length (default RoPE); a position's entry is one fixed value.
        self.rotary_table = None
        if self.native is not None and getattr(self.rotary, "rope_type", None) == "default":
            positions = torch.arange(min(cfg.max_position_embeddings, self.ROTARY_TABLE_POSITIONS))[None]
            with torch.inference_mode():
                cos, sin = self.rotary(self.embed[:1][None], positions)  # [1, P, D] each
            self.rotary_table = (cos[0], sin[0])

    def hidden(self, input_ids: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor, cache,
               keep: int) -> torch.Tensor:
        """input_ids, positions [B, W] (positions: each token's index among its row's valid tokens); valid
        [B, L + W] bool, the cache's slots and the new ones (True: a real token); cache: a BufferedCache
        holding L slots, to which the W new ones are appended -> the final norm's output [B, keep, hidden]
        for the last `keep` columns. Through the native layers where the model has them."""
        B, W = input_ids.shape
        past = cache.get_seq_length()
        slots = past + W
        # the mask transformers' sdpa_mask builds: key j is seen by new column i when it is a real token
        # and no later than i's own slot
        causal = torch.arange(slots)[None, :] <= (past + torch.arange(W))[:, None]  # [W, L + W]
        sees = (valid[:, None, :] & causal[None]).to(torch.uint8).contiguous()  # [B, W, L + W]
        hidden = F.embedding(input_ids, self.embed)  # [B, W, hidden]
        if self.native is not None:
            if self.rotary_table is not None and slots <= len(self.rotary_table[0]):  # positions < slots
                cos, sin = self.rotary_table[0][positions], self.rotary_table[1][positions]  # [B, W, D] each
            else:
                cos, sin = self.rotary(hidden, positions)
            hidden = hidden.contiguous()
            self.native.run(hidden, cache, past, cos.contiguous(), sin.contiguous(), sees)
            return native_forward.rms_norm_rows(hidden[:, -keep:], self.norm, self.eps)
        cos, sin = self.rotary(hidden, positions)  # [B, W, D] each
        H, Hkv, D = self.heads, self.kv_heads, self.head_dim
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        for i, layer in enumerate(self.layers):
            x = _rms_norm(hidden, layer.norm1, layer.eps1)
            q, k, v = layer.project_qkv(x)
            q = _rotate(q.view(B, W, H, D).transpose(1, 2), cos, sin)  # [B, H, W, D]
            k = _rotate(k.view(B, W, Hkv, D).transpose(1, 2), cos, sin)  # [B, Hkv, W, D]
            keys, values = cache.update(k, v.view(B, W, Hkv, D).transpose(1, 2), i)  # views [B, Hkv, L + W, D]
            attended = cpu_kernels.attention(q.contiguous(), keys, values, sees, self.scaling)  # [B, W, H, D]
            hidden = hidden + layer.o(attended.reshape(B, W, H * D))
            hidden = hidden + layer.mlp(_rms_norm(hidden, layer.norm2, layer.eps2))
        return _rms_norm(hidden[:, -keep:], self.norm, self.eps)

    def logits(self, input_ids: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor, cache,
               keep: int) -> torch.Tensor:
        """As `hidden`, through the model's output head -> logits [B, keep, V]."""
        return self.head(self.hidden(input_ids, valid, positions, cache, keep))


def attach(model: nn.Module) -> nn.Module:
    """Give `model` its lean forward as `model.lean_forward` where `supports(model)`, else None there; the
    text decoder runs whichever it finds. Returns the model."""
    model.lean_forward = LeanForward(model) if supports(model) else None
    return model
