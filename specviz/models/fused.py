"""The GPU step's element-wise work fused into one kernel per stage (Triton), with the torch operations they replace.

Why: in a CUDA graph a decoding step of these small models costs what its kernels cost, and most of them are
tiny: transformers' arithmetic spends ~35 kernels a layer (RMS norm 4–6, rotary 10, cache writes, copies, SiLU
and the residual adds), against 4 matrix products. Three kernels do that work here, ~10 kernels a layer in all:

- `add_rms_norm`: the residual add and the next RMS norm (one read of the row);
- `rope_store`: rotary on q and k, q written grouped by key head (the layout attention reads), k and v written
  straight into the cache's slots;
- `silu_mul`: SiLU(gate) · up.

Each has a torch reference with transformers' operation order (rounding to the model's dtype where it rounds);
the kernels compute each output in fp32 and round once, so they agree with it up to that rounding. Which one a
model uses is decided once per model (`choose`): the kernels where Triton is there and they agree with the
references on the model's own shapes, else the references. Both run inside the graphs.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

# ---- references (and the CPU path) -------------------------------------------------------------------------


def add_rms_norm_ref(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """x, delta [R, N] (delta None: no add) -> (x + delta, transformers' RMSNorm of it: in fp32, back to the dtype,
    times the weight)."""
    if delta is not None:
        x = x + delta
    return x, weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def rope_store_ref(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: torch.Tensor, W: int,
                   heads: int, kv_heads: int, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """qkv [B·W, (heads + 2·kv_heads)·D] (rows b·W + w); cos, sin [B·W, D]; start LongTensor[1]: the slot of column
    0; keys, values [B, kv_heads, C, D], written at slots start … start + W − 1 -> q rotated, grouped by key head:
    [B, kv_heads, G·W, D], query g·W + w of key head k being head k·G + g."""
    D = cos.shape[-1]
    B = qkv.shape[0] // W
    G = heads // kv_heads
    q, k, v = qkv.view(B, W, heads + 2 * kv_heads, D).split((heads, kv_heads, kv_heads), dim=2)
    c, s = cos.view(B, 1, W, D), sin.view(B, 1, W, D)
    q = _rotate(q.transpose(1, 2), c, s)  # [B, H, W, D]
    slots = start + torch.arange(W, device=qkv.device)
    keys.index_copy_(2, slots, _rotate(k.transpose(1, 2), c, s))
    values.index_copy_(2, slots, v.transpose(1, 2))
    return q.reshape(B, kv_heads, G * W, D)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # x [B, heads, W, D]
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:  # gate_up [R, 2·I] -> [R, I]
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# ---- Triton kernels ----------------------------------------------------------------------------------------

_kernels = None


def _triton_kernels():
    """The jitted kernels (Triton imported on first use: the CPU install has none)."""
    global _kernels
    if _kernels is not None:
        return _kernels
    import triton
    import triton.language as tl

    @triton.jit
    def add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, x_out_ptr, h_ptr, N, eps, HAS_DELTA: tl.constexpr,
                            BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0)
        if HAS_DELTA:
            d = tl.load(d_ptr + row * N + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + d.to(tl.float32)).to(x_out_ptr.dtype.element_ty)
            tl.store(x_out_ptr + row * N + cols, x, mask=mask)
        xf = x.to(tl.float32)
        inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
        h = (xf * inv).to(h_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(h_ptr + row * N + cols, (w * h).to(h_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def rope_store_kernel(qkv_ptr, cos_ptr, sin_ptr, start_ptr, q_ptr, k_ptr, v_ptr, W, H, HKV, G, stride_b,
                          stride_h, D: tl.constexpr, HALF: tl.constexpr):
        r = tl.program_id(0)  # row b·W + w of qkv
        head = tl.program_id(1)  # q heads, then k heads, then v heads
        b = r // W
        w = r % W
        half = tl.arange(0, HALF)
        src = qkv_ptr + r * (H + 2 * HKV) * D + head * D
        x1 = tl.load(src + half)
        x2 = tl.load(src + HALF + half)
        slot = tl.load(start_ptr) + w
        if head < H + HKV:
            c1 = tl.load(cos_ptr + r * D + half).to(tl.float32)
            c2 = tl.load(cos_ptr + r * D + HALF + half).to(tl.float32)
            s1 = tl.load(sin_ptr + r * D + half).to(tl.float32)
            s2 = tl.load(sin_ptr + r * D + HALF + half).to(tl.float32)
            f1 = x1.to(tl.float32)
            f2 = x2.to(tl.float32)
            o1 = f1 * c1 - f2 * s1
            o2 = f2 * c2 + f1 * s2
            if head < H:
                kh = head // G
                dst = q_ptr + ((b * HKV + kh) * G * W + (head % G) * W + w) * D
                tl.store(dst + half, o1.to(q_ptr.dtype.element_ty))
                tl.store(dst + HALF + half, o2.to(q_ptr.dtype.element_ty))
            else:
                dst = k_ptr + b * stride_b + (head - H) * stride_h + slot * D
                tl.store(dst + half, o1.to(k_ptr.dtype.element_ty))
                tl.store(dst + HALF + half, o2.to(k_ptr.dtype.element_ty))
        else:
            dst = v_ptr + b * stride_b + (head - H - HKV) * stride_h + slot * D
            tl.store(dst + half, x1)
            tl.store(dst + HALF + half, x2)

    @triton.jit
    def silu_mul_kernel(gu_ptr, out_ptr, I, BLOCK: tl.constexpr):
        r = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < I
        g = tl.load(gu_ptr + r * 2 * I + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + r * 2 * I + I + cols, mask=mask, other=0.0).to(tl.float32)
        s = (g * tl.sigmoid(g)).to(out_ptr.dtype.element_ty).to(tl.float32)  # SiLU rounds, as F.silu's output
        tl.store(out_ptr + r * I + cols, (s * u).to(out_ptr.dtype.element_ty), mask=mask)

    _kernels = (triton, add_rms_norm_kernel, rope_store_kernel, silu_mul_kernel)
    return _kernels


def add_rms_norm_triton(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """add_rms_norm_ref's contract; x, delta contiguous [R, N]."""
    triton, kernel, _, _ = _triton_kernels()
    R, N = x.shape
    x_out = torch.empty_like(x) if delta is not None else x
    h = torch.empty_like(x)
    kernel[(R,)](x, delta if delta is not None else x, weight, x_out, h, N, eps, HAS_DELTA=delta is not None,
                 BLOCK=triton.next_power_of_2(N))
    return x_out, h


