"""The decoding driver: batched speculative decoding with ragged acceptance, and the target-only reference.

One driver for text and speech and for any batch size B ≥ 1 (Qian et al., BASS). A `Source`
(specviz.decoding.source) says what is decoded; `generate` decodes groups of up to `batch_size` sequences and yields
records (specviz.decoding.records): how far a group's prefill has read, a group was prefilled, one iteration of the whole batch, a sequence finished, the
run completed. Consumers build their own Trace from those immutable records.

One iteration: a proposer (specviz.decoding.proposers) drafts for every live row, the target scores all drafts in
one forward over its slotted cache (specviz.decoding.decoder), verification (specviz.verify) keeps a prefix of each
row's drafts and draws the next token, and every cache keeps only what was verified. The γ policy
(specviz.decoding.gamma) picks the next iteration's γ from what this one showed; γ = 0 is a plain target step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generator, Iterator

import torch

from specviz.decoding.clock import Stopwatch
from specviz.config import SpecConfig
from specviz.decoding.calibration import CALIBRATION_TOKENS, MAX_GAMMA, calibrate
from specviz.decoding.cost import CostModel
from specviz.decoding.decoder import SlottedDecoder
from specviz.decoding.explain import examine
from specviz.decoding.gamma import Feedback, Policy, make_policy
from specviz.decoding.drafts import lookup
from specviz.decoding.proposers import DraftSetup, Proposal, Proposer, make_proposers, uses_draft_model
from specviz.decoding.records import (ACCEPTED, BONUS, DISCARDED, REJECTED, RESAMPLED, TARGET, Completed, Decision, Event, Examined, Finished, Iteration, Prefilled, Prefilling, StepRecord)
from specviz.sampling import draw, draw_checked
from specviz.decoding.source import SequenceSpec, Source, Vocabulary, unique_names
from specviz.verify import VerifyHost, VerifyMetadata, verify_batch

# SequenceSpec, Source, Vocabulary and unique_names live in specviz.decoding.source and stay importable from here.
__all__ = ["generate", "LiveSequence", "SequenceSpec", "Source", "Vocabulary", "unique_names"]

Finish = tuple[int, str]  # (sequence, "eos" or "length")


@dataclass
class LiveSequence:
    """A sequence still decoding, in its row of the batch: its tokens so far (prompt first) and how many more
    it may produce."""

    sequence: int  # index of the sequence in the run
    tokens: list[int]
    remaining: int


@dataclass
class RunState:
    """What lasts the whole run: its settings, clock, random stream, γ policy and measured costs."""

    cfg: SpecConfig
    vocab: Vocabulary
    clock: Stopwatch
    generator: torch.Generator  # the run's one random stream: drafts, verification and plain steps draw from it
    policy: Policy
    costs: CostModel  # this run's measurements: the driver writes them, the cost-aware policy reads them
    start: float  # clock reading when the run began
    steps: int = 0  # iterations so far: the next one's index

    def elapsed(self) -> float:
        return self.clock.now() - self.start


@dataclass
class Batch:
    """A group of sequences decoded together: the live ones in row order, and the caches that hold them."""

    live: list[LiveSequence]
    target: SlottedDecoder
    draft: SlottedDecoder | None  # None for target-only runs and for drafts without a model

    @property
    def decoders(self) -> list[SlottedDecoder]:
        return [d for d in (self.draft, self.target) if d is not None]

    def draft_lag(self) -> int:
        """The most tokens any row's draft cache has not seen yet (0 without a draft model)."""
        if self.draft is None:
            return 0
        return max(len(s.tokens) - self.draft.fed(i) for i, s in enumerate(self.live))


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
    costs = CostModel()
    run = RunState(cfg=cfg, vocab=source.vocab, clock=clock,
                   generator=torch.Generator(device=source.device).manual_seed(cfg.seed),
                   policy=make_policy(cfg.gamma_policy, cfg.gamma_init, costs, cfg.gamma_schedule,
                                      cfg.drafter_schedule), costs=costs,
                   start=clock.now())
    events = _groups(source, run, target_only, batch_size)
    try:
        for event in events:
            with clock.stopped():  # what the consumer does with a record (the page draws it) is not decoding
                yield event
    finally:
        events.close()


