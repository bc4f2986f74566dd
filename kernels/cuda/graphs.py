"""One CUDA graph per launch plan and generator: the uniforms, both kernels and the readback's copy, replayed in
one launch over static inputs the graph owns.

An eager call costs the host 190-400 µs (two `torch.rand` draws, argument packing, two CuPy launches, a copy);
a replay is one `cudaGraphLaunch`. A graph reads and writes fixed addresses, and the decoding engine hands
every iteration fresh tensors (`proposal.padded(...)`, stacked draft logits, gathered target logits), so a
graph keyed by the callers' data pointers almost never replayed there (captures, then eager calls: a median
0.97 ms per iteration). So each graph owns its inputs: at capture it allocates static draft tokens [B, γ]
(int64), draft logits [B, γ, V] and target logits [B, γ+1, V] (the call's dtypes, contiguous) and captures
over those; a call copies its tensors in (`static.copy_(given)` on the call's stream, before the replay; a
tensor that already is the static one, same address and strides, is not copied; `copy_` handles any strides)
and replays. The cache (`GraphCache`, an LRU) is keyed by the call's layout (`graph_key`: mode, device,
stream, shapes, dtypes, settings; not strides, not addresses) and its generator, so every call of a layout hits
after the first. One lock per graph covers copy-in, replay and readback: two threads never interleave on one
graph (the device outputs a call returns are the graph's buffer, valid until the next call of its key).

Random numbers: the graph draws u [B, γ] then u_res [B] from the caller's generator with torch's graph-safe
Philox (the generator is registered with the graph, which is why it is part of the key). The captured draws
read the seed and a base offset from device scalars (u at the base, u_res past what u consumes); before each
launch torch writes the generator's current seed and offset there and advances the offset by what both draws
consume, as two eager `torch.rand` calls would. So a replay draws what `specviz.verify.kernel_args` would have
drawn from the same generator state, fresh on every replay. What differs from the eager path: torch's writes
of those scalars (small launches before the graph's, on the same stream), and the capture itself consumes no
offsets. A graph holds its generator (torch 2.11's CUDA generators take no weak references); the cache's LRU
bound (16) is what lets a finished run's graphs go.

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

    instance: what besides the layout a graph is bound to (`graph_key`: the id of the generator, which the
    graph holds, so the id stays its own while the graph is cached). A key is captured once; `capture`
    returning None marks the layout as never graphed (e.g. logits that need a cast) and the call launches
    eagerly. Thread-safe: capture runs under the lock, so two threads never capture at once and a key is
    captured once.
    """

    def __init__(self, capacity: int = 16):
        self.capacity = capacity
        self._entries: OrderedDict[tuple, T] = OrderedDict()  # (layout, instance) -> graph
        self._never: set[Hashable] = set()
        self._lock = threading.Lock()

    def get(self, layout: Hashable, instance: Hashable, capture: Callable[[], T | None]) -> T | None:
        """The graph of this key: cached, or captured now; None: launch eagerly (not graphable)."""
        key = (layout, instance)
        with self._lock:
            graph = self._entries.get(key)
            if graph is not None:
                self._entries.move_to_end(key)
                return graph
            if layout in self._never:
                return None
            graph = capture()
            if graph is None:
                if len(self._never) > 1024:  # layouts are few; bound the bookkeeping anyway
                    self._never.clear()
                self._never.add(layout)
                return None
            self._entries[key] = graph
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
            return graph

    def peek(self, layout: Hashable, instance: Hashable) -> T | None:
        """The cached graph of this key, or None; captures nothing and does not count as a use."""
        with self._lock:
            return self._entries.get((layout, instance))

    def keys(self) -> list[tuple]:
        """(layout, instance) of the cached graphs, least recently used first."""
        with self._lock:
            return list(self._entries)

    def clear(self) -> None:
        """Drop every graph and forget the layouts marked never graphed."""
        with self._lock:
            self._entries.clear()
            self._never.clear()