def rope_store_triton(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: torch.Tensor, W: int,
                      heads: int, kv_heads: int, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """rope_store_ref's contract; qkv, cos, sin contiguous; keys and values share strides, last two dims dense."""
    _, _, kernel, _ = _triton_kernels()
    D = cos.shape[-1]
    B = qkv.shape[0] // W
    G = heads // kv_heads
    q = torch.empty((B, kv_heads, G * W, D), dtype=qkv.dtype, device=qkv.device)
    kernel[(B * W, heads + 2 * kv_heads)](qkv, cos, sin, start, q, keys, values, W, heads, kv_heads, G,
                                          keys.stride(0), keys.stride(1), D=D, HALF=D // 2)
    return q


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:  # gate_up contiguous [R, 2·I] -> [R, I]
    _, _, _, kernel = _triton_kernels()
    R, I2 = gate_up.shape
    out = torch.empty((R, I2 // 2), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    kernel[(R, -(-(I2 // 2) // block))](gate_up, out, I2 // 2, BLOCK=block)
    return out


class Ops:
    """The three stages a step calls: the kernels or the references (`fused` says which; `why` why not)."""

    def __init__(self, fused: bool, why: str = ""):
        self.fused, self.why = fused, why
        self.add_rms_norm = add_rms_norm_triton if fused else add_rms_norm_ref
        self.rope_store = rope_store_triton if fused else rope_store_ref
        self.silu_mul = silu_mul_triton if fused else silu_mul_ref


REFERENCE = Ops(False, "the torch operations (no GPU)")


def choose(device: torch.device, dtype: torch.dtype, hidden: int, intermediate: int, heads: int, kv_heads: int,
           head_dim: int, eps: float) -> Ops:
    """The kernels where they run here and agree with the references on these shapes (random inputs, the dtype's
    rounding as tolerance), else the references, saying why."""
    if device.type != "cuda":
        return REFERENCE
    if head_dim & (head_dim - 1):
        return Ops(False, f"head_dim {head_dim} is not a power of two")
    try:
        error = _self_check(device, dtype, hidden, intermediate, heads, kv_heads, head_dim, eps)
    except Exception as e:  # noqa: BLE001 (no Triton, or it cannot compile here: the references still run)
        return Ops(False, f"{type(e).__name__}: {e}"[:300])
    return Ops(True) if error is None else Ops(False, error)


def _self_check(device, dtype, hidden, intermediate, heads, kv_heads, D, eps) -> str | None:
    g = torch.Generator(device=device).manual_seed(0)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype in (torch.bfloat16, torch.float16) else dict(rtol=1e-4, atol=1e-4)

    def rand(*shape):
        return torch.randn(shape, generator=g, device=device).to(dtype)

    B, W, C = 2, 3, 16
    x, d, w = rand(B * W, hidden), rand(B * W, hidden), rand(hidden)
    for delta in (d, None):
        for a, b in zip(add_rms_norm_triton(x, delta, w, eps), add_rms_norm_ref(x, delta, w, eps)):
            if not torch.allclose(a.float(), b.float(), **tol):
                return f"add_rms_norm differs from the reference by {(a.float() - b.float()).abs().max():.3g}"
    gu = rand(B * W, 2 * intermediate)
    a, b = silu_mul_triton(gu), silu_mul_ref(gu)
    if not torch.allclose(a.float(), b.float(), **tol):
        return f"silu_mul differs from the reference by {(a.float() - b.float()).abs().max():.3g}"
    qkv = rand(B * W, (heads + 2 * kv_heads) * D)
    angle = torch.rand((B * W, D // 2), generator=g, device=device) * 6.3
    cos, sin = torch.cat([angle.cos()] * 2, -1).to(dtype), torch.cat([angle.sin()] * 2, -1).to(dtype)
    start = torch.tensor([5], device=device)
    caches = [[rand(B, kv_heads, C, D) for _ in range(2)] for _ in range(2)]
    caches[1] = [t.clone() for t in caches[0]]
    qa = rope_store_triton(qkv, cos, sin, start, W, heads, kv_heads, *caches[0])
    qb = rope_store_ref(qkv, cos, sin, start, W, heads, kv_heads, *caches[1])
    for name, a, b in (("q", qa, qb), ("keys", *[c[0] for c in caches]), ("values", *[c[1] for c in caches])):
        if not torch.allclose(a.float(), b.float(), **tol):
            return f"rope_store's {name} differ from the reference by {(a.float() - b.float()).abs().max():.3g}"
    return None
