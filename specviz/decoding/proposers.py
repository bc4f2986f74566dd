"""Who drafts: the `Proposer` protocol, one class per `SpecConfig.draft_kind`, and the factory that picks one.

A proposer turns each row's tokens so far into up to cap[r] drafted tokens and the draft logits they were
drawn from. Verification stays exact for any proposer whose logits are the distribution its tokens were
drawn from (a deterministic proposal has one-hot logits: speculative sampling keeps such a token with
probability p(x)); a poor proposal costs scored tokens, never exactness. A new kind is one class with
`kind`, `uses_draft_model` and `propose`, listed in PROPOSERS (and in config.DRAFT_KINDS). The kind "priced" is
no class of its own: the cost policy picks one of the others at each iteration (gamma.CostAware.plan).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from specviz.config import LOOKUP_THEN_MODEL, PRICED, PRICED_KINDS, SpecConfig
from specviz.decoding.decoder import PAD_ID, SlottedDecoder
from specviz.decoding.drafts import lookup, one_hot_logits
from specviz.decoding.records import LOOKUP, MODEL
from specviz.sampling import draw_checked
from specviz.decoding.source import Vocabulary


@dataclass(frozen=True)
class Proposal:
    """What the rows of a batch propose for one iteration."""

    tokens: list[list[int]]  # per row, 1..cap[r] drafted ids
    logits: torch.Tensor  # [B, γmax, V] draft logits; zeros beyond a row's own draft (padding, never read)
    drafters: list[str]  # per row: MODEL or LOOKUP

    @property
    def lengths(self) -> list[int]:
        return [len(t) for t in self.tokens]

    @property
    def width(self) -> int:
        """γmax: the longest row's draft."""
        return max(self.lengths)

    @property
    def model_forwards(self) -> int:
        """Batched draft-model forwards it took: one per position of the longest row the model drafted."""
        return max((len(t) for t, by in zip(self.tokens, self.drafters) if by == MODEL), default=0)

    def padded(self, device: torch.device) -> torch.Tensor:
        """The drafts as LongTensor[B, γmax], PAD_ID beyond each row's own (verification never reads it)."""
        return torch.tensor([t + [PAD_ID] * (self.width - len(t)) for t in self.tokens], device=device)


@dataclass(frozen=True)
class DraftSetup:
    """What a proposer may draw on."""

    cfg: SpecConfig
    vocab: Vocabulary
    device: torch.device  # where proposals' logits go: the target's device
    generator: torch.Generator  # the run's one random stream (sampled drafts draw from it, in row order)
    draft: SlottedDecoder | None  # the draft model's decoder; None when the kind needs no draft model


class Proposer(Protocol):
    """Drafts for the rows of a batch; `histories[r]` is row r's tokens so far (prompt first)."""

    kind: ClassVar[str]  # the SpecConfig.draft_kind it implements
    uses_draft_model: ClassVar[bool]  # whether the driver opens a draft model for it

    def __init__(self, setup: DraftSetup) -> None:
        ...

    def propose(self, histories: list[list[int]], caps: list[int]) -> Proposal:
        """Up to caps[r] ≥ 1 tokens for every row (at least one each)."""
        ...


class ModelDraft:
    """The draft model samples its tokens, one batched forward per position (Leviathan et al.)."""

    kind = "model"
    uses_draft_model = True

    def __init__(self, setup: DraftSetup):
        if setup.draft is None:
            raise ValueError(f"draft kind {self.kind!r} needs a draft model")
        self.draft = setup.draft
        self.sampling = setup.cfg.sampling
        self.confidence = setup.cfg.draft_confidence  # 0: off
        self.generator = setup.generator

    def propose(self, histories: list[list[int]], caps: list[int]) -> Proposal:
        tokens, logits = self.draft_rows(histories, caps, list(range(len(histories))))
        return Proposal(tokens, logits, [MODEL] * len(histories))

    def draft_rows(self, histories: list[list[int]], caps: list[int],
                   live: list[int]) -> tuple[list[list[int]], torch.Tensor]:
        """Rows `live` draft up to caps[r] tokens each; a row stops early when the draft doubts its own token
        (cfg.draft_confidence). Other rows draft nothing and feed nothing (their cache catches up when they
        next draft). Returns the drafts and their logits [B, γmax, V], zero beyond a row's own draft."""
        draft = self.draft
        drafts: list[list[int]] = [[] for _ in histories]
        # first the tokens the cache has not seen: the last one, or more after plain steps or lookup
        feeds = [h[draft.fed(i):] if i in live else [] for i, h in enumerate(histories)]
        logits = []
        while live:
            z = draft.forward(feeds, 1)[:, 0]  # [B, V]
            z_live = z if len(live) == len(histories) else z.index_select(0, torch.tensor(live, device=z.device))
            x = draw_checked(z_live, self.sampling, self.generator, "draft")  # b tokens, one readback
            doubt = self._doubts(z_live, torch.tensor(x, device=z.device)) if self.confidence else None
            logits.append(z)
            feeds = [[] for _ in histories]
            still = []
            for k, (i, token) in enumerate(zip(live, x)):
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

    def _doubts(self, z: torch.Tensor, x: torch.Tensor) -> list[bool] | None:  # z [b, V], x LongTensor[b]
        """Per live row, whether the draft's own probability of its token fell below the threshold."""
        if not self.confidence:
            return None
        confidence = z.float().softmax(-1).gather(-1, x[:, None])[:, 0]  # [b]
        return (confidence < self.confidence).tolist()


