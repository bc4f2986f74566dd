"""The decoding driver: batched speculative decoding with ragged acceptance, and the target-only reference.

One driver for text and speech and for any batch size B ≥ 1 (Qian et al., BASS). A `Source` says what is
decoded (the sequences' prompts, how to open a model's decoder on a group of them); `generate` decodes
groups of up to `batch_size` sequences and yields records (specviz.records): a group was prefilled, one
iteration of the whole batch, a sequence finished, the run completed. Consumers build their own Trace
from those immutable records.

KV caches of a ragged batch: every row of a cache has the same length, and each forward appends the same
number of slots to every row, right-aligned, so a row that feeds fewer tokens gets padding slots. Rejected
drafts and padding stay behind as masked slots ("holes"): the attention mask hides them and explicit
position ids count only a row's valid tokens, so every row computes what it would compute alone. Holes
rather than moving accepted entries into place (the realignment that costs eBay's batched decoding up
to 40% of its compute): a hole costs one masked key per layer in later attention and nothing else, and
trailing slots that no row uses are cropped. Both costs are measured per iteration (StepRecord). Prompts
of different lengths are prefilled one by one (no padded compute) and merged, left-padded, into one cache.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol, TypeVar

import torch

from .config import SpecConfig
from .cost import CALIBRATION_TOKENS, CostModel, calibrate
from .gamma import Feedback, make_policy
from .drafts import lookup, one_hot_logits
from .explain import examine
from .prompt_cache import Layers, PromptCache
from .records import (ACCEPTED, BONUS, DISCARDED, LOOKUP, MODEL, REJECTED, RESAMPLED, TARGET, Completed, Decision,
                      Event, Finished, Iteration, Prefilled, StepRecord)
from .sampling import check_logits, draw
from .verify import verify

T = TypeVar("T")
PAD_ID = 0  # the token fed into padding slots; they are masked, so which token it is does not matter


class Stopwatch:
    """Run-time seconds; synchronizes CUDA first so that queued kernels are counted where they run.

    `paused()` stops the clock for work that only serves the display (recording the why-panel's
    distributions), so every time the trace reports is the time decoding itself took.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.excluded = 0.0  # seconds spent paused so far

    def _wall(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def now(self) -> float:
        return self._wall() - self.excluded

    def paused(self, work: Callable[[], T]) -> tuple[T, float]:
        """Run work with the clock stopped; returns its result and the seconds it took."""
        t0 = self._wall()
        result = work()
        seconds = self._wall() - t0
        self.excluded += seconds
        return result, seconds


class SlottedDecoder:
    """One model's side of a batch: a KV cache whose slots are, per row, a valid token or a hole.

    Subclasses say how to build a cache and run the model (`_new_cache`, `_run`); this class keeps the
    slot bookkeeping: `slots[r]` lists the cache slot of every token row r has fed, in order, and `valid`
    ([B, L] bool, on the model's device) is the attention mask over the cache.
    """

    def __init__(self, batch: int, device: torch.device, prompt_cache: PromptCache | None = None):
        self.device = device
        self.prompt_cache = prompt_cache  # prompts read before (by any decoder of this model); None: always prefill
        self.prompts_reused = 0  # prompts taken from it by this decoder
        self.cache = self._new_cache()
        self.valid = torch.zeros((batch, 0), dtype=torch.bool, device=device)  # [B, L]
        self.slots: list[list[int]] = [[] for _ in range(batch)]
        self.real_fed = 0  # tokens fed for real since the last take_counts()
        self.pad_fed = 0  # padding fed beside them

    # ---- model-specific ----------------------------------------------------------------------
    def _new_cache(self):
        raise NotImplementedError

    def _run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, keep: int,
             cache, rows: list[int]) -> torch.Tensor:
        """input_ids, position_ids [b, W]; attention_mask [b, L+W] over the cache and the new tokens; rows:
        which batch rows these are (speech picks their encoder output). Returns float logits [b, keep, V]."""
        raise NotImplementedError

    def _select_rows(self, index: torch.Tensor) -> None:
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

    def prefill(self, prompts: list[list[int]]) -> None:
        """Feed each row its tokens into an empty cache. Identical prompts (N samples of one input) are fed
        once and copied; equal lengths: one batched forward; otherwise one forward per row, merged into a
        left-padded cache so that no compute goes into padding."""
        unique = list(dict.fromkeys(tuple(p) for p in prompts))
        if self.shares_identical_prompts and len(unique) < len(prompts):
            self.valid = self.valid[: len(unique)]
            self.slots = [[] for _ in unique]
            self._prefill_distinct([list(u) for u in unique])
            self.select([unique.index(tuple(p)) for p in prompts])
            return
        self._prefill_distinct(prompts)

    def _prefill_distinct(self, prompts: list[list[int]]) -> None:
        lengths = {len(p) for p in prompts}
        if len(lengths) == 1 and self.prompt_cache is None:
            if lengths != {0}:
                self.forward(prompts, 1)
            self.take_counts()
            return
        width = max(lengths)
        if width == 0:
            self.take_counts()
            return
        per_row = [self._prompt_layers(r, prompt) for r, prompt in enumerate(prompts)]
        self.cache = self._merge(per_row, [len(p) for p in prompts], width)
        self.valid = torch.zeros((len(prompts), width), dtype=torch.bool, device=self.device)
        for r, prompt in enumerate(prompts):
            self.valid[r, width - len(prompt):] = True
            self.slots[r] = list(range(width - len(prompt), width))
        self.take_counts()

    def _prompt_layers(self, row: int, prompt: list[int]) -> Layers | None:
        """Row's keys and values for its prompt alone: from the prompt cache, or computed (and stored)."""
        if not prompt:
            return None
        key = tuple(prompt)
        if self.prompt_cache is not None and (layers := self.prompt_cache.get(key)) is not None:
            self.prompts_reused += 1
            return layers
        cache = self._new_cache()
        ids = torch.tensor([prompt], device=self.device)
        ones = torch.ones_like(ids, dtype=torch.long)
        self._run(ids, ones, torch.arange(len(prompt), device=self.device)[None], 1, cache, [row])
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
        self.valid = torch.cat([self.valid, new.to(self.device)], dim=1)
        return self._run(ids.to(self.device), self.valid.long(), positions.to(self.device), keep, self.cache,
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
        self.valid = self.valid[index]
        self.slots = [list(self.slots[r]) for r in rows]  # copies: a row may be selected twice
        self._select_rows(index)
        self._crop_unused_tail()

    def _crop_unused_tail(self) -> None:
        length = self.valid.shape[1]
        used = max((s[-1] + 1 for s in self.slots if s), default=0)
        if used < length:
            self.cache.crop(used - length)  # transformers 5 takes the number of slots to drop, negative
            self.valid = self.valid[:, :used]

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


@dataclass(frozen=True)
class SequenceSpec:
    """One sequence to decode: its prompt and where it came from (kept in the trace)."""

    prompt_ids: list[int]
    label: str  # e.g. "article.txt", "article.txt · sample 2", "clip.flac · 0:30–1:00"
    group: str  # sequences of one group form one output (speech: the windows of one file)
    info: dict


def unique_names(names: list[str]) -> list[str]:
    """Input names made distinct (two files of one name in a batch stay two outputs): 'a', 'a #2', ..."""
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name} #{seen[name]}")
    return out


