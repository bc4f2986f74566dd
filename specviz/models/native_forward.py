"""The decoder layers in one native call per step (kernels/decoder_cpu.cpp), for the lean forward's models whose
every projection has 8-bit activations.

Why: after the matmuls reached the memory's speed, the 0.5B draft's two-core step was still ~30% norms,
rotary, cache writes, SiLU and Python (4.1 of 14 ms, ~30 torch operations and 4 kernel calls per layer);
the draft's cost relative to the target's is what decides whether speculation pays (docs/benchmarks.md).

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

STAGES = ("norm", "qkv", "rotary_cache", "attention", "output", "gate_up", "swiglu", "down", "residual")
MATMUL_STAGES = ("qkv", "output", "gate_up", "down")


class _Projection(ctypes.Structure):  # decoder_cpu.cpp's Projection: change both together
    _fields_ = [("q", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("minv", ctypes.c_void_p),
                ("bias", ctypes.c_void_p), ("n", ctypes.c_int64), ("group", ctypes.c_int64)]


class _Layer(ctypes.Structure):  # decoder_cpu.cpp's Layer
    _fields_ = [("norm1", ctypes.c_void_p), ("norm2", ctypes.c_void_p), ("eps1", ctypes.c_double),
                ("eps2", ctypes.c_double), ("qkv", _Projection * 3), ("qkv_parts", ctypes.c_int64),
                ("o", _Projection), ("gate_up", _Projection * 2), ("gate_up_parts", ctypes.c_int64),
                ("down", _Projection)]


def applies(projections: list[PackedLinear]) -> bool:
    """Whether the native layers can run these (the lean forward's) projections: the build has them, and every
    projection is held for 8-bit activations."""
    return (cpu_kernels.available() and bool(cpu_kernels.library().specviz_has_decoder())
            and all(p.int8_activations for p in projections))


def _projection(p: PackedLinear) -> _Projection:
    group = 32 if p.kind == "q4" else p.in_features // p.scale.shape[1]
    return _Projection(p.q.data_ptr(), p.scale.data_ptr(), None if p.minv is None else p.minv.data_ptr(),
                       None if p.bias is None else p.bias.data_ptr(), p.out_features, group)


class NativeLayers:
    """The layers of a LeanForward as decoder_cpu.cpp's array of Layer. Points into the weights' own tensors, which
    the LeanForward holds for as long as this lives; read-only after construction (any thread may run it)."""

    def __init__(self, layers: list, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int,
                 scaling: float):
        self.shape = (hidden, heads, kv_heads, head_dim, intermediate)
        self.scaling = scaling
        self.array = (_Layer * len(layers))()
        for entry, layer in zip(self.array, layers):
            entry.norm1, entry.norm2 = layer.norm1.data_ptr(), layer.norm2.data_ptr()
            entry.eps1, entry.eps2 = layer.eps1, layer.eps2
            qkv = [layer.qkv] if layer.qkv is not None else [layer.q, layer.k, layer.v]
            gate_up = [layer.gate_up] if layer.gate_up is not None else [layer.gate, layer.up]
            for i, p in enumerate(qkv):
                entry.qkv[i] = _projection(p)
            for i, p in enumerate(gate_up):
                entry.gate_up[i] = _projection(p)
            entry.qkv_parts, entry.gate_up_parts = len(qkv), len(gate_up)
            entry.o, entry.down = _projection(layer.o), _projection(layer.down)
        for name in ("norm1", "norm2"):  # the pointers above are to these: fp32 and contiguous
            assert all(getattr(layer, name).is_contiguous() and getattr(layer, name).dtype == torch.float32
                       for layer in layers)

    def run(self, hidden: torch.Tensor, buffers: list[tuple[torch.Tensor, torch.Tensor]], past: int,
            cos: torch.Tensor, sin: torch.Tensor, sees: torch.Tensor) -> None:
        """hidden [B, W, E] fp32 contiguous, updated in place through every layer; buffers: each layer's cache
        buffers (keys, values) [B, Hkv, capacity, D], the W new slots at past …; cos, sin [B, W, D] contiguous;
        sees [B, W, past + W] uint8 contiguous."""
        B, W, E = hidden.shape
        hidden_size, H, Hkv, D, I = self.shape
        capacity = buffers[0][0].shape[2]
        if E != hidden_size or any(k.shape != (B, Hkv, capacity, D) or v.shape != k.shape for k, v in buffers):
            raise ValueError(f"cache buffers {[tuple(k.shape) for k, _ in buffers[:1]]} do not fit a call of "
                             f"{B} rows × {W} and capacity {capacity}")
        assert hidden.is_contiguous() and cos.is_contiguous() and sin.is_contiguous() and sees.is_contiguous()
        assert sees.shape == (B, W, past + W) and past + W <= capacity
        n = len(buffers)
        keys = (ctypes.c_void_p * n)(*(k.data_ptr() for k, _ in buffers))
        values = (ctypes.c_void_p * n)(*(v.data_ptr() for _, v in buffers))
        seconds = _timing.seconds if _timing.owner == threading.get_ident() else None
        cpu_kernels.library().specviz_decoder_layers(
            hidden.data_ptr(), self.array, n, keys, values, capacity, past, cos.data_ptr(), sin.data_ptr(),
            sees.data_ptr(), B, W, E, H, Hkv, D, I, self.scaling,
            None if seconds is None else seconds.ctypes.data, torch.get_num_threads())


class _Timing:
    """Per-stage seconds the native layers add up while `stage_seconds` is open. Written by the one thread that
    opened it (the benchmark's) and read after: other threads' calls see owner != their id and pass no timer."""

    def __init__(self):
        self.owner: int | None = None
        self.seconds = None


_timing = _Timing()


@contextlib.contextmanager
def stage_seconds() -> Iterator[dict[str, float]]:
    """Within the block, this thread's native-layer calls add each stage's wall time; the yielded dict holds
    them ({stage: seconds}) once the block ends. One block open at a time (a benchmark's)."""
    import numpy as np

    if _timing.owner is not None:
        raise RuntimeError("stage_seconds is already open")
    _timing.owner, _timing.seconds = threading.get_ident(), np.zeros(len(STAGES))
    out: dict[str, float] = {}
    try:
        yield out
    finally:
        out.update(zip(STAGES, _timing.seconds.tolist()))
        _timing.owner, _timing.seconds = None, None
