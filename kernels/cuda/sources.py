"""verify.cu as the host sees it: where the sources are, and the sizes and entry-point names that must match it."""

from __future__ import annotations

from pathlib import Path

import torch

KERNEL_DIR = Path(__file__).resolve().parent
THREADS = 256  # SV_THREADS in verify.cu
MAX_GAMMA = 256  # SV_MAX_GAMMA in verify.cu
# Largest in-kernel top-k: the last block of each row merges K1·k candidates alone, so its tail grows with
# k; larger k (rare) goes through `standardize` on the torch side (with any top-p).
MAX_TOPK = 1024
MAX_GRID_YZ = 65535
UNROLL_SPAN = 1024  # SV_THREADS · SV_UNROLL: the columns one pass of a block covers
MODES = ("exact", "sigmoid")
DTYPE_SUFFIX = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}  # logits dtype -> entry suffix
# Launch 1 and the sigmoid launch come in variants that compile only the filtering they need (registers)
_KINDS = ("exact_stats", "exact_stats_topk", "exact_stats_topp", "exact_resample", "sigmoid", "sigmoid_filtered")
ENTRY_POINTS = tuple(f"sv_{kind}_{suffix}" for suffix in DTYPE_SUFFIX.values() for kind in _KINDS)


def source_files() -> list[Path]:
    """The CUDA sources of this package."""
    return sorted(KERNEL_DIR.glob("*.cu"))


def verify_source() -> str:
    """The text of verify.cu, the one translation unit the run-time compile builds."""
    return (KERNEL_DIR / "verify.cu").read_text()