@dataclass(frozen=True)
class Vocabulary:
    """What the loop needs to know about tokens: how to show them and which end the output."""

    decode: Callable[[list[int]], str]
    eos: frozenset[int]
    size: int  # logit columns (V)


class Source(Protocol):
    """What the driver decodes: text prompts or audio windows, and the models that read them."""

    sequences: list[SequenceSpec]
    vocab: Vocabulary
    device: torch.device

    def decoders(self, rows: list[int], with_draft: bool) -> tuple[SlottedDecoder | None, SlottedDecoder]:
        """Fresh (draft, target) decoders for these sequences, in this row order (no tokens fed yet)."""
        ...

    def detokenize(self, ids: list[int]) -> str:
        """Output text of token ids (special tokens left out)."""
        ...

    def meta(self) -> dict:
        """What the trace records about the models and the task."""
        ...


@dataclass
class Row:
    """A sequence in the batch: its tokens so far (prompt first) and how many more it may produce."""

    sequence: int
    tokens: list[int]
    remaining: int


def _chunks(n: int, size: int) -> list[list[int]]:
    return [list(range(i, min(n, i + size))) for i in range(0, n, size)]


@torch.inference_mode()
def generate(source: Source, cfg: SpecConfig, *, target_only: bool = False, batch_size: int = 8) -> Iterator[Event]:
    """Decode every sequence of `source`, up to batch_size at a time, yielding records as they happen."""
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    if not source.sequences:
        raise ValueError("nothing to decode: no input sequences")
    for spec in source.sequences:
        if not spec.prompt_ids:
            raise ValueError(f"the prompt of {spec.label} is empty")
    clock = Stopwatch(source.device)
    generator = torch.Generator(device=source.device).manual_seed(cfg.seed)
    costs = CostModel()  # this run's measurements: the driver writes them, the cost-aware policy reads them
    policy = make_policy(cfg.gamma_policy, cfg.gamma_init, costs)
    start = clock.now()
    steps = 0
    for group in _chunks(len(source.sequences), batch_size):
        t0 = clock.now()
        draft, target = source.decoders(group, with_draft=not target_only and cfg.draft_kind != "lookup")
        rows = [Row(s, list(source.sequences[s].prompt_ids), cfg.max_new_tokens) for s in group]
        # each cache holds all prompt tokens but the last, which the first step feeds
        target.prefill([r.tokens[:-1] for r in rows])
        if draft is not None:
            draft.prefill([r.tokens[:-1] for r in rows])
        yield Prefilled(group, clock.now() - t0, target.prompts_reused + (draft.prompts_reused if draft else 0))
        if target_only:
            loop = _target_only(rows, target, cfg, source.vocab, generator, clock, start, steps)
        else:
            # measuring what calls cost serves the policy and the page's prediction, not decoding: off the clock
            clock.paused(lambda: _calibrate(costs, source, rows, draft, target, cfg))
            loop = _speculate(rows, draft, target, cfg, source.vocab, generator, policy, costs, clock, start, steps)
        for event in loop:
            if isinstance(event, Iteration):
                steps += 1
            yield event
    yield Completed(clock.now() - start, None if target_only else costs.to_dict())


