"""What the engine yields while it decodes: immutable records, one kind per event.

The driver produces them, consumers (the CLI's progress bar, the page's thread, a TraceBuilder) read them;
nothing flows back. A record is never mutated after it is yielded, so handing one to another thread is safe.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from specviz.config import LOOKUP_THEN_MODEL

# Outcome of each drafted token, then of the token verification adds (TARGET: target-only decoding).
ACCEPTED, REJECTED, DISCARDED = "accepted", "rejected", "discarded"  # discarded: drafted after a rejection
RESAMPLED, BONUS, TARGET = "resampled", "bonus", "target"
OUTCOMES = (ACCEPTED, REJECTED, DISCARDED)
NEXT_KINDS = (RESAMPLED, BONUS, TARGET)
FINISH_REASONS = ("eos", "length", "")  # "": still decoding when the trace was taken
MODEL, LOOKUP = "model", "lookup"  # who drafted: the draft model, or prompt lookup (specviz.decoding.drafts)
DRAFTERS = (MODEL, LOOKUP)


def drafted_by(decisions: Iterable[Decision]) -> str:
    """Who drafted in one iteration, from its rows' decisions: MODEL or LOOKUP for all of them, LOOKUP_THEN_MODEL
    where rows differ, "" at a plain step (nothing drafted)."""
    who = {d.drafter for d in decisions if d.gamma}
    return "" if not who else next(iter(who)) if len(who) == 1 else LOOKUP_THEN_MODEL


@dataclass(frozen=True)
class TopTokens:
    """The N most probable tokens of a distribution, most probable first, and the mass of all the others."""

    ids: list[int]
    texts: list[str]
    probs: list[float]
    rest: float  # 1 - sum(probs): the mass outside the top N


@dataclass(frozen=True)
class Examined:
    """Why one position of a decision went as it did: the distributions verification compared there.

    Positions examined: every accepted draft, the rejected one, and the bonus position (γ) when all drafts
    were accepted. Drafts after a rejection were never examined and have no entry.
    """

    position: int  # draft position k in 0..γ-1, or γ for the bonus position (nothing drafted there)
    p: TopTokens  # the target's standardized distribution (softmax, even in sigmoid mode)
    q: TopTokens | None  # the draft's standardized distribution; None at the bonus position
    # Where the next token was drawn from, as the mode drew it: the normalized residual max(0, p - l·q) at
    # the rejected position, p at the bonus position (sigmoid: from p̂ and q̂); None at accepted positions.
    drawn_from: TopTokens | None
    # sigmoid with sampling only (None otherwise): what exact verification would say at this position
    exact_accept_prob: float | None  # min(1, p(x) / (l·q(x))) with softmax p and q
    sigmoid_tv: float | None  # total-variation distance of p̂ (normalized) from p


@dataclass(frozen=True)
class Decision:
    """One sequence's part of one iteration: what it drafted and what verification did with it."""

    step: int  # index of the iteration (StepRecord.index)
    sequence: int  # index of the sequence in the run
    gamma: int  # tokens this sequence drafted (its draft may stop before the batch's γ)
    draft_ids: list[int]
    draft_text: list[str]
    q: list[float]  # draft probability of each drafted token
    p: list[float]  # target probability of each drafted token
    accept_prob: list[float]  # min(1, p / (l·q))
    uniform: list[float]  # the uniform each drafted token was compared with
    outcome: list[str]  # ACCEPTED / REJECTED / DISCARDED per drafted token
    n_accepted: int
    next_id: int
    next_text: str
    next_kind: str  # RESAMPLED, BONUS, or TARGET
    emitted: int  # tokens appended to the output (fewer than n_accepted + 1 at EOS or the token limit)
    drafter: str = MODEL  # MODEL or LOOKUP (target-only steps: MODEL, unused)
    why: list[Examined] = field(default_factory=list)  # examined positions in order; empty when not recorded

    @property
    def tokens(self) -> list[int]:
        """The tokens this iteration appended to the sequence's output."""
        return (self.draft_ids[: self.n_accepted] + [self.next_id])[: self.emitted]

    @property
    def examined_accept_probs(self) -> list[float]:
        """min(1, p/(l·q)) of the drafts verification examined (up to and including the first rejection).

        The one definition behind every α specviz shows or uses (Trace.alpha_estimate, the acceptance
        figure, the γ policies' feedback): each is the chance its context accepts a draft sample, so their
        mean estimates α = 1 − D_LK (Leviathan §3); drafts after a rejection are left out because their
        contexts never occur in the output.
        """
        return [a for a, o in zip(self.accept_prob, self.outcome) if o != DISCARDED]


@dataclass(frozen=True)
class StepRecord:
    """Batch-level facts of one iteration: one target forward for every sequence still decoding."""

    index: int
    gamma: int  # the γ policy's value for this iteration (0 for target-only steps)
    sequences: list[int]  # the sequences in the batch, in row order
    draft_s: float
    target_s: float
    verify_s: float
    end_s: float  # seconds from the start of the run to the end of this iteration
    real_tokens: int  # tokens fed to draft and target for real this iteration
    pad_tokens: int  # padding fed beside them because rows fed different counts (compute spent on nothing)
    cache_slots: int  # KV-cache entries per layer held by draft and target after the iteration (rows × length)
    cache_holes: int  # of which masked: padding, rejected drafts, and left padding of shorter prompts
    # Seconds spent recording the why-panel's distributions (Decision.why) after verification; the run's
    # clock stops meanwhile, so end_s and every other time exclude it.
    explain_s: float = 0.0


@dataclass(frozen=True)
class Iteration:
    step: StepRecord
    decisions: list[Decision]  # one per sequence in step.sequences, same order


@dataclass(frozen=True)
class Prefilling:
    """How far one model has read a group's prompts (progress only; the trace keeps nothing of it)."""

    sequences: list[int]
    model: str  # "target" or "draft"
    read: int  # prompt tokens read so far
    total: int  # of how many (prompts found in the prompt cache count as read at once)


@dataclass(frozen=True)
class Prefilled:
    """A group of sequences entered the batch; their prompts were fed (and the audio encoded)."""

    sequences: list[int]
    seconds: float
    reused: int = 0  # prompts whose keys and values came from the prompt cache (specviz.models.prompt_cache)
    by_model: tuple[tuple[str, float], ...] = ()  # ("target", s), ("draft", s): each model's reading of the prompts


@dataclass(frozen=True)
class Finished:
    sequence: int
    reason: str  # "eos" or "length"
    at_s: float  # seconds from the start of the run


@dataclass(frozen=True)
class Completed:
    total_s: float  # wall time of the whole run, prefill included
    # What the run measured of each call's cost (specviz.decoding.cost.CostModel.to_dict); None for target-only runs.
    # A fresh dict no one else holds.
    costs: dict | None = None


Event = Prefilling | Prefilled | Iteration | Finished | Completed
