"""The GPU step's element-wise work fused into one kernel per stage (Triton), with the torch operations they replace.

Why: in a CUDA graph a decoding step of these small models costs what its kernels cost, and most of them are
tiny: transformers' arithmetic spends ~35 kernels a layer (RMS norm 4–6, rotary 10, cache writes, copies, SiLU
and the residual adds), against 4 matrix products. Three kernels do that work here (11–12 kernels a layer in
all, measured on an H200):

- `add_rms_norm`: the residual add and the next RMS norm (one read of the row);
- `rope_store`: rotary on q and k, q written grouped by key head (the layout attention reads), k and v written
  straight into the cache's slots;
- `silu_mul`: SiLU(gate) · up;
- `attend` (the default; SPECVIZ_STEP_ATTENTION=matmul switches back): attention split over the keys and
  combined straight into the output projection's layout, two kernels where two matrix products, a softmax, the
  bias's copy and a transpose take five (on an H200 5.5 µs a layer against ~20).

The projections, with the norm before them and SiLU·up after them folded in where that measures faster, are
fused_linear.py's; `Ops` carries both.

Each has a torch reference (models/step_reference.py) with transformers' operation order (rounding to the
model's dtype where it rounds); the kernels compute each output in fp32 and round once, so they agree with it up
to that rounding. Which one a model uses is decided once per model (`choose`): the kernels where Triton is there
and they agree with the references on the model's own shapes, else the references. Both run inside the graphs.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from specviz.models import fused_linear
from specviz.models.step_reference import add_rms_norm_ref, attend_ref, rope_store_ref, silu_mul_ref

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

    @triton.jit
    def attend_split_kernel(q_ptr, k_ptr, v_ptr, bias_ptr, part_ptr, ml_ptr, M, C, HKV, S, stride_b, stride_h,
                            scale, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            SPLIT: tl.constexpr, PRECISION: tl.constexpr):
        bh = tl.program_id(0)  # b·HKV + key head
        s = tl.program_id(1)  # this program's SPLIT keys
        b = bh // HKV
        rows = tl.arange(0, BLOCK_M)
        dims = tl.arange(0, D)
        live = rows < M
        # products in fp32 (tf32 keeps a bf16 / fp16 input's every bit; fp32 models ask for ieee)
        q = tl.load(q_ptr + (bh * M + rows[:, None]) * D + dims[None, :], mask=live[:, None], other=0.0).to(tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        kv = b * stride_b + (bh % HKV) * stride_h
        for i in range(0, SPLIT // BLOCK_N):
            cols = s * SPLIT + i * BLOCK_N + tl.arange(0, BLOCK_N)
            seen = cols < C
            k = tl.load(k_ptr + kv + cols[:, None] * D + dims[None, :], mask=seen[:, None], other=0.0).to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_M, BLOCK_N], fp32
            bias = tl.load(bias_ptr + (b * M + rows[:, None]) * C + cols[None, :],
                           mask=live[:, None] & seen[None, :], other=float("-inf"))
            scores += bias.to(tl.float32)
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key seen yet: every weight stays 0
            p = tl.exp(scores - m_safe[:, None])
            rescale = tl.exp(m_i - m_safe)
            l_i = l_i * rescale + tl.sum(p, axis=1)
            v = tl.load(v_ptr + kv + cols[:, None] * D + dims[None, :], mask=seen[:, None], other=0.0).to(tl.float32)
            acc = acc * rescale[:, None] + tl.dot(p, v, input_precision=PRECISION)
            m_i = m_new
        at = (bh * S + s) * BLOCK_M + rows
        tl.store(part_ptr + at[:, None] * D + dims[None, :], acc, mask=live[:, None])
        tl.store(ml_ptr + at * 2, m_i, mask=live)
        tl.store(ml_ptr + at * 2 + 1, l_i, mask=live)

    @triton.jit
    def attend_combine_kernel(part_ptr, ml_ptr, out_ptr, M, W, G, HKV, S, D: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_S: tl.constexpr):
        bh = tl.program_id(0)
        r = tl.program_id(1)  # query g·W + w
        splits = tl.arange(0, BLOCK_S)
        here = splits < S
        at = (bh * S + splits) * BLOCK_M + r
        m = tl.load(ml_ptr + at * 2, mask=here, other=float("-inf"))
        l = tl.load(ml_ptr + at * 2 + 1, mask=here, other=0.0)
        weight = tl.where(here, tl.exp(m - tl.max(m, axis=0)), 0.0)  # a row sees at least one key: max finite
        dims = tl.arange(0, D)
        part = tl.load(part_ptr + at[:, None] * D + dims[None, :], mask=here[:, None], other=0.0)
        o = tl.sum(part * weight[:, None], axis=0) / tl.sum(weight * l, axis=0)
        b = bh // HKV
        w = r % W
        head = (bh % HKV) * G + r // W
        tl.store(out_ptr + (b * W + w) * (HKV * G * D) + head * D + dims, o.to(out_ptr.dtype.element_ty))

    _kernels = SimpleNamespace(triton=triton, add_rms_norm=add_rms_norm_kernel, rope_store=rope_store_kernel,
                               silu_mul=silu_mul_kernel, attend_split=attend_split_kernel,
                               attend_combine=attend_combine_kernel)
    return _kernels


def add_rms_norm_triton(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """add_rms_norm_ref's contract; x, delta contiguous [R, N]."""
    k = _triton_kernels()
    R, N = x.shape
    x_out = torch.empty_like(x) if delta is not None else x
    h = torch.empty_like(x)
    k.add_rms_norm[(R,)](x, delta if delta is not None else x, weight, x_out, h, N, eps, HAS_DELTA=delta is not None,
                         BLOCK=k.triton.next_power_of_2(N))
    return x_out, h


