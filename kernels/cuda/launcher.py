"""Launching a verification on the GPU (CuPy on torch's current stream) and reading its outputs back.

`launch` takes the caller's uniforms and launches eagerly; `launch_sampled` draws them itself, which lets it
replay one CUDA graph per layout and generator instead, over static inputs the call's tensors are copied into
(graphs.py). Importing this module needs neither CuPy nor a GPU: CuPy is imported inside the functions that
launch.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import warnings
from dataclasses import dataclass

import torch

from . import graphs
from .build import _functions
from .outputs import _views, host_lists, raise_for_errors
from .plan import _cached_plan, _prepare, state_size
from .sources import THREADS
from .spec import LaunchSpec

# The zero int32 state of each (device index, stream pointer). Guarded: two threads can launch on one stream
# (both on the default stream, say), and then they share its state, which is safe because their kernels run
# one after another on that stream. The lock covers lookup and insert only; torch.zeros queues a fill on the
# stream, so it runs outside the lock, and of two racing allocations the first insert wins.
_states: dict[tuple[int, int], torch.Tensor] = {}
_states_lock = threading.Lock()


def _state(device: torch.device, stream: int, entries: int) -> torch.Tensor:
    """The zero int32 state (ticket counters, error words) of one device and stream; the kernels re-zero it.

    Call with `stream` current on `device`: a new state's zero fill is queued there, ahead of its kernels.
    """
    key = (device.index, stream)
    with _states_lock:
        state = _states.get(key)
    if state is not None and state.numel() >= entries:
        return state
    fresh = torch.zeros(max(entries, 1024), dtype=torch.int32, device=device)
    with _states_lock:
        state = _states.get(key)
        if state is None or state.numel() < entries:
            # A replaced, smaller state may still be read by kernels queued on this stream: torch's caching
            # allocator hands its memory out again only to work queued after them on the same stream.
            state = _states[key] = fresh
    return state


# CuPy's handle on each (device index, torch stream pointer). Guarded: threads decoding on different streams
# fill it concurrently. Making a handle only wraps the pointer (no device work), so it happens under the lock.
# Sharing one handle between threads is safe: CuPy keeps the stack that `with handle:` pushes per thread.
_streams: dict[tuple[int, int], object] = {}
_streams_lock = threading.Lock()


def _cupy_stream(cupy, stream: torch.cuda.Stream):
    """CuPy's handle on a torch stream (cached by device and pointer), so the kernels queue behind torch's work."""
    key = (stream.device.index, stream.cuda_stream)
    with _streams_lock:
        handle = _streams.get(key)
        if handle is None:
            handle = _streams[key] = _wrap_stream(cupy, stream)
        return handle


def _wrap_stream(cupy, stream: torch.cuda.Stream):
    from_external = getattr(cupy.cuda.Stream, "from_external", None)  # CuPy >= 14
    if from_external is not None:
        try:
            return from_external(stream)
        except Exception:
            pass
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(stream.cuda_stream, stream.device.index)


# Not locked: the count is a pure function of the device, so a racing duplicate call is harmless, and
# lru_cache's own bookkeeping is thread-safe.
@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _launch_kernels(cupy, device_index: int, launches: list, stream: torch.cuda.Stream) -> None:
    """Queue `_prepare`'s launches [(entry point, grid, args)] on a torch stream, through CuPy's handle on it."""
    functions = _functions(device_index)
    with cupy.cuda.Device(device_index), _cupy_stream(cupy, stream):
        for name, grid, args in launches:
            functions[name](grid, (THREADS, 1, 1), args)


@dataclass
class Launched:
    """One verification on the GPU: device views of the outputs, and their host copy when it was read back."""

    outputs: dict  # verify_tiled's keys -> device tensors (views of the call's buffer, or of a graph's)
    host: dict | None  # the same keys -> Python lists ([B] or [B][γ]), from the one readback; None if check=False
    u_res: torch.Tensor | None = None  # [B]: the residual uniforms `launch_sampled` drew (None from `launch`)
    graphed: bool = False  # replayed a CUDA graph (launch_sampled)


def launch(mode: str, draft_tokens: torch.Tensor, draft_logits: torch.Tensor, target_logits: torch.Tensor,
           u: torch.Tensor, u_res: torch.Tensor, *, check: bool = True, events: tuple | None = None,
           **settings: float | None) -> Launched:
    """`verify_cuda`'s work, returning the device outputs and (check=True) the host lists of the readback.

    Tensors and settings as `verify_cuda` takes them. The readback copies the few output bytes into pinned
    host memory and waits for that copy only: the one host sync of a call. events: optional (start, end)
    torch.cuda.Events recorded right before the first and after the last kernel launch (benchmarks: GPU time
    without the host's share).
    """
    if not target_logits.is_cuda:
        raise ValueError("verify_cuda needs CUDA tensors")
    import cupy

    device = target_logits.device
    spec = LaunchSpec.of(mode, draft_tokens, draft_logits, target_logits, u, u_res, sms=_sm_count(device.index),
                         **settings)
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device)
        state = _state(device, stream.cuda_stream, state_size(spec.batch, spec.gamma))
        prep = _prepare(spec, draft_tokens, draft_logits, target_logits, u, u_res, state)
        if events is not None:
            events[0].record(stream)
        _launch_kernels(cupy, device.index, prep.launches, stream)
        if events is not None:
            events[1].record(stream)
        outputs = _views(prep.buffer, spec.batch, spec.gamma)
        outputs.pop("errors")
        if not check:
            return Launched(outputs, None)
        pinned = torch.empty(prep.out_bytes, dtype=torch.uint8, pin_memory=True)
        pinned.copy_(prep.buffer[: prep.out_bytes], non_blocking=True)
        stream.synchronize()  # the one host sync: waits for the kernels and this copy
    host = host_lists(pinned.numpy(), spec.batch, spec.gamma)
    raise_for_errors(host.pop("errors"), spec.vocab)
    return Launched(outputs, host)


# Graphs of `launch_sampled`, by layout and generator (graphs.GraphCache: LRU; each graph owns its inputs).
_graph_cache: graphs.GraphCache[graphs.Graphed] = graphs.GraphCache(capacity=16)


def launch_sampled(mode: str, draft_tokens: torch.Tensor, draft_logits: torch.Tensor, target_logits: torch.Tensor,
                   generator: torch.Generator | None, *, graphs_on: bool | None = None, events: tuple | None = None,
                   **settings: float | None) -> Launched:
    """`launch` with check=True that draws its own uniforms from `generator` (None: the device's default):
    u = rand((B, γ)) then u_res = rand((B,)), as `specviz.verify.kernel_args` does.

    Where it can, one CUDA graph per layout and generator does all of it (graphs.py): the call's tensors are
    copied into the graph's static inputs, then one replay makes the draws, runs both kernels and copies into
    pinned memory, then the one sync. Any tensors of the layout hit the graph (fresh ones every call too);
    passing the static inputs themselves (`graph_inputs`) skips their copies. Its device outputs are the graph's
    buffer: valid until the next call of the same layout and generator. Eager instead (the same draws, then
    `launch`) when graphs are off (graphs_on=False, or None and `graphs.graphs_enabled()` False), the generator
    is not a CUDA one, the tensors are not all on the logits' device, or the logits need a cast (mixed or
    unsupported dtypes). draft_tokens LongTensor[B, γ], draft_logits [B, γ, V], target_logits [B, γ+1, V];
    settings and errors as `verify_cuda`'s. events: (start, end) CUDA events around the copy-in and replay,
    or around the kernels.
    """
    if graphs.graphs_enabled() if graphs_on is None else graphs_on:
        done = _launch_graphed(mode, draft_tokens, draft_logits, target_logits, generator, events, settings)
        if done is not None:
            return done
    B, gamma = draft_tokens.shape
    u = torch.rand((B, gamma), generator=generator, device=target_logits.device)
    u_res = torch.rand((B,), generator=generator, device=target_logits.device)
    done = launch(mode, draft_tokens, draft_logits, target_logits, u, u_res, events=events, **settings)
    done.u_res = u_res
    return done


def _graph_key(mode: str, draft_tokens: torch.Tensor, draft_logits: torch.Tensor, target_logits: torch.Tensor,
               generator: torch.Generator | None, settings: dict) -> tuple | None:
    """(layout, instance, generator) of a call's graph (the generator resolved: None is the device's
    default); None where no graph applies (CPU tensors or generator, tensors on different devices)."""
    if not target_logits.is_cuda or generator is not None and generator.device.type != "cuda":
        return None
    index = target_logits.get_device()
    if draft_tokens.get_device() != index or draft_logits.get_device() != index:
        return None  # eager: `launch` names the stray tensor (a copy-in would move it silently)
    if generator is None:
        generator = torch.cuda.default_generators[index]
    layout, instance = graphs.graph_key(mode, draft_tokens, draft_logits, target_logits, generator,
                                        torch._C._cuda_getCurrentRawStream(index), settings)
    return layout, instance, generator


def _launch_graphed(mode: str, draft_tokens: torch.Tensor, draft_logits: torch.Tensor, target_logits: torch.Tensor,
                    generator: torch.Generator | None, events: tuple | None, settings: dict) -> Launched | None:
    """`launch_sampled` through its layout's graph (captured on the first call); None where no graph applies."""
    key = _graph_key(mode, draft_tokens, draft_logits, target_logits, generator, settings)
    if key is None:
        return None
    layout, instance, gen = key
    graph = _graph_cache.get(layout, instance, lambda: _capture(mode, draft_tokens, draft_logits, target_logits,
                                                                gen, settings))
    if graph is None:
        return None
    host = graph.run((draft_tokens, draft_logits, target_logits), events)
    raise_for_errors(host.pop("errors"), graph.spec.vocab)
    return Launched(dict(graph.outputs), host, graph.u_res, True)


