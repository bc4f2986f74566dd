"""Decoding steps as CUDA graphs over static key/value buffers (project issue 40).

Why: on a GPU, transformers' eager forward of these small models is bound by kernel launches, not by their
weights (H100: the 0.5B draft's step cost ~0.8 of the 1.5B target's, and speculation lost). Here one function
walks the layers with explicit state, as gpt-fast's `generate.py` does, over key/value buffers whose addresses do
not change while a decoder lives: a step of one shape (rows B, new tokens W, logits kept) is captured once as
a CUDA graph and then replayed, one launch from the host, with only its inputs' contents changing.

What makes a step replayable: every call attends over the buffers' whole capacity C, and the mask hides what
is not a key of that query (slots that hold no valid token of the row, and slots after the query's own: new
column i sits at slot start + i). The write position `start` is a device scalar set before each replay.

Buffers come from `Workspace`s kept by the model's `GraphedForward` and reused from one decoder to the next
(the page's run and its target-only reference, compare's rounds), so their graphs are captured once per shape
and not once per run.

Exactness: the graphs replay the eager function's kernels on the same shapes, so a replay gives the eager call's
bits (tests/test_graphed.py, on a GPU). A position's logits do not depend on the other rows of a call (attention
is per row and masked; every other operation is per token), but cuBLAS may choose another algorithm for another
number of rows B·W, so across call shapes they agree up to rounding only; and they agree with transformers'
forward up to rounding (fused projections, element-wise work rounded once in fused kernels: models/fused.py).

Measured on an H200 (docs/benchmarks.md, "Steps on a GPU"): steps 4–14× cheaper than transformers' eager forward,
then 11–12 kernels a layer at 1.2–5 µs each and ~1.2 µs between each two, whatever the layer's size.
"""

from __future__ import annotations

import os
import threading
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from specviz.models import fused
from specviz.models.kv_cache import BufferedCache

_FAMILIES = ("qwen2", "llama")  # decoder layers of this shape: q/k/v/o, gate/up/down, two RMS norms
MAX_GRAPH_WIDTH = 32  # new tokens per row that a step may have and still be graphed (γ + 1 ≤ 16; catch-ups)
HEADROOM = 1024  # slots a workspace holds beyond its first write: a run's new tokens and rejected drafts
ALIGN = 256  # capacities are multiples of this, so runs on prompts of similar length share a workspace
KEPT_FREE = 4  # workspaces kept for reuse per forward once their decoders are gone
MODES = ("graphs", "eager", "transformers")  # SPECVIZ_GPU_STEPS: how a CUDA model steps (default graphs)
ATTENTION = ("triton", "matmul", "sdpa")  # SPECVIZ_STEP_ATTENTION: how a step attends (default triton)
LINEAR = ("auto", "cublas")  # SPECVIZ_STEP_LINEAR: the projections on fused_linear's kernel where faster, or cuBLAS


def gpu_steps() -> str:
    """How CUDA models step: 'graphs' (default), 'eager' (this module's forward, no graphs: for side-by-side
    measurement) or 'transformers' (transformers' own forward)."""
    mode = os.environ.get("SPECVIZ_GPU_STEPS", "graphs")
    if mode not in MODES:
        raise ValueError(f"SPECVIZ_GPU_STEPS={mode!r}: use one of {', '.join(MODES)}")
    return mode


def supports(model: nn.Module) -> bool:
    """Whether this forward runs `model`: a Qwen2/Llama-family decoder with plain linear layers, full attention,
    SiLU, and default rotary embeddings (else the model keeps transformers' forward)."""
    cfg = model.config
    if cfg.model_type not in _FAMILIES or cfg.hidden_act != "silu" or getattr(cfg, "use_sliding_window", False):
        return False
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
        return False
    if getattr(model.model.rotary_emb, "rope_type", "default") != "default":
        return False
    linears = [m for layer in model.model.layers for m in (*_attention_linears(layer), *_mlp_linears(layer))]
    return all(type(m) is nn.Linear for m in linears) and type(model.lm_head) is nn.Linear