# What identifies a cost curve besides the machine: the models, their weights and where they run.
_COST_IDENTITY = ("task", "draft", "target", "device", "dtype", "draft_vocab_size", "draft_weights", "target_weights")


def _calibrate(costs: CostModel, source: Source, rows: list[Row], draft: SlottedDecoder | None,
               target: SlottedDecoder, cfg: SpecConfig) -> None:
    """Time target calls over CALIBRATION_TOKENS tokens per row, a plain step and a draft forward on the
    group's own caches, each rolled back (or read from the cache file of an earlier run)."""
    meta = source.meta()
    identity = {k: meta.get(k) for k in _COST_IDENTITY}
    width = CALIBRATION_TOKENS[-1]
    feeds = [(r.tokens[-1:] + r.tokens * width)[:width] for r in rows]  # real tokens: ordinary attention
    target_fed = [target.fed(i) for i in range(len(rows))]
    own = torch.Generator(device=source.device).manual_seed(0)  # the run's generator stays untouched

    def target_step(m: int) -> None:
        target.forward([f[:m] for f in feeds], m)
        target.rollback(target_fed)

    def plain_step() -> None:
        z = target.forward([f[:1] for f in feeds], 1)[:, 0]  # [B, V]
        draw(z, cfg.sampling, own)
        target.rollback(target_fed)

    draft_step = None
    if draft is not None:
        draft_fed = [draft.fed(i) for i in range(len(rows))]

        def draft_step() -> None:
            draft.forward([f[:1] for f in feeds], 1)
            draft.rollback(draft_fed)

    calibrate(costs, identity, len(rows), target_step, draft_step, plain_step)
    target.take_counts()  # calibration tokens are not the run's
    if draft is not None:
        draft.take_counts()


def _limit(tokens: list[int], budget: int, eos: frozenset[int]) -> tuple[list[int], bool]:
    """Cut tokens at the first EOS (kept) and at the budget; report whether an EOS ended them."""
    for i, t in enumerate(tokens[:budget]):
        if t in eos:
            return tokens[: i + 1], True
    return tokens[:budget], False