def _groups(source: Source, run: RunState, target_only: bool, batch_size: int) -> Iterator[Event]:
    """Prefill and decode each group of sequences in turn."""
    cfg, clock, costs = run.cfg, run.clock, run.costs
    for group in _chunks(len(source.sequences), batch_size):
        t0 = clock.now()
        batch, by_model = yield from _prefill(source, group, cfg, clock,
                                              with_draft=not target_only and uses_draft_model(cfg.draft_kind))
        yield Prefilled(group, clock.now() - t0, sum(d.prompts_reused for d in batch.decoders), by_model)
        if target_only:
            yield from _target_only(run, batch)
            continue
        # measuring what calls cost serves the policy and the page's prediction, not decoding: off the clock
        clock.paused(lambda: _calibrate(costs, source, batch, cfg))
        proposers = make_proposers(DraftSetup(cfg=cfg, vocab=source.vocab, device=batch.target.device,
                                              generator=run.generator, draft=batch.draft))
        yield from _speculate(run, batch, proposers)
    yield Completed(run.elapsed(), None if target_only else costs.to_dict())


def _prefill(source: Source, group: list[int], cfg: SpecConfig, clock: Stopwatch, *, with_draft: bool
             ) -> Generator[Prefilling, None, tuple[Batch, tuple[tuple[str, float], ...]]]:
    """The group's decoders, each holding every prompt token but the last, which the first step feeds, and
    the seconds each model spent reading; how far each has read, as it goes."""
    draft, target = source.decoders(group, with_draft=with_draft)
    live = [LiveSequence(s, list(source.sequences[s].prompt_ids), cfg.max_new_tokens) for s in group]
    seconds = []
    for name, decoder in (("target", target), ("draft", draft)):
        if decoder is not None:
            t0 = clock.now()
            for read, total in decoder.prefill_steps([s.tokens[:-1] for s in live]):
                yield Prefilling(group, name, read, total)
            seconds.append((name, clock.now() - t0))
    return Batch(live, target, draft), tuple(seconds)


# What identifies a cost curve besides the machine: the models, their weights and where they run.
_COST_IDENTITY = ("task", "draft", "target", "device", "dtype", "draft_vocab_size", "draft_weights", "target_weights")


def _calibrate(costs: CostModel, source: Source, batch: Batch, cfg: SpecConfig) -> None:
    """Time target calls over CALIBRATION_TOKENS tokens per row, a plain step and a draft forward on the
    group's own caches, each rolled back (or read from the cache file of an earlier run)."""
    meta = source.meta()
    identity = {k: meta.get(k) for k in _COST_IDENTITY}
    width = CALIBRATION_TOKENS[-1]
    feeds = [(s.tokens[-1:] + s.tokens * width)[:width] for s in batch.live]  # real tokens: ordinary attention
    rows = len(batch.live)
    target, draft = batch.target, batch.draft
    target_fed = [target.fed(i) for i in range(rows)]
    own = torch.Generator(device=source.device).manual_seed(0)  # the run's generator stays untouched

    def target_step(m: int) -> None:
        target.forward([f[:m] for f in feeds], m)
        target.rollback(target_fed)

    def plain_step() -> None:
        z = target.forward([f[:1] for f in feeds], 1)[:, 0]  # [B, V]
        draw(z, cfg.sampling, own)
        target.rollback(target_fed)

    draft_fed = [] if draft is None else [draft.fed(i) for i in range(rows)]

    def draft_step() -> None:
        draft.forward([f[:1] for f in feeds], 1)
        draft.rollback(draft_fed)

    calibrate(costs, identity, rows, target_step, None if draft is None else draft_step, plain_step)
    for decoder in batch.decoders:
        decoder.take_counts()  # calibration tokens are not the run's


def _speculate(run: RunState, batch: Batch, proposers: dict[str, Proposer]) -> Iterator[Event]:
    """Iterations until every sequence of the batch has finished, at the γ the policy picks each time (and,
    in a priced run, with the proposer it picks)."""
    previous_end = run.elapsed()  # what passes between two iterations is their "other" cost
    while batch.live:
        gamma, kind, candidates = _next(run, batch, proposers)
        if gamma == 0:  # a plain target step: nothing is expected to beat it
            iteration, finished = _plain_iteration(run, batch, candidates)
        else:
            iteration, finished = _speculative_iteration(run, batch, proposers[kind], gamma, previous_end,
                                                         candidates)
        run.steps += 1
        yield iteration
        previous_end = iteration.step.end_s
        yield from _leave(run, batch, finished)


