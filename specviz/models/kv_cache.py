"""A KV cache whose layers are preallocated buffers written in place (project issue 29).

transformers' DynamicCache grows every layer's keys and values with `torch.cat` at every forward: the whole
cache is copied each step (114 `cat` calls and 12.7 ms of the target's ~89 ms step on the 2-core CPU, more as
the context grows). Here each layer holds buffers [B, heads, capacity, head_dim]; a forward writes its new
entries into the next free slots and attention gets views of the used length. Capacity is reserved up front
where the caller knows it (`reserve`) and otherwise grows geometrically, so appending copies nothing but the
new entries. The views hold the same numbers as DynamicCache's tensors, and attention reads them in the
same order, so a position's logits are the same bits (tests/test_kv_cache.py).

Everything the slotted decoder asks of a cache works in place or by a copy of the used length only: `crop`
(a shorter view), `batch_select_indices` (rows leaving: the others move in place; rows that repeat, a copy), and
`place_rows` (prompts prefilled one by one, merged left-padded).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from specviz.models.arena import Pool

HEADROOM = 256  # slots a fresh buffer holds beyond its first write: ~a run's new tokens and holes, no regrowth
GROWTH = 2  # capacity multiplier when a write does not fit: amortized O(1) copies per appended slot


class BufferedLayer(DynamicLayer):
    """One layer's keys and values: `keys`/`values` are views [B, heads, length, head_dim] of buffers
    [B, heads, capacity, head_dim] that updates write into."""

    def __init__(self, reserve: int = 0, headroom: int = HEADROOM, pool: Pool | None = None):
        super().__init__()
        self.reserve = reserve  # the least capacity to allocate (0: first write + headroom)
        self.headroom = headroom
        self.pool = pool  # where CPU buffers come from (2 MB pages); None: torch's allocator
        self.length = 0  # used slots
        self._keys: torch.Tensor | None = None  # [B, heads, capacity, head_dim]
        self._values: torch.Tensor | None = None

    @property
    def capacity(self) -> int:
        return 0 if self._keys is None else self._keys.shape[-2]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def _allocate(self, like_k: torch.Tensor, like_v: torch.Tensor, batch: int, capacity: int) -> None:
        """New buffers of `capacity` slots for `batch` rows (the current batch where any slot is used), the used
        slots copied over. like_k, like_v: [*, heads, *, head_dim], giving shape, dtype, device."""
        keys = self._empty(like_k, (batch, like_k.shape[1], capacity, like_k.shape[3]))
        values = self._empty(like_v, (batch, like_v.shape[1], capacity, like_v.shape[3]))
        if self._keys is not None and self.length:
            keys[:, :, : self.length] = self._keys[:, :, : self.length]
            values[:, :, : self.length] = self._values[:, :, : self.length]
        self._keys, self._values = keys, values

    def _empty(self, like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        if self.pool is not None and like.device.type == "cpu":
            return self.pool.empty(shape, like.dtype)
        return like.new_empty(shape)

    # keys / values: views of the used length, made when read (the native layers claim slots and the slotted
    # decoder crops 24-28 layers per call without reading them: making views there cost ~0.2 ms a draft step)
    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._keys is None else self._keys[:, :, : self.length]

    @keys.setter
    def keys(self, value: None) -> None:  # CacheLayerMixin.__init__ sets None; the buffers are the state
        if value is not None:
            raise AttributeError("a BufferedLayer's keys are views of its buffers; write them through update")

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._values is None else self._values[:, :, : self.length]

    @values.setter
    def values(self, value: None) -> None:
        if value is not None:
            raise AttributeError("a BufferedLayer's values are views of its buffers; write them through update")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """key_states, value_states [B, heads, n, head_dim]: written after the used slots; returns views
        [B, heads, length + n, head_dim] of everything held."""
        start = self._claim(key_states, value_states)
        self._keys[:, :, start: self.length] = key_states
        self._values[:, :, start: self.length] = value_states
        return self.keys, self.values

    def _claim(self, key_states: torch.Tensor, value_states: torch.Tensor) -> int:
        """Room for key_states' n slots ([B, heads, n, head_dim], as for values), counted as used from now;
        returns the first of them. Allocates or grows the buffers where needed."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[-2]
        if self._keys is not None and self._keys.shape[0] != key_states.shape[0]:
            if self.length:
                raise ValueError(f"{key_states.shape[0]} rows written into a cache of {self._keys.shape[0]}")
            self._keys = self._values = None  # empty: start over at the new batch size
        if self._keys is None:
            self._allocate(key_states, value_states, key_states.shape[0], max(end + self.headroom, self.reserve))
        elif end > self.capacity:
            self._allocate(key_states, value_states, key_states.shape[0], max(end, GROWTH * self.capacity))
        self.length = end
        return start

    def claim(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Room for n new slots that the caller writes itself (the native layers, models/native_forward.py); like
        [B, heads, n, head_dim] gives their shape and dtype. Returns the whole buffers (keys, values) [B, heads,
        capacity, head_dim] and the first new slot. The slots count as used from now: write them before any read."""
        start = self._claim(like, like)
        return self._keys, self._values, start

    def get_seq_length(self) -> int:
        return self.length

    def reset(self) -> None:
        """Empty, buffers kept for the next use."""
        self.length = 0

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last -tokens_to_remove slots (transformers 5's convention: a negative count); the buffer
        stays, and later writes reuse the slots."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of slots to drop, got {tokens_to_remove}")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self.length = max(0, self.length + tokens_to_remove)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """indices LongTensor[b]: keep these rows, in this order (a row may repeat). Rows leaving a batch move in
        place where no row is read after it is written: kept rows increasing (each copied down), or each kept row
        where it is or taken from beyond the first b (the engine's order: the rows past the new batch fill the
        leavers' places, one row copied a leaver); the buffers become their first b rows (a view). Otherwise the
        used slots are copied into new buffers of the same capacity. (Copying every kept row anew took ~10 ms a
        finished row on a 4-row batch of ~800 tokens.)"""
        if self._keys is None:
            return
        kept = indices.tolist()
        b = len(kept)
        in_place = (all(x < y for x, y in zip(kept, kept[1:]))
                    or (len(set(kept)) == b and all(k == r or k >= b for r, k in enumerate(kept))))
        if in_place and (not kept or max(kept) < self._keys.shape[0]):
            for row, source in enumerate(kept):
                if row != source:
                    self._keys[row, :, : self.length] = self._keys[source, :, : self.length]
                    self._values[row, :, : self.length] = self._values[source, :, : self.length]
            self._keys, self._values = self._keys[: len(kept)], self._values[: len(kept)]
            return
        keys = self._empty(self._keys, (len(indices), *self._keys.shape[1:]))
        values = self._empty(self._values, (len(indices), *self._values.shape[1:]))
        indices = indices.to(self._keys.device)
        keys[:, :, : self.length] = self._keys[indices, :, : self.length]
        values[:, :, : self.length] = self._values[indices, :, : self.length]
        self._keys, self._values = keys, values

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:  # beam_idx [b]
        self.batch_select_indices(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self._keys is not None:
            self.batch_select_indices(torch.arange(self._keys.shape[0]).repeat_interleave(repeats))

    def place_rows(self, rows: list[tuple[torch.Tensor, torch.Tensor] | None], width: int) -> None:
        """Start over as len(rows) rows of `width` slots, row r's keys and values ([1, heads, n, head_dim])
        right-aligned and zeros before them (masked padding, kept finite: 0 · NaN would leak through a mask)."""
        k0, v0 = next(r for r in rows if r is not None)
        self.dtype, self.device, self.is_initialized = k0.dtype, k0.device, True
        self._keys = self._values = None
        self.length = 0
        self._allocate(k0, v0, len(rows), max(width + self.headroom, self.reserve))
        for r, row in enumerate(rows):
            n = 0 if row is None else row[0].shape[-2]
            self._keys[r, :, : width - n] = 0
            self._values[r, :, : width - n] = 0
            if n:
                self._keys[r, :, width - n: width] = row[0][0]
                self._values[r, :, width - n: width] = row[1][0]
        self.length = width


class BufferedCache(DynamicCache):
    """A decoder-only KV cache of BufferedLayer, one per model layer, created on the layer's first update.

    A DynamicCache to transformers (EncoderDecoderCache's crop and row selection insist on one), with its own
    layers: everything DynamicCache adds to Cache (iteration over (keys, values)) works on the views.

    reserve: the capacity (slots) each layer allocates on its first write, when the caller knows the total
    (prompt + new tokens + holes); 0 allocates the first write plus `headroom`. Growth past it doubles.
    kv_dtype: what the native layers keep keys and values as (fp16 for a draft model: half the bytes).
    pooled: buffers on 2 MB pages (arena.Pool), for a cache that decodes; a stored prompt's would pin a chunk.
    """

    def __init__(self, reserve: int = 0, headroom: int = HEADROOM, kv_dtype: torch.dtype = torch.float32,
                 pooled: bool = False):
        Cache.__init__(self, layers=[])  # not DynamicCache's: it would replicate plain DynamicLayers
        self.reserve_slots, self.headroom = reserve, headroom
        # what the native layers (models/native_forward.py) write keys and values as; other forwards write their own
        self.kv_dtype = kv_dtype
        # where the layers' CPU buffers come from: a decoding cache's on 2 MB pages (models/arena.py; this cache's
        # thread only), others (a prompt's stored entry, kept for later runs) torch's
        self.pool = Pool() if pooled else None

    def reserve(self, slots: int, headroom: int | None = None) -> None:
        """Layers not yet written allocate at least `slots` on their first write (written ones keep their
        buffers); headroom 0 with slots = a prompt's length keeps the prompt's stored entry exactly its size."""
        self.reserve_slots = slots
        if headroom is not None:
            self.headroom = headroom
        for layer in self.layers:
            layer.reserve, layer.headroom = slots, self.headroom

    def _layer(self, layer_idx: int) -> BufferedLayer:
        while len(self.layers) <= layer_idx:
            self.layers.append(BufferedLayer(self.reserve_slots, self.headroom, self.pool))
        return self.layers[layer_idx]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """key_states, value_states [B, heads, n, head_dim] -> views [B, heads, length, head_dim]."""
        return self._layer(layer_idx).update(key_states, value_states)

    def claim(self, layer_idx: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """BufferedLayer.claim on layer `layer_idx`: its buffers [B, heads, capacity, head_dim] and the first of the
        new slots that like [B, heads, n, head_dim] describes."""
        return self._layer(layer_idx).claim(like)

    def place_rows(self, rows: list[tuple[tuple[torch.Tensor, torch.Tensor], ...] | None], width: int) -> None:
        """Become a cache of len(rows) rows and `width` slots from single-row prompts' keys and values
        (per layer (keys, values), each [1, heads, n, head_dim]; None: an empty row), left-padded."""
        donor = next(r for r in rows if r is not None)
        for i in range(len(donor)):
            self._layer(i).place_rows([None if r is None else r[i] for r in rows], width)
