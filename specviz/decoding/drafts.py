"""Cheaper drafts that keep verification exact: a reduced-vocabulary draft head and prompt lookup.

Reduced vocabulary (the FR-Spec idea, Zhao et al. 2025): the draft scores only a subset S of the vocabulary
and gives every other token q = 0. The target keeps its full head, so speculative sampling stays exact for
any S: a token outside S is never drafted, and on a rejection the residual max(0, p − q) equals p there,
so the target's mass outside S is still reached through the correction. What S costs is acceptance: a
token the target wants that lies outside S is always a rejection. S = the K first token ids (byte-pair
merge order, which ranks tokens roughly by corpus frequency, for free) ∪ the special tokens ∪ the tokens of
the prompt (summaries and transcripts copy their input).

Prompt lookup (as transformers' prompt_lookup_num_tokens): no draft model at all. The draft is the
continuation of the most recent earlier occurrence of the sequence's last n tokens; q is one-hot on it,
which speculative sampling accepts with probability p(x), so the output stays exact.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from specviz.models.arena import Arena, footprint
from specviz.models.half_linear import HalfLinear
from specviz.models.packed import PackedLinear

LOOKUP_MAX_NGRAM = 3  # longest suffix matched; longer matches are tried first


def subset_ids(vocab_size: int, k: int, always: set[int]) -> torch.Tensor:
    """The draft's token ids: 0..k-1 (merge order), plus `always` (specials, prompt tokens), sorted.
    k <= 0 or k >= vocab_size: the whole vocabulary."""
    if k <= 0 or k >= vocab_size:
        return torch.arange(vocab_size)
    extra = sorted(t for t in always if k <= t < vocab_size)
    return torch.cat([torch.arange(k), torch.tensor(extra, dtype=torch.long)])


def _rows(head: nn.Module, ids: torch.Tensor) -> nn.Module:
    """A linear layer computing `head`'s outputs for rows `ids` only; int8 and packed heads stay so."""
    if isinstance(head, PackedLinear):  # its rows keep their own blocks and scales
        return head.select_rows(ids.to(head.q.device))
    if isinstance(head, HalfLinear):
        return HalfLinear(head.weight.index_select(0, ids), None if head.bias is None else head.bias[ids])
    qlinear = torch.ao.nn.quantized.dynamic.Linear
    if isinstance(head, qlinear):
        weight = head.weight()  # per-tensor int8: rows keep the same scale
        bias = head.bias()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.ao is deprecated for torchao; see specviz.models.quant
            sub = qlinear(head.in_features, len(ids), dtype=torch.qint8)
        sub.set_weight_bias(weight.index_select(0, ids.to(weight.device)), None if bias is None else bias[ids])
        return sub
    sub = nn.Linear(head.in_features, len(ids), bias=head.bias is not None, device=head.weight.device,
                    dtype=head.weight.dtype)
    with torch.no_grad():
        sub.weight.copy_(head.weight.index_select(0, ids.to(head.weight.device)))
        if head.bias is not None:
            sub.bias.copy_(head.bias[ids])
    return sub


class SubsetHead:
    """The draft's output head over a subset of the vocabulary; logits are -inf (q = 0) elsewhere.

    Read-only after construction, so one instance may serve any number of decoders.
    """

    def __init__(self, head: nn.Module, ids: torch.Tensor, vocab_size: int):  # ids LongTensor[K]
        self.linear = _rows(head, ids)
        if isinstance(self.linear, PackedLinear) and self.linear.q.device.type == "cpu":
            # on 2 MB pages as the model's own layers (models/arena.py): the 32K head's step 0.71 → 0.61 ms
            tensors = [t for t in (getattr(self.linear, n) for n in PackedLinear.BUFFERS) if t is not None]
            self.linear.relocate(Arena(footprint(tensors)).place)
        self.ids = ids.to(_device(head))
        self.vocab_size = vocab_size
        self.quantized = isinstance(self.linear, torch.ao.nn.quantized.dynamic.Linear)

    @property
    def size(self) -> int:
        return len(self.ids)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:  # hidden [b, k, H] -> logits [b, k, V]
        """Logits in the head's own dtype (fp32 on the CPU; a bf16 GPU model's stay bf16, like the target's, so
        that the verification kernels read both without a cast and run as one graph)."""
        z = self.linear(hidden.float() if self.quantized else hidden)
        out = torch.full((*z.shape[:-1], self.vocab_size), float("-inf"), dtype=z.dtype, device=z.device)
        return out.index_copy_(-1, self.ids, z)


def _device(head: nn.Module) -> torch.device:
    if isinstance(head, torch.ao.nn.quantized.dynamic.Linear):
        return torch.device("cpu")
    if isinstance(head, PackedLinear):
        return head.q.device
    return head.weight.device  # nn.Linear, HalfLinear


def subset_head(model: nn.Module, vocab_size: int, k: int, always: set[int]) -> SubsetHead | None:
    """The reduced head of `model` (its output embeddings) for k and `always`; None when k keeps everything."""
    ids = subset_ids(vocab_size, k, always)
    if len(ids) >= vocab_size:
        return None
    return SubsetHead(model.get_output_embeddings(), ids, vocab_size)


def special_ids(tokenizer) -> set[int]:
    """Ids of a tokenizer's special and added tokens (EOS, chat markers, Whisper's task tokens)."""
    return set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))


def draft_head_size(head: SubsetHead | None, vocab_size: int) -> int:
    """Tokens the draft scores: the subset's size, or the whole vocabulary."""
    return vocab_size if head is None else head.size


def lookup(tokens: list[int], limit: int, eos: frozenset[int], *, min_ngram: int = 1,
           max_ngram: int = LOOKUP_MAX_NGRAM) -> list[int]:
    """Up to `limit` tokens that followed the most recent earlier occurrence of the longest suffix of
    `tokens` (max_ngram down to min_ngram tokens long); [] when no suffix recurs. A proposal ends after an
    EOS: nothing the sequence would produce after it can count."""
    n_tokens = len(tokens)
    longest = min(max(max_ngram, min_ngram), n_tokens - 1)
    if longest < min_ngram:
        return []
    # Every earlier occurrence of the last token that leaves one after it, found by list.index at C speed: a
    # Python scan over every start took 0.17 ms a row at 850 tokens, each iteration, twice in a priced run.
    ends, last = [], tokens[-1]
    try:
        at = -1
        while True:
            at = tokens.index(last, at + 1, n_tokens - 1)
            ends.append(at)
    except ValueError:
        pass
    for n in range(longest, min_ngram - 1, -1):
        suffix = tokens[n_tokens - n:]
        for end in reversed(ends):  # latest first: recent context is the likeliest to be continued
            if end >= n - 1 and tokens[end - n + 1:end + 1] == suffix:
                follow = tokens[end + 1:end + 1 + limit]
                for i, t in enumerate(follow):
                    if t in eos:
                        return follow[: i + 1]
                return follow
    return []


def one_hot_logits(drafts: list[list[int]], width: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    """Draft logits [B, width, V] of deterministic drafts: 0 at the drafted token, -inf elsewhere (q one-hot);
    positions beyond a row's draft are zeros (padding, never read into a decision)."""
    out = torch.full((len(drafts), width, vocab_size), float("-inf"), device=device)
    for r, d in enumerate(drafts):
        if d:
            out[r, torch.arange(len(d)), torch.tensor(d)] = 0.0
        out[r, len(d):] = 0.0
    return out