def graph_key(mode: str, draft_tokens: torch.Tensor, draft_logits: torch.Tensor, target_logits: torch.Tensor,
              generator: torch.Generator | None, stream: int, settings: dict) -> tuple[tuple, object]:
    """(layout, instance) of a call. layout: what its graph's launches depend on (mode, device, stream,
    shapes, dtypes, settings); not strides (the copy-in makes the static inputs contiguous) and not addresses
    (the graph owns its inputs). instance: the id of the generator the graph registers and holds (None for
    None). draft_tokens LongTensor[B, γ], draft_logits [B, γ, V], target_logits [B, γ+1, V]; stream: the raw
    CUDA stream the call runs on.

    A few attribute reads per tensor (the hit path's whole key; `LaunchSpec` is built only on a capture).
    """
    layout = (mode, target_logits.get_device(), stream, draft_tokens.shape, draft_logits.shape,
              target_logits.shape, draft_tokens.dtype, draft_logits.dtype, target_logits.dtype,
              tuple(settings.items()))
    # an id, not a weak reference: torch 2.11's CUDA generators take none (seen on the H200); the graph holds it
    return layout, (None if generator is None else id(generator))


def static_inputs(draft_tokens: torch.Tensor, draft_logits: torch.Tensor,
                  target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uninitialized contiguous tensors of these shapes and dtypes on target_logits' device (a graph's inputs)."""
    device = target_logits.device
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=device)
                 for t in (draft_tokens, draft_logits, target_logits))


def _needs_copy(given: torch.Tensor, static: torch.Tensor) -> bool:
    return given.data_ptr() != static.data_ptr() or given.stride() != static.stride()


@dataclass(eq=False)
class Graphed:
    """One captured verification and everything it owns: its inputs, state, buffers and pinned readback."""

    graph: torch.cuda.CUDAGraph
    stream: torch.cuda.Stream  # the caller's stream: copy-in, replays and the one sync run there
    inputs: tuple  # (draft tokens [B, γ], draft logits [B, γ, V], target logits [B, γ+1, V]): static, contiguous
    state: torch.Tensor  # int32 zero state of this graph alone; its kernels re-zero it
    u_res: torch.Tensor  # [B], drawn by each replay (u is the "uniforms" output)
    buffer: torch.Tensor  # uint8 outputs then workspace (the graph's pool)
    pinned: torch.Tensor  # uint8 [out_bytes], pinned host copy of the outputs
    spec: LaunchSpec
    generator: torch.Generator | None = None  # registered with the graph; held so that its id in the key stays unique
    outputs: dict = field(init=False)  # device views of `buffer`, made once
    host_bytes: np.ndarray = field(init=False)  # numpy view of `pinned`, made once
    lock: threading.Lock = field(init=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.outputs = _views(self.buffer, self.spec.batch, self.spec.gamma)
        self.outputs.pop("errors")
        self.host_bytes = self.pinned.numpy()

    def run(self, given: tuple, events: tuple | None = None) -> dict[str, list]:
        """Copy `given` (draft tokens, draft logits, target logits, as `inputs` but any strides) into the
        inputs, replay, wait for the readback's copy (the one host sync) and return `host_lists` of it.

        The caller runs on `stream` (the key says so), so the copies queue there, ahead of the replay; a given
        tensor that is the static one is not copied. events: optional (start, end) torch.cuda.Events recorded
        before the copies and after the replay (GPU time). Locked: another call on this graph must neither
        overwrite the inputs before this replay has read them nor the pinned bytes before this one has read them.
        """
        with self.lock:
            if events is not None:
                events[0].record(self.stream)
            for static, tensor in zip(self.inputs, given):
                if _needs_copy(tensor, static):
                    static.copy_(tensor)
            self.graph.replay()
            if events is not None:
                events[1].record(self.stream)
            self.stream.synchronize()
            return host_lists(self.host_bytes, self.spec.batch, self.spec.gamma)


# One capture stream per device (torch requires a non-default stream). Used under GraphCache's lock only.
_capture_streams: dict[int, torch.cuda.Stream] = {}


def capture(spec: LaunchSpec, inputs: tuple, generator: torch.Generator, state: torch.Tensor,
            stream: torch.cuda.Stream, launch_kernels: Callable[[list, torch.cuda.Stream], None]) -> Graphed:
    """Capture one verification of `inputs` (static_inputs: draft tokens LongTensor[B, γ], draft logits
    [B, γ, V], target logits [B, γ+1, V], as `spec` describes them) for replay on `stream`.

    The caller has warmed the plan up eagerly on `stream` (compile, first launch of each entry point, the
    checks `_prepare` makes) and made `state` (zero int32, `state_size` entries, zeroed on `stream`).
    launch_kernels(launches, stream) queues `_prepare`'s launches on a torch stream (CuPy's handle on it).
    """
    import cupy

    draft_tokens, draft_logits, target_logits = inputs
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
    return Graphed(graph, stream, inputs, state, u_res, prep.buffer, pinned, spec, generator)
