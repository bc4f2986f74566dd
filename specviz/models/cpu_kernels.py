"""The models' CPU kernels (kernels/cpu/qmatmul_cpu.cpp, kernels/cpu/attention_cpu.cpp): packed matrix multiplies and
the batch-invariant attention, called through ctypes on the library specviz.native builds once per machine.
"""

from __future__ import annotations

import ctypes

import torch

from specviz import native
from specviz.native import SOURCES, KernelBuildError, library, source_digest  # noqa: F401 (the models' entry points)


# Through this module's own `library`, so that a test replacing it (no compiler, say) reaches these too.
def available() -> bool:
    """Whether the kernels' library builds and loads here."""
    return native.available(library)


def max_rows() -> int:
    """The most rows one kernel call takes (its per-thread accumulators are sized for it)."""
    library()
    return native.max_rows()


def vectorized() -> bool:
    """Whether the build has the AVX2/FMA path (else the portable scalar one)."""
    return bool(library().specviz_has_avx2())


def isa() -> str:
    """The instruction set the 8-bit-activation kernels run here: avx512-vnni+amx, avx512-vnni, avx-vnni, avx2 or
    portable."""
    return library().specviz_isa().decode()


def amx_min_rows(rows: int | None = None) -> int | None:
    """The fewest rows a q4 8-bit-activation call needs to take AMX's tiles (q8: twice as many; 0: never); with `rows`, set it and return
    the value before. None where this machine, build or process has no AMX (the VNNI tiles then run every call;
    both give the same bits)."""
    if not has_int8_activations():
        return None
    before = library().specviz_amx_min_rows(-1 if rows is None else rows)
    return None if before < 0 else before


def has_int8_activations() -> bool:
    """Whether the build has the 8-bit-activation kernels (they need AVX2)."""
    return bool(library().specviz_has_a8())


def int8_peak_macs(iterations: int) -> float:
    """Runs the int8 dot-product sequence the kernels use with operands in registers, on torch's threads;
    returns the multiply-adds done (time the call for the peak rate). Where has_int8_activations() only."""
    return library().specviz_int8_peak(iterations, torch.get_num_threads())


def address(t: torch.Tensor | None) -> int | None:
    """A tensor's data pointer for ctypes, None (a null pointer) for None."""
    return None if t is None else t.data_ptr()


def q4_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] fp32 contiguous (M <= max_rows(), K a multiple of 64), q [N, K/2] uint8, scale/minv [N, K/32]
    fp32, bias [N] fp32 or None -> y [M, N]."""
    M, K = x.shape
    N = q.shape[0]
    y = torch.empty((M, N), dtype=torch.float32)
    library().specviz_q4_matmul(x.data_ptr(), M, K, q.data_ptr(), scale.data_ptr(), minv.data_ptr(), N, address(bias),
                                y.data_ptr(), torch.get_num_threads())
    return y


def q8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] fp32 contiguous (M <= max_rows(), K a multiple of 32), q [N, K] int8, scale [N, K/G] fp32
    (G = 16 or 32), bias [N] fp32 or None -> y [M, N]."""
    M, K = x.shape
    N = q.shape[0]
    y = torch.empty((M, N), dtype=torch.float32)
    library().specviz_q8_matmul(x.data_ptr(), M, K, q.data_ptr(), scale.data_ptr(), K // scale.shape[1], N,
                                address(bias), y.data_ptr(), torch.get_num_threads())
    return y


