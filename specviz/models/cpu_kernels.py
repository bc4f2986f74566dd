"""The CPU kernels (kernels/qmatmul_cpu.cpp, kernels/attention_cpu.cpp): built once per machine into one
library, called through ctypes.

Built with the system's C++ compiler, -O3 -march=native and OpenMP, into the model cache (keyed by the
source, the compiler and the CPU), so each machine gets code for its own instruction set; later processes
load the built library in milliseconds. OpenMP resolves to the libgomp that torch has already loaded, so the
kernels and torch share one pool of threads (two pools on two cores would fight for them).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import threading
from pathlib import Path

import torch

from specviz.cache import cache_dir
from specviz.paths import KERNELS

SOURCES = [KERNELS / name for name in ("qmatmul_cpu.cpp", "attention_cpu.cpp")]


class KernelBuildError(RuntimeError):
    """The CPU kernels could not be built here; the message says why (the fp32 path still works)."""


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        model = next((l for l in info.splitlines() if l.startswith("model name")), "")
        flags = next((l for l in info.splitlines() if l.startswith("flags")), "")
        return model + flags
    except OSError:
        return platform.processor() + platform.machine()


@functools.cache
def source_digest() -> str:
    """A digest of the kernels' source (read once): the build's cache key, and what was measured on one
    version (a cost table) is not another's."""
    return hashlib.sha256(b"".join(path.read_bytes() for path in SOURCES)).hexdigest()[:16]


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    raise KernelBuildError("no C++ compiler found (g++, c++ or clang++; or set $CXX) to build the CPU kernels")


def _build(out: Path) -> None:
    cxx = _compiler()
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    cmd = [cxx, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17", *map(str, SOURCES), "-o", str(tmp)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KernelBuildError(f"building the CPU kernels failed: {e}") from e
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise KernelBuildError(f"building the CPU kernels failed ({' '.join(cmd)}):\n{done.stderr.strip()[-2000:]}")
    os.replace(tmp, out)  # whole or not at all: a killed build leaves no library that a later load would trust


_lock = threading.Lock()  # guards the one-time build and load below (the page decodes from several threads)
_library: ctypes.CDLL | None = None
_max_rows = 0


def library() -> ctypes.CDLL:
    """The loaded kernel library, built on first use on this machine."""
    global _library, _max_rows
    if _library is not None:  # set once, never unset: read without the lock on every call (the hot path)
        return _library
    with _lock:
        if _library is not None:
            return _library
        try:
            version = subprocess.run([_compiler(), "--version"], capture_output=True, text=True).stdout
        except OSError as e:
            raise KernelBuildError(f"cannot run the C++ compiler: {e}") from e
        key = hashlib.sha256((source_digest() + version + _cpu_signature()).encode()).hexdigest()[:16]
        path = cache_dir() / "kernels" / f"qmatmul-{key}.so"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            _build(path)
        lib = ctypes.CDLL(str(path))
        i64, ptr, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        lib.specviz_q4_matmul.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, ptr, ptr, cint]
        lib.specviz_q8_matmul.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, ptr, ptr, cint]
        lib.specviz_q4_dequant.argtypes = [ptr, ptr, ptr, i64, i64, ptr]
        lib.specviz_q8_dequant.argtypes = [ptr, ptr, i64, i64, i64, ptr]
        functions = [lib.specviz_q4_matmul, lib.specviz_q8_matmul, lib.specviz_q4_dequant, lib.specviz_q8_dequant]
        if lib.specviz_has_attention():
            lib.specviz_attention.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, i64, ctypes.c_float,
                                              ptr, cint]
            functions.append(lib.specviz_attention)
        if lib.specviz_has_a8():
            lib.specviz_int8_peak.argtypes = [i64, cint]
            lib.specviz_int8_peak.restype = ctypes.c_double
            lib.specviz_q4a8_matmul.argtypes = lib.specviz_q4_matmul.argtypes
            lib.specviz_q8a8_matmul.argtypes = lib.specviz_q8_matmul.argtypes
            functions += [lib.specviz_q4a8_matmul, lib.specviz_q8a8_matmul]
        for f in functions:
            f.restype = None
        lib.specviz_isa.restype = ctypes.c_char_p
        _max_rows = lib.specviz_max_rows()
        _library = lib
        return lib


