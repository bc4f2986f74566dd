"""Compiling verify.cu: nvcc / NVRTC checks, the per-device run-time compile, and whether the kernels can run here.

Importing this module needs neither CuPy nor a GPU: CuPy is imported inside the functions that use it.
"""

from __future__ import annotations

import importlib
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from .sources import ENTRY_POINTS, source_files, verify_source

NVRTC_OPTIONS = ("-std=c++17",)


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


# Entry points per device index. Guarded: a page run and a compare may reach their first launch on a device
# together, and the compile takes seconds, so it must happen once. The lock is held across the compile (no
# kernel launch happens under it), so every thread's launch waits for it: once per device and process.
_compiled: dict[int, dict] = {}
_compile_lock = threading.Lock()


def _functions(device_index: int) -> dict:
    """verify.cu's entry points compiled for the device (once per process and device), by name."""
    with _compile_lock:
        functions = _compiled.get(device_index)
        if functions is None:
            functions = _compiled[device_index] = _compile(device_index)
        return functions


def _compile(device_index: int) -> dict:
    import cupy

    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=verify_source(), options=NVRTC_OPTIONS)
        return {name: module.get_function(name) for name in ENTRY_POINTS}


# (available, reason), decided once. Lock order: _probe_lock, then _compile_lock (inside _functions).
_availability: tuple[bool, str] | None = None
_probe_lock = threading.Lock()


def _probe() -> tuple[bool, str]:
    global _availability
    with _probe_lock:
        if _availability is None:
            _availability = _check_available()
        return _availability


def _check_available() -> tuple[bool, str]:
    try:
        if not torch.cuda.is_available():
            return False, "torch sees no CUDA device"
        try:
            importlib.import_module("cupy")
        except Exception as exc:  # ImportError, or a CuPy that does not match the driver
            return False, f"CuPy is not importable: {exc}"
        _functions(torch.cuda.current_device())
        return True, ""
    except Exception as exc:  # compile or driver failure
        return False, f"{type(exc).__name__}: {exc}"


def available() -> bool:
    """True when CuPy imports, a CUDA device is present and verify.cu compiles for it. Never raises."""
    return _probe()[0]


def unavailable_reason() -> str:
    """Why `available()` is False ('' when it is True)."""
    return _probe()[1]