def _draft(rows: list[Row], draft: SlottedDecoder, caps: list[int], cfg: SpecConfig, generator: torch.Generator,
           live: list[int]) -> tuple[list[list[int]], torch.Tensor]:
    """Rows `live` draft up to caps[r] tokens each with the draft model, one batched draft forward per
    position; a row stops early when the draft doubts its own token (cfg.draft_confidence). Other rows draft
    nothing and feed nothing (their cache catches up when they next draft). Returns the drafts and their
    logits [B, γmax, V], zero beyond a row's own draft length."""
    drafts: list[list[int]] = [[] for _ in rows]
    feeds = [r.tokens[draft.fed(i):] if i in live else [] for i, r in enumerate(rows)]
    logits = []
    while live:
        z = draft.forward(feeds, 1)[:, 0]  # [B, V]
        index = torch.tensor(live, device=z.device)
        z_live = z.index_select(0, index)  # [b, V]
        check_logits(z_live, "draft")
        x = draw(z_live, cfg.sampling, generator)  # [b]
        doubt = None
        if cfg.draft_confidence:
            confidence = z_live.float().softmax(-1).gather(-1, x[:, None])[:, 0]
            doubt = (confidence < cfg.draft_confidence).tolist()
        logits.append(z)
        feeds = [[] for _ in rows]
        still = []
        for k, (i, token) in enumerate(zip(live, x.tolist())):
            drafts[i].append(token)
            if len(drafts[i]) < caps[i] and not (doubt and doubt[k]):
                still.append(i)
                feeds[i] = [token]
        live = still
    stacked = torch.stack(logits, dim=1)  # [B, γmax, V]
    for i, d in enumerate(drafts):  # padding positions: finite zeros (suppressed -inf entries would fail the
        if len(d) < stacked.shape[1]:  # logits check), never read into a decision; nothing to do when not ragged
            stacked[i, len(d):] = 0.0
    return drafts, stacked


def _propose(rows: list[Row], draft: SlottedDecoder | None, caps: list[int], cfg: SpecConfig, vocab: Vocabulary,
             device: torch.device, generator: torch.Generator) -> tuple[list[list[int]], torch.Tensor, list[str]]:
    """Drafts per row, their logits [B, γmax, V] (zero beyond a row's draft) and who drafted each row.

    Prompt lookup first where cfg.draft_kind allows it; the draft model for the rows it left without a
    proposal. Lookup alone falls back to a 1-gram match, then to repeating the last token, so that every
    row proposes something (any deterministic proposal keeps the output exact; a poor one costs one scored
    token)."""
    if cfg.draft_kind == "model":
        drafts, logits = _draft(rows, draft, caps, cfg, generator, list(range(len(rows))))
        return drafts, logits, [MODEL] * len(rows)
    alone = cfg.draft_kind == "lookup"
    drafts = [lookup(r.tokens, cap, vocab.eos, min_ngram=1 if alone else cfg.lookup_ngram)
              for r, cap in zip(rows, caps)]
    if alone:
        drafts = [d or [r.tokens[-1]] for d, r in zip(drafts, rows)]
    by = [LOOKUP if d else MODEL for d in drafts]
    modelled = [i for i, d in enumerate(drafts) if not d]
    if not modelled:
        return drafts, one_hot_logits(drafts, max(map(len, drafts)), vocab.size, device), by
    model_drafts, model_logits = _draft(rows, draft, caps, cfg, generator, modelled)
    for i in modelled:
        drafts[i] = model_drafts[i]
    logits = one_hot_logits([[] if i in modelled else d for i, d in enumerate(drafts)],
                            max(map(len, drafts)), vocab.size, device)
    w = model_logits.shape[1]
    index = torch.tensor(modelled, device=device)
    logits[index, :w] = model_logits.index_select(0, index).to(logits.dtype)
    return drafts, logits, by


def _left_aligned(logits: torch.Tensor, counts: list[int], width: int) -> torch.Tensor:
    """logits [B, W, V] whose row r ends with its counts[r] relevant columns -> [B, width, V] starting with
    them (padding beyond repeats the row's last column)."""
    W = logits.shape[1]
    cols = torch.tensor([[W - n + min(j, n - 1) for j in range(width)] for n in counts], device=logits.device)
    return logits.gather(1, cols[..., None].expand(-1, -1, logits.shape[-1]))