def graph_inputs(mode: str, draft_tokens: torch.Tensor, draft_logits: torch.Tensor, target_logits: torch.Tensor,
                 generator: torch.Generator | None, **settings: float | None) -> tuple | None:
    """The static inputs (draft tokens, draft logits, target logits) of the graph that `launch_sampled` with
    these arguments would replay, or None while there is none (nothing is captured here). A caller that
    writes its tensors there and passes those saves the copy-in; they are rewritten by any call of the same
    layout and generator that passes other tensors."""
    key = _graph_key(mode, draft_tokens, draft_logits, target_logits, generator, settings)
    graph = None if key is None else _graph_cache.peek(key[0], key[1])
    return None if graph is None else graph.inputs


def _capture(mode: str, draft_tokens: torch.Tensor, draft_logits: torch.Tensor, target_logits: torch.Tensor,
             generator: torch.Generator, settings: dict) -> graphs.Graphed | None:
    """Allocate the layout's static inputs, copy this call's tensors in, warm the plan up eagerly on them and
    capture its graph over them; None when it should stay eager (the logits need a cast). Raises as `launch`
    does (shapes, settings)."""
    import cupy

    device = target_logits.device
    B, gamma = draft_tokens.shape if draft_tokens.dim() == 2 else (1, 1)  # else LaunchSpec.of raises
    u = torch.full((B, gamma), 0.5, device=device)  # warm-up uniforms: the generator is not drawn from
    u_res = torch.full((B,), 0.5, device=device)
    given = LaunchSpec.of(mode, draft_tokens, draft_logits, target_logits, u, u_res, sms=_sm_count(device.index),
                          **settings)
    V = given.vocab
    spec = dataclasses.replace(given, draft_strides=(gamma * V, V, 1), target_strides=((gamma + 1) * V, V, 1))
    plan = _cached_plan(spec)  # validates the settings
    if plan.cast:
        return None
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device)
        inputs = graphs.static_inputs(draft_tokens, draft_logits, target_logits)
        for static, tensor in zip(inputs, (draft_tokens, draft_logits, target_logits)):
            static.copy_(tensor)
        state = torch.zeros(plan.state_entries, dtype=torch.int32, device=device)
        # eagerly once: every entry point has run before capture
        prep = _prepare(spec, *inputs, u, u_res, state)
        _launch_kernels(cupy, device.index, prep.launches, stream)
        return graphs.capture(spec, inputs, generator, state, stream,
                              lambda launches, on: _launch_kernels(cupy, device.index, launches, on))


