"""GGUF quantized blocks -> the CPU kernels' packed formats, with no second rounding.

llama.cpp's block formats are integers times per-group scales (and, for Q4_K, minus per-group minimums).
Each maps to one of two formats the kernels read (kernels/cpu/qmatmul_cpu.cpp):

- q4 (from Q4_K): 4-bit q in 0..15, two per byte (element 2i in the low nibble), w = scale[g] * q - min[g]
  over groups of 32. Q4_K's scales
  are two-level (an fp16 super-block scale times a 6-bit integer); their product has at most 17 significant
  bits, so it is exact in fp32.
- q8 (from Q6_K, Q5_0, Q8_0): int8 q, w = scale[g] * q over groups of 16 (Q6_K) or 32; the formats' fixed
  offsets (Q6_K's -32, Q5_0's -16) are folded into q, which stays within int8.

Every weight is therefore the same number llama.cpp's dequantization gives, up to the final fp32 multiply.

Q4_K and Q6_K also keep their two levels as they are (`sub`, `sup`): an integer per group and an fp32 per 256
elements, whose product is the flat scale exactly (checked here). The 8-bit-activation kernels read those:
3 bytes of scales per 32 weights instead of 8 for Q4_K, 2.5 instead of 8 for Q6_K (kernels/cpu/qmatmul_cpu.cpp,
SuperQ4 / SuperQ8).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT


class UnsupportedBlocks(ValueError):
    """A tensor's GGUF type has no packed form here (it stays dense)."""


@dataclass(frozen=True)
class Packed:
    """One weight [N, K] in a kernel format: q4 (q uint8 [N, K/2], scale and minv fp32 [N, K/32]) or q8
    (q int8 [N, K], scale fp32 [N, K/G], minv None). From Q4_K and Q6_K also the two levels those scales are made
    of: q4 sub uint8 [N, K/32, 2] (scale, minimum) and sup fp32 [N, K/256, 2] (d, dmin), scale = sub[..., 0] ·
    sup[..., 0] per group (minv likewise with 1); q8 sub int8 [N, K/16], sup fp32 [N, K/256]. None otherwise."""

    kind: str  # "q4" or "q8"
    q: torch.Tensor
    scale: torch.Tensor
    minv: torch.Tensor | None
    source: str  # the GGUF block type, e.g. "Q4_K"
    sub: torch.Tensor | None = None
    sup: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        n = self.q.shape[0]
        return (n, self.q.shape[1] * 2) if self.kind == "q4" else (n, self.q.shape[1])

    @property
    def nbytes(self) -> int:
        """Bytes of the weight and its flat scales (what the fp32-activation kernels read)."""
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.minv) if t is not None)


