"""A model whose linear layers read their GGUF weights in packed form (specviz.models.gguf_pack) on the CPU.

Decoding on a CPU is bound by reading weights: the dequantized fp32 target reads 6.2 GB per step, its
Q4_K_M blocks hold 0.9 GB. `pack_gguf` packs (and checks) a GGUF file's blocks for every nn.Linear of a
transformers model loaded from it, and `apply_packed` swaps those layers for PackedLinear, which multiplies
straight from the blocks (kernels/cpu/qmatmul_cpu.cpp); norms,
embeddings, attention and biases stay as they were, in fp32.

Contract — a stated target, batch-invariant:
- Each packed weight is checked against the dense weight transformers dequantized from the same file before
  it is used (equal up to the last fp32 rounding). With fp32 activations (`--weights packed`) the packed
  target and `--weights dense` are one model.
- With 8-bit activations (`--weights packed-a8`, llama.cpp's way of running the same file) each row of a
  layer's input is quantized on its own, per group of 32 (scale = max|x| / 127): a different target from
  the dense one (its logits measured against it in docs/benchmarks.md), named in every trace.
- Either way a position's logits do not depend on what else is scored in the same call: never a per-call
  activation scale, and the kernel computes every output row with the same operations in the same order
  whatever the number of rows (bitwise; tested), prefill included.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from specviz.models import cpu_attention, cpu_kernels
from specviz.models.gguf_pack import Packed, UnsupportedBlocks, dequantize_reference, pack

FORMAT_VERSION = 3  # bump whenever the kernels read the packed bytes differently (v1: another nibble order; v2:
# without the k-quants' two-level scales)
PACKED_FILE = "packed.safetensors"

# GGUF tensor names (llama.cpp's qwen2/llama layout) -> transformers module names
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


class PackedLinear(nn.Module):
    """y = x · Wᵀ + b with W packed; a drop-in nn.Linear for fp32 inputs on the CPU, which the kernel
    multiplies as they are or, with int8_activations, quantized per row and group of 32. With 8-bit activations
    the weight is held in the kernels' interleaved layout (eight columns side by side, cpu_kernels.q4_interleave):
    q [N8, ...], and either the k-quants' two-level scales where the weight has them (sub, sup:
    cpu_kernels.super_interleave; scale and minv None) or scale / minv [N8, K/group, 8], in fp16 for q4 where fp16
    holds every one of them exactly (the 4-bit draft's: models/quant.py), else fp32. Otherwise the row-major
    one: q [N, ...], scale / minv [N, K/group]. `packed()` gives the row-major form either way."""

    def __init__(self, packed: Packed, bias: torch.Tensor | None, int8_activations: bool = False):
        super().__init__()
        self.kind, self.source, self.int8_activations = packed.kind, packed.source, int8_activations
        self.out_features, self.in_features = packed.shape
        q, scale, minv, sub, sup = packed.q, packed.scale, packed.minv, None, None
        if int8_activations and self.kind == "q4":
            q, scale, minv = cpu_kernels.q4_interleave(q, scale, minv)
        elif int8_activations:
            q, scale = cpu_kernels.q8_interleave(q, scale)
        if int8_activations and packed.sub is not None:  # the same bits from 5 (q4) or 5.5 (Q6_K) fewer bytes per 32
            sub, sup = cpu_kernels.super_interleave(packed.sub, packed.sup)
            scale = minv = None
        elif int8_activations and self.kind == "q4" and _fp16_exact(scale) and _fp16_exact(minv):
            scale, minv = scale.half(), minv.half()  # the same bits from 4 fewer bytes per 32 weights
        self.register_buffer("q", q, persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self.register_buffer("minv", minv, persistent=False)
        self.register_buffer("sub", sub, persistent=False)
        self.register_buffer("sup", sup, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous(), persistent=False)

    @property
    def scale_groups(self) -> int:
        """Scale groups along K (K/32, or K/16 for Q6_K)."""
        return (self.scale if self.sub is None else self.sub).shape[1]

    def packed(self) -> Packed:
        """The weight in the row-major format (gguf_pack.Packed)."""
        q, scale, minv, n = self.q, self.scale, self.minv, self.out_features
        sub = sup = None
        if self.sub is not None:
            sub, sup = cpu_kernels.super_deinterleave(self.sub, self.sup, n)
            scale, minv = self._flat_scales()
        if self.int8_activations and self.kind == "q4":
            q, scale, minv = cpu_kernels.q4_deinterleave(q, scale, minv, n)
        elif self.int8_activations:
            q, scale = cpu_kernels.q8_deinterleave(q, scale, n)
        return Packed(self.kind, q, scale, minv, self.source, sub, sup)

    def _flat_scales(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The two-level scales multiplied out, in the interleaved layout: scale [, minv] [N8, G, 8]."""
        if self.kind == "q4":  # sub [N8, G, 2, 8], sup [N8, G/8, 2, 8]
            full = self.sub.float() * self.sup.repeat_interleave(8, dim=1)
            return full[:, :, 0].contiguous(), full[:, :, 1].contiguous()
        return (self.sub.float() * self.sup.repeat_interleave(16, dim=1)).contiguous(), None

    @property
    def nbytes(self) -> int:
        """Bytes a call reads of the weight (its layout's own, padding included)."""
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.minv, self.sub, self.sup)
                   if t is not None)

    def dense(self) -> torch.Tensor:
        """The fp32 weight [N, K]."""
        p = self.packed()
        if self.kind == "q4":
            return cpu_kernels.q4_dequant(p.q, p.scale, p.minv)
        return cpu_kernels.q8_dequant(p.q, p.scale)

    def _matmul(self, rows: torch.Tensor) -> torch.Tensor:  # rows [M, K] fp32 contiguous -> [M, N]
        n = self.out_features
        if self.sub is not None and self.kind == "q4":
            return cpu_kernels.q4a8_super_matmul(rows, self.q, self.sub, self.sup, n, self.bias)
        if self.sub is not None:
            return cpu_kernels.q8a8_super_matmul(rows, self.q, self.sub, self.sup, n, self.bias)
        if self.int8_activations and self.scale.dtype == torch.float16:
            return cpu_kernels.q4a8_half_matmul(rows, self.q, self.scale, self.minv, n, self.bias)
        if self.int8_activations and self.kind == "q4":
            return cpu_kernels.q4a8_matmul(rows, self.q, self.scale, self.minv, n, self.bias)
        if self.int8_activations:
            return cpu_kernels.q8a8_matmul(rows, self.q, self.scale, n, self.bias)
        if self.kind == "q4":
            return cpu_kernels.q4_matmul(rows, self.q, self.scale, self.minv, self.bias)
        return cpu_kernels.q8_matmul(rows, self.q, self.scale, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., K] -> [..., N]
        rows = x.reshape(-1, self.in_features).float().contiguous()  # [M, K]
        step = cpu_kernels.max_rows()
        if rows.shape[0] <= step:
            y = self._matmul(rows)
        else:  # a long prefill: the same kernel over chunks of rows (each row's result is the same either way)
            y = torch.cat([self._matmul(rows[i:i + step]) for i in range(0, rows.shape[0], step)])
        return y.reshape(*x.shape[:-1], self.out_features)

    BUFFERS = ("q", "scale", "minv", "sub", "sup", "bias")

    @classmethod
    def holding(cls, like: "PackedLinear", tensors: dict[str, torch.Tensor | None], out_features: int,
                source: str) -> "PackedLinear":
        """A layer of `like`'s kind and activations on `tensors` (BUFFERS), already in its layout."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.kind, layer.source, layer.int8_activations = like.kind, source, like.int8_activations
        layer.out_features, layer.in_features = out_features, like.in_features
        for name in cls.BUFFERS:
            layer.register_buffer(name, tensors[name], persistent=False)
        return layer

    def relocate(self, place: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Move the weight's tensors to where `place` puts them (models/arena.py)."""
        for name in self.BUFFERS:
            if getattr(self, name) is not None:
                setattr(self, name, place(getattr(self, name)))

    def select_rows(self, ids: torch.Tensor) -> "PackedLinear":
        """A PackedLinear computing only outputs `ids` (LongTensor [K]); the rows keep their own scales."""
        whole = _leading_blocks(ids) if self.int8_activations else 0
        if whole:  # ids start with outputs 0 … 8·whole − 1, whole blocks already in the interleaved layout: kept as they
            # are, only the rest goes back to rows (the draft's 32K head: 100 → 6 ms a run; the same bits)
            rest = self.select_rows(ids[8 * whole:]) if len(ids) > 8 * whole else None
            tensors = {name: None if name == "bias" or getattr(self, name) is None else
                       getattr(self, name)[:whole] if rest is None else
                       torch.cat([getattr(self, name)[:whole], getattr(rest, name).to(getattr(self, name).dtype)])
                       for name in self.BUFFERS}
            tensors["bias"] = None if self.bias is None else self.bias.index_select(0, ids)
            return PackedLinear.holding(self, tensors, len(ids), self.source)
        if self.int8_activations:  # only the 8-column blocks holding `ids` go back to rows (a head is ~100 MB)
            blocks = torch.unique(ids // 8)  # sorted
            part = PackedLinear.holding(self, {name: None if name == "bias" or getattr(self, name) is None
                                               else getattr(self, name)[blocks] for name in self.BUFFERS},
                                        8 * len(blocks), self.source)
            p, at = part.packed(), torch.searchsorted(blocks, ids // 8) * 8 + ids % 8
        else:
            p, at = self.packed(), ids
        pick = lambda t: None if t is None else t.index_select(0, at)  # noqa: E731
        rows = Packed(self.kind, pick(p.q), pick(p.scale), pick(p.minv), self.source, pick(p.sub), pick(p.sup))
        return PackedLinear(rows, None if self.bias is None else self.bias.index_select(0, ids), self.int8_activations)

    def extra_repr(self) -> str:
        activations = "int8" if self.int8_activations else "fp32"
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.kind} from {self.source}, "
                f"{activations} activations")


