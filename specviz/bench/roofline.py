"""The two ceilings a CPU step is measured against (docs/benchmarks.md, "Roofline"): how fast this machine
reads memory, and how many int8 multiply-adds per second the kernels' dot-product instructions can do; and
how much of a step its linear layers take (the rest is norms, rotary, attention and Python)."""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Iterator, Sequence

import torch
from torch import nn

from specviz.models import arena, cpu_kernels
from specviz.models.packed import PackedLinear

INT8_LINEAR = torch.ao.nn.quantized.dynamic.Linear  # the int8 draft's layers (specviz.models.quant)


def read_bandwidth(gib: float = 1.0, repeat: int = 5) -> float:
    """Bytes per second torch's threads read summing a `gib` GiB fp32 tensor (far beyond any cache), median of
    `repeat` after one warm-up: the floor under a weight-bound step is its bytes over this. The tensor lies on
    2 MB pages, as the models' weights do (models/arena.py): on 4 KB pages the sum read 22.2 GB/s on the 2-vCPU
    Xeon, 30.4 on 2 MB pages, and the target's step then read "121%" of its ceiling."""
    nbytes = int(gib * 2**30) // 4 * 4
    x = arena.huge_page_bytes(nbytes).view(torch.float32)
    x.fill_(1.0)  # touched before it is timed: the first touch is the page faults'
    x.sum()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / statistics.median(times)


def int8_peak(repeat: int = 3, iterations: int = 10**7) -> float | None:
    """Multiply-adds per second of the kernels' int8 dot products, operands in registers, on torch's threads
    (median of `repeat` after one warm-up); None where the kernels have no 8-bit path."""
    if not (cpu_kernels.available() and cpu_kernels.has_int8_activations()):
        return None
    cpu_kernels.int8_peak_macs(iterations // 10)
    rates = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        macs = cpu_kernels.int8_peak_macs(iterations)
        rates.append(macs / (time.perf_counter() - t0))
    return statistics.median(rates)


def model_linears(model: nn.Module) -> list[nn.Module]:
    """The model's own linear layers (packed, dense or int8)."""
    return [m for m in model.modules() if isinstance(m, (PackedLinear, nn.Linear, INT8_LINEAR))]


def called_linears(model: nn.Module) -> list[nn.Module]:
    """The linear layers a forward may call: the model's own, and the fused ones its lean forward calls
    instead of some of them (models/lean.py; they hold views of the same weights)."""
    lean = getattr(model, "lean_forward", None)
    fused = [] if lean is None else [m for layer in lean.layers for m in (layer.qkv, layer.gate_up) if m is not None]
    return model_linears(model) + fused


@contextlib.contextmanager
def linear_time(model: nn.Module, extra: Sequence[nn.Module] = ()) -> Iterator[list[float]]:
    """Within the block, seconds spent inside the model's linear layers, and in `extra` ones it calls from outside
    (a reduced draft head), accumulate in the yielded [total]."""
    total = [0.0]
    started: dict[int, float] = {}

    def before(module, args):
        started[id(module)] = time.perf_counter()

    def after(module, args, output):
        total[0] += time.perf_counter() - started.pop(id(module))

    handles = [h for m in [*called_linears(model), *extra]
               for h in (m.register_forward_pre_hook(before), m.register_forward_hook(after))]
    try:
        yield total
    finally:
        for h in handles:
            h.remove()
