"""A decoding step's projections for a few rows as one Triton kernel each, the RMS norm before them and the
SiLU·up after them folded in (issue 40).

Why: profiled on an H200 (docs/benchmarks.md, "Steps on a GPU"), a graphed one-token step of the embedded draft
spends ~34 µs a layer in 12 kernels plus ~1.1 µs between each two, against ~7.5 µs that its weights' bytes need.
cuBLAS's kernels for one row take 4.4 µs for q/k/v or the output projection (0.4–0.5 µs of bytes) and 7 µs for the
down projection (split over K, then a reduction kernel); the norm before a projection and the SiLU·up after the
gate/up one are kernels of their own. Here a program computes `block_n` outputs for every row of the call: it
reads the rows (adding the residual and normalising them itself where the stage has a norm: the rows are a few
KB, read from L2 by every program), then streams its slice of the weight once: up to four kernels a layer where
cuBLAS and fused.py take eight. Measured on the H200 it wins only where the weight is small (the draft's q/k/v
with its norm 6.5 µs against 6.8, the output projections 3.8 against 4.8 and 6.0 against 7.4); cuBLAS keeps
gate/up and down, where it streams the larger matrices faster (the draft's gate/up 10.8 against 14.2 µs).

Rounding follows the references (`norm_linear_ref`, `linear_ref`: the norm rounded to the dtype as transformers
rounds it, products accumulated in fp32, each output rounded once, SiLU rounded before its product); the sums
run in another order than cuBLAS's, so results agree up to that rounding. A row's outputs never depend on the
other rows of the call: the row tile is always `ROWS` wide and the reduction order is fixed by `block_k`.
Which stages use the kernel is measured on the GPU per model (`choose`): each stage's kernel and its cuBLAS
composition timed inside CUDA graphs over the model's own layers; a stage takes the kernel only where it is at
least MARGIN faster.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import torch

from specviz.models.step_reference import linear_ref, norm_linear_ref

ROWS = 16  # rows one program holds (the smallest tl.dot tile); calls of more rows use the cuBLAS composition
STAGES = ("qkv", "o", "gate_up", "down")  # a layer's projections, in order
MARGIN = 0.03  # the kernel replaces cuBLAS in a stage only where it times at least this much faster


@dataclass(frozen=True)
class Config:
    """How one stage's kernel is launched: outputs per program, weight columns per loop step, warps."""

    block_n: int
    block_k: int
    warps: int = 4


# Timed per stage against cuBLAS on the GPU. On an H200 (2026-11-27) 16 × 256 won every stage the kernel won
# (q/k/v with its norm and o of the 0.5B draft, o of the 1.5B target; the 7B's o a tie); 32 × 128 and 64 × 128
# won none and each added a compile per stage at load, so they were dropped.
CANDIDATES = (Config(16, 256),)


# ---- the kernel -------------------------------------------------------------------------------------------

_kernel = None


