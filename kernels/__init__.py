"""CUDA verification kernels (verify.cu), compiled at run time with CuPy's NVRTC and launched on torch tensors.

    from specviz.verify import project_kernels  # never `import kernels`: a PyPI package has that name
    kernels = project_kernels()
    if kernels.available():
        fields = kernels.verify_cuda("exact", draft_tokens, draft_logits, target_logits, u, u_res,
                             scale=1 / temperature, lenience=1.0, sigmoid_alpha=-1e4, sigmoid_beta=1e4)

`verify_cuda` decides exactly as `specviz.verify.tiled.verify_tiled` (same random numbers, same acceptance
rule, same two-level residual scan) and returns the same keys. The caller draws the random numbers from its
generator in tiled.py's order, `u = rand((B, γ))` then `u_res = rand((B,))`, and passes them in.

Launches per call: two for `exact` (per-chunk softmax statistics, then normalizers + acceptance + residual
masses + sampling in the last block of each row), one for `sigmoid`. All on torch's current CUDA stream,
no copies of the logits (any batch/row strides; the last dimension must be contiguous or it is copied).
One readback (a few bytes per row) when `check=True`, to raise on NaN / +inf / all -inf logits or drafted
tokens outside the vocabulary; `check=False` makes the call fully asynchronous and skips those errors.

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
]

KERNEL_DIR = Path(__file__).resolve().parent
THREADS = 256  # SV_THREADS in verify.cu
MAX_GAMMA = 256  # SV_MAX_GAMMA in verify.cu
MAX_GRID_YZ = 65535
UNROLL_SPAN = 1024  # SV_THREADS · SV_UNROLL: the columns one pass of a block covers
NVRTC_OPTIONS = ("-std=c++17",)
MODES = ("exact", "sigmoid")
_SUFFIX = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
ENTRY_POINTS = tuple(
    f"sv_{kind}_{suffix}" for suffix in _SUFFIX.values() for kind in ("exact_stats", "exact_resample", "sigmoid")
)
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

    Launch 1 (exact) has ceil(V / stats_chunk)·(2γ+1)·B blocks, aimed at ~4 per SM; the residual launch has
    ceil(V / residual_chunk)·B blocks (exact, ~2 per SM) or ·(2γ+1)·B (sigmoid). The residual chunk also
    bounds the last block's final scan, so it stays within [1024, 4096].
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


def _prepare(
    mode: str,
    draft_tokens: torch.Tensor,
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    u: torch.Tensor,
    u_res: torch.Tensor,
    *,
    scale: float,
    lenience: float,
    sigmoid_alpha: float,
    sigmoid_beta: float,
    state: torch.Tensor,
    sms: int,
    stats_chunk: int | None = None,
    residual_chunk: int | None = None,
) -> Prepared:
    """Validate, lay out buffers and build the argument lists. Works on any device (no CuPy here).

    state: int32, zero, at least state_size(B, γ) entries; the kernels leave it zero again.
    """
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
    if mode == "sigmoid" and not sigmoid_alpha < sigmoid_beta:
        raise ValueError("sigmoid α must be smaller than β")
    device = target_logits.device
    for name, t in (("draft_tokens", draft_tokens), ("draft_logits", draft_logits), ("u", u), ("u_res", u_res)):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, target_logits on {device}")

    # Logits: fp32 / fp16 / bf16 are read as they are; anything else (or a mixed pair) goes through fp32,
    # which is what the torch path computes in anyway (`logits.float()`).
    if draft_logits.dtype != target_logits.dtype or target_logits.dtype not in _SUFFIX:
        draft_logits, target_logits = draft_logits.float(), target_logits.float()
    if target_logits.stride(-1) != 1:
        target_logits = target_logits.contiguous()
    if draft_logits.stride(-1) != 1:
        draft_logits = draft_logits.contiguous()
    tokens = draft_tokens.contiguous()
    u = u.to(torch.float32).contiguous()
    u_res = u_res.to(torch.float32).contiguous()
    suffix = _SUFFIX[target_logits.dtype]

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
    if max(K1, K2) > (1 << 31) - 1:
        raise ValueError("vocabulary too large for the grid")
    if state.dtype != torch.int32 or state.numel() < state_size(B, gamma) or state.device != device:
        raise ValueError("state must be a zero int32 tensor of at least state_size(B, γ) entries on the logits' device")

    # One allocation: outputs [n (B) | next_token (B) | errors (5B)] int64, [accept_prob | p | q | u] fp32
    # (B·γ each), then the workspace: partials [B, 2γ+1, K1] (max, sum) and masses [B, K2] (residual, p).
    off_f32 = 7 * B * 8
    out_bytes = off_f32 + 4 * B * gamma * 4
    off_part = _round_up(out_bytes, 256)
    part_bytes = B * R * K1 * 2 * 4 if mode == "exact" else 0
    off_mass = _round_up(off_part + part_bytes, 256)
    total = off_mass + B * K2 * 2 * 4
    buffer = torch.empty(total, dtype=torch.uint8, device=device)
    base = buffer.data_ptr()
    out_i64, out_f32 = np.uint64(base), np.uint64(base + off_f32)
    partials, masses = np.uint64(base + off_part), np.uint64(base + off_mass)
    counters = np.uint64(state.data_ptr())
    rowflags = np.uint64(state.data_ptr() + 4 * B)

    i32, i64, f32 = np.int32, np.int64, np.float32
    logits = (
        _ptr(target_logits), i64(target_logits.stride(0)), i64(target_logits.stride(1)),
        _ptr(draft_logits), i64(draft_logits.stride(0)), i64(draft_logits.stride(1)),
    )
    ctx = logits + (
        _ptr(tokens), _ptr(u), _ptr(u_res), i32(B), i32(gamma), i64(V),
        f32(scale), f32(lenience), f32(sigmoid_alpha), f32(1.0 / (sigmoid_beta - sigmoid_alpha)),  # as torch on CUDA
        out_i64, out_f32,
    )
    if mode == "exact":
        launches = [
            (f"sv_exact_stats_{suffix}", (K1, R, B), logits + (i32(gamma), i64(V), f32(scale), i64(chunk1), partials)),
            (f"sv_exact_resample_{suffix}", (K2, B, 1), ctx + (i64(chunk2), i32(K1), partials, masses, counters)),
        ]
    else:
        launches = [(f"sv_sigmoid_{suffix}", (K2, R, B), ctx + (i64(chunk2), masses, rowflags, counters))]
    return Prepared(launches, buffer, out_bytes, B, gamma, V, (target_logits, draft_logits, tokens, u, u_res, state))


def _views(raw: torch.Tensor, B: int, gamma: int) -> dict[str, torch.Tensor]:
    """Typed views of the output bytes (device buffer or its host copy)."""
    i64 = raw[: 7 * B * 8].view(torch.int64)
    f32 = raw[7 * B * 8: 7 * B * 8 + 16 * B * gamma].view(torch.float32).view(4, B, gamma)
    return dict(
        n_accepted=i64[:B],
        next_token=i64[B:2 * B],
        errors=i64[2 * B:].view(B, 5),
        accept_prob=f32[0],
        p_draft=f32[1],
        q_draft=f32[2],
        uniforms=f32[3],
    )


def raise_for_errors(errors: torch.Tensor, vocab: int) -> None:
    """Raise for the first problem the kernels flagged; errors: host int64 [B, 5] (see verify.cu sv_finish).

    Order as in `specviz.verify`: drafted tokens out of range, then draft logits, then target logits.
    """
    try:
        from specviz.sampling import InvalidLogitsError
    except Exception:  # used outside the project
        InvalidLogitsError = ValueError  # noqa: N806
    rows = errors.tolist()
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


def verify_cuda(
    mode: str,
    draft_tokens: torch.Tensor,
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    u: torch.Tensor,
    u_res: torch.Tensor,
    *,
    scale: float = 1.0,
    lenience: float = 1.0,
    sigmoid_alpha: float = -1e4,
    sigmoid_beta: float = 1e4,
    check: bool = True,
    host: bool = False,
    stats_chunk: int | None = None,
    residual_chunk: int | None = None,
) -> dict[str, torch.Tensor]:
    """Verify on the GPU; returns verify_tiled's keys: n_accepted, next_token, accept_prob, uniforms, p_draft, q_draft.

    mode: 'exact' or 'sigmoid'. Logits as verify_tiled receives them after its own preparation: raw logits
    with scale = 1/temperature (temperature-only sampling), or standardized logits (-inf masks) with scale = 1.
    u [B, γ] and u_res [B]: the uniforms, drawn by the caller (u first, then u_res).
    check: read the few output bytes back once and raise InvalidLogitsError (NaN / +inf / all -inf logits,
    naming tensor and row) or ValueError (drafted token outside [0, V)); False: no host sync, no errors.
    host: return the host copies from that readback instead of device tensors (needs check=True).
    stats_chunk / residual_chunk: columns per block (default: sized to fill the GPU); tests use them.
    """
    if not target_logits.is_cuda:
        raise ValueError("verify_cuda needs CUDA tensors")
    if host and not check:
        raise ValueError("host=True needs check=True (the readback)")
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
        )
        functions = _functions(device.index)
        with cupy.cuda.Device(device.index), _cupy_stream(cupy, stream):
            for name, grid, args in prep.launches:
                functions[name](grid, (THREADS, 1, 1), args)
        outputs = _views(prep.buffer, prep.batch, prep.gamma)
        if check:
            host_bytes = prep.buffer[: prep.out_bytes].cpu()  # the one readback (synchronizes the stream)
            host_views = _views(host_bytes, prep.batch, prep.gamma)
            raise_for_errors(host_views["errors"], prep.vocab)
            if host:
                outputs = host_views
    outputs.pop("errors")
    return outputs