def rope_store_triton(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: torch.Tensor, W: int,
                      heads: int, kv_heads: int, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """rope_store_ref's contract; qkv, cos, sin contiguous; keys and values share strides, last two dims dense."""
    kernel = _triton_kernels().rope_store
    D = cos.shape[-1]
    B = qkv.shape[0] // W
    G = heads // kv_heads
    q = torch.empty((B, kv_heads, G * W, D), dtype=qkv.dtype, device=qkv.device)
    kernel[(B * W, heads + 2 * kv_heads)](qkv, cos, sin, start, q, keys, values, W, heads, kv_heads, G,
                                          keys.stride(0), keys.stride(1), D=D, HALF=D // 2)
    return q


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:  # gate_up contiguous [R, 2·I] -> [R, I]
    kernel = _triton_kernels().silu_mul
    R, I2 = gate_up.shape
    out = torch.empty((R, I2 // 2), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    kernel[(R, -(-(I2 // 2) // block))](gate_up, out, I2 // 2, BLOCK=block)
    return out


ATTEND_SPLIT = 128  # keys per program: a few hundred programs over 2,048 slots, whatever the key heads
ATTEND_MAX_ROWS = 64  # queries per key head (G·W) one program holds; wider calls attend through attend_ref


def attend_triton(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scale: float,
                  W: int) -> torch.Tensor:
    """attend_ref's contract in two kernels (split over keys, then combined into the output's layout), where
    attend_ref takes five (the bias copied into the scores, two products, the softmax, the transpose). q, bias
    contiguous; keys and values share strides, last two dims dense."""
    k = _triton_kernels()
    B, Hkv, M, D = q.shape
    C = keys.shape[2]
    S = k.triton.cdiv(C, ATTEND_SPLIT)
    block_m = max(16, k.triton.next_power_of_2(M))
    part = torch.empty((B * Hkv * S * block_m, D), dtype=torch.float32, device=q.device)
    ml = torch.empty((B * Hkv * S * block_m, 2), dtype=torch.float32, device=q.device)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32 holds bf16 / fp16 inputs exactly
    k.attend_split[(B * Hkv, S)](q, keys, values, bias, part, ml, M, C, Hkv, S, keys.stride(0), keys.stride(1),
                                 scale, D=D, BLOCK_M=block_m, BLOCK_N=64, SPLIT=ATTEND_SPLIT, PRECISION=precision)
    out = torch.empty((B * W, Hkv * (M // W) * D), dtype=q.dtype, device=q.device)
    k.attend_combine[(B * Hkv, M)](part, ml, out, M, W, M // W, Hkv, S, D=D, BLOCK_M=block_m,
                                   BLOCK_S=k.triton.next_power_of_2(S))
    return out


class Ops:
    """The stages a step calls: the kernels or the references (`fused` says which; `why` why not). The attention
    kernels are checked apart (`attend_fused`, `attend_why`): the newer ones, so that their failing to compile or
    to agree leaves the other three on their kernels. The projections (`norm_linear`, `linear`) run per stage on
    fused_linear's kernel where `linear` gives the stage a config (chosen by timing on the GPU), else on cuBLAS
    between the norm and SiLU·up stages above."""

    def __init__(self, fused: bool, why: str = "", attend_fused: bool | None = None, attend_why: str = "",
                 linear: dict[str, fused_linear.Config | None] | None = None, linear_why: str = "",
                 linear_timings: dict | None = None):
        self.fused, self.why = fused, why
        self.attend_fused = fused if attend_fused is None else attend_fused
        self.attend_why = attend_why or why
        self.add_rms_norm = add_rms_norm_triton if fused else add_rms_norm_ref
        self.rope_store = rope_store_triton if fused else rope_store_ref
        self.silu_mul = silu_mul_triton if fused else silu_mul_ref
        self.attend = attend_triton if self.attend_fused else attend_ref
        self.linear_configs = {stage: (linear or {}).get(stage) for stage in fused_linear.STAGES}
        self.linear_timings = linear_timings or {}
        self.linear_why = linear_why or ("" if any(self.linear_configs.values()) else
                                         "cuBLAS measured faster" if self.linear_timings else why or "not chosen")

    def norm_linear(self, stage: str, x: torch.Tensor, delta: torch.Tensor | None, norm: torch.Tensor, eps: float,
                    weight: torch.Tensor, bias: torch.Tensor | None, silu: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """fused_linear.norm_linear_ref's contract: x, delta [R, K] -> (x + delta, the stage's projection [R, N])."""
        config = self.linear_configs[stage]
        if config is not None and x.shape[0] <= fused_linear.ROWS:
            return fused_linear.norm_linear_triton(x, delta, norm, eps, weight, bias, silu, config)
        return fused_linear.norm_linear_ref(x, delta, norm, eps, weight, bias, silu, self.add_rms_norm, self.silu_mul)

    def linear(self, stage: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [R, K] -> x @ weightᵀ + bias [R, N]."""
        config = self.linear_configs[stage]
        if config is not None and x.shape[0] <= fused_linear.ROWS:
            return fused_linear.linear_triton(x, weight, bias, config)
        return fused_linear.linear_ref(x, weight, bias)

    def describe(self) -> dict[str, object]:
        """What runs where, for a bench's record: each stage's kernel or why not."""
        return {"elementwise": self.fused or self.why, "attend": self.attend_fused or self.attend_why,
                "linear": {s: (f"{c.block_n}x{c.block_k}" if c else "cublas") for s, c in self.linear_configs.items()},
                "linear_why": self.linear_why, "linear_us": self.linear_timings}


REFERENCE = Ops(False, "the torch operations (no GPU)")


def choose(device: torch.device, dtype: torch.dtype, hidden: int, intermediate: int, heads: int, kv_heads: int,
           head_dim: int, eps: float, layers: list | None = None, linear: str = "auto") -> Ops:
    """The kernels where they run here and agree with the references on these shapes (random inputs, the dtype's
    rounding as tolerance), else the references, saying why. With `layers` (and `linear` 'auto'), each projection
    stage takes fused_linear's kernel where it measures faster than cuBLAS on those layers ('cublas': never)."""
    if device.type != "cuda":
        return REFERENCE
    if head_dim & (head_dim - 1):
        return Ops(False, f"head_dim {head_dim} is not a power of two")
    errors = []
    for check in (_self_check, _attend_check):
        try:
            errors.append(check(device, dtype, hidden, intermediate, heads, kv_heads, head_dim, eps))
        except Exception as e:  # noqa: BLE001 (no Triton, or it cannot compile here: the references still run)
            errors.append(f"{type(e).__name__}: {e}"[:300])
    elementwise = errors[0] is None
    configs, why, timings = None, "", {}
    if linear == "cublas":
        why = "cuBLAS asked for (SPECVIZ_STEP_LINEAR=cublas)"
    elif layers and elementwise:
        try:
            chosen = fused_linear.choose(layers, dtype, add_rms_norm_triton, silu_mul_triton)
            configs, why, timings = chosen.configs, chosen.why, chosen.timings
        except Exception as e:  # noqa: BLE001 (the projections stay on cuBLAS)
            why = f"{type(e).__name__}: {e}"[:300]
    return Ops(elementwise, errors[0] or "", elementwise and errors[1] is None, errors[1] or "", configs, why, timings)


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


def _attend_check(device, dtype, hidden, intermediate, heads, kv_heads, D, eps) -> str | None:
    g = torch.Generator(device=device).manual_seed(1)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype in (torch.bfloat16, torch.float16) else dict(rtol=1e-4, atol=1e-4)

    def rand(*shape):
        return torch.randn(shape, generator=g, device=device).to(dtype)

    B, W = 2, 3
    G, C = heads // kv_heads, 300  # more keys than one program's split, and not a multiple of it
    q, keys, values = rand(B, kv_heads, G * W, D), rand(B, kv_heads, C, D), rand(B, kv_heads, C, D)
    seen = torch.rand((B, 1, G * W, C), generator=g, device=device) < 0.7
    seen[..., 0] = True  # every query sees a key
    bias = torch.zeros((B, 1, G * W, C), dtype=dtype, device=device).masked_fill_(~seen, float("-inf"))
    a, b = attend_triton(q, keys, values, bias, D ** -0.5, W), attend_ref(q, keys, values, bias, D ** -0.5, W)
    if not torch.allclose(a.float(), b.float(), **tol):
        return f"attend differs from the reference by {(a.float() - b.float()).abs().max():.3g}"
    return None