def _next(run: RunState, batch: Batch, proposers: dict[str, Proposer]) -> tuple[int, str, dict[int, list[int]]]:
    """γ and who drafts next: the run's one proposer at the policy's γ, or a priced run's plan, which weighs
    each row's prompt-lookup continuation (found in well under a millisecond) against the draft model. Also
    the continuations by sequence (a priced run's; the policy learns lookup's acceptance from them)."""
    if len(proposers) == 1:
        return run.policy.current(), next(iter(proposers)), {}
    candidates = {s.sequence: lookup(s.tokens, MAX_GAMMA, run.vocab.eos, min_ngram=run.cfg.lookup_ngram)
                  for s in batch.live}
    plan = run.policy.plan([s.sequence for s in batch.live], [len(candidates[s.sequence]) for s in batch.live],
                           lag=batch.draft_lag(), remaining=[s.remaining for s in batch.live])
    return plan.gamma, plan.kind, candidates


def _speculative_iteration(run: RunState, batch: Batch, proposer: Proposer, gamma: int, previous_end: float,
                           candidates: dict[int, list[int]]) -> tuple[Iteration, list[Finish]]:
    """Draft, score, verify and keep the verified tokens, for every live row at this γ."""
    clock, live = run.clock, batch.live
    caps = [max(1, min(gamma, s.remaining)) for s in live]
    # a draft that sat out plain steps first feeds what it missed: that forward is not a step's cost
    caught_up = batch.draft_lag() > 2
    t0 = clock.now()
    proposal = proposer.propose([s.tokens for s in live], caps)
    t1 = clock.now()
    target_logits = _score(batch, proposal)  # [B, γmax+1, V]
    t2 = clock.now()
    meta = VerifyMetadata.for_run(run.cfg, proposal.lengths)
    result = verify_batch(meta, proposal.padded(target_logits.device), proposal.logits, target_logits, run.generator)
    host = result.host()  # one readback (the kernel path made it already)
    t3 = clock.now()
    draft_s, target_s, verify_s = t1 - t0, t2 - t1, t3 - t2
    why, explain_s = _explain(run, meta, proposal, host, target_logits)

    kept = [len(s.tokens) + n for s, n in zip(live, host.n_accepted)]  # the context plus the accepted drafts
    decisions, finished = _append_verified(run, batch, proposal, host, why)
    _keep_verified(batch, kept)
    run.policy.update(Feedback.of(gamma, decisions, draft_s=draft_s, target_s=target_s, candidates=candidates))
    step = _record_step(run, batch, gamma=gamma, draft_s=draft_s, target_s=target_s, verify_s=verify_s,
                        explain_s=explain_s)
    run.costs.observe(batch=len(live), gamma=gamma, scored=proposal.width + 1, draft_forwards=proposal.model_forwards,
                      draft_s=draft_s, target_s=target_s, verify_s=verify_s,
                      other_s=step.end_s - previous_end - (t3 - t0), draft_caught_up=caught_up)
    return Iteration(step, decisions), finished


def _score(batch: Batch, proposal: Proposal) -> torch.Tensor:
    """One target forward over each row's tokens the cache has not seen and its drafts. Returns logits
    [B, γmax+1, V], left-aligned: position k scores draft k, position γ_b the row's bonus."""
    target = batch.target
    feeds = [s.tokens[target.fed(i):] + d for i, (s, d) in enumerate(zip(batch.live, proposal.tokens))]
    scored = target.forward(feeds, max(len(f) for f in feeds))  # [B, W, V], right-aligned
    return _left_aligned(scored, [n + 1 for n in proposal.lengths], proposal.width + 1)


