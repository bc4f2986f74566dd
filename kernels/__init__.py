"""CUDA verification kernels (verify.cu), compiled at run time with CuPy's NVRTC and launched on torch tensors.

    from specviz.verify import project_kernels  # never `import kernels`: a PyPI package has that name
    kernels = project_kernels()
    if kernels.available():
        fields = kernels.verify_cuda("exact", draft_tokens, draft_logits, target_logits, u, u_res,
                             scale=1 / temperature, lenience=1.0, sigmoid_alpha=-1e4, sigmoid_beta=1e4)
        # top-k / top-p inside the kernels, on raw logits (`standardize`'s semantics, see verify.cu):
        fields = kernels.verify_cuda("exact", ..., scale=kernels.topk_scale(T), topk=50, top_p=0.9)

`verify_cuda` decides exactly as `specviz.verify.tiled.verify_tiled` (same random numbers, same acceptance
rule, same two-level residual scan) and returns the same keys. The caller draws the random numbers from its
generator in tiled.py's order, `u = rand((B, γ))` then `u_res = rand((B,))`, and passes them in.

Launches per call: two for `exact` (per-chunk softmax statistics, with `topk` each chunk's k largest
values, and with `topk` or `top_p` each row's threshold and normalizer, found by the last block of the
row; then acceptance, residual masses and sampling in the last block of each batch row), one for
`sigmoid`, two with `topk` or `top_p` (the first launch of `exact` for the thresholds, then the sigmoid
one). Top-p without top-k reads each row 2 more times (fp16 / bf16) or 4 (fp32), by the last block of the
row, from L2; with top-k it ranks the K1·k candidate lists only, no pass over the vocabulary. All on torch's current CUDA stream, no copies of the
logits (any batch/row strides; the last dimension must be contiguous or it is copied). One readback (a few
bytes per row, into pinned memory) when `check=True`: it raises on NaN / +inf / all -inf logits or drafted
tokens outside the vocabulary, and `launch` hands its host copy back so that callers need no further sync;
`check=False` makes the call fully asynchronous and skips those errors.

Host cost: the grids, workspace layout and argument lists depend only on (mode, shapes, dtypes, strides,
settings), so they are planned once per such key (`_cached_plan`) and a call patches the data pointers in.

Importing this package needs neither CuPy nor a GPU: CuPy is imported inside the functions that use it.
"""

from __future__ import annotations

import functools
import math
import shutil
import subprocess
import tempfile
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "available",
    "unavailable_reason",
    "verify_cuda",
    "source_files",
    "compile_check",
    "nvrtc_check",
    "MAX_GAMMA",
    "MAX_TOPK",
    "launch",
    "Launched",
    "sigmoid_inv_den",
    "topk_scale",
    "topp_value",
]

KERNEL_DIR = Path(__file__).resolve().parent
THREADS = 256  # SV_THREADS in verify.cu
MAX_GAMMA = 256  # SV_MAX_GAMMA in verify.cu
# Largest in-kernel top-k: the last block of each row merges K1·k candidates alone, so its tail grows with
# k; larger k (rare) goes through `standardize` on the torch side (with any top-p).
MAX_TOPK = 1024
MAX_GRID_YZ = 65535
UNROLL_SPAN = 1024  # SV_THREADS · SV_UNROLL: the columns one pass of a block covers
NVRTC_OPTIONS = ("-std=c++17",)
MODES = ("exact", "sigmoid")
_SUFFIX = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
# Launch 1 and the sigmoid launch come in variants that compile only the filtering they need (registers)
_KINDS = ("exact_stats", "exact_stats_topk", "exact_stats_topp", "exact_resample", "sigmoid", "sigmoid_filtered")
ENTRY_POINTS = tuple(f"sv_{kind}_{suffix}" for suffix in _SUFFIX.values() for kind in _KINDS)
_ERROR_KIND = {1: "NaN", 2: "+inf", 4: "only -inf (no token has any probability)"}


def source_files() -> list[Path]:
    """The CUDA sources of this package."""
    return sorted(KERNEL_DIR.glob("*.cu"))


def _source() -> str:
    return (KERNEL_DIR / "verify.cu").read_text()


# ------------------------------------------------------------------------------------------------------
# Compiling
# ------------------------------------------------------------------------------------------------------


