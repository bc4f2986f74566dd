"""A one-line description of where a measurement ran, stored beside every figure."""

from __future__ import annotations

import os
import platform

import torch


def device_name(device: torch.device) -> str:
    """The GPU's name on CUDA, else the device string ('cpu')."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)


def describe() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, torch {torch.__version__}"
