"""Slotted KV caches: one model's side of a ragged batch, where rejected drafts and padding stay as masked holes.

Every row of a cache has the same length, and each forward appends the same number of slots to every row,
right-aligned, so a row that feeds fewer tokens gets padding slots. Rejected drafts and padding stay behind
as masked slots ("holes"): the attention mask hides them and explicit position ids count only a row's valid
tokens, so every row computes what it would compute alone. Holes rather than moving accepted entries into
place (the realignment that costs eBay's batched decoding up to 40% of its compute): a hole costs one
masked key per layer in later attention and nothing else, and trailing slots that no row uses are cropped.
Both costs are measured per iteration (StepRecord). Prompts of different lengths are prefilled one by one
(no padded compute) and merged, left-padded, into one cache.
"""

from __future__ import annotations

from typing import Generator, Iterator

import torch

from specviz.models.kv_cache import HEADROOM, BufferedCache
from specviz.models.prompt_cache import Layers, PromptCache

PAD_ID = 0  # the token fed into padding slots; they are masked, so which token it is does not matter


class SlottedDecoder:
    """One model's side of a batch: a KV cache whose slots are, per row, a valid token or a hole.

    Subclasses say how to build a cache and run the model (`_new_cache`, `_run`); this class keeps the
    slot bookkeeping: `slots[r]` lists the cache slot of every token row r has fed, in order, and `valid`
    ([B, L] bool, on the model's device) is the attention mask over the cache: a view of a preallocated
    buffer, so that a forward writes its new columns in place instead of copying the mask (issue 29).
    """

    def __init__(self, batch: int, device: torch.device, prompt_cache: PromptCache | None = None):
        self.device = device
        self.prompt_cache = prompt_cache  # prompts read before (by any decoder of this model); None: always prefill
        self.prompts_reused = 0  # prompts taken from it by this decoder
        self.cache = self._new_cache()
        self._set_valid(torch.zeros((batch, 0), dtype=torch.bool, device=device))
        self.slots: list[list[int]] = [[] for _ in range(batch)]
        self.real_fed = 0  # tokens fed for real since the last take_counts()
        self.pad_fed = 0  # padding fed beside them

    # ---- model-specific ----------------------------------------------------------------------
    def _new_cache(self):
        raise NotImplementedError

    def _new_prompt_cache(self):
        """The cache one prompt is read into alone, whose per-layer keys and values are then stored and merged
        (a decoder-only cache with `layers`); the decoder's own kind unless a subclass says otherwise."""
        return self._new_cache()

    def _run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, keep: int,
             cache, rows: list[int]) -> torch.Tensor:
        """input_ids, position_ids [b, W]; attention_mask [b, L+W] bool over the cache and the new tokens (a
        view: each model converts it to what it takes); rows:
        which batch rows these are (speech picks their encoder output). Returns float logits [b, keep, V]."""
        raise NotImplementedError

    def _select_rows(self, index: torch.Tensor) -> None:  # index LongTensor[b]
        """Keep only batch rows `index` of whatever else the subclass holds per row."""

    # ---- bookkeeping -------------------------------------------------------------------------
    @property
    def batch(self) -> int:
        return len(self.slots)

    def fed(self, row: int) -> int:
        """How many of row's tokens the cache holds."""
        return len(self.slots[row])

    # Whether rows with identical prompts may share one prefill (copied into each row afterwards). Not for
    # encoder-decoder models: there the cache also holds each row's own cross-attention keys and values.
    shares_identical_prompts = True

    # Prompt tokens per forward where a prompt is read in pieces. Only for models whose every position's
    # outputs are independent of what else one call computes (the packed kernels with the batch-invariant
    # attention: subclasses set `reads_in_pieces`): there the pieces give the same keys, values and logits as
    # one forward, bit for bit (tests/test_lean.py), and the page and CLI can show how far the prefill is.
    PREFILL_PIECE = 128
    reads_in_pieces = False

    def prefill(self, prompts: list[list[int]]) -> None:
        """Feed each row its tokens into an empty cache. Identical prompts (N samples of one input) are fed
        once and copied; equal lengths: one batched forward; otherwise one forward per row, merged into a
        left-padded cache so that no compute goes into padding."""
        for _ in self.prefill_steps(prompts):
            pass

    def prefill_steps(self, prompts: list[list[int]]) -> Iterator[tuple[int, int]]:
        """As `prefill`, yielding (prompt tokens read, of how many) as it goes; the last, (n, n), once the
        cache is complete."""
        unique = list(dict.fromkeys(tuple(p) for p in prompts))
        shared = self.shares_identical_prompts and len(unique) < len(prompts)
        fed = [list(u) for u in unique] if shared else prompts
        if shared:
            self._set_valid(self.valid[: len(unique)])
            self.slots = [[] for _ in unique]
        yield from self._prefill_distinct(fed)
        if shared:
            self.select([unique.index(tuple(p)) for p in prompts])
        total = sum(len(p) for p in fed)
        yield total, total

    def _prefill_distinct(self, prompts: list[list[int]]) -> Iterator[tuple[int, int]]:
        """Feed the prompts; yields the progress before the end (prefill_steps says when it is done)."""
        lengths = {len(p) for p in prompts}
        total = sum(len(p) for p in prompts)
        if len(lengths) == 1 and self.prompt_cache is None:  # one batched forward per piece
            n = len(prompts[0])
            piece = self.PREFILL_PIECE if self.reads_in_pieces else max(n, 1)
            for start in range(0, n, piece):
                self.forward([p[start:start + piece] for p in prompts], 1)
                if start + piece < n:
                    yield (start + piece) * len(prompts), total
            self.take_counts()
            return
        width = max(lengths)
        if width == 0:
            self.take_counts()
            return
        per_row, before = [], 0
        for r, prompt in enumerate(prompts):
            per_row.append((yield from self._prompt_layers(r, prompt, before, total)))
            before += len(prompt)
            if before < total:
                yield before, total
        self.cache = self._merge(per_row, [len(p) for p in prompts], width)
        valid = torch.zeros((len(prompts), width), dtype=torch.bool, device=self.device)
        for r, prompt in enumerate(prompts):
            valid[r, width - len(prompt):] = True
            self.slots[r] = list(range(width - len(prompt), width))
        self._set_valid(valid)
        self.take_counts()

    def _prompt_layers(self, row: int, prompt: list[int], before: int = 0, total: int = 0
                       ) -> Generator[tuple[int, int], None, Layers | None]:
        """Row's keys and values for its prompt alone: from the prompt cache, or computed (and stored),
        yielding (before + its tokens read so far, total) after each forward but the last."""
        if not prompt:
            return None
        key = tuple(prompt)
        if self.prompt_cache is not None and (layers := self.prompt_cache.get(key)) is not None:
            self.prompts_reused += 1
            return layers
        cache = self._new_prompt_cache()
        if isinstance(cache, BufferedCache):
            cache.reserve(len(prompt), headroom=0)  # the stored entry holds exactly the prompt, contiguous
        ids = torch.tensor([prompt], device=self.device)
        piece = self.PREFILL_PIECE if self.reads_in_pieces else len(prompt)
        for start in range(0, len(prompt), piece):
            end = min(start + piece, len(prompt))
            self._run(ids[:, start:end], torch.ones((1, end), dtype=torch.bool, device=self.device),
                      torch.arange(start, end, device=self.device)[None], 1, cache, [row])
            if end < len(prompt):
                yield before + end, total
        source = _self_attention_layers(cache)
        if source is not cache:
            raise NotImplementedError("prompts of different lengths need a decoder-only cache")
        layers = tuple((layer.keys, layer.values) for layer in source.layers)
        if self.prompt_cache is not None:
            self.prompt_cache.put(key, layers)
        return layers

    def _merge(self, rows: list[Layers | None], lengths: list[int], width: int):
        """One cache of batch len(rows) from single-row keys and values, each left-padded with zeros to `width`."""
        merged = self._new_cache()
        if isinstance(merged, BufferedCache):  # rows written straight into its buffers, no concatenation
            merged.place_rows(rows, width)
            return merged
        layers = _self_attention_layers(merged)
        donor = next(r for r, n in zip(rows, lengths) if n)
        for i, (ref_k, ref_v) in enumerate(donor):  # [1, heads, n, head_dim]
            keys, values = [], []
            for row, n in zip(rows, lengths):
                k = ref_k.new_zeros(1, ref_k.shape[1], width, ref_k.shape[3])
                v = ref_v.new_zeros(1, ref_v.shape[1], width, ref_v.shape[3])
                if n:
                    k[:, :, width - n:] = row[i][0]
                    v[:, :, width - n:] = row[i][1]
                keys.append(k)
                values.append(v)
            layers.update(torch.cat(keys), torch.cat(values), i)
        return merged

    def forward(self, feeds: list[list[int]], keep: int) -> torch.Tensor:
        """Feed row r the tokens feeds[r] (counts may differ, 0 included), right-aligned so that every
        row's last token sits in the last column. Returns logits [B, keep, V] of the last `keep` columns."""
        B, L = self.batch, self.valid.shape[1]
        width = max(len(f) for f in feeds)
        ids = torch.full((B, width), PAD_ID, dtype=torch.long)
        positions = torch.zeros((B, width), dtype=torch.long)
        new = torch.zeros((B, width), dtype=torch.bool)
        for r, feed in enumerate(feeds):
            k = len(feed)
            if k:
                start = len(self.slots[r])
                ids[r, width - k:] = torch.tensor(feed)
                positions[r, width - k:] = torch.arange(start, start + k)
                new[r, width - k:] = True
            self.slots[r].extend(range(L + width - k, L + width))
        self.real_fed += sum(len(f) for f in feeds)
        self.pad_fed += B * width - sum(len(f) for f in feeds)
        self._extend_valid(new.to(self.device))
        return self._run(ids.to(self.device), self.valid, positions.to(self.device), keep, self.cache,
                         list(range(B)))

    def rollback(self, keep: list[int]) -> None:
        """Row r keeps its first keep[r] fed tokens; the slots of the rest become holes."""
        rows, cols = [], []
        for r, n in enumerate(keep):
            dropped = self.slots[r][n:]
            if dropped:
                rows += [r] * len(dropped)
                cols += dropped
                del self.slots[r][n:]
        if cols:
            self.valid[torch.tensor(rows, device=self.device), torch.tensor(cols, device=self.device)] = False
        self._crop_unused_tail()

    def select(self, rows: list[int]) -> None:
        """Keep these rows, in this order (sequences that finished leave the batch; a prefill shared by
        identical prompts is copied into each of their rows)."""
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        if self.valid.shape[1]:
            self.cache.batch_select_indices(index)
        self._set_valid(self.valid[index], self._valid_buffer.shape[1])
        self.slots = [list(self.slots[r]) for r in rows]  # copies: a row may be selected twice
        self._select_rows(index)
        self._crop_unused_tail()

    def _crop_unused_tail(self) -> None:
        length = self.valid.shape[1]
        used = max((s[-1] + 1 for s in self.slots if s), default=0)
        if used < length:
            self.cache.crop(used - length)  # transformers 5 takes the number of slots to drop, negative
            self.valid = self.valid[:, :used]

    def _set_valid(self, valid: torch.Tensor, capacity: int = 0) -> None:  # valid [B, L] bool
        """Make `valid` a view of a new buffer of at least `capacity` columns (else L + HEADROOM)."""
        buffer = valid.new_zeros((valid.shape[0], max(capacity, valid.shape[1] + HEADROOM)))
        buffer[:, : valid.shape[1]] = valid
        self._valid_buffer = buffer  # [B, capacity]
        self.valid = buffer[:, : valid.shape[1]]

    def _extend_valid(self, new: torch.Tensor) -> None:  # new [B, W] bool
        """Append W columns to `valid`, in place while they fit, doubling the buffer otherwise."""
        length, width = self.valid.shape[1], new.shape[1]
        if length + width > self._valid_buffer.shape[1]:
            self._set_valid(self.valid, max(length + width, 2 * self._valid_buffer.shape[1]))
        self._valid_buffer[:, length: length + width] = new
        self.valid = self._valid_buffer[:, : length + width]

    def take_counts(self) -> tuple[int, int]:
        """(real, padding) tokens fed since the last call."""
        counts = (self.real_fed, self.pad_fed)
        self.real_fed = self.pad_fed = 0
        return counts

    def cache_use(self) -> tuple[int, int]:
        """(slots, holes): rows × cache length, and how many of those entries are masked."""
        slots = self.valid.numel()
        return slots, slots - sum(len(s) for s in self.slots)


def _self_attention_layers(cache):
    """The self-attention part of a cache (an encoder-decoder cache also holds cross-attention)."""
    return getattr(cache, "self_attention_cache", cache)