def compile_check(nvcc: str = "nvcc", arch: str = "sm_90") -> None:
    """Compile every .cu file with nvcc (cubin for `arch`: front end and ptxas), warnings as errors.

    Raises FileNotFoundError when nvcc is missing and RuntimeError with the compiler output on failure.
    """
    exe = shutil.which(nvcc)
    if exe is None:
        raise FileNotFoundError(f"nvcc not found (looked for {nvcc!r})")
    with tempfile.TemporaryDirectory() as tmp:
        for src in source_files():
            cmd = [exe, "-std=c++17", f"-arch={arch}", "--cubin", "-Werror", "all-warnings",
                   "-o", str(Path(tmp) / (src.stem + ".cubin")), str(src)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            output = (proc.stdout + proc.stderr).strip()
            if proc.returncode != 0:
                raise RuntimeError(f"nvcc failed on {src.name} ({' '.join(cmd)}):\n{output}")


def nvrtc_check(arch: str = "sm_90") -> None:
    """Compile every .cu file with NVRTC (through CuPy's bindings; no GPU needed), as `available()` will.

    Raises ImportError without CuPy and RuntimeError with the NVRTC log on failure or on any warning.
    """
    from cupy_backends.cuda.libs import nvrtc

    for src in source_files():
        prog = nvrtc.createProgram(src.read_text(), src.name, [], [])
        try:
            try:
                nvrtc.compileProgram(prog, [*NVRTC_OPTIONS, f"-arch={arch}"])
            except Exception as exc:  # nvrtc.NVRTCError
                raise RuntimeError(f"NVRTC failed on {src.name}: {exc}\n{nvrtc.getProgramLog(prog)}") from exc
            log = nvrtc.getProgramLog(prog).strip()
            if log:
                raise RuntimeError(f"NVRTC warnings on {src.name}:\n{log}")
        finally:
            nvrtc.destroyProgram(prog)


@functools.lru_cache(maxsize=None)
def _functions(device_index: int) -> dict:
    """Compile verify.cu for the device (once per process and device) and fetch every entry point."""
    import cupy

    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=_source(), options=NVRTC_OPTIONS)
        return {name: module.get_function(name) for name in ENTRY_POINTS}


_availability: tuple[bool, str] | None = None
_lock = threading.Lock()


def _probe() -> tuple[bool, str]:
    global _availability
    with _lock:
        if _availability is None:
            try:
                if not torch.cuda.is_available():
                    _availability = (False, "torch sees no CUDA device")
                else:
                    try:
                        import cupy  # noqa: F401
                    except Exception as exc:  # ImportError, or a CuPy that does not match the driver
                        _availability = (False, f"CuPy is not importable: {exc}")
                    else:
                        _functions(torch.cuda.current_device())
                        _availability = (True, "")
            except Exception as exc:  # compile or driver failure
                _availability = (False, f"{type(exc).__name__}: {exc}")
        return _availability


def available() -> bool:
    """True when CuPy imports, a CUDA device is present and verify.cu compiles for it. Never raises."""
    return _probe()[0]


def unavailable_reason() -> str:
    """Why `available()` is False ('' when it is True)."""
    return _probe()[1]