def fuse(layers: list[PackedLinear], place: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
         ) -> PackedLinear | None:
    """One PackedLinear computing the outputs of `layers` side by side (their rows concatenated), or None
    when they differ in format (kind, scale groups, activations, bias or not), or, interleaved, when a layer's
    outputs are no whole number of 8-column blocks. The kernels compute every output column alone, so the
    fused layer's outputs are the same bits as each layer's own. The layers then hold views of the fused
    tensors: they keep working, and the weights are stored once. `place` puts each fused tensor where it
    should live (models/arena.py)."""
    first = layers[0]
    same = all(m.kind == first.kind and m.in_features == first.in_features
               and m.int8_activations == first.int8_activations and m.scale_groups == first.scale_groups
               and all((getattr(m, name) is None) == (getattr(first, name) is None) for name in PackedLinear.BUFFERS)
               and (m.scale is None or m.scale.dtype == first.scale.dtype)
               and (not m.int8_activations or m.out_features % 8 == 0)
               for m in layers)
    if not same:
        return None

    def cat(name: str) -> torch.Tensor | None:
        return None if getattr(first, name) is None else place(torch.cat([getattr(m, name) for m in layers]))

    fused = PackedLinear.holding(first, {name: cat(name) for name in PackedLinear.BUFFERS},
                                 sum(m.out_features for m in layers), "+".join(sorted({m.source for m in layers})))
    start = 0
    for m in layers:
        for name in PackedLinear.BUFFERS:
            if getattr(fused, name) is not None:
                per_row = 1 if name == "bias" or not m.int8_activations else 8  # interleaved tensors: blocks of 8
                setattr(m, name, getattr(fused, name)[start // per_row:(start + m.out_features) // per_row])
        start += m.out_features
    return fused


def _leading_blocks(ids: torch.Tensor) -> int:  # ids LongTensor [K]
    """How many whole blocks of 8 outputs `ids` starts with, in order: the largest w with ids[:8w] = 0 … 8w − 1."""
    off = (ids != torch.arange(len(ids), device=ids.device)).nonzero()
    return (int(off[0]) if len(off) else len(ids)) // 8


def _fp16_exact(t: torch.Tensor) -> bool:
    """Whether fp16 holds every value of t (fp32) exactly."""
    return bool(torch.equal(t.half().float(), t))


class PackingError(ValueError):
    """A GGUF file's blocks cannot stand in for the model's linear layers; the message says which and why."""


def _linear_names(model: nn.Module) -> dict[str, nn.Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def _candidates(module: str, tensors: dict) -> list[str]:
    """GGUF tensor names that may hold the weight of transformers module `module`."""
    if module == "lm_head":
        return [n for n in ("output.weight", "token_embd.weight") if n in tensors]  # tied heads read token_embd
    parts = module.split(".")
    if len(parts) >= 5 and parts[0] == "model" and parts[1] == "layers":
        sub = ".".join(parts[3:])
        for gguf, hf in _LAYER_NAMES.items():
            if hf == sub:
                return [f"blk.{parts[2]}.{gguf}.weight"]
    return []


def _matches(packed: Packed, dense: torch.Tensor) -> bool:
    if packed.shape != tuple(dense.shape):
        return False
    ref = dequantize_reference(packed)
    return bool((ref - dense.float()).abs().max() <= 1e-6 * max(float(dense.abs().max()), 1e-30))


def pack_gguf(model: nn.Module, gguf_path: Path, progress: Callable[[str, float | None], None] | None = None
              ) -> dict[str, Packed]:
    """Packed weights for every linear layer of `model` (loaded by transformers from gguf_path), each checked
    against the model's own dense weight. Raises PackingError when a layer has no matching GGUF tensor."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf_path)
    tensors = {t.name: t for t in reader.tensors}
    linears = _linear_names(model)
    out = {}
    for i, (name, linear) in enumerate(linears.items()):
        if progress:
            progress("packing the GGUF weights for the CPU kernels", i / len(linears))
        found = None
        for candidate in _candidates(name, tensors):
            t = tensors[candidate]
            try:
                packed = pack(np.asarray(t.data), t.tensor_type, int(t.shape[-1]))
            except UnsupportedBlocks as e:
                raise PackingError(f"{name}: {e}") from None
            if _matches(packed, linear.weight.detach()):
                found = packed
                break
        if found is None:
            raise PackingError(f"{name}: no tensor of {gguf_path.name} holds its weight "
                               f"(tried {', '.join(_candidates(name, tensors)) or 'none'})")
        out[name] = found
    return out


def save_packed(packed: dict[str, Packed], path: Path) -> None:
    """Write packed weights to one safetensors file, whole or not at all."""
    tensors, kinds = {}, {}
    for name, p in packed.items():
        for part in ("q", "scale", "minv", "sub", "sup"):
            if getattr(p, part) is not None:
                tensors[f"{name}.{part}"] = getattr(p, part).contiguous()
        kinds[name] = [p.kind, p.source]
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file(tensors, str(tmp), metadata={"specviz_packed": json.dumps({"version": FORMAT_VERSION, "kinds": kinds})})
    os.replace(tmp, path)


def _packed_meta(path: Path) -> dict | None:
    """The file's packing metadata when it is of this format version, else None (missing, unreadable, old)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("specviz_packed", "{}"))
    except Exception:  # a missing or truncated file: rebuilt by the caller
        return None
    return meta if meta.get("version") == FORMAT_VERSION else None


def packed_current(path: Path) -> bool:
    """Whether `path` holds packed weights this version of the kernels reads."""
    return _packed_meta(path) is not None


def load_packed(path: Path) -> dict[str, Packed] | None:
    """Packed weights saved by save_packed; None when the file is missing, unreadable or of another version."""
    meta = _packed_meta(path)
    if meta is None:
        return None
    tensors = load_file(str(path))
    return {name: Packed(kind, tensors[f"{name}.q"], tensors[f"{name}.scale"], tensors.get(f"{name}.minv"), source,
                         tensors.get(f"{name}.sub"), tensors.get(f"{name}.sup"))
            for name, (kind, source) in meta["kinds"].items()}


def apply_packed(model: nn.Module, packed: dict[str, Packed], int8_activations: bool = False) -> nn.Module:
    """Replace model's linear layers by PackedLinear, in place; the dense weights they held are released."""
    if int8_activations and not cpu_kernels.has_int8_activations():
        raise PackingError("8-bit activations need the AVX2 build of the CPU kernels, which this machine lacks")
    linears = _linear_names(model)
    missing = linears.keys() - packed.keys()
    if missing:
        raise PackingError(f"no packed weight for {len(missing)} linear layers (e.g. {sorted(missing)[0]})")
    tied = getattr(model.config, "tie_word_embeddings", False)
    for name, linear in linears.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, PackedLinear(packed[name], linear.bias, int8_activations))
    if tied:  # the input embedding keeps its own dense weight; the head no longer shares it
        model.config.tie_word_embeddings = False
    cpu_attention.use(model)  # the rest of the forward batch-invariant too, bit for bit (cpu_attention)
    return model


def describe(model: nn.Module) -> str:
    """What the model's linear layers run on, e.g. 'GGUF Q4_K/Q6_K blocks, specviz avx512-vnni kernel, ...'."""
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    if not layers:
        return f"dense {str(next(model.parameters()).dtype).removeprefix('torch.')}"
    sources = sorted({m.source for m in layers})
    isa = cpu_kernels.isa()
    activations = "int8 activations (per row, groups of 32)" if layers[0].int8_activations else "fp32 activations"
    attention = "batch-invariant attention" if model.config._attn_implementation == cpu_attention.NAME else \
        f"{model.config._attn_implementation} attention"
    blocks = f"GGUF {'/'.join(sources)} blocks" if all("specviz" not in s for s in sources) else \
        f"{'/'.join(sources)} blocks"  # a draft re-quantized by specviz.models.quant
    return f"{blocks}, specviz {isa} kernel, {activations}, {attention}"