class PromptLookup:
    """No draft model: the continuation of the latest earlier occurrence of the row's last cfg.lookup_ngram
    or more tokens (the match lookup+model and a priced run's plan see), else of its last 1..3; a row without
    any match repeats its last token, so that every row proposes something."""

    kind = "lookup"
    uses_draft_model = False

    def __init__(self, setup: DraftSetup):
        self.vocab, self.device, self.ngram = setup.vocab, setup.device, setup.cfg.lookup_ngram

    def propose(self, histories: list[list[int]], caps: list[int]) -> Proposal:
        eos = self.vocab.eos
        tokens = [lookup(h, cap, eos, min_ngram=self.ngram) or lookup(h, cap, eos, min_ngram=1) or [h[-1]]
                  for h, cap in zip(histories, caps)]
        logits = one_hot_logits(tokens, max(map(len, tokens)), self.vocab.size, self.device)
        return Proposal(tokens, logits, [LOOKUP] * len(histories))


class LookupThenModel:
    """Prompt lookup where the row's last cfg.lookup_ngram tokens recur earlier; the draft model elsewhere."""

    kind = LOOKUP_THEN_MODEL
    uses_draft_model = True

    def __init__(self, setup: DraftSetup):
        self.model = ModelDraft(setup)
        self.vocab, self.device, self.min_ngram = setup.vocab, setup.device, setup.cfg.lookup_ngram

    def propose(self, histories: list[list[int]], caps: list[int]) -> Proposal:
        found = [lookup(h, cap, self.vocab.eos, min_ngram=self.min_ngram) for h, cap in zip(histories, caps)]
        drafters = [LOOKUP if f else MODEL for f in found]
        modelled = [i for i, f in enumerate(found) if not f]
        if not modelled:
            return Proposal(found, one_hot_logits(found, max(map(len, found)), self.vocab.size, self.device),
                            drafters)
        model_tokens, model_logits = self.model.draft_rows(histories, caps, modelled)  # [B, w, V]
        tokens = [model_tokens[i] if i in modelled else f for i, f in enumerate(found)]
        logits = one_hot_logits(found, max(map(len, tokens)), self.vocab.size, self.device)  # modelled rows: zeros
        index = torch.tensor(modelled, device=self.device)
        logits[index, :model_logits.shape[1]] = model_logits.index_select(0, index).to(logits.dtype)
        return Proposal(tokens, logits, drafters)


PROPOSERS: dict[str, type[Proposer]] = {cls.kind: cls for cls in (ModelDraft, PromptLookup, LookupThenModel)}


def _kind(name: str) -> type[Proposer]:
    if name not in PROPOSERS:
        raise ValueError(f"unknown draft kind {name!r}; choose one of {', '.join(PROPOSERS)}")
    return PROPOSERS[name]


def uses_draft_model(kind: str) -> bool:
    """Whether draft kind `kind` needs the draft model opened."""
    return kind == PRICED or _kind(kind).uses_draft_model


def make_proposers(setup: DraftSetup) -> dict[str, Proposer]:
    """The proposer of setup.cfg.draft_kind by its kind; for "priced", every kind a priced run chooses among
    (the γ policy's plan picks one per iteration; they share the draft model's decoder)."""
    kinds = PRICED_KINDS if setup.cfg.draft_kind == PRICED else (setup.cfg.draft_kind,)
    return {kind: _kind(kind)(setup) for kind in kinds}