def _attention_linears(layer: nn.Module) -> tuple[nn.Linear, ...]:
    a = layer.self_attn
    return a.q_proj, a.k_proj, a.v_proj, a.o_proj


def _mlp_linears(layer: nn.Module) -> tuple[nn.Linear, ...]:
    return layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj


@torch.no_grad()
def _fuse(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight [sum of outputs, in] (and bias) for several projections of one input; each module's own
    parameters become views of it, so memory does not double and one matrix product replaces several."""
    weight = torch.cat([m.weight for m in linears])
    has_bias = [m.bias is not None for m in linears]
    bias = None
    if any(has_bias):
        bias = torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.out_features) for m in linears])
    start = 0
    for m in linears:
        end = start + m.out_features
        m.weight = nn.Parameter(weight[start:end], requires_grad=False)
        if m.bias is not None:
            m.bias = nn.Parameter(bias[start:end], requires_grad=False)
        start = end
    return weight, bias


@dataclass
class _Layer:
    """One decoder layer's weights, q/k/v and gate/up fused."""

    qkv_weight: torch.Tensor  # [q + k + v outputs, hidden]
    qkv_bias: torch.Tensor | None
    widths: tuple[int, int, int]
    o_proj: nn.Linear
    gate_up_weight: torch.Tensor  # [2 · intermediate, hidden]
    gate_up_bias: torch.Tensor | None
    intermediate: int
    down_proj: nn.Linear
    norm1: torch.Tensor
    eps1: float
    norm2: torch.Tensor
    eps2: float

    @classmethod
    def of(cls, layer: nn.Module) -> "_Layer":
        q, k, v, o = _attention_linears(layer)
        gate, up, down = _mlp_linears(layer)
        qkv_w, qkv_b = _fuse([q, k, v])
        gu_w, gu_b = _fuse([gate, up])
        return cls(qkv_w, qkv_b, (q.out_features, k.out_features, v.out_features), o, gu_w, gu_b,
                   gate.out_features, down, layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon,
                   layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon)


class GraphedForward:
    """The forward of one supported model (`supports`), eager or replayed from CUDA graphs, and the pool of
    workspaces its decoders draw their key/value buffers from. Its weights are the model's own (q/k/v and
    gate/up fused, the modules keeping views). One instance serves any number of decoders and threads: the pool
    is locked; a workspace and its graphs belong to one decoder at a time."""

    ROTARY_TABLE_POSITIONS = 262144  # at most this many positions' rotary values are tabled (16 MB per 32K at D = 128)

    def __init__(self, model: nn.Module, graphs: bool = True, attention: str = "triton", linear: str = "auto",
                 capture: Callable[..., tuple] | None = None):
        """attention: ATTENTION; linear: LINEAR ('auto': each projection on fused_linear's kernel where it measures
        faster on this GPU). capture(run, device, pool) -> (graph with replay(), output): how a step shape is
        captured; default `cuda_graph` on CUDA when `graphs`, none (eager steps) elsewhere. Tests pass a stand-in
        to drive the graph bookkeeping on the CPU."""
        cfg = model.config
        if attention not in ATTENTION:
            raise ValueError(f"attention {attention!r}: use one of {', '.join(ATTENTION)}")
        if linear not in LINEAR:
            raise ValueError(f"linear {linear!r}: use one of {', '.join(LINEAR)}")
        self.model, self.attention = model, attention
        self.device, self.dtype = model.device, model.dtype
        self.capture = capture if capture is not None else (cuda_graph if graphs and self.device.type == "cuda" else None)
        self.graphs = self.capture is not None
        self.embed = model.model.embed_tokens.weight
        self.layers = [_Layer.of(layer) for layer in model.model.layers]
        self.norm, self.eps = model.model.norm.weight, model.model.norm.variance_epsilon
        self.head = model.lm_head
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scaling = model.model.layers[0].self_attn.scaling
        positions = torch.arange(min(cfg.max_position_embeddings, self.ROTARY_TABLE_POSITIONS), device=self.device)
        with torch.inference_mode():  # transformers' own rotary values, in the model's dtype as it applies them
            cos, sin = model.model.rotary_emb(self.embed[:1][None], positions[None])
        self.cos, self.sin = cos[0].clone(), sin[0].clone()  # [P, D]
        self.ops = fused.choose(self.device, self.dtype, cfg.hidden_size, self.layers[0].intermediate, self.heads,
                                self.kv_heads, self.head_dim, self.eps, self.layers, linear)
        self._free: list[Workspace] = []  # released workspaces, most recent last
        self._lock = threading.Lock()  # decoders of several page sessions acquire and release concurrently

    # ---- the forward ---------------------------------------------------------------------------
    def hidden(self, ids: torch.Tensor, positions: torch.Tensor, start: torch.Tensor, valid: torch.Tensor,
               keys: list[torch.Tensor], values: list[torch.Tensor], keep: int) -> torch.Tensor:
        """ids, positions [B, W] (positions: each token's index among its row's valid tokens); start LongTensor[1]:
        the slot of new column 0; valid [B, C] bool: which of the C slots hold a token of the row (read up to
        start + W, the new columns included); keys, values per layer [B, kv heads, C, D], written at slots start …
        start + W − 1 -> the final norm's output [B, keep, hidden] for the last `keep` columns."""
        B, W = ids.shape
        C = keys[0].shape[2]
        H, Hkv, D = self.heads, self.kv_heads, self.head_dim
        G = H // Hkv
        ops = self.ops
        slots = start + torch.arange(W, device=ids.device)  # [W]
        causal = torch.arange(C, device=ids.device)[None, :] <= slots[:, None]  # [W, C]
        sees = valid[:, None, :] & causal[None]  # [B, W, C]
        # queries grouped by key head ([B, Hkv, G·W, D], query g·W + w), so attention reads each key head once;
        # the mask is additive, made once per step for every layer
        bias = torch.zeros((B, 1, G, W, C), dtype=self.dtype, device=ids.device)
        bias.masked_fill_(~sees[:, None, None], float("-inf"))
        bias = bias.view(B, 1, G * W, C)
        split = self.attention == "triton" and G * W <= fused.ATTEND_MAX_ROWS  # else two products, as 'matmul'
        if self.attention != "sdpa" and not split:
            bias = bias.expand(B, Hkv, G * W, C).reshape(B * Hkv, G * W, C)
        cos, sin = self.cos[positions].view(B * W, D), self.sin[positions].view(B * W, D)
        x = F.embedding(ids, self.embed).view(B * W, -1)  # [B·W, hidden]: rows b·W + w
        delta = None  # what the last block adds to x: added by the next norm, in the same kernel
        for i, layer in enumerate(self.layers):
            x, qkv = ops.norm_linear("qkv", x, delta, layer.norm1, layer.eps1, layer.qkv_weight,
                                     layer.qkv_bias)  # [B·W, (H + 2·Hkv)·D]
            q = ops.rope_store(qkv, cos, sin, start, W, H, Hkv, keys[i], values[i])  # [B, Hkv, G·W, D]
            if split:  # [B·W, H·D] straight from the kernels
                attended = ops.attend(q, keys[i], values[i], bias, self.scaling, W)
            else:
                attended = self._attend(q, keys[i], values[i], bias)
                attended = attended.view(B, Hkv, G, W, D).permute(0, 3, 1, 2, 4).reshape(B * W, H * D)
            out = ops.linear("o", attended, layer.o_proj.weight, layer.o_proj.bias)
            x, act = ops.norm_linear("gate_up", x, out, layer.norm2, layer.eps2, layer.gate_up_weight,
                                     layer.gate_up_bias, silu=True)  # [B·W, intermediate]
            delta = ops.linear("down", act, layer.down_proj.weight, layer.down_proj.bias)
        last = lambda t: t.view(B, W, -1)[:, -keep:].reshape(B * keep, -1)  # noqa: E731
        return ops.add_rms_norm(last(x), last(delta), self.norm, self.eps)[1].view(B, keep, -1)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """q [B, Hkv, M, D] over keys, values [B, Hkv, C, D] with the additive mask bias ([B·Hkv, M, C] for
        'matmul', [B, 1, M, C] for 'sdpa') -> [B, Hkv, M, D].

        'matmul' (and 'triton' beyond its rows): scores and the weighted sum as two batched matrix products
        (cuBLAS spreads a few queries over many keys across the chip) and a softmax between them, as transformers' eager attention
        computes them (scores in the model's dtype, softmax in fp32). 'sdpa': torch's fused attention, whose
        memory-efficient kernel gives each (row, key head) one block: 2 blocks for the embedded draft at one
        token, ~70 µs a layer over 2,048 slots on an H200, against the ~10 µs its bytes need. 'triton' (the
        default, up to fused.ATTEND_MAX_ROWS queries a key head; `hidden` calls it directly, wider calls come
        here as 'matmul'): two kernels split over the keys (fused.attend_triton) where these take five; on the
        H200 5.5 µs a layer against ~20, the draft's step 1.74 → 1.28 ms."""
        if self.attention == "sdpa":
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, scale=self.scaling)
        B, Hkv, M, D = q.shape
        C = keys.shape[2]
        scores = torch.baddbmm(bias, q.view(B * Hkv, M, D), keys.reshape(B * Hkv, C, D).transpose(1, 2),
                               alpha=self.scaling)  # [B·Hkv, M, C]
        probs = torch.softmax(scores, dim=-1)  # accumulated in fp32, rounded once to the dtype
        return torch.bmm(probs, values.reshape(B * Hkv, C, D)).view(B, Hkv, M, D)

    # ---- a decoder's call ----------------------------------------------------------------------
    def logits(self, ids: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor, keep: int,
               cache: BufferedCache, head: Callable[[torch.Tensor], torch.Tensor] | None, vocab: int) -> torch.Tensor:
        """A decoder's forward (SlottedDecoder._run): ids, positions [B, W]; valid [B, L + W] bool over the cache's
        L slots and the W new ones; the new keys and values go into `cache` -> logits [B, keep, vocab], a tensor
        of the caller's (never a graph's output buffer, which the next replay overwrites)."""
        head = head or self.head
        if isinstance(cache, StaticCache):
            workspace, start = cache.claim_all(ids.shape[1])
            out = workspace.step(self, ids, valid, positions, start, keep, head)
        else:  # a prompt read alone into a plain buffered cache (its keys and values are stored for reuse)
            buffers = [cache.claim(i, self._like(ids.shape[0], ids.shape[1])) for i in range(len(self.layers))]
            start = buffers[0][2]
            C = buffers[0][0].shape[2]
            full = valid.new_zeros((valid.shape[0], C))
            full[:, : valid.shape[1]] = valid
            hidden = self.hidden(ids, positions, torch.tensor([start], device=ids.device), full,
                                 [b[0] for b in buffers], [b[1] for b in buffers], keep)
            out = head(hidden)
        return out[..., :vocab]

    def _like(self, batch: int, width: int) -> torch.Tensor:
        """A tensor of a layer's new keys' shape [B, kv heads, W, D] and dtype (for BufferedCache.claim),
        allocating nothing."""
        return self.embed.new_empty(()).expand(batch, self.kv_heads, width, self.head_dim)

    # ---- workspaces ----------------------------------------------------------------------------
    def acquire(self, batch: int, capacity: int) -> "Workspace":
        """A workspace of at least `batch` rows and exactly `capacity` slots (reused where one is free), zeroed:
        slots no forward wrote yet are read as masked keys, and 0 · NaN would leak through the mask."""
        with self._lock:
            for i in range(len(self._free) - 1, -1, -1):
                w = self._free[i]
                if w.capacity == capacity and w.batch >= batch:
                    del self._free[i]
                    break
            else:
                w = None
        if w is None:
            w = Workspace(self, batch, capacity)
        w.clear()
        return w

    def release(self, workspace: "Workspace") -> None:
        with self._lock:
            self._free.append(workspace)
            del self._free[:-KEPT_FREE]