def _f16(raw: np.ndarray) -> np.ndarray:
    """uint8 [..., 2] little-endian halves -> float32 [...]."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """q uint8 [..., 2n] in 0..15 -> [..., n]: byte i holds element 2i (low nibble) and 2i + 1 (high)."""
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    """blocks uint8 [N, nb, 144] -> q [N, nb*8, 32] (0..15), scale and min [N, nb*8], and their two levels:
    sub uint8 [N, nb*8, 2] (scale, min), sup fp32 [N, nb, 2] (d, dmin)."""
    d = _f16(blocks[..., 0:2])
    dmin = _f16(blocks[..., 2:4])
    s = blocks[..., 4:16].astype(np.uint8)
    qs = blocks[..., 16:144]
    sc = np.empty((*blocks.shape[:2], 8), dtype=np.uint8)
    mn = np.empty_like(sc)
    sc[..., :4] = s[..., 0:4] & 63
    mn[..., :4] = s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    # 4 chunks of 64 elements: the low nibbles of a chunk's 32 bytes are sub-block 2c, the high ones 2c + 1
    chunks = qs.reshape(*blocks.shape[:2], 4, 32)
    q = np.stack([chunks & 0xF, chunks >> 4], axis=3).reshape(*blocks.shape[:2], 8, 32)
    scale = d[..., None] * sc.astype(np.float32)
    minv = dmin[..., None] * mn.astype(np.float32)
    n = blocks.shape[0]
    sub = np.stack([sc, mn], axis=-1).reshape(n, -1, 2)
    sup = np.stack([d, dmin], axis=-1)
    return q.reshape(n, -1, 32), scale.reshape(n, -1), minv.reshape(n, -1), sub, sup


def _q6_k(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    """blocks uint8 [N, nb, 210] -> q int8 [N, nb*256] (q - 32), scale [N, nb*16], and its two levels: sub int8
    [N, nb*16], sup fp32 [N, nb]."""
    ql, qh = blocks[..., 0:128], blocks[..., 128:192]
    sub = blocks[..., 192:208].copy().view(np.int8)
    sc = sub.astype(np.float32)
    d = _f16(blocks[..., 208:210])
    q = np.empty((*blocks.shape[:2], 256), dtype=np.int16)
    for half in range(2):
        lo = ql[..., 64 * half: 64 * half + 64]
        hi = qh[..., 32 * half: 32 * half + 32]
        base = 128 * half
        q[..., base + 0: base + 32] = (lo[..., :32] & 0xF) | (((hi >> 0) & 3) << 4)
        q[..., base + 32: base + 64] = (lo[..., 32:] & 0xF) | (((hi >> 2) & 3) << 4)
        q[..., base + 64: base + 96] = (lo[..., :32] >> 4) | (((hi >> 4) & 3) << 4)
        q[..., base + 96: base + 128] = (lo[..., 32:] >> 4) | (((hi >> 6) & 3) << 4)
    n = blocks.shape[0]
    return (q - 32).astype(np.int8).reshape(n, -1), (d[..., None] * sc).reshape(n, -1), sub.reshape(n, -1), d


def _q5_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """blocks uint8 [N, nb, 22] -> q int8 [N, nb*32] (q - 16), scale [N, nb]."""
    d = _f16(blocks[..., 0:2])
    qh = np.ascontiguousarray(blocks[..., 2:6]).view(np.uint32)[..., 0]
    qs = blocks[..., 6:22]
    bits = (qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1
    lo = np.concatenate([qs & 0xF, qs >> 4], axis=-1).astype(np.int16)
    q = lo | (bits.astype(np.int16) << 4)
    n = blocks.shape[0]
    return (q - 16).astype(np.int8).reshape(n, -1), d.reshape(n, -1)


def _q8_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """blocks uint8 [N, nb, 34] -> q int8 [N, nb*32], scale [N, nb]."""
    d = _f16(blocks[..., 0:2])
    q = np.ascontiguousarray(blocks[..., 2:34]).view(np.int8)
    n = blocks.shape[0]
    return q.reshape(n, -1), d.reshape(n, -1)


_BLOCK = {QT.Q4_K: 144, QT.Q6_K: 210, QT.Q5_0: 22, QT.Q8_0: 34}
SUPPORTED = tuple(t.name for t in _BLOCK)


def pack(raw: np.ndarray, kind: QT, rows: int) -> Packed:
    """raw: a GGUF tensor's bytes (uint8, any shape, row-major over `rows` output rows) -> its packed form."""
    if kind not in _BLOCK:
        raise UnsupportedBlocks(f"GGUF blocks of type {kind.name} have no packed form (supported: {', '.join(SUPPORTED)})")
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, _BLOCK[kind])
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    if kind == QT.Q4_K:
        q, scale, minv, sub, sup = _q4_k(blocks)
        return two_level(Packed("q4", t(_pack_nibbles(q).reshape(rows, -1)), t(scale), t(minv), kind.name, t(sub),
                                t(sup)))
    if kind == QT.Q6_K:
        q, scale, sub, sup = _q6_k(blocks)
        return two_level(Packed("q8", t(q), t(scale), None, kind.name, t(sub), t(sup)))
    q, scale = {QT.Q5_0: _q5_0, QT.Q8_0: _q8_0}[kind](blocks)
    return Packed("q8", t(q), t(scale), None, kind.name)


def two_level(p: Packed) -> Packed:
    """p with its two-level scales where they give its flat scales exactly (always, for llama.cpp's own blocks:
    an fp16 times an integer of at most 8 bits), else without them."""
    if p.sub is None or p.sup is None:
        return p
    if p.kind == "q4":
        n, groups = p.sub.shape[:2]
        expand = lambda part: (p.sub[..., part].float().reshape(n, -1, 8)  # noqa: E731
                               * p.sup[..., part].reshape(n, -1, 1)).reshape(n, groups)
        exact = torch.equal(expand(0), p.scale) and torch.equal(expand(1), p.minv)
    else:
        n, groups = p.sub.shape
        exact = groups == p.scale.shape[1] and torch.equal(
            (p.sub.float().reshape(n, -1, 16) * p.sup.reshape(n, -1, 1)).reshape(n, groups), p.scale)
    return p if exact else Packed(p.kind, p.q, p.scale, p.minv, p.source)


def dequantize_reference(packed: Packed) -> torch.Tensor:
    """The dense fp32 weight [N, K] of a packed weight, computed in torch (independent of the C++ kernels)."""
    if packed.kind == "q4":
        q = packed.q
        n = q.shape[0]
        values = torch.stack([q & 0xF, q >> 4], dim=-1).reshape(n, -1, 32).float()  # [N, G, 32]
        w = values * packed.scale[..., None] - packed.minv[..., None]
        return w.reshape(n, -1)
    n, k = packed.q.shape
    group = k // packed.scale.shape[1]
    return (packed.q.float().reshape(n, -1, group) * packed.scale[..., None]).reshape(n, k)