def available() -> bool:
    try:
        library()
        return True
    except KernelBuildError:
        return False


def max_rows() -> int:
    """The most rows one kernel call takes (its per-thread accumulators are sized for it)."""
    library()
    return _max_rows


def vectorized() -> bool:
    """Whether the build has the AVX2/FMA path (else the portable scalar one)."""
    return bool(library().specviz_has_avx2())


def isa() -> str:
    """The instruction set the kernels were built for here: avx512-vnni, avx-vnni, avx2 or portable."""
    return library().specviz_isa().decode()


def has_int8_activations() -> bool:
    """Whether the build has the 8-bit-activation kernels (they need AVX2)."""
    return bool(library().specviz_has_a8())


def int8_peak_macs(iterations: int) -> float:
    """Runs the int8 dot-product sequence the kernels use with operands in registers, on torch's threads;
    returns the multiply-adds done (time the call for the peak rate). Where has_int8_activations() only."""
    return library().specviz_int8_peak(iterations, torch.get_num_threads())


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def q4_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor,
              bias: torch.Tensor | None, int8_activations: bool = False) -> torch.Tensor:
    """x [M, K] fp32 contiguous (M <= max_rows(), K a multiple of 64), q [N, K/2] uint8, scale/minv [N, K/32]
    fp32, bias [N] fp32 or None -> y [M, N]. int8_activations: x quantized per row and group of 32 first."""
    M, K = x.shape
    N = q.shape[0]
    y = torch.empty((M, N), dtype=torch.float32)
    lib = library()
    kernel = lib.specviz_q4a8_matmul if int8_activations else lib.specviz_q4_matmul
    kernel(x.data_ptr(), M, K, q.data_ptr(), scale.data_ptr(), minv.data_ptr(), N, _ptr(bias), y.data_ptr(),
           torch.get_num_threads())
    return y


def q8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
              int8_activations: bool = False) -> torch.Tensor:
    """x [M, K] fp32 contiguous (M <= max_rows(), K a multiple of 32), q [N, K] int8, scale [N, K/G] fp32
    (G = 16 or 32), bias [N] fp32 or None -> y [M, N]. int8_activations: as in q4_matmul."""
    M, K = x.shape
    N = q.shape[0]
    y = torch.empty((M, N), dtype=torch.float32)
    lib = library()
    kernel = lib.specviz_q8a8_matmul if int8_activations else lib.specviz_q8_matmul
    kernel(x.data_ptr(), M, K, q.data_ptr(), scale.data_ptr(), K // scale.shape[1], N, _ptr(bias), y.data_ptr(),
           torch.get_num_threads())
    return y


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


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sees: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, H, L, D] contiguous, k and v [B, Hkv, S, D] fp32, each contiguous or the first S positions of a
    contiguous buffer (H a multiple of Hkv, D of 8), sees [B, L, S] uint8 (1: row i attends to key j)
    -> out [B, L, H, D]: each row over exactly its keys, in order (batch-invariant). A cache's views are read in
    place, not copied: the same numbers in the same order, so the same bits."""
    B, H, L, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    rows = buffer_rows(k)
    if rows is None or buffer_rows(v) != rows:
        k, v, rows = k.contiguous(), v.contiguous(), S
    out = torch.empty((B, L, H, D), dtype=torch.float32)
    library().specviz_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), sees.data_ptr(), B, H, Hkv, L, S, rows, D,
                                scale, out.data_ptr(), torch.get_num_threads())
    return out