def _speculate(rows: list[Row], draft: SlottedDecoder | None, target: SlottedDecoder, cfg: SpecConfig,
               vocab: Vocabulary, generator: torch.Generator, policy, costs: CostModel, clock: Stopwatch, start: float,
               first_index: int) -> Iterator[Event]:
    index = first_index
    previous_end = clock.now() - start
    while rows:
        gamma = policy.current()
        if gamma == 0:  # a plain target step: nothing is expected to beat it
            t0 = clock.now()
            decisions, finished = _plain_step(rows, target, cfg, vocab, generator, index)
            t1 = clock.now()
            policy.update(Feedback(0, [0] * len(rows), [0] * len(rows), {r.sequence: [] for r in rows}, 0.0, t1 - t0))
            step = _step(index, 0, rows, (draft, target), 0.0, t1 - t0, 0.0, clock.now() - start)
            costs.observe(len(rows), 0, 1, 0, 0.0, t1 - t0, 0.0, 0.0, False)
            yield Iteration(step, decisions)
            index += 1
            previous_end = step.end_s
            rows = yield from _leave(rows, finished, (draft, target), clock, start)
            continue
        caps = [max(1, min(gamma, r.remaining)) for r in rows]
        # a draft that sat out plain steps first feeds what it missed: that forward is not a step's cost
        caught_up = draft is not None and max(len(r.tokens) - draft.fed(i) for i, r in enumerate(rows)) > 2
        t0 = clock.now()
        drafts, draft_logits, drafted_by = _propose(rows, draft, caps, cfg, vocab, target.device, generator)
        lengths = [len(d) for d in drafts]
        widest = max(lengths)
        t1 = clock.now()
        feeds = [r.tokens[target.fed(i):] + d for i, (r, d) in enumerate(zip(rows, drafts))]
        scored = target.forward(feeds, max(len(f) for f in feeds))
        target_logits = _left_aligned(scored, [n + 1 for n in lengths], widest + 1)  # [B, γmax+1, V]
        t2 = clock.now()
        tokens = torch.tensor([d + [PAD_ID] * (widest - len(d)) for d in drafts], device=target_logits.device)
        result = verify(
            cfg.mode, tokens, draft_logits, target_logits, cfg.sampling, generator, lenience=cfg.lenience,
            sigmoid_alpha=cfg.sigmoid_alpha, sigmoid_beta=cfg.sigmoid_beta, backend=cfg.verify_backend,
            draft_lengths=lengths if min(lengths) < widest else None,
        )
        host = result.host()  # one readback (the kernel path made it already)
        t3 = clock.now()
        why, explain_s = [[] for _ in rows], 0.0
        if cfg.explain_top:
            why, explain_s = clock.paused(lambda: examine(
                drafts, host.n_accepted, draft_logits, target_logits, cfg.sampling, lenience=cfg.lenience,
                sigmoid=(cfg.sigmoid_alpha, cfg.sigmoid_beta) if cfg.mode == "sigmoid" else None,
                top=cfg.explain_top, decode=vocab.decode))

        decisions, target_keep, draft_keep, finished = [], [], [], []
        for i, (row, d) in enumerate(zip(rows, drafts)):
            n, next_id, g = host.n_accepted[i], host.next_token[i], len(d)
            kept = len(row.tokens) + n  # both caches may keep the context plus the accepted drafts
            target_keep.append(kept)
            if draft is not None:
                draft_keep.append(min(draft.fed(i), kept))
            emitted, hit_eos = _limit(d[:n] + [next_id], row.remaining, vocab.eos)
            row.tokens.extend(emitted)
            row.remaining -= len(emitted)
            accept_prob, uniform, p, q = (x[i][:g] for x in
                                          (host.accept_prob, host.uniforms, host.p_draft, host.q_draft))
            decisions.append(Decision(
                step=index, sequence=row.sequence, gamma=g, draft_ids=d, draft_text=[vocab.decode([t]) for t in d],
                q=q, p=p, accept_prob=accept_prob, uniform=uniform,
                outcome=[ACCEPTED] * n + ([REJECTED] if n < g else []) + [DISCARDED] * max(0, g - n - 1),
                n_accepted=n, next_id=next_id, next_text=vocab.decode([next_id]),
                next_kind=BONUS if n == g else RESAMPLED, emitted=len(emitted), drafter=drafted_by[i], why=why[i],
            ))
            if hit_eos or row.remaining == 0:
                finished.append((row.sequence, "eos" if hit_eos else "length"))
        target.rollback(target_keep)
        if draft is not None:
            draft.rollback(draft_keep)
        policy.update(Feedback(
            gamma, lengths, host.n_accepted,
            {dec.sequence: dec.examined_accept_probs for dec in decisions},
            t1 - t0, t2 - t1,
        ))
        step = _step(index, gamma, rows, (draft, target), t1 - t0, t2 - t1, t3 - t2, clock.now() - start, explain_s)
        modelled = [g for g, by in zip(lengths, drafted_by) if by == MODEL]
        costs.observe(len(rows), gamma, widest + 1, max(modelled, default=0), t1 - t0, t2 - t1, t3 - t2,
                      step.end_s - previous_end - (t3 - t0), caught_up)
        yield Iteration(step, decisions)
        index += 1
        previous_end = step.end_s
        rows = yield from _leave(rows, finished, (draft, target), clock, start)


