"""One CUDA graph per launch plan: the uniforms, both kernels and the readback's copy, replayed in one launch.

An eager call costs the host 190-400 µs (two `torch.rand` draws, argument packing, two CuPy launches, a copy);
a replay is one `cudaGraphLaunch`. A graph reads and writes fixed addresses, so it is keyed by the layout of a
call (`graph_key`'s layout: mode, device, stream, shapes, strides, dtypes, settings) and by the instance
(generator, data pointers of draft tokens, draft logits and target logits): a call whose tensors sit at the
captured addresses replays; any other call captures anew (`GraphCache`, an LRU with a capture budget per
layout, so that callers whose pointers never recur fall back to eager launches instead of capturing forever).

Random numbers: the graph draws u [B, γ] then u_res [B] from the caller's generator with torch's graph-safe
Philox (the generator is registered with the graph). The captured draws read the seed and a base offset from
device scalars (u at the base, u_res past what u consumes); before each launch torch writes the generator's
current seed and offset there and advances the offset by what both draws consume, as two eager `torch.rand`
calls would. So a replay draws what `specviz.verify.kernel_args` would have drawn from the same generator
state, fresh on every replay. What differs from the eager path: torch's writes of those scalars (small
launches before the graph's, on the same stream), and the capture itself consumes no offsets.

Importing this module needs neither CuPy nor a GPU.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Generic, Hashable, TypeVar

import numpy as np
import torch

from .outputs import _views, host_lists
from .plan import _cached_plan, _prepare
from .spec import LaunchSpec

ENV = "SPECVIZ_VERIFY_GRAPHS"  # "0": every call launches eagerly (benchmarks compare both in one process)
_enabled = os.environ.get(ENV, "1") != "0"
_DEVICE_TO_HOST = 2  # cudaMemcpyDeviceToHost


def graphs_enabled() -> bool:
    """Whether calls that draw their own uniforms replay CUDA graphs (`SPECVIZ_VERIFY_GRAPHS`, default on)."""
    return _enabled


def set_graphs_enabled(flag: bool) -> None:
    """Switch graphs on or off for this process (overrides `SPECVIZ_VERIFY_GRAPHS`)."""
    global _enabled
    _enabled = bool(flag)


T = TypeVar("T")


class GraphCache(Generic[T]):
    """Captured graphs by (layout, instance), least recently used evicted beyond `capacity`.

    Capturing costs milliseconds, so each layout has a budget: it starts at `budget` captures, each capture
    spends one and each hit earns back `earn` (up to `budget`). A caller whose pointers never recur spends it
    and then gets None (launch eagerly) until one of its graphs is hit again. `capture` returning None marks
    the layout as never graphed (e.g. logits that need a cast). Thread-safe: capture runs under the lock, so
    two threads never capture at once and a key is captured once.
    """

    def __init__(self, capacity: int = 16, budget: float = 8.0, earn: float = 1 / 32):
        self.capacity = capacity
        self._budget, self._earn = budget, earn
        # (layout, instance) -> (graph, its layout's credit cell): a hit hashes the key once
        self._entries: OrderedDict[tuple, tuple[T, list[float]]] = OrderedDict()
        self._credit: dict[Hashable, list[float]] = {}  # layout -> [captures it may still make]
        self._never: set[Hashable] = set()
        self._lock = threading.Lock()

    def get(self, layout: Hashable, instance: Hashable, capture: Callable[[], T | None]) -> T | None:
        """The graph of this key: cached, or captured now (budget permitting); None: launch eagerly."""
        key = (layout, instance)
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
                graph, credit = found
                if credit[0] < self._budget:
                    credit[0] = min(self._budget, credit[0] + self._earn)
                return graph
            if layout in self._never:
                return None
            credit = self._credit.get(layout)
            if credit is None:
                if len(self._credit) > 1024:  # layouts are few; bound the bookkeeping anyway
                    self._credit.clear()
                credit = self._credit[layout] = [self._budget]
            if credit[0] < 1:
                return None
            graph = capture()
            if graph is None:
                self._never.add(layout)
                return None
            credit[0] -= 1
            self._entries[key] = (graph, credit)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
            return graph

    def keys(self) -> list[tuple]:
        """(layout, instance) of the cached graphs, least recently used first."""
        with self._lock:
            return list(self._entries)

    def clear(self) -> None:
        """Drop every graph and reset the budgets."""
        with self._lock:
            self._entries.clear()
            self._credit.clear()
            self._never.clear()


def graph_key(mode: str, draft_tokens: torch.Tensor, draft_logits: torch.Tensor, target_logits: torch.Tensor,
              generator: torch.Generator | None, stream: int, settings: dict) -> tuple[tuple, tuple]:
    """(layout, instance) of a call: what its graph's launches depend on besides addresses, and the addresses
    (with the generator whose state the graph registered). draft_tokens LongTensor[B, γ], draft_logits
    [B, γ, V], target_logits [B, γ+1, V]; stream: the raw CUDA stream the call runs on.

    A few attribute reads per tensor (the hit path's whole key; `LaunchSpec` is built only on a capture).
    """
    layout = (mode, target_logits.get_device(), stream, draft_tokens.shape, draft_logits.shape,
              target_logits.shape, draft_tokens.stride(), draft_logits.stride(), target_logits.stride(),
              draft_tokens.dtype, draft_logits.dtype, target_logits.dtype, tuple(settings.items()))
    instance = (id(generator), draft_tokens.data_ptr(), draft_logits.data_ptr(), target_logits.data_ptr())
    return layout, instance


@dataclass(eq=False)
class Graphed:
    """One captured verification and everything it owns: its state, buffers and pinned readback."""

    graph: torch.cuda.CUDAGraph
    stream: torch.cuda.Stream  # the caller's stream: replays and the one sync run there
    generator: torch.Generator  # registered with the graph; held so that its id in the key stays unique
    state: torch.Tensor  # int32 zero state of this graph alone; its kernels re-zero it
    u_res: torch.Tensor  # [B], drawn by each replay (u is the "uniforms" output)
    buffer: torch.Tensor  # uint8 outputs then workspace (the graph's pool)
    pinned: torch.Tensor  # uint8 [out_bytes], pinned host copy of the outputs
    spec: LaunchSpec
    outputs: dict = field(init=False)  # device views of `buffer`, made once
    host_bytes: np.ndarray = field(init=False)  # numpy view of `pinned`, made once
    lock: threading.Lock = field(init=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.outputs = _views(self.buffer, self.spec.batch, self.spec.gamma)
        self.outputs.pop("errors")
        self.host_bytes = self.pinned.numpy()

    def run(self, events: tuple | None = None) -> dict[str, list]:
        """Replay, wait for the copy (the one host sync) and return `host_lists` of the pinned bytes.

        events: optional (start, end) torch.cuda.Events recorded around the replay (GPU time). Locked: a
        second replay must not overwrite the pinned bytes before this one has read them.
        """
        with self.lock:
            if events is not None:
                events[0].record(self.stream)
            self.graph.replay()
            if events is not None:
                events[1].record(self.stream)
            self.stream.synchronize()
            return host_lists(self.host_bytes, self.spec.batch, self.spec.gamma)


# One capture stream per device (torch requires a non-default stream). Used under GraphCache's lock only.
_capture_streams: dict[int, torch.cuda.Stream] = {}


def capture(spec: LaunchSpec, draft_tokens: torch.Tensor, draft_logits: torch.Tensor, target_logits: torch.Tensor,
            generator: torch.Generator, state: torch.Tensor, stream: torch.cuda.Stream,
            launch_kernels: Callable[[list, torch.cuda.Stream], None]) -> Graphed:
    """Capture one verification of these tensors (draft_tokens LongTensor[B, γ], draft_logits [B, γ, V],
    target_logits [B, γ+1, V], as `spec` describes them) for replay on `stream`.

    The caller has warmed the plan up eagerly on `stream` (compile, first launch of each entry point, the
    checks `_prepare` makes) and made `state` (zero int32, `state_size` entries, zeroed on `stream`).
    launch_kernels(launches, stream) queues `_prepare`'s launches on a torch stream (CuPy's handle on it).
    """
    import cupy

    device = target_logits.device
    B, gamma = spec.batch, spec.gamma
    scratch = torch.Generator(device=device)  # loads torch's uniform kernel without drawing from `generator`
    torch.rand((B, gamma), generator=scratch, device=device)
    torch.rand((B,), generator=scratch, device=device)
    side = _capture_streams.get(device.index)
    if side is None:
        side = _capture_streams[device.index] = torch.cuda.Stream(device)
    pinned = torch.empty(_cached_plan(spec).out_bytes, dtype=torch.uint8, pin_memory=True)
    graph = torch.cuda.CUDAGraph()
    graph.register_generator_state(generator)
    with torch.cuda.stream(side):
        # thread_local: another thread's CUDA calls (a second decode) do not break this capture
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            u = torch.rand((B, gamma), generator=generator, device=device)  # the order of kernel_args
            u_res = torch.rand((B,), generator=generator, device=device)
            prep = _prepare(spec, draft_tokens, draft_logits, target_logits, u, u_res, state)
            launch_kernels(prep.launches, side)
            cupy.cuda.runtime.memcpyAsync(pinned.data_ptr(), prep.buffer.data_ptr(), prep.out_bytes,
                                          _DEVICE_TO_HOST, side.cuda_stream)
        finally:
            graph.capture_end()
    return Graphed(graph, stream, generator, state, u_res, prep.buffer, pinned, spec)