def _left_aligned(logits: torch.Tensor, counts: list[int], width: int) -> torch.Tensor:
    """logits [B, W, V] whose row r ends with its counts[r] relevant columns -> [B, width, V] starting with
    them (padding beyond repeats the row's last column)."""
    W = logits.shape[1]
    if width == W and all(n == W for n in counts):  # every row fed its drafts and one more: aligned already
        return logits  # (the gather copied 4.9 MB for 4 rows at γ 1: 1.4 ms of a 80 ms call)
    cols = torch.tensor([[W - n + min(j, n - 1) for j in range(width)] for n in counts], device=logits.device)
    return logits.gather(1, cols[..., None].expand(-1, -1, logits.shape[-1]))


def _explain(run: RunState, meta: VerifyMetadata, proposal: Proposal, host: VerifyHost,
             target_logits: torch.Tensor) -> tuple[list[list[Examined]], float]:  # target_logits [B, γmax+1, V]
    """The why-panel's distributions per row and the seconds they took, recorded with the clock stopped
    (none when cfg.explain_top is 0)."""
    if not run.cfg.explain_top:
        return [[] for _ in proposal.tokens], 0.0
    return run.clock.paused(lambda: examine(
        proposal.tokens, host.n_accepted, proposal.logits, target_logits, meta.sampling, lenience=meta.lenience,
        sigmoid=meta.sigmoid, top=run.cfg.explain_top, decode=run.vocab.decode))


def _append_verified(run: RunState, batch: Batch, proposal: Proposal, host: VerifyHost,
                     why: list[list[Examined]]) -> tuple[list[Decision], list[Finish]]:
    """Append each row's kept drafts and next token (cut at EOS and at its budget) and record the decision."""
    decisions, finished = [], []
    for row, (seq, drafted) in enumerate(zip(batch.live, proposal.tokens)):
        n = host.n_accepted[row]
        emitted, hit_eos = _limit(drafted[:n] + [host.next_token[row]], seq.remaining, run.vocab.eos)
        seq.tokens.extend(emitted)
        seq.remaining -= len(emitted)
        decisions.append(_decision(run, seq, drafted, proposal.drafters[row], host, row, len(emitted), why[row]))
        if hit_eos or seq.remaining == 0:
            finished.append((seq.sequence, "eos" if hit_eos else "length"))
    return decisions, finished


def _limit(tokens: list[int], budget: int, eos: frozenset[int]) -> tuple[list[int], bool]:
    """Cut tokens at the first EOS (kept) and at the budget; report whether an EOS ended them."""
    for i, t in enumerate(tokens[:budget]):
        if t in eos:
            return tokens[: i + 1], True
    return tokens[:budget], False


def _decision(run: RunState, seq: LiveSequence, drafted: list[int], drafter: str, host: VerifyHost, row: int,
              emitted: int, why: list[Examined]) -> Decision:
    """What verification did with one row's drafts (host's per-position lists cut to the row's own γ)."""
    g, n, next_id, decode = len(drafted), host.n_accepted[row], host.next_token[row], run.vocab.decode
    return Decision(
        step=run.steps, sequence=seq.sequence, gamma=g, draft_ids=drafted, draft_text=[decode([t]) for t in drafted],
        q=host.q_draft[row][:g], p=host.p_draft[row][:g], accept_prob=host.accept_prob[row][:g],
        uniform=host.uniforms[row][:g],
        outcome=[ACCEPTED] * n + ([REJECTED] if n < g else []) + [DISCARDED] * max(0, g - n - 1),
        n_accepted=n, next_id=next_id, next_text=decode([next_id]), next_kind=BONUS if n == g else RESAMPLED,
        emitted=emitted, drafter=drafter, why=why,
    )


def _keep_verified(batch: Batch, kept: list[int]) -> None:
    """Every cache keeps at most row r's first kept[r] tokens; the rest (rejected drafts) become holes. A draft
    cache may hold fewer: its last draft was never fed, and rows it did not draft for fed nothing."""
    for decoder in batch.decoders:
        decoder.rollback([min(decoder.fed(i), k) for i, k in enumerate(kept)])


def _plain_iteration(run: RunState, batch: Batch, candidates: dict[int, list[int]]
                     ) -> tuple[Iteration, list[Finish]]:
    """A speculative run's γ = 0 step; the policy and the cost model learn from it as from any other."""
    t0 = run.clock.now()
    decisions, finished = _plain_step(run, batch)
    target_s = run.clock.now() - t0
    run.policy.update(Feedback.of(0, decisions, draft_s=0.0, target_s=target_s, candidates=candidates))
    step = _record_step(run, batch, gamma=0, draft_s=0.0, target_s=target_s, verify_s=0.0)
    run.costs.observe(batch=len(batch.live), gamma=0, scored=1, draft_forwards=0, draft_s=0.0, target_s=target_s,
                      verify_s=0.0, other_s=0.0, draft_caught_up=False)
    return Iteration(step, decisions), finished