def _step(index: int, gamma: int, rows: list[Row], decoders: tuple, draft_s: float, target_s: float, verify_s: float,
          end_s: float, explain_s: float = 0.0) -> StepRecord:
    real = pad = slots = holes = 0
    for decoder in decoders:
        if decoder is not None:
            r, p = decoder.take_counts()
            s, h = decoder.cache_use()
            real, pad, slots, holes = real + r, pad + p, slots + s, holes + h
    return StepRecord(index=index, gamma=gamma, sequences=[r.sequence for r in rows], draft_s=draft_s,
                      target_s=target_s, verify_s=verify_s, end_s=end_s, real_tokens=real, pad_tokens=pad,
                      cache_slots=slots, cache_holes=holes, explain_s=explain_s)


def _leave(rows: list[Row], finished: list[tuple[int, str]], decoders: tuple, clock: Stopwatch,
           start: float) -> Iterator[Event]:
    """Announce finished sequences and drop their rows from every cache; returns the rows that remain."""
    if not finished:
        return rows
    done = {s for s, _ in finished}
    at = clock.now() - start
    for sequence, reason in finished:
        yield Finished(sequence, reason, at)
    keep = [i for i, r in enumerate(rows) if r.sequence not in done]
    if keep:
        for decoder in decoders:
            if decoder is not None:
                decoder.select(keep)
    return [rows[i] for i in keep]


def _target_only(rows: list[Row], target: SlottedDecoder, cfg: SpecConfig, vocab: Vocabulary,
                 generator: torch.Generator, clock: Stopwatch, start: float, first_index: int) -> Iterator[Event]:
    """The autoregressive reference on the same stack and sampling: one target forward per token, batched."""
    index = first_index
    while rows:
        t0 = clock.now()
        decisions, finished = _plain_step(rows, target, cfg, vocab, generator, index)
        t1 = clock.now()
        yield Iteration(_step(index, 0, rows, (None, target), 0.0, t1 - t0, 0.0, clock.now() - start), decisions)
        index += 1
        rows = yield from _leave(rows, finished, (None, target), clock, start)


def _plain_step(rows: list[Row], target: SlottedDecoder, cfg: SpecConfig, vocab: Vocabulary,
                generator: torch.Generator, index: int) -> tuple[list[Decision], list[tuple[int, str]]]:
    """One target forward per row and one token drawn from it: target-only decoding's step, and a
    speculative run's γ = 0 step (the draft's cache catches up when it next drafts)."""
    z = target.forward([r.tokens[target.fed(i):] for i, r in enumerate(rows)], 1)[:, 0]  # [B, V]
    check_logits(z, "target")
    tokens = draw(z, cfg.sampling, generator).tolist()
    decisions, finished = [], []
    for row, x in zip(rows, tokens):
        row.tokens.append(x)
        row.remaining -= 1
        decisions.append(Decision(step=index, sequence=row.sequence, gamma=0, draft_ids=[], draft_text=[], q=[],
                                  p=[], accept_prob=[], uniform=[], outcome=[], n_accepted=0, next_id=x,
                                  next_text=vocab.decode([x]), next_kind=TARGET, emitted=1))
        if x in vocab.eos or row.remaining == 0:
            finished.append((row.sequence, "eos" if x in vocab.eos else "length"))
    return decisions, finished