# ------------------------------------------------------------------------------------------------------
# Planning: grids, chunk sizes, buffers and argument lists (device-agnostic, no CuPy)
# ------------------------------------------------------------------------------------------------------


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def plan_chunks(mode: str, batch: int, gamma: int, vocab: int, sms: int) -> tuple[int, int]:
    """(stats_chunk, residual_chunk) in columns: enough blocks to fill `sms` multiprocessors.

    Launch 1 (exact; sigmoid with top-k / top-p) has ceil(V / stats_chunk)·(2γ+1)·B blocks, aimed at ~4 per
    SM; the residual launch has ceil(V / residual_chunk)·B blocks (exact, ~2 per SM) or ·(2γ+1)·B (sigmoid).
    The residual chunk also bounds the last block's final scan, so it stays within [1024, 4096].
    """
    rows = 2 * gamma + 1
    stats = _round_up(-(-vocab * rows * batch // (4 * sms)), UNROLL_SPAN)
    stats = min(max(stats, 2048), 32768)
    if mode == "exact":
        residual = -(-vocab * batch // (2 * sms))
    else:
        residual = -(-vocab * rows * batch // (4 * sms))
    residual = min(max(_round_up(residual, UNROLL_SPAN), 1024), 4096)
    return stats, residual


# Byte offsets of the outputs and the workspace inside a call's one device allocation (see `_layout`).
_SRC_TARGET, _SRC_DRAFT, _SRC_TOKENS, _SRC_U, _SRC_URES, _SRC_BUFFER, _SRC_STATE = range(7)


@dataclass
class Plan:
    """What every call of one (mode, shapes, dtypes, strides, settings) launches, minus the pointers.

    launches: [(entry point, grid, argument template, pointer slots)]; a slot (i, source, offset) means
    argument i is the data pointer of source (_SRC_*) plus offset bytes. Built once per key by `_plan`,
    so a call only patches pointers into copies of the templates.
    """

    launches: list
    out_bytes: int  # the leading bytes of the buffer that hold the outputs
    total_bytes: int  # outputs, then workspace
    batch: int
    gamma: int
    vocab: int
    cast: bool  # the logits go through fp32 (mixed or unsupported dtypes)
    copy_target: bool  # the last dimension is not contiguous: copied
    copy_draft: bool
    state_entries: int
    slot_arrays: dict = None  # entry point -> `_slot_arrays` of its slots (filled by `_plan`)


@dataclass
class Prepared:
    """Everything one call launches, and the views of its outputs (see `_prepare`)."""

    launches: list  # [(entry point, grid, args)]
    buffer: torch.Tensor  # uint8: outputs, then workspace
    out_bytes: int  # the leading bytes of `buffer` that hold the outputs
    batch: int
    gamma: int
    vocab: int
    keep: tuple  # tensors the launches read (contiguous copies, if any were made)


def _ptr(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


def state_size(batch: int, gamma: int) -> int:
    """int32 entries of the zero-initialized state a call needs: B ticket counters, then B·(2γ+1) error words."""
    return batch + batch * (2 * gamma + 1)


def sigmoid_inv_den(alpha: float, beta: float) -> np.float32:
    """fp32(1) / fp32(β - α): the factor torch on CUDA multiplies by for `t / (β - α)` (a Python scalar)."""
    return np.float32(1) / np.float32(beta - alpha)


def topk_scale(temperature: float) -> np.float32:
    """fp32(1) / fp32(T): the factor torch on CUDA multiplies by for `standardize`'s `z / T`."""
    return np.float32(1) / np.float32(temperature)


def topp_value(top_p: float) -> np.float32:
    """fp32(top_p): `standardize` compares a float32 tensor with the Python float, which torch casts to fp32."""
    return np.float32(top_p)


def _validate(mode, draft_tokens, draft_logits, target_logits, u, u_res, scale, lenience, alpha, beta, topk,
              top_p):
    """The input checks of a plan (run once per plan key: shapes, dtypes and settings are in the key)."""
    if mode not in MODES:
        raise ValueError(f"unknown CUDA verification mode {mode!r}; choose one of {', '.join(MODES)}")
    if draft_tokens.dim() != 2 or draft_tokens.dtype != torch.long:
        raise ValueError(f"draft_tokens must be a LongTensor [B, γ], got {draft_tokens.dtype} {tuple(draft_tokens.shape)}")
    B, gamma = draft_tokens.shape
    if B < 1 or gamma < 1:
        raise ValueError(f"need B >= 1 and γ >= 1, got B={B}, γ={gamma}")
    if gamma > MAX_GAMMA:
        raise ValueError(f"the CUDA kernels support γ <= {MAX_GAMMA}, got {gamma}")
    if B > MAX_GRID_YZ:
        raise ValueError(f"the CUDA kernels support B <= {MAX_GRID_YZ}, got {B}")
    if draft_logits.dim() != 3 or tuple(draft_logits.shape[:2]) != (B, gamma):
        raise ValueError(f"draft_logits must be [B={B}, γ={gamma}, V], got {tuple(draft_logits.shape)}")
    if target_logits.dim() != 3 or tuple(target_logits.shape[:2]) != (B, gamma + 1):
        raise ValueError(f"target_logits must be [B={B}, γ+1={gamma + 1}, V], got {tuple(target_logits.shape)}")
    V = target_logits.shape[-1]
    if draft_logits.shape[-1] != V or V < 1:
        raise ValueError(f"draft and target vocabularies differ or are empty: {draft_logits.shape[-1]} vs {V}")
    if tuple(u.shape) != (B, gamma) or tuple(u_res.shape) != (B,):
        raise ValueError(f"u must be [B, γ] = [{B}, {gamma}] and u_res [B] = [{B}], got {tuple(u.shape)}, {tuple(u_res.shape)}")
    if not 0 < lenience <= 1:
        raise ValueError(f"lenience must be in (0, 1], got {lenience}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number, got {scale}")
    if mode == "sigmoid" and not alpha < beta:
        raise ValueError("sigmoid α must be smaller than β")
    if topk and not 0 < topk <= MAX_TOPK:
        raise ValueError(f"in-kernel top-k needs 1 <= k <= {MAX_TOPK}, got k={topk}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p}")


def _inputs(draft_logits: torch.Tensor, target_logits: torch.Tensor, tokens: torch.Tensor, u: torch.Tensor,
            u_res: torch.Tensor, plan: Plan) -> tuple:
    """The tensors the kernels read, converted as the plan says (no-ops in the usual case)."""
    if plan.cast:
        draft_logits, target_logits = draft_logits.float(), target_logits.float()
    if plan.copy_target:
        target_logits = target_logits.contiguous()
    if plan.copy_draft:
        draft_logits = draft_logits.contiguous()
    if not tokens.is_contiguous():
        tokens = tokens.contiguous()
    if u.dtype != torch.float32 or not u.is_contiguous():
        u = u.to(torch.float32).contiguous()
    if u_res.dtype != torch.float32 or not u_res.is_contiguous():
        u_res = u_res.to(torch.float32).contiguous()
    return target_logits, draft_logits, tokens, u, u_res


def _plan(mode, draft_tokens, draft_logits, target_logits, u, u_res, *, scale, lenience, sigmoid_alpha, sigmoid_beta,
          sms, stats_chunk, residual_chunk, topk, top_p) -> Plan:
    """Validate once and lay out buffers, grids and argument templates (see `Plan`)."""
    _validate(mode, draft_tokens, draft_logits, target_logits, u, u_res, scale, lenience, sigmoid_alpha,
              sigmoid_beta, topk, top_p)
    B, gamma = draft_tokens.shape
    V = target_logits.shape[-1]
    # Logits: fp32 / fp16 / bf16 are read as they are; anything else (or a mixed pair) goes through fp32,
    # which is what the torch path computes in anyway (`logits.float()`).
    cast = draft_logits.dtype != target_logits.dtype or target_logits.dtype not in _SUFFIX
    if cast:
        draft_logits, target_logits = draft_logits.float(), target_logits.float()
    copy_target, copy_draft = target_logits.stride(-1) != 1, draft_logits.stride(-1) != 1
    if copy_target:
        target_logits = target_logits.contiguous()
    if copy_draft:
        draft_logits = draft_logits.contiguous()
    suffix = _SUFFIX[target_logits.dtype]
    if topk >= V:
        topk = 0  # keeps every token, as `standardize` skips top_k >= V
    topp = topp_value(top_p)  # the kernels filter while it is below 1 (fp32)
    filtered = bool(topk) or topp < 1

    R = 2 * gamma + 1
    auto_stats, auto_residual = plan_chunks(mode, B, gamma, V, sms)
    chunk1 = int(stats_chunk or auto_stats)
    chunk2 = int(residual_chunk or auto_residual)
    if chunk1 < 1 or not 1 <= chunk2 <= 1 << 30:
        raise ValueError(f"chunk sizes must be >= 1 (residual <= 2^30), got {chunk1}, {chunk2}")
    K1 = -(-V // chunk1)
    K2 = -(-V // chunk2)
    if mode == "sigmoid" and K2 * R >= 1 << 32:
        raise ValueError("too many blocks per row for the 32-bit ticket counter")
    if max(K1, K2) > (1 << 31) - 1 or K1 * max(topk, 1) > (1 << 31) - 1:
        raise ValueError("vocabulary too large for the grid")

    # One allocation: outputs [n (B) | next_token (B) | errors (5B)] int64, [accept_prob | p | q | u] fp32
    # (B·γ each), then the workspace: partials [B, 2γ+1, K1] (max, sum), top-k candidates [B, 2γ+1, K1, k],
    # their tie counts [B, 2γ+1, K1] and the rows' (threshold, normalizer) [B, 2γ+1, 2], masses [B, K2]
    # (residual, p).
    off_f32 = 7 * B * 8
    out_bytes = off_f32 + 4 * B * gamma * 4
    off_part = _round_up(out_bytes, 256)
    part_bytes = B * R * K1 * 2 * 4 if mode == "exact" or filtered else 0
    off_cand = _round_up(off_part + part_bytes, 256)
    off_extra = _round_up(off_cand + B * R * K1 * topk * 4, 256)
    off_rowstat = _round_up(off_extra + (B * R * K1 * 4 if topk else 0), 256)
    off_mass = _round_up(off_rowstat + (B * R * 2 * 4 if filtered else 0), 256)
    total = off_mass + B * K2 * 2 * 4

    i32, i64, f32 = np.int32, np.int64, np.float32
    null = np.uint64(0)
    # (argument index -> source, offset): filled per call by `_materialize`
    logits = [null, i64(target_logits.stride(0)), i64(target_logits.stride(1)),
              null, i64(draft_logits.stride(0)), i64(draft_logits.stride(1))]
    logit_slots = [(0, _SRC_TARGET, 0), (3, _SRC_DRAFT, 0)]
    ctx = logits + [null, null, null, i32(B), i32(gamma), i64(V), f32(scale), f32(lenience), f32(sigmoid_alpha),
                    sigmoid_inv_den(sigmoid_alpha, sigmoid_beta), null, null]
    ctx_slots = logit_slots + [(6, _SRC_TOKENS, 0), (7, _SRC_U, 0), (8, _SRC_URES, 0), (16, _SRC_BUFFER, 0),
                               (17, _SRC_BUFFER, off_f32)]
    n = len(ctx)
    # Launch 1 of exact; with top-k / top-p also the thresholds, for either mode
    stats = logits + [i32(gamma), i64(V), f32(scale), i64(chunk1), null, i32(topk), topp, null, null, null, null]
    stats_slots = logit_slots + [(10, _SRC_BUFFER, off_part)]
    if topk:
        stats_slots += [(13, _SRC_BUFFER, off_cand), (14, _SRC_BUFFER, off_extra)]
    if filtered:  # row tickets: the state's error-word region, which launch 1 does not otherwise use
        stats_slots += [(15, _SRC_BUFFER, off_rowstat), (16, _SRC_STATE, 4 * B)]
    stats_kind = "exact_stats_topp" if topp < 1 else ("exact_stats_topk" if topk else "exact_stats")
    launches = [(f"sv_{stats_kind}_{suffix}", (K1, R, B), stats, stats_slots)] if mode == "exact" or filtered else []
    if mode == "exact":
        resample = ctx + [i64(chunk2), i32(K1), null, null, null, i32(filtered), null]
        resample_slots = ctx_slots + [(n + 2, _SRC_BUFFER, off_part), (n + 3, _SRC_BUFFER, off_mass),
                                      (n + 4, _SRC_STATE, 0)]
        if filtered:
            resample_slots += [(n + 6, _SRC_BUFFER, off_rowstat)]
        launches.append((f"sv_exact_resample_{suffix}", (K2, B, 1), resample, resample_slots))
    else:
        sig = ctx + [i64(chunk2), null, null, null, null]
        sig_slots = ctx_slots + [(n + 1, _SRC_BUFFER, off_mass), (n + 2, _SRC_STATE, 4 * B), (n + 3, _SRC_STATE, 0)]
        if filtered:
            sig_slots += [(n + 4, _SRC_BUFFER, off_rowstat)]
        launches.append((f"sv_sigmoid{'_filtered' if filtered else ''}_{suffix}", (K2, R, B), sig, sig_slots))
    return Plan(launches, out_bytes, total, B, gamma, V, cast, copy_target, copy_draft, state_size(B, gamma),
                {name: _slot_arrays(slots) for name, _, _, slots in launches})


_plans: dict[tuple, Plan] = {}
_MAX_PLANS = 256  # shapes vary with B and γ; beyond this the cache starts over (a plan is cheap to rebuild)


def _plan_key(mode, draft_tokens, draft_logits, target_logits, u, u_res, scale, lenience, alpha, beta, sms,
              stats_chunk, residual_chunk, topk, top_p) -> tuple:
    return (mode, tuple(draft_tokens.shape), draft_tokens.dtype, draft_logits.dtype, target_logits.dtype,
            tuple(draft_logits.shape), draft_logits.stride(), tuple(target_logits.shape), target_logits.stride(),
            tuple(u.shape), tuple(u_res.shape), scale, lenience, alpha, beta, sms, stats_chunk, residual_chunk, topk,
            top_p)


def _cached_plan(mode, draft_tokens, draft_logits, target_logits, u, u_res, *, scale, lenience, sigmoid_alpha,
                 sigmoid_beta, sms, stats_chunk=None, residual_chunk=None, topk=0, top_p=1.0) -> Plan:
    key = _plan_key(mode, draft_tokens, draft_logits, target_logits, u, u_res, scale, lenience, sigmoid_alpha,
                    sigmoid_beta, sms, stats_chunk, residual_chunk, topk, top_p)
    plan = _plans.get(key)
    if plan is None:
        plan = _plan(mode, draft_tokens, draft_logits, target_logits, u, u_res, scale=scale, lenience=lenience,
                     sigmoid_alpha=sigmoid_alpha, sigmoid_beta=sigmoid_beta, sms=sms, stats_chunk=stats_chunk,
                     residual_chunk=residual_chunk, topk=topk, top_p=top_p)
        if len(_plans) >= _MAX_PLANS:
            _plans.clear()
        _plans[key] = plan
    return plan


def _slot_arrays(slots: list) -> tuple:
    """(argument indices, source indices, byte offsets as uint64) of a launch's pointer slots."""
    return ([i for i, _, _ in slots], np.array([src for _, src, _ in slots], dtype=np.intp),
            np.array([off for _, _, off in slots], dtype=np.uint64))


def _materialize(plan: Plan, sources: tuple, buffer: torch.Tensor, state: torch.Tensor) -> list:
    """[(entry point, grid, args)]: the plan's templates with this call's pointers patched in."""
    base = np.array([t.data_ptr() for t in sources] + [buffer.data_ptr(), state.data_ptr()], dtype=np.uint64)
    launches = []
    for name, grid, template, slots in plan.launches:
        idx, src, off = plan.slot_arrays[name]
        args = list(template)
        for i, v in zip(idx, base[src] + off):  # one numpy op per launch, np.uint64 scalars out
            args[i] = v
        launches.append((name, grid, tuple(args)))
    return launches


def _prepare(
    mode: str,
    draft_tokens: torch.Tensor,  # LongTensor[B, γ]
    draft_logits: torch.Tensor,  # [B, γ, V]
    target_logits: torch.Tensor,  # [B, γ+1, V]
    u: torch.Tensor,  # [B, γ]
    u_res: torch.Tensor,  # [B]
    *,
    scale: float,
    lenience: float,
    sigmoid_alpha: float,
    sigmoid_beta: float,
    state: torch.Tensor,
    sms: int,
    stats_chunk: int | None = None,
    residual_chunk: int | None = None,
    topk: int = 0,
    top_p: float = 1.0,
) -> Prepared:
    """Validate (once per plan), allocate the buffer and patch the argument lists. Any device (no CuPy here).

    state: int32, zero, at least state_size(B, γ) entries; the kernels leave it zero again.
    topk / top_p: in-kernel top-k and top-p on the logits scaled by `scale` (0 / 1 = none; see verify_cuda).
    """
    plan = _cached_plan(mode, draft_tokens, draft_logits, target_logits, u, u_res, scale=scale, lenience=lenience,
                        sigmoid_alpha=sigmoid_alpha, sigmoid_beta=sigmoid_beta, sms=sms, stats_chunk=stats_chunk,
                        residual_chunk=residual_chunk, topk=topk, top_p=top_p)
    device = target_logits.device
    for name, t in (("draft_tokens", draft_tokens), ("draft_logits", draft_logits), ("u", u), ("u_res", u_res)):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, target_logits on {device}")
    if state.dtype != torch.int32 or state.numel() < plan.state_entries or state.device != device:
        raise ValueError("state must be a zero int32 tensor of at least state_size(B, γ) entries on the logits' device")
    sources = _inputs(draft_logits, target_logits, draft_tokens, u, u_res, plan)
    buffer = torch.empty(plan.total_bytes, dtype=torch.uint8, device=device)
    return Prepared(_materialize(plan, sources, buffer, state), buffer, plan.out_bytes, plan.batch, plan.gamma,
                    plan.vocab, sources + (state,))


def _views(raw: torch.Tensor, B: int, gamma: int) -> dict[str, torch.Tensor]:
    """Typed views of the output bytes (device buffer or its host copy)."""
    # split / unbind: one op for several views (each torch op costs the host ~1-2 µs)
    n, t, errors = raw[: 7 * B * 8].view(torch.int64).split([B, B, 5 * B])
    accept_prob, p_draft, q_draft, uniforms = (
        raw[7 * B * 8: 7 * B * 8 + 16 * B * gamma].view(torch.float32).view(4, B, gamma).unbind(0))
    return dict(n_accepted=n, next_token=t, errors=errors.view(B, 5), accept_prob=accept_prob, p_draft=p_draft,
                q_draft=q_draft, uniforms=uniforms)


def host_lists(raw: np.ndarray, B: int, gamma: int) -> dict[str, list]:
    """The output bytes (uint8, host) as Python lists: the same keys as `_views`, [B] or [B][γ] each."""
    i64 = raw[: 7 * B * 8].view(np.int64)
    f32 = raw[7 * B * 8: 7 * B * 8 + 16 * B * gamma].view(np.float32).reshape(4, B, gamma).tolist()
    return dict(
        n_accepted=i64[:B].tolist(),
        next_token=i64[B:2 * B].tolist(),
        errors=i64[2 * B:].reshape(B, 5).tolist(),
        accept_prob=f32[0],
        p_draft=f32[1],
        q_draft=f32[2],
        uniforms=f32[3],
    )


def raise_for_errors(errors, vocab: int) -> None:
    """Raise for the first problem the kernels flagged; errors: host int64 [B, 5] (tensor or nested list;
    see verify.cu sv_finish).

    Order as in `specviz.verify`: drafted tokens out of range, then draft logits, then target logits.
    """
    try:
        from specviz.sampling import InvalidLogitsError
    except Exception:  # used outside the project
        InvalidLogitsError = ValueError  # noqa: N806
    rows = errors.tolist() if hasattr(errors, "tolist") else errors
    for b, row in enumerate(rows):
        if row[4] >= 0:
            raise ValueError(f"draft_tokens must lie in [0, {vocab}): position [{b}, {row[4]}] does not")
    for name, col in (("draft", 0), ("target", 2)):
        for b, row in enumerate(rows):
            if row[col] >= 0:
                bits = row[col + 1]
                what = next((text for bit, text in _ERROR_KIND.items() if bits & bit), f"error bits {bits}")
                raise InvalidLogitsError(
                    f"{name} logits contain {what} at index [{b}, {row[col]}]; the model output is unusable"
                )


# ------------------------------------------------------------------------------------------------------
# Launching on the GPU
# ------------------------------------------------------------------------------------------------------

_states: dict[tuple[int, int], torch.Tensor] = {}


def _state(device: torch.device, stream: int, entries: int) -> torch.Tensor:
    """The zero int32 state (ticket counters, error words) of one device and stream; the kernels re-zero it."""
    key = (device.index, stream)
    state = _states.get(key)
    if state is None or state.numel() < entries:
        state = torch.zeros(max(entries, 1024), dtype=torch.int32, device=device)
        _states[key] = state
    return state


_streams: dict[tuple[int, int], object] = {}


def _cupy_stream(cupy, stream: torch.cuda.Stream):
    """CuPy's handle on a torch stream (cached by device and pointer), so the kernels queue behind torch's work."""
    key = (stream.device.index, stream.cuda_stream)
    handle = _streams.get(key)
    if handle is None:
        from_external = getattr(cupy.cuda.Stream, "from_external", None)  # CuPy >= 14
        if from_external is not None:
            try:
                handle = from_external(stream)
            except Exception:
                handle = None
        if handle is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                handle = cupy.cuda.ExternalStream(stream.cuda_stream, stream.device.index)
        _streams[key] = handle
    return handle


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@dataclass
class Launched:
    """One verification on the GPU: device views of the outputs, and their host copy when it was read back."""

    outputs: dict  # verify_tiled's keys -> device tensors (views of the call's buffer)
    host: dict | None  # the same keys -> Python lists ([B] or [B][γ]), from the one readback; None if check=False


def launch(
    mode: str,
    draft_tokens: torch.Tensor,  # LongTensor[B, γ]
    draft_logits: torch.Tensor,  # [B, γ, V]
    target_logits: torch.Tensor,  # [B, γ+1, V]
    u: torch.Tensor,  # [B, γ]
    u_res: torch.Tensor,  # [B]
    *,
    scale: float = 1.0,
    lenience: float = 1.0,
    sigmoid_alpha: float = -1e4,
    sigmoid_beta: float = 1e4,
    topk: int = 0,
    top_p: float = 1.0,
    check: bool = True,
    stats_chunk: int | None = None,
    residual_chunk: int | None = None,
    events: tuple | None = None,
) -> Launched:
    """`verify_cuda`'s work, returning the device outputs and (check=True) the host lists of the readback.

    The readback copies the few output bytes into pinned host memory and waits for that copy only: the
    one host sync of a call. events: optional (start, end) torch.cuda.Events recorded right before the
    first and after the last kernel launch (benchmarks: GPU time without the host's share).
    """
    if not target_logits.is_cuda:
        raise ValueError("verify_cuda needs CUDA tensors")
    import cupy

    device = target_logits.device
    B, gamma = draft_tokens.shape if draft_tokens.dim() == 2 else (0, 0)
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device)
        state = _state(device, stream.cuda_stream, state_size(max(B, 1), max(gamma, 1)))
        prep = _prepare(
            mode, draft_tokens, draft_logits, target_logits, u, u_res,
            scale=scale, lenience=lenience, sigmoid_alpha=sigmoid_alpha, sigmoid_beta=sigmoid_beta,
            state=state, sms=_sm_count(device.index), stats_chunk=stats_chunk, residual_chunk=residual_chunk,
            topk=topk, top_p=top_p,
        )
        functions = _functions(device.index)
        if events is not None:
            events[0].record(stream)
        with cupy.cuda.Device(device.index), _cupy_stream(cupy, stream):
            for name, grid, args in prep.launches:
                functions[name](grid, (THREADS, 1, 1), args)
        if events is not None:
            events[1].record(stream)
        outputs = _views(prep.buffer, prep.batch, prep.gamma)
        outputs.pop("errors")
        if not check:
            return Launched(outputs, None)
        pinned = torch.empty(prep.out_bytes, dtype=torch.uint8, pin_memory=True)
        pinned.copy_(prep.buffer[: prep.out_bytes], non_blocking=True)
        stream.synchronize()  # the one host sync: waits for the kernels and this copy
    host = host_lists(pinned.numpy(), prep.batch, prep.gamma)
    raise_for_errors(host.pop("errors"), prep.vocab)
    return Launched(outputs, host)


def verify_cuda(
    mode: str,
    draft_tokens: torch.Tensor,  # LongTensor[B, γ]
    draft_logits: torch.Tensor,  # [B, γ, V]
    target_logits: torch.Tensor,  # [B, γ+1, V]
    u: torch.Tensor,  # [B, γ]
    u_res: torch.Tensor,  # [B]
    *,
    scale: float = 1.0,
    lenience: float = 1.0,
    sigmoid_alpha: float = -1e4,
    sigmoid_beta: float = 1e4,
    topk: int = 0,
    top_p: float = 1.0,
    check: bool = True,
    host: bool = False,
    stats_chunk: int | None = None,
    residual_chunk: int | None = None,
) -> dict[str, torch.Tensor]:
    """Verify on the GPU; returns verify_tiled's keys: n_accepted, next_token, accept_prob, uniforms, p_draft, q_draft.

    mode: 'exact' or 'sigmoid'. Logits as verify_tiled receives them after its own preparation: raw logits
    with scale = 1/temperature (temperature-only sampling), or standardized logits (-inf masks) with scale = 1.
    topk (1..MAX_TOPK; 0 = off) and top_p ((0, 1]; 1 = off), either mode: filter each row inside the kernels
    as `standardize` does, on raw logits with scale = topk_scale(T): top-k keeps the k largest values of
    scale·logits (ties with the k-th kept), then top-p drops a value when the mass of the larger ones
    reaches fp32(top_p) (the largest always stays; ties with the boundary value all kept, see verify.cu).
    u [B, γ] and u_res [B]: the uniforms, drawn by the caller (u first, then u_res).
    check: read the few output bytes back once and raise InvalidLogitsError (NaN / +inf / all -inf logits,
    naming tensor and row) or ValueError (drafted token outside [0, V)); False: no host sync, no errors.
    host: return CPU tensors made from that readback instead of device tensors (needs check=True).
    stats_chunk / residual_chunk: columns per block (default: sized to fill the GPU); tests use them.
    """
    if host and not check:
        raise ValueError("host=True needs check=True (the readback)")
    done = launch(mode, draft_tokens, draft_logits, target_logits, u, u_res, scale=scale, lenience=lenience,
                  sigmoid_alpha=sigmoid_alpha, sigmoid_beta=sigmoid_beta, topk=topk, top_p=top_p, check=check,
                  stats_chunk=stats_chunk, residual_chunk=residual_chunk)
    if not host:
        return done.outputs
    h = done.host
    return dict(
        n_accepted=torch.tensor(h["n_accepted"], dtype=torch.long),
        next_token=torch.tensor(h["next_token"], dtype=torch.long),
        **{k: torch.tensor(h[k], dtype=torch.float32) for k in ("accept_prob", "uniforms", "p_draft", "q_draft")},
    )