def f16_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] fp32 contiguous (K a multiple of 8), weight [N, K] fp16 contiguous, bias [N] fp32 or None -> y [M, N]
    fp32 (kernels/cpu/half_matmul_cpu.cpp: any M, each row's outputs the same bits whatever else is in the call)."""
    M, K = x.shape
    N = weight.shape[0]
    if (K % 8 or weight.shape[1] != K or weight.element_size() != 2 or not weight.is_contiguous()
            or x.dtype != torch.float32 or not x.is_contiguous()
            or (bias is not None and (bias.dtype != torch.float32 or bias.shape != (N,) or not bias.is_contiguous()))):
        raise ValueError(f"f16_matmul: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}, "
                         "bias: a contiguous fp32 x, a contiguous 2-byte weight [N, K] and K a multiple of 8 are needed")
    y = torch.empty((M, N), dtype=torch.float32)
    library().specviz_f16_matmul(x.data_ptr(), M, K, weight.data_ptr(), N, address(bias), y.data_ptr(),
                                 torch.get_num_threads())
    return y


# The 8-bit-activation kernels read their weights interleaved: eight output columns side by side
# (kernels/cpu/qmatmul_cpu.cpp has the byte layout). N8 = ceil(N / 8), the number of 8-column blocks.

def q4_interleave(q: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [N, K/2] uint8, scale/minv [N, K/32] -> qi [N8, 4K] uint8, si/mi [N8, K/32, 8] (zero past N)."""
    N, K = q.shape[0], q.shape[1] * 2
    N8, G = -(-N // 8), K // 32
    qi = torch.empty((N8, 4 * K), dtype=torch.uint8)
    si, mi = torch.empty((N8, G, 8)), torch.empty((N8, G, 8))
    q, scale, minv = q.contiguous(), scale.contiguous(), minv.contiguous()  # held until the call returns
    library().specviz_q4_interleave(q.data_ptr(), scale.data_ptr(), minv.data_ptr(), N, K, qi.data_ptr(),
                                    si.data_ptr(), mi.data_ptr())
    return qi, si, mi


def q8_interleave(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K] int8, scale [N, K/G] -> qi [N8, 8K] uint8 (w + 128), si [N8, K/G, 8] (zero past N)."""
    N, K = q.shape
    N8, G = -(-N // 8), scale.shape[1]
    qi = torch.empty((N8, 8 * K), dtype=torch.uint8)
    si = torch.empty((N8, G, 8))
    q, scale = q.contiguous(), scale.contiguous()  # held until the call returns
    library().specviz_q8_interleave(q.data_ptr(), scale.data_ptr(), K // G, N, K, qi.data_ptr(), si.data_ptr())
    return qi, si


def super_interleave(sub: torch.Tensor, sup: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The k-quants' two-level scales (gguf_pack.Packed.sub / .sup) in the kernels' layout: sub [N, G, *parts]
    -> [N8, G, *parts, 8], sup [N, S, *parts] -> [N8, S, *parts, 8] (column n of block b in lane n % 8; zero past N).
    q4: parts (scale, minimum); q8: none."""
    def blocks(t: torch.Tensor) -> torch.Tensor:
        n = t.shape[0]
        padded = torch.zeros((-(-n // 8) * 8, *t.shape[1:]), dtype=t.dtype)
        padded[:n] = t
        rest = list(range(2, t.dim() + 1))
        return padded.reshape(-1, 8, *t.shape[1:]).permute(0, *rest, 1).contiguous()
    return blocks(sub), blocks(sup)


def super_deinterleave(subi: torch.Tensor, supi: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of super_interleave for the first n columns."""
    def rows(t: torch.Tensor) -> torch.Tensor:
        order = (0, t.dim() - 1, *range(1, t.dim() - 1))
        return t.permute(*order).reshape(-1, *t.shape[1:-1])[:n].contiguous()
    return rows(subi), rows(supi)


def _columns(interleaved: torch.Tensor, n: int) -> torch.Tensor:  # [N8, G, 8] -> [n, G] fp32
    return interleaved.transpose(1, 2).reshape(-1, interleaved.shape[1])[:n].float().contiguous()


def q4_deinterleave(qi: torch.Tensor, si: torch.Tensor, mi: torch.Tensor, n: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of q4_interleave for the first n columns: q [n, K/2], scale/minv [n, K/32]."""
    N8, K = qi.shape[0], qi.shape[1] // 4
    halves = torch.stack([qi & 15, qi >> 4], -1).reshape(N8, K // 8, 8, 4, 2)  # [block, chunk, column, i, half]
    elements = halves.permute(0, 2, 1, 4, 3).reshape(N8 * 8, K)[:n]  # element 8·chunk + 4·half + i
    q = elements[:, 0::2] | (elements[:, 1::2] << 4)
    return q.contiguous(), _columns(si, n), _columns(mi, n)


def q8_deinterleave(qi: torch.Tensor, si: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of q8_interleave for the first n columns: q [n, K] int8, scale [n, K/G]."""
    N8, K = qi.shape[0], qi.shape[1] // 8
    stored = qi.reshape(N8, K // 4, 8, 4).permute(0, 2, 1, 3).reshape(N8 * 8, K)[:n]
    return (stored.to(torch.int16) - 128).to(torch.int8).contiguous(), _columns(si, n)


def _a8(kernel: str, x: torch.Tensor, weight: tuple, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """One 8-bit-activation kernel call: x [M, K] fp32 contiguous, the weight's interleaved tensors (and a q8's
    group) in the kernel's order, n output columns, bias [n] or None -> y [M, n]."""
    M, K = x.shape
    y = torch.empty((M, n), dtype=torch.float32)
    args = [w.data_ptr() if isinstance(w, torch.Tensor) else w for w in weight]
    getattr(library(), kernel)(x.data_ptr(), M, K, *args, n, address(bias), y.data_ptr(), torch.get_num_threads())
    return y


def q4a8_matmul(x: torch.Tensor, qi: torch.Tensor, si: torch.Tensor, mi: torch.Tensor, n: int,
                bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] fp32 contiguous (any M, K a multiple of 64), quantized per row and group of 32 inside;
    q4_interleave's qi, si, mi; n output columns; bias [n] or None -> y [M, n]."""
    return _a8("specviz_q4a8_matmul", x, (qi, si, mi), n, bias)


def q4a8_half_matmul(x: torch.Tensor, qi: torch.Tensor, si: torch.Tensor, mi: torch.Tensor, n: int,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """As q4a8_matmul with si, mi in fp16 (q4_interleave's, where fp16 holds them exactly): the same bits."""
    return _a8("specviz_q4a8_half_matmul", x, (qi, si, mi), n, bias)


def q4a8_super_matmul(x: torch.Tensor, qi: torch.Tensor, subi: torch.Tensor, supi: torch.Tensor, n: int,
                      bias: torch.Tensor | None) -> torch.Tensor:
    """As q4a8_matmul on the two-level scales (super_interleave's subi uint8 [N8, K/32, 2, 8], supi fp32
    [N8, K/256, 2, 8]; K a multiple of 256): the same bits."""
    return _a8("specviz_q4a8_super_matmul", x, (qi, subi, supi), n, bias)


def q8a8_super_matmul(x: torch.Tensor, qi: torch.Tensor, subi: torch.Tensor, supi: torch.Tensor, n: int,
                      bias: torch.Tensor | None) -> torch.Tensor:
    """As q8a8_matmul (groups of 16) on the two-level scales (subi int8 [N8, K/16, 8], supi fp32 [N8, K/256, 8])."""
    return _a8("specviz_q8a8_super_matmul", x, (qi, subi, supi), n, bias)


def q8a8_matmul(x: torch.Tensor, qi: torch.Tensor, si: torch.Tensor, n: int, bias: torch.Tensor | None
                ) -> torch.Tensor:
    """As q4a8_matmul for q8_interleave's qi, si (K a multiple of 32)."""
    return _a8("specviz_q8a8_matmul", x, (qi, si, x.shape[1] // si.shape[1]), n, bias)


def q4_dequant(q: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor) -> torch.Tensor:
    """The dense fp32 weight [N, K] of a q4 weight (scalar code: for checks, not for speed)."""
    N, K = q.shape[0], q.shape[1] * 2
    out = torch.empty((N, K), dtype=torch.float32)
    library().specviz_q4_dequant(q.data_ptr(), scale.data_ptr(), minv.data_ptr(), N, K, out.data_ptr())
    return out


def q8_dequant(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The dense fp32 weight [N, K] of a q8 weight (scalar code: for checks, not for speed)."""
    N, K = q.shape
    out = torch.empty((N, K), dtype=torch.float32)
    library().specviz_q8_dequant(q.data_ptr(), scale.data_ptr(), K // scale.shape[1], N, K, out.data_ptr())
    return out


def has_attention() -> bool:
    """Whether the build has the batch-invariant attention kernel (it needs AVX2)."""
    return bool(library().specviz_has_attention())


def buffer_rows(x: torch.Tensor) -> int | None:
    """Positions per key head of the buffer `x` [B, Hkv, S, D] is the leading part of: S for a contiguous tensor,
    a KV cache buffer's capacity for its view (models.kv_cache); None for any other layout (copy it first)."""
    B, Hkv, S, D = x.shape
    if x.stride(3) != 1 or x.stride(2) != D or x.stride(1) % D:
        return None
    rows = x.stride(1) // D
    return rows if rows >= S and (B == 1 or x.stride(0) == Hkv * rows * D) else None


BF16_HEAD_DIMS = (32, 64, 128)  # what specviz_bf16_attention is built for (Whisper's heads are 64 wide)


def has_bf16_attention() -> bool:
    """Whether the kernels build here and have the full attention over bf16 inputs (it needs AVX-512 BF16)."""
    return available() and bool(library().specviz_has_bf16_attention())


def bf16_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                   out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q, k, v [B, H, S, D] bf16, each row of D contiguous (a linear layer's [B, S, H·D] output seen as heads is read
    in place), every row attending to every key -> out [B, S, H, D] in out_dtype (fp32, or bf16: the fp32 result
    rounded to nearest even, as .to(torch.bfloat16) rounds it): q · k as bf16 dot products (each product exact,
    fp32 sums), softmax and probabilities · values in fp32; each (sequence, head) on its own
    (kernels/cpu/encoder_attention_cpu.cpp). Only where has_bf16_attention()."""
    B, H, S, D = q.shape
    if not (q.dtype == k.dtype == v.dtype == torch.bfloat16) or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"bf16_attention: q, k, v must be bf16 of one shape, got {q.dtype} {tuple(q.shape)}, "
                         f"{k.dtype} {tuple(k.shape)}, {v.dtype} {tuple(v.shape)}")
    if D not in BF16_HEAD_DIMS or any(t.stride(-1) != 1 for t in (q, k, v)):
        raise ValueError(f"bf16_attention: heads of width {BF16_HEAD_DIMS} with contiguous rows, got {D}")
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"bf16_attention: the output is fp32 or bf16, not {out_dtype}")
    strides = [(ctypes.c_int64 * 3)(*t.stride()[:3]) for t in (q, k, v)]
    out = torch.empty((B, S, H, D), dtype=out_dtype)
    if library().specviz_bf16_attention(q.data_ptr(), strides[0], k.data_ptr(), strides[1], v.data_ptr(), strides[2],
                                        B, H, S, D, scale, out.data_ptr(), int(out_dtype == torch.bfloat16),
                                        torch.get_num_threads()):
        raise RuntimeError("this build of the CPU kernels has no bf16 attention")
    return out


def bf16_attention_tiles(on: bool | None = None) -> bool | None:
    """Whether bf16_attention takes AMX's tiles (with `on`: set it, returning the setting before); None where this
    machine, build or process has no AMX (its AVX-512 BF16 path runs every call). Tests switch it to run both paths."""
    if not has_bf16_attention():
        return None
    before = library().specviz_encoder_attention_tiles(-1 if on is None else int(on))
    return None if before < 0 else bool(before)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sees: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, H, L, D] contiguous, k and v [B, Hkv, S, D] fp32 (or both fp16: the bits their fp32 copies would
    give, from half the bytes), each contiguous or the first S positions of a contiguous buffer (H a multiple of
    Hkv, D of 8), sees [B, L, S] uint8 (1: row i attends to key j) -> out [B, L, H, D]: each row over exactly its
    keys, in order (batch-invariant). A cache's views are read in place, not copied: the same numbers in the same
    order, so the same bits."""
    B, H, L, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if k.dtype != v.dtype or k.dtype not in (torch.float32, torch.float16):
        raise ValueError(f"attention: keys and values must both be fp32 or both fp16, got {k.dtype} and {v.dtype}")
    rows = buffer_rows(k)
    if rows is None or buffer_rows(v) != rows:
        k, v, rows = k.contiguous(), v.contiguous(), S
    out = torch.empty((B, L, H, D), dtype=torch.float32)
    run = library().specviz_attention_f16kv if k.dtype == torch.float16 else library().specviz_attention
    run(q.data_ptr(), k.data_ptr(), v.data_ptr(), sees.data_ptr(), B, H, Hkv, L, S, rows, D, scale, out.data_ptr(),
        torch.get_num_threads())
    return out
