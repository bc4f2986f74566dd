"""The decoder layers in one native call per step (kernels/cpu/decoder_cpu.cpp), for the lean forward's models whose
every projection has 8-bit activations.

Why: after the matmuls reached the memory's speed, the 0.5B draft's two-core step was still ~30% norms,
rotary, cache writes, SiLU and Python (4.1 of 14 ms, ~30 torch operations and 4 kernel calls per layer);
the draft's cost relative to the target's is what decides whether speculation pays (docs/history.md).

Contract: batch-invariant bit for bit (each row computed alone, by the same operations whatever the call),
not transformers' bits: its norms and SiLU reduce in their own order, so logits agree to rounding
(tests/test_lean.py measures it). One model decodes through one path, so a run and its target-only
reference see the same model.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from typing import Iterator

import torch

from specviz.models import cpu_kernels
from specviz.models.packed import PackedLinear

KV_DTYPES = (torch.float32, torch.float16)  # what a cache's kv_dtype may ask of the native layers
MAX_HALF_HEAD_DIM = 512  # decoder_cpu.cpp's MAX_HEAD_DIM
STAGES = ("norm", "qkv", "rotary_cache", "attention", "output", "gate_up", "swiglu", "down", "residual")
MATMUL_STAGES = ("qkv", "output", "gate_up", "down")


class Projection(ctypes.Structure):  # decoder_cpu.cpp's Projection: change both together
    _fields_ = [("q", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("minv", ctypes.c_void_p),
                ("sub", ctypes.c_void_p), ("sup", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("n", ctypes.c_int64),
                ("group", ctypes.c_int64), ("q4", ctypes.c_int64), ("half", ctypes.c_int64)]


class _Layer(ctypes.Structure):  # decoder_cpu.cpp's Layer
    _fields_ = [("norm1", ctypes.c_void_p), ("norm2", ctypes.c_void_p), ("eps1", ctypes.c_double),
                ("eps2", ctypes.c_double), ("qkv", Projection * 3), ("qkv_parts", ctypes.c_int64),
                ("o", Projection), ("gate_up", Projection * 2), ("gate_up_parts", ctypes.c_int64),
                ("down", Projection)]


def applies(projections: list[PackedLinear], norms: list[torch.Tensor]) -> bool:
    """Whether the native layers can run these (the lean forward's) projections and norm weights: the build has
    them, every projection is held for 8-bit activations, and the norms are fp32."""
    return (cpu_kernels.available() and bool(cpu_kernels.library().specviz_has_decoder())
            and all(p.int8_activations for p in projections) and all(w.dtype == torch.float32 for w in norms))


def projection(p: PackedLinear) -> Projection:
    """decoder_cpu.cpp's view of a packed projection (pointers into p's tensors: the caller holds them)."""
    ptr = cpu_kernels.address
    return Projection(p.q.data_ptr(), ptr(p.scale), ptr(p.minv), ptr(p.sub), ptr(p.sup), ptr(p.bias),
                      p.out_features, p.in_features // p.scale_groups, int(p.kind == "q4"),
                      int(p.scale is not None and p.scale.dtype == torch.float16))


def claim_slots(cache, layers: int, like: torch.Tensor, past: int) -> tuple[list[int], list[int], int]:
    """Every layer's room for a native call's new slots (like [B, Hkv, W, D]) in `cache` (a BufferedCache), each
    starting at `past` -> the layers' key and value buffer addresses and their one capacity (the kernels take one)."""
    keys, values, capacity = [], [], None
    for i in range(layers):
        k, v, start = cache.claim(i, like)
        capacity = k.shape[2] if capacity is None else capacity
        if start != past or k.shape[2] != capacity:  # the cache's layers grow together; the kernel takes one
            raise ValueError(f"layer {i} of the cache holds {start} of {k.shape[2]} slots, layer 0 {past} of "
                             f"{capacity}")
        keys.append(k.data_ptr())
        values.append(v.data_ptr())
    return keys, values, capacity