def _target_only(run: RunState, batch: Batch) -> Iterator[Event]:
    """The autoregressive reference on the same stack and sampling: one target forward per token, batched."""
    while batch.live:
        t0 = run.clock.now()
        decisions, finished = _plain_step(run, batch)
        step = _record_step(run, batch, gamma=0, draft_s=0.0, target_s=run.clock.now() - t0, verify_s=0.0)
        run.steps += 1
        yield Iteration(step, decisions)
        yield from _leave(run, batch, finished)


def _plain_step(run: RunState, batch: Batch) -> tuple[list[Decision], list[Finish]]:
    """One target forward per row and one token drawn from it: target-only decoding's step, and a
    speculative run's γ = 0 step (the draft's cache catches up when it next drafts)."""
    target, vocab = batch.target, run.vocab
    z = target.forward([s.tokens[target.fed(i):] for i, s in enumerate(batch.live)], 1)[:, 0]  # [B, V]
    tokens = draw_checked(z, run.cfg.sampling, run.generator, "target")
    decisions, finished = [], []
    for seq, x in zip(batch.live, tokens):
        seq.tokens.append(x)
        seq.remaining -= 1
        decisions.append(Decision(step=run.steps, sequence=seq.sequence, gamma=0, draft_ids=[], draft_text=[], q=[],
                                  p=[], accept_prob=[], uniform=[], outcome=[], n_accepted=0, next_id=x,
                                  next_text=vocab.decode([x]), next_kind=TARGET, emitted=1))
        if x in vocab.eos or seq.remaining == 0:
            finished.append((seq.sequence, "eos" if x in vocab.eos else "length"))
    return decisions, finished


def _record_step(run: RunState, batch: Batch, *, gamma: int, draft_s: float, target_s: float, verify_s: float,
                 explain_s: float = 0.0) -> StepRecord:
    """The iteration's batch-level facts; takes the tokens each cache was fed since the last record."""
    end_s = run.elapsed()
    real = pad = slots = holes = 0
    for decoder in batch.decoders:
        fed_real, fed_pad = decoder.take_counts()
        held, masked = decoder.cache_use()
        real, pad, slots, holes = real + fed_real, pad + fed_pad, slots + held, holes + masked
    return StepRecord(index=run.steps, gamma=gamma, sequences=[s.sequence for s in batch.live], draft_s=draft_s,
                      target_s=target_s, verify_s=verify_s, end_s=end_s, real_tokens=real, pad_tokens=pad,
                      cache_slots=slots, cache_holes=holes, explain_s=explain_s)


def _leave(run: RunState, batch: Batch, finished: list[Finish]) -> Iterator[Event]:
    """Announce finished sequences and drop their rows from the batch and from every cache."""
    if not finished:
        return
    done = {s for s, _ in finished}
    at = run.elapsed()
    for sequence, reason in finished:
        yield Finished(sequence, reason, at)
    keep = _rows_after_leaving([s.sequence not in done for s in batch.live])
    if keep:
        for decoder in batch.decoders:
            decoder.select(keep)
    batch.live = [batch.live[i] for i in keep]


def _rows_after_leaving(stays: list[bool]) -> list[int]:
    """The batch's rows after some leave (stays[r]: row r stays), in their new order: a row stays where it is
    where it can, and the rows past the new batch's end fill the leavers' places, so each leaver costs one row's
    copy in every cache, not one a row after it (a 4-row batch's caches at ~900 tokens: ~6 ms a row copied).
    Rows are batch-invariant, so their order changes no row's numbers; a sampled run draws in row order, so
    the order is part of what a seed decides (and a replay repeats it)."""
    kept = [r for r, stay in enumerate(stays) if stay]
    size = len(kept)
    movers = iter(r for r in kept if r >= size)
    return [r if stays[r] else next(movers) for r in range(size)]