def verify_cuda(mode: str, draft_tokens: torch.Tensor, draft_logits: torch.Tensor, target_logits: torch.Tensor,
                u: torch.Tensor, u_res: torch.Tensor, *, check: bool = True, host: bool = False,
                **settings: float | None) -> dict[str, torch.Tensor]:
    """Verify on the GPU; returns verify_tiled's keys: n_accepted, next_token, accept_prob, uniforms, p_draft, q_draft.

    mode: 'exact' or 'sigmoid'. draft_tokens LongTensor[B, γ], draft_logits [B, γ, V], target_logits
    [B, γ+1, V]: logits as verify_tiled receives them after its own preparation: raw logits with
    scale = 1/temperature (temperature-only sampling), or standardized logits (-inf masks) with scale = 1.
    u [B, γ] and u_res [B]: the uniforms, drawn by the caller (u first, then u_res).
    settings: `LaunchSpec`'s fields with defaults (scale, lenience, sigmoid_alpha, sigmoid_beta, topk, top_p,
    stats_chunk, residual_chunk). topk (1..MAX_TOPK; 0 = off) and top_p ((0, 1]; 1 = off), either mode:
    filter each row inside the kernels as `standardize` does, on raw logits with scale = topk_scale(T): top-k
    keeps the k largest values of scale·logits (ties with the k-th kept), then top-p drops a value when the
    mass of the larger ones reaches fp32(top_p) (the largest always stays; ties with the boundary value all
    kept, see verify.cu).
    check: read the few output bytes back once and raise InvalidLogitsError (NaN / +inf / all -inf logits,
    naming tensor and row) or ValueError (drafted token outside [0, V)); False: no host sync, no errors.
    host: return CPU tensors made from that readback instead of device tensors (needs check=True).
    """
    if host and not check:
        raise ValueError("host=True needs check=True (the readback)")
    done = launch(mode, draft_tokens, draft_logits, target_logits, u, u_res, check=check, **settings)
    if not host:
        return done.outputs
    h = done.host
    return dict(
        n_accepted=torch.tensor(h["n_accepted"], dtype=torch.long),
        next_token=torch.tensor(h["next_token"], dtype=torch.long),
        **{k: torch.tensor(h[k], dtype=torch.float32) for k in ("accept_prob", "uniforms", "p_draft", "q_draft")},
    )