class NativeLayers:
    """The layers of a LeanForward as decoder_cpu.cpp's array of Layer, pointing into the weights' tensors, which it
    holds itself (a later LeanForward over the same model moves the modules' tensors to its own arena; these stay).
    Read-only after construction: any thread may run it."""

    def __init__(self, layers: list, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int,
                 scaling: float):
        self.shape = (hidden, heads, kv_heads, head_dim, intermediate)
        self.scaling = scaling
        self.array = (_Layer * len(layers))()
        self._held: list[torch.Tensor] = []  # every tensor a pointer in `array` points into
        for entry, layer in zip(self.array, layers):
            norms = [w.contiguous() for w in (layer.norm1, layer.norm2)]
            self._held += norms
            entry.norm1, entry.norm2 = norms[0].data_ptr(), norms[1].data_ptr()
            entry.eps1, entry.eps2 = layer.eps1, layer.eps2
            qkv = [layer.qkv] if layer.qkv is not None else [layer.q, layer.k, layer.v]
            gate_up = [layer.gate_up] if layer.gate_up is not None else [layer.gate, layer.up]
            for i, p in enumerate(qkv):
                entry.qkv[i] = projection(p)
            for i, p in enumerate(gate_up):
                entry.gate_up[i] = projection(p)
            entry.qkv_parts, entry.gate_up_parts = len(qkv), len(gate_up)
            entry.o, entry.down = projection(layer.o), projection(layer.down)
            self._held += [t for p in (*qkv, *gate_up, layer.o, layer.down)
                           for t in (getattr(p, name) for name in PackedLinear.BUFFERS) if t is not None]

    @property
    def layers(self) -> int:
        return len(self.array)

    def _check(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sees: torch.Tensor,
               past: int) -> None:
        """ValueError unless a call over hidden [B, W, E] with these tables and mask fits this model."""
        B, W, E = hidden.shape
        hidden_size, H, Hkv, D, I = self.shape
        tables = all(t.shape == (B, W, D) and t.dtype == torch.float32 and t.is_contiguous() for t in (cos, sin))
        if (E != hidden_size or hidden.dtype != torch.float32 or not hidden.is_contiguous() or not tables
                or sees.shape != (B, W, past + W) or sees.dtype != torch.uint8 or not sees.is_contiguous()):
            raise ValueError(f"a native call over hidden {tuple(hidden.shape)} {hidden.dtype}, rotary tables "
                             f"{tuple(cos.shape)}, mask {tuple(sees.shape)} does not fit a model of hidden size "
                             f"{hidden_size} and head size {D} after {past} slots")

    def run(self, hidden: torch.Tensor, cache, past: int, cos: torch.Tensor, sin: torch.Tensor,
            sees: torch.Tensor) -> None:
        """hidden [B, W, E] fp32 contiguous, updated in place through every layer; cache: the BufferedCache holding
        `past` slots per layer, whose next W the layers write their keys and values into (in its kv_dtype: fp32, or
        fp16 for a draft, rounded as they are written); cos, sin [B, W, D] fp32
        contiguous; sees [B, W, past + W] uint8 contiguous. Checked before the cache hands out any slot."""
        self._check(hidden, cos, sin, sees, past)
        B, W, E = hidden.shape
        _, H, Hkv, D, I = self.shape
        kv_dtype = getattr(cache, "kv_dtype", torch.float32)
        if kv_dtype not in KV_DTYPES or (kv_dtype == torch.float16 and D > MAX_HALF_HEAD_DIM):
            raise ValueError(f"the native layers keep keys and values in fp32, or fp16 for heads of at most "
                             f"{MAX_HALF_HEAD_DIM}; asked for {kv_dtype} at head size {D}")
        held = next((layer.keys.dtype for layer in getattr(cache, "layers", ()) if layer.keys is not None), kv_dtype)
        if held != kv_dtype:  # the kernel would write one format into the other
            raise ValueError(f"the cache holds {held} keys and values; the native layers were asked to write {kv_dtype}")
        keys, values, capacity = claim_slots(cache, self.layers, hidden.new_empty(B, Hkv, W, D, dtype=kv_dtype), past)
        seconds = _timing.seconds_for(threading.get_ident())
        cpu_kernels.library().specviz_decoder_layers(
            hidden.data_ptr(), self.array, self.layers, (ctypes.c_void_p * self.layers)(*keys),
            (ctypes.c_void_p * self.layers)(*values), int(kv_dtype == torch.float16), capacity, past,
            cos.data_ptr(), sin.data_ptr(),
            sees.data_ptr(), B, W, E, H, Hkv, D, I, self.scaling,
            None if seconds is None else seconds.ctypes.data, torch.get_num_threads())


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., E] fp32 -> each row RMS-normalized times weight [E] fp32, by the native layers' own row norm (one
    call, where torch's takes five operations)."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty_like(rows)
    cpu_kernels.library().specviz_rms_norm_rows(rows.data_ptr(), weight.data_ptr(), eps, rows.shape[0],
                                                rows.shape[1], out.data_ptr())
    return out.reshape(x.shape)


class _Timing:
    """Per-stage seconds the native layers add up while `stage_seconds` is open. Opened and closed under the lock;
    only the thread that opened it gets the array (other threads' calls pass no timer), and it is read after."""

    def __init__(self):
        self.lock = threading.Lock()
        self.owner: int | None = None
        self.seconds = None

    def seconds_for(self, thread: int):
        return self.seconds if self.owner == thread else None


_timing = _Timing()


@contextlib.contextmanager
def stage_seconds() -> Iterator[dict[str, float]]:
    """Within the block, this thread's native-layer calls add each stage's wall time; the yielded dict holds
    them ({stage: seconds}) once the block ends. One block open at a time (a benchmark's)."""
    import numpy as np

    with _timing.lock:
        if _timing.owner is not None:
            raise RuntimeError("stage_seconds is already open")
        _timing.owner, _timing.seconds = threading.get_ident(), np.zeros(len(STAGES))
    out: dict[str, float] = {}
    try:
        yield out
    finally:
        with _timing.lock:
            out.update(zip(STAGES, _timing.seconds.tolist()))
            _timing.owner, _timing.seconds = None, None