def capacity_for(slots: int) -> int:
    """The workspace capacity for a cache whose first write ends at `slots`."""
    return -(-(slots + HEADROOM) // ALIGN) * ALIGN


def cuda_graph(run: Callable[[], torch.Tensor], device: torch.device, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Capture `run` as a CUDA graph in `pool` -> (the graph, the output tensor its replays write). The warm-up run
    before capturing (cuBLAS picks and allocates its workspaces outside the capture) writes the same keys and
    values the replays will."""
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        run()
    graph = torch.cuda.CUDAGraph()
    # thread_local: another page session's thread may launch work while this one captures
    with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
        out = run()
    torch.cuda.current_stream(device).wait_stream(stream)
    return graph, out


@dataclass
class _Captured:
    """One step shape's graph and the static tensors it reads and writes."""

    graph: "torch.cuda.CUDAGraph"  # or whatever the forward's `capture` returns: anything with replay()
    inputs: torch.Tensor  # LongTensor[2·B·W + 1]: ids, positions, start, copied in with one transfer
    out: torch.Tensor  # [B, keep, V]


@dataclass(eq=False)
class Workspace:
    """Key/value buffers of `batch` rows and `capacity` slots for every layer, the valid-slot mask the graphs read,
    and the graphs captured over them, keyed by (rows, new tokens, logits kept, head). Used by one decoder at a
    time (its cache holds it until the cache is dropped)."""

    forward: GraphedForward
    batch: int
    capacity: int
    keys: list[torch.Tensor] = field(init=False)  # per layer [batch, kv heads, capacity, D]
    values: list[torch.Tensor] = field(init=False)
    valid: torch.Tensor = field(init=False)  # [batch, capacity] bool
    graphs: dict = field(init=False, default_factory=dict)

    def __post_init__(self):
        f = self.forward
        shape = (self.batch, f.kv_heads, self.capacity, f.head_dim)
        self.keys = [torch.zeros(shape, dtype=f.dtype, device=f.device) for _ in f.layers]
        self.values = [torch.zeros(shape, dtype=f.dtype, device=f.device) for _ in f.layers]
        self.valid = torch.zeros((self.batch, self.capacity), dtype=torch.bool, device=f.device)
        # one memory pool per workspace: its graphs run one after another (one decoder), never beside another's
        self.pool = torch.cuda.graph_pool_handle() if f.graphs and f.device.type == "cuda" else None

    @torch.inference_mode()  # the buffers were made under it (decoding runs there), so are written under it
    def clear(self) -> None:
        for t in (*self.keys, *self.values):
            t.zero_()

    def step(self, f: GraphedForward, ids: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor, start: int,
             keep: int, head) -> torch.Tensor:
        """One forward over rows [:B] of the buffers: ids, positions [B, W]; valid [B, L + W] -> logits [B, keep, V]."""
        B, W = ids.shape
        self.valid[:B, : valid.shape[1]] = valid  # columns past L + W are stale, and hidden by causality
        if not f.graphs or W > MAX_GRAPH_WIDTH:
            start_t = torch.tensor([start], device=ids.device)
            return head(f.hidden(ids, positions, start_t, self.valid[:B], [k[:B] for k in self.keys],
                                 [v[:B] for v in self.values], keep))
        key = (B, W, keep, id(head))
        captured = self.graphs.get(key)
        packed = torch.cat([ids.reshape(-1), positions.reshape(-1), ids.new_full((1,), start)])
        if captured is None:
            captured = self.graphs[key] = self._capture(f, packed, B, W, keep, head)
        else:
            captured.inputs.copy_(packed)
            captured.graph.replay()
        return captured.out.clone()

    def _capture(self, f: GraphedForward, packed: torch.Tensor, B: int, W: int, keep: int, head) -> _Captured:
        """Capture the step of this shape over static inputs (a copy of this call's) and run it once: this call's
        result is the first replay's."""
        keys, values = [k[:B] for k in self.keys], [v[:B] for v in self.values]
        inputs = packed.clone()
        ids, positions = inputs[: B * W].view(B, W), inputs[B * W: 2 * B * W].view(B, W)
        start = inputs[2 * B * W:]

        def run() -> torch.Tensor:
            return head(f.hidden(ids, positions, start, self.valid[:B], keys, values, keep))

        graph, out = f.capture(run, f.device, self.pool)
        graph.replay()
        return _Captured(graph, inputs, out)


class StaticCache(BufferedCache):
    """A decoder's cache on a workspace of its model's `GraphedForward`: the slotted decoder's bookkeeping
    (crop, row selection, merged prompts) done in place on fixed buffers, so graphs captured over them stay valid.
    Rows [:B] of the workspace are the cache's B rows. Grows (to a workspace of twice the capacity) only when a
    run outlasts its headroom."""

    def __init__(self, forward: GraphedForward, batch: int):
        super().__init__()
        self.forward, self.max_batch = forward, batch
        self.workspace: Workspace | None = None
        self.length = 0  # used slots
        self._finalizer = None

    # what the slotted decoder and transformers ask of a cache
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of slots to drop, got {tokens_to_remove}")
        self.length = max(0, self.length + tokens_to_remove)

    def claim_all(self, width: int) -> tuple[Workspace, int]:
        """Room for `width` new slots in every layer, counted as used from now -> (workspace, first new slot)."""
        start, end = self.length, self.length + width
        if self.workspace is None:
            self._use(self.forward.acquire(self.max_batch, capacity_for(end)))
        elif end > self.workspace.capacity:
            self._grow(2 * self.workspace.capacity)
        self.length = end
        return self.workspace, start

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """indices LongTensor[b]: keep these rows, in this order (a row may repeat), in place in rows [:b]."""
        if len(indices) > self.max_batch:
            raise ValueError(f"{len(indices)} rows selected from a cache of at most {self.max_batch}")
        w = self.workspace
        if w is not None and self.length:
            indices = indices.to(w.valid.device)
            for t in (*w.keys, *w.values):
                t[: len(indices), :, : self.length] = t[indices, :, : self.length]  # gathered first, then written

    def place_rows(self, rows: list, width: int) -> None:
        """Start over as len(rows) rows of `width` slots, row r's per-layer (keys, values) [1, heads, n, D]
        right-aligned and zeros before them."""
        if len(rows) > self.max_batch:
            raise ValueError(f"{len(rows)} rows placed in a cache of at most {self.max_batch}")
        if self.workspace is None or width > self.workspace.capacity:
            self._release()
            self._use(self.forward.acquire(self.max_batch, capacity_for(width)))
        w = self.workspace
        for i in range(len(w.keys)):
            for r, row in enumerate(rows):
                n = 0 if row is None else row[i][0].shape[-2]
                w.keys[i][r, :, : width - n] = 0
                w.values[i][r, :, : width - n] = 0
                if n:
                    w.keys[i][r, :, width - n: width] = row[i][0][0]
                    w.values[i][r, :, width - n: width] = row[i][1][0]
        self.length = width

    def _use(self, workspace: Workspace) -> None:
        self.workspace = workspace
        # the workspace goes back to the pool when this cache is dropped (decoders are not closed explicitly)
        self._finalizer = weakref.finalize(self, self.forward.release, workspace)

    def _release(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # runs once: returns the workspace
        self.workspace, self._finalizer = None, None

    def _grow(self, capacity: int) -> None:
        old = self.workspace
        new = self.forward.acquire(self.max_batch, capacity)
        for dst, src in zip((*new.keys, *new.values), (*old.keys, *old.values)):
            dst[:, :, : self.length] = src[:, :, : self.length]
        self._release()
        self._use(new)


def attach(model: nn.Module, mode: str | None = None) -> nn.Module:
    """Give a CUDA `model` its `graphed_forward` where `supports(model)` and the mode (`gpu_steps()`) is not
    'transformers'; None otherwise, and the text decoder runs transformers' forward. Returns the model."""
    mode = mode or gpu_steps()
    attention = os.environ.get("SPECVIZ_STEP_ATTENTION", ATTENTION[0])
    linear = os.environ.get("SPECVIZ_STEP_LINEAR", LINEAR[0])
    model.graphed_forward = (GraphedForward(model, graphs=mode == "graphs", attention=attention, linear=linear)
                             if mode != "transformers" and supports(model) else None)
    return model
