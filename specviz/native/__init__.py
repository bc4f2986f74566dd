"""The C++ kernels' one library (kernels/cpu/: qmatmul_cpu.cpp, attention_cpu.cpp, encoder_attention_cpu.cpp,
decoder_cpu.cpp, verify_cpu.cpp):
built once per machine, loaded through ctypes, its functions declared here.

Built with the system's C++ compiler, -O3 -march=native and OpenMP, into the model cache (keyed by the
source, the compiler and the CPU), so each machine gets code for its own instruction set; later processes
load the built library in milliseconds. OpenMP resolves to the libgomp that torch has already loaded, so the
kernels and torch share one pool of threads (two pools on two cores would fight for them). The models'
wrappers are in specviz.models.cpu_kernels, verification's in specviz.verify.cpu, sampling's in specviz.sampling. Imports cache and paths only
(the layer every other package may import).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Callable, Iterator

from specviz.cache import cache_dir
from specviz.paths import KERNELS

SOURCES = [KERNELS / "cpu" / name for name in ("qmatmul_cpu.cpp", "half_matmul_cpu.cpp", "attention_cpu.cpp",
                                               "encoder_attention_cpu.cpp", "decoder_cpu.cpp", "verify_cpu.cpp")]
HEADERS = [KERNELS / "cpu" / name for name in ("vector_math.h", "amx.h")]  # included by the sources: part of what a build is keyed by


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
    return _digest(SOURCES + HEADERS)


def _digest(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        try:
            digest.update(path.read_bytes())
        except OSError:  # a copy without it: its build fails and says so (KernelBuildError); the digest does not
            digest.update(b"missing " + path.name.encode())
    return digest.hexdigest()[:16]


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    raise KernelBuildError("no C++ compiler found (g++, c++ or clang++; or set $CXX) to build the CPU kernels")


def _build(out: Path, sources: list[Path]) -> None:
    cxx = _compiler()
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    cmd = [cxx, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17", *map(str, sources), "-o", str(tmp)]
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
_failure: str | None = None  # why the build or load failed: not tried again in this process
_max_rows = 0


def library() -> ctypes.CDLL:
    """The loaded kernel library, built on first use on this machine; KernelBuildError where it cannot be
    (every later call says the same at once, so asking costs nothing on any path)."""
    global _library, _failure
    if _library is not None:  # set once, never unset (swapped only by `using`, in benchmarks): read without the
        # lock on every call (the hot path)
        return _library
    with _lock:
        if _library is None:
            if _failure is not None:
                raise KernelBuildError(_failure)
            try:
                _library = _load()
            except KernelBuildError as e:
                _failure = str(e)
                raise
    return _library


def _load(sources: list[Path] | None = None, digest: str | None = None) -> ctypes.CDLL:
    """Build (first use on this machine) and load the library, its functions declared; `sources` (and their
    `digest`, headers included) where another copy of the kernels is built (`load_variant`)."""
    global _max_rows
    try:
        version = subprocess.run([_compiler(), "--version"], capture_output=True, text=True).stdout
    except OSError as e:
        raise KernelBuildError(f"cannot run the C++ compiler: {e}") from e
    key = hashlib.sha256(((digest or source_digest()) + version + _cpu_signature()).encode()).hexdigest()[:16]
    path = cache_dir() / "kernels" / f"qmatmul-{key}.so"
    try:  # an unwritable cache or a damaged library is a failed build too: callers fall back to torch
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            _build(path, sources or SOURCES)
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise KernelBuildError(f"the CPU kernels could not be built or loaded at {path}: {e}") from e
    i64, ptr, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.specviz_q4_matmul.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, ptr, ptr, cint]
    lib.specviz_q8_matmul.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, ptr, ptr, cint]
    lib.specviz_q4_dequant.argtypes = [ptr, ptr, ptr, i64, i64, ptr]
    lib.specviz_q8_dequant.argtypes = [ptr, ptr, i64, i64, i64, ptr]
    functions = [lib.specviz_q4_matmul, lib.specviz_q8_matmul, lib.specviz_q4_dequant, lib.specviz_q8_dequant]
    if lib.specviz_has_attention():
        lib.specviz_attention.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, i64, ctypes.c_float,
                                          ptr, cint]
        lib.specviz_attention_f16kv.argtypes = lib.specviz_attention.argtypes
        functions += [lib.specviz_attention, lib.specviz_attention_f16kv]
    lib.specviz_bf16_attention.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, ctypes.c_float, ptr,
                                           cint, cint]
    lib.specviz_bf16_attention.restype = cint
    lib.specviz_encoder_attention_tiles.argtypes = [cint]
    lib.specviz_encoder_attention_tiles.restype = cint
    if lib.specviz_has_a8():
        lib.specviz_int8_peak.argtypes = [i64, cint]
        lib.specviz_int8_peak.restype = ctypes.c_double
        lib.specviz_amx_min_rows.argtypes = [i64]
        lib.specviz_amx_min_rows.restype = i64
        lib.specviz_q4a8_matmul.argtypes = lib.specviz_q4_matmul.argtypes
        lib.specviz_q8a8_matmul.argtypes = lib.specviz_q8_matmul.argtypes
        lib.specviz_q4a8_half_matmul.argtypes = lib.specviz_q4_matmul.argtypes
        lib.specviz_q4a8_super_matmul.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, ptr, ptr, cint]
        lib.specviz_q8a8_super_matmul.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, ptr, ptr, cint]
        functions += [lib.specviz_q4a8_matmul, lib.specviz_q8a8_matmul, lib.specviz_q4a8_half_matmul,
                      lib.specviz_q4a8_super_matmul,
                      lib.specviz_q8a8_super_matmul]
    if lib.specviz_has_decoder():  # layers: an array of decoder_cpu.cpp's Layer (specviz.models.native_forward)
        lib.specviz_decoder_layers.argtypes = [ptr, ptr, i64, ptr, ptr, i64, i64, i64, ptr, ptr, ptr, i64, i64, i64,
                                               i64, i64, i64, i64, ctypes.c_float, ptr, cint]
        lib.specviz_rms_norm_rows.argtypes = [ptr, ptr, ctypes.c_float, i64, i64, ptr]
        # layers: an array of WhisperLayer (specviz.speech.native_whisper)
        lib.specviz_whisper_layers.argtypes = [ptr, ptr, i64, ptr, ptr, i64, i64, i64, ptr, ptr, ptr, i64, i64, i64,
                                               i64, i64, i64, i64, i64, ctypes.c_float, cint]
        functions += [lib.specviz_decoder_layers, lib.specviz_rms_norm_rows, lib.specviz_whisper_layers]
    lib.specviz_q4_interleave.argtypes = [ptr, ptr, ptr, i64, i64, ptr, ptr, ptr]
    lib.specviz_q8_interleave.argtypes = [ptr, ptr, i64, i64, i64, ptr, ptr]
    functions += [lib.specviz_q4_interleave, lib.specviz_q8_interleave]
    lib.specviz_f16_matmul.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr, cint]
    functions.append(lib.specviz_f16_matmul)
    f32 = ctypes.c_float
    lib.specviz_row_lse.argtypes = [ptr, i64, i64, i64, i64, i64, f32, ptr, cint]
    lib.specviz_residual_pick.argtypes = [ptr, i64, i64, ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr,
                                          f32, ptr, cint]
    lib.specviz_sample_rows.argtypes = [ptr, i64, i64, i64, f32, ptr, ptr, cint]
    lib.specviz_row_argmax.argtypes = [ptr, i64, i64, i64, ptr, cint]
    functions += [lib.specviz_row_lse, lib.specviz_residual_pick, lib.specviz_sample_rows, lib.specviz_row_argmax]
    for f in functions:
        f.restype = None
    lib.specviz_isa.restype = ctypes.c_char_p
    _max_rows = lib.specviz_max_rows()
    return lib


def load_variant(directory: Path) -> ctypes.CDLL:
    """The library built from another copy of kernels/cpu/ (a change under test: same file names), declared as
    `library()`'s and cached by that copy's digest. For side-by-side benchmarks (specviz.bench.kernel_ab); the
    rows limit must be the project's own."""
    global _max_rows
    own_rows = max_rows()
    sources = [Path(directory) / p.name for p in SOURCES]
    lib = _load(sources, _digest(sources + [Path(directory) / p.name for p in HEADERS]))
    _max_rows = own_rows  # _load set the variant's; callers size calls by the project's
    if lib.specviz_max_rows() != own_rows:
        raise KernelBuildError(f"the variant in {directory} holds {lib.specviz_max_rows()} rows a call, "
                               f"the project's library {own_rows}")
    return lib


@contextlib.contextmanager
def using(lib: ctypes.CDLL) -> Iterator[None]:
    """Every kernel call in the block goes to `lib` (a variant from load_variant), then back to the project's
    library. Benchmarks only: the swap is process-wide, so nothing else may decode meanwhile."""
    global _library
    own = library()
    with _lock:
        _library = lib
    try:
        yield
    finally:
        with _lock:
            _library = own


def available(load: Callable[[], ctypes.CDLL] | None = None) -> bool:
    """Whether the library builds and loads here (`load`: what loads it, `library` unless given)."""
    try:
        (load or library)()
        return True
    except KernelBuildError:
        return False


def max_rows() -> int:
    """The most rows one kernel call takes (its per-thread accumulators are sized for it)."""
    library()
    return _max_rows