def _triton_kernel():
    global _kernel
    if _kernel is not None:
        return _kernel
    import triton
    import triton.language as tl

    @triton.jit
    def rows_linear_kernel(x_ptr, d_ptr, nw_ptr, x_out_ptr, w_ptr, b_ptr, y_ptr, R, N, eps, K: tl.constexpr,
                           HAS_NORM: tl.constexpr, HAS_DELTA: tl.constexpr, HAS_BIAS: tl.constexpr,
                           SILU: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        pid = tl.program_id(0)
        rows = tl.arange(0, ROWS)
        live = rows < R
        ks = tl.arange(0, BLOCK_K)
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        out = cols < N
        dtype = y_ptr.dtype.element_ty
        inv = tl.zeros([ROWS], tl.float32)
        if HAS_NORM:  # pass 1: the rows' sum of squares (and the residual written once, by program 0)
            ss = tl.zeros([ROWS], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                at = rows[:, None] * K + (k0 + ks)[None, :]
                m = live[:, None] & ((k0 + ks) < K)[None, :]
                x = tl.load(x_ptr + at, mask=m, other=0.0)
                if HAS_DELTA:
                    d = tl.load(d_ptr + at, mask=m, other=0.0)
                    x = (x.to(tl.float32) + d.to(tl.float32)).to(dtype)
                    if pid == 0:
                        tl.store(x_out_ptr + at, x, mask=m)
                xf = x.to(tl.float32)
                ss += tl.sum(xf * xf, axis=1)
            inv = tl.rsqrt(ss / K + eps)
        acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
        acc_up = tl.zeros([ROWS, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + ks
            inside = kk < K
            at = rows[:, None] * K + kk[None, :]
            m = live[:, None] & inside[None, :]
            x = tl.load(x_ptr + at, mask=m, other=0.0)
            if HAS_NORM:
                if HAS_DELTA:
                    d = tl.load(d_ptr + at, mask=m, other=0.0)
                    x = (x.to(tl.float32) + d.to(tl.float32)).to(dtype)
                normed = (x.to(tl.float32) * inv[:, None]).to(dtype).to(tl.float32)
                nw = tl.load(nw_ptr + kk, mask=inside, other=0.0).to(tl.float32)
                x = (normed * nw[None, :]).to(dtype)
            w = tl.load(w_ptr + cols[:, None] * K + kk[None, :], mask=out[:, None] & inside[None, :], other=0.0)
            if UPCAST:  # Triton's CPU interpreter multiplies 16-bit floats wrongly: fp32 (tf32 holds them exactly)
                x = x.to(tl.float32)
                w = w.to(tl.float32)
            acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
            if SILU:
                u = tl.load(w_ptr + (cols + N)[:, None] * K + kk[None, :], mask=out[:, None] & inside[None, :],
                            other=0.0)
                if UPCAST:
                    u = u.to(tl.float32)
                acc_up += tl.dot(x, tl.trans(u), input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=out, other=0.0).to(tl.float32)[None, :]
            if SILU:
                acc_up += tl.load(b_ptr + N + cols, mask=out, other=0.0).to(tl.float32)[None, :]
        y = acc.to(dtype)
        if SILU:  # the products rounded as cuBLAS rounds them, SiLU rounded as F.silu's output, then their product
            g = y.to(tl.float32)
            s = (g * tl.sigmoid(g)).to(dtype).to(tl.float32)
            y = (s * acc_up.to(dtype).to(tl.float32)).to(dtype)
        tl.store(y_ptr + rows[:, None] * N + cols[None, :], y, mask=live[:, None] & out[None, :])

    _kernel = SimpleNamespace(triton=triton, rows_linear=rows_linear_kernel)
    return _kernel


def _launch(x: torch.Tensor, delta: torch.Tensor | None, norm: torch.Tensor | None, eps: float,
            weight: torch.Tensor, bias: torch.Tensor | None, silu: bool, config: Config
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch: x, delta [R, K]; weight [N or 2·I, K] -> (x + delta or x, the outputs [R, N or I])."""
    k = _triton_kernel()
    R, K = x.shape
    if R > ROWS:
        raise ValueError(f"{R} rows: the kernel holds at most {ROWS}")
    if delta is not None and norm is None:
        raise ValueError("a residual add comes with its norm: the kernel adds delta only in the norm's pass")
    if not all(t.is_contiguous() for t in (x, weight, *(() if delta is None else (delta,)))):
        raise ValueError("the kernel indexes x, delta and the weight as dense row-major matrices")
    N = weight.shape[0] // 2 if silu else weight.shape[0]
    y = torch.empty((R, N), dtype=x.dtype, device=x.device)
    x_out = torch.empty_like(x) if delta is not None else x
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # bf16 / fp16 operands: tf32 is exact for them
    k.rows_linear[(k.triton.cdiv(N, config.block_n),)](
        x, delta if delta is not None else x, norm if norm is not None else x, x_out, weight,
        bias if bias is not None else weight, y, R, N, eps, K=K, HAS_NORM=norm is not None,
        HAS_DELTA=delta is not None, HAS_BIAS=bias is not None, SILU=silu, ROWS=ROWS, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, PRECISION=precision, UPCAST=x.device.type != "cuda", num_warps=config.warps)
    return x_out, y


def norm_linear_triton(x: torch.Tensor, delta: torch.Tensor | None, norm: torch.Tensor, eps: float,
                       weight: torch.Tensor, bias: torch.Tensor | None, silu: bool, config: Config
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """norm_linear_ref's contract for at most ROWS rows; x, delta, weight contiguous."""
    return _launch(x, delta, norm, eps, weight, bias, silu, config)


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: Config) -> torch.Tensor:
    """linear_ref's contract for at most ROWS rows; x, weight contiguous."""
    return _launch(x, None, None, 0.0, weight, bias, False, config)[1]


# ---- checking and choosing ----------------------------------------------------------------------------------

ALL_CASES = tuple(itertools.product((False, True), repeat=3))  # (silu, residual add, bias)


def check(device: torch.device, dtype: torch.dtype, config: Config,
          cases: tuple[tuple[bool, bool, bool], ...] = ALL_CASES, hidden: int = 96, out: int = 80,
          rows: tuple[int, ...] = (1, 3, ROWS), tol: dict | None = None) -> str | None:
    """The kernel against the references on random inputs of these shapes, for each (silu, residual add, bias)
    case (and the plain projection, no norm): None where it agrees within the dtype's rounding (or `tol`) and
    row 0 computed alone gives the same bits, else what differs. Inputs drawn fresh for every case."""
    g = torch.Generator(device=device).manual_seed(5)
    tol = tol or (dict(rtol=2e-2, atol=2e-2) if dtype in (torch.bfloat16, torch.float16) else dict(rtol=1e-4, atol=1e-4))

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(shape, generator=g, device=device)).to(dtype)

    for R in rows:
        for silu, with_delta, with_bias in cases:
            x, d, nw = rand(R, hidden), rand(R, hidden) if with_delta else None, rand(hidden)
            w = rand((2 if silu else 1) * out, hidden, scale=hidden ** -0.5)
            b = rand(w.shape[0]) if with_bias else None
            got = norm_linear_triton(x, d, nw, 1e-6, w, b, silu, config)
            want = norm_linear_ref(x, d, nw, 1e-6, w, b, silu)
            # the residual is one rounded add, as torch's: exact in fp32 (the interpreter rounds 16-bit floats
            # otherwise than a GPU, so there within the tolerance)
            exact_residual = dtype == torch.float32
            if exact_residual and not torch.equal(got[0], want[0]):
                return f"rows_linear's residual (R={R}, silu={silu}) differs from x + delta"
            for name, a, c in zip(("residual", "output"), got, want):
                if not torch.allclose(a.float(), c.float(), **tol):
                    return (f"rows_linear's {name} (R={R}, silu={silu}, residual add={with_delta}, bias={with_bias}) "
                            f"differs from the reference by {(a.float() - c.float()).abs().max():.3g}")
            alone = norm_linear_triton(x[:1], d[:1] if d is not None else None, nw, 1e-6, w, b, silu, config)[1]
            if not torch.equal(alone[0], got[1][0]):  # batch invariance: row 0 alone gives row 0's bits
                return f"rows_linear's row 0 changes with the other rows of the call (R={R}, silu={silu})"
            if not silu and not with_delta:
                a, c = linear_triton(x, w, b, config), linear_ref(x, w, b)
                if not torch.allclose(a.float(), c.float(), **tol):
                    return f"rows_linear (no norm, R={R}) differs by {(a.float() - c.float()).abs().max():.3g}"
    return None


def _graph_us(calls: list[Callable[[], object]], reps: int) -> float:
    """Median GPU µs of one replay of a CUDA graph of `calls` in order, after a warm-up outside the capture
    (Triton compiles, cuBLAS chooses and allocates)."""
    for c in calls:
        c()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        for c in calls:
            c()
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            for c in calls:
                c()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def gpu_time_us(calls: list[Callable[[], object]], reps: int = 5) -> float:
    """Median GPU µs of one of `calls`, run in order inside one CUDA graph (launch gaps as in a step), each after
    a write of twice the L2 (as in a step, where a layer's other matrices pass through the cache between two
    calls of one stage; a small model's matrices of one stage would otherwise be read from L2); the writes'
    own time, measured alone, is taken off."""
    device = torch.cuda.current_device()
    scratch = torch.empty(2 * torch.cuda.get_device_properties(device).L2_cache_size // 4 + 1024,
                          dtype=torch.float32, device="cuda")
    flush = scratch.zero_
    flushed = [f for c in calls for f in (flush, c)]
    return max(0.0, (_graph_us(flushed, reps) - _graph_us([flush] * len(calls), reps)) / len(calls))


@dataclass
class Choice:
    """Per stage: the kernel's config, or None (the cuBLAS composition); and the µs each option measured."""

    configs: dict[str, Config | None]
    timings: dict[str, dict[str, float]]
    why: str = ""


def choose(layers: list, dtype: torch.dtype, add_rms_norm: Callable, silu_mul: Callable,
           timer: Callable[[list[Callable[[], object]]], float] = gpu_time_us) -> Choice:
    """For each of a layer's four projections, the cuBLAS composition or the fastest of the kernel's candidate
    configs where that is at least MARGIN faster, timed by `timer` (µs of one of the calls: gpu_time_us, inside
    CUDA graphs; tests pass a stand-in) over every layer's own weights, one row as a decoding step's call. Only
    configs that pass `check` on the model's dtype and widths are timed."""
    device = layers[0].qkv_weight.device
    qkv_bias, mlp_bias = layers[0].qkv_bias is not None, layers[0].gate_up_bias is not None
    hidden, attended, intermediate = (layers[0].norm1.shape[0], layers[0].o_proj.weight.shape[1],
                                      layers[0].intermediate)
    # checked at each stage's own K (a compile-time constant of the kernel), so the kernels checked are the ones
    # the steps run: q/k/v without (layer 0) and with the residual add, gate/up, the two plain projections
    by_width = {hidden: [(False, False, qkv_bias), (False, True, qkv_bias), (True, True, mlp_bias)]}
    by_width.setdefault(attended, []).append((False, False, layers[0].o_proj.bias is not None))
    by_width.setdefault(intermediate, []).append((False, False, layers[0].down_proj.bias is not None))
    usable = [c for c in CANDIDATES
              if all(check(device, dtype, c, tuple(sorted(set(cs))), k, rows=(1, ROWS)) is None
                     for k, cs in by_width.items())]
    if not usable:
        return Choice(dict.fromkeys(STAGES), {}, "the kernel disagrees with the references here")
    g = torch.Generator(device=device).manual_seed(7)
    x = torch.randn((1, hidden), generator=g, device=device).to(dtype)
    o_in = torch.randn((1, attended), generator=g, device=device).to(dtype)
    act = torch.randn((1, intermediate), generator=g, device=device).to(dtype)

    def stage_calls(stage: str, config: Config | None) -> list[Callable[[], object]]:
        calls = []
        for L in layers:
            if stage == "qkv":
                args = (x, x, L.norm1, L.eps1, L.qkv_weight, L.qkv_bias, False)
            elif stage == "gate_up":
                args = (x, x, L.norm2, L.eps2, L.gate_up_weight, L.gate_up_bias, True)
            else:
                lin = L.o_proj if stage == "o" else L.down_proj
                a = o_in if stage == "o" else act
                calls.append((lambda a=a, lin=lin: linear_ref(a, lin.weight, lin.bias)) if config is None else
                             (lambda a=a, lin=lin: linear_triton(a, lin.weight, lin.bias, config)))
                continue
            calls.append((lambda args=args: norm_linear_ref(*args, add_rms_norm, silu_mul)) if config is None else
                         (lambda args=args: norm_linear_triton(*args, config)))
        return calls

    configs, timings = {}, {}
    for stage in STAGES:
        options = {f"{c.block_n}x{c.block_k}": c for c in usable}
        timings[stage] = {"cublas": timer(stage_calls(stage, None)),
                          **{name: timer(stage_calls(stage, c)) for name, c in options.items()}}
        best = min(options, key=lambda name: timings[stage][name])
        # the kernel only where it is clearly faster: a tie within the timings' noise keeps cuBLAS
        configs[stage] = options[best] if timings[stage][best] <= (1 - MARGIN) * timings[stage]["cublas"] else None
    return Choice(configs, timings)
