"""What the driver decodes: the sequences, their vocabulary, and the `Source` that opens models on them."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from specviz.decoding.decoder import SlottedDecoder


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


def with_token_texts_kept(decode: Callable[[list[int]], str]) -> Callable[[list[int]], str]:
    """`decode`, remembering each single token's text: every iteration names each decided token (a record's
    draft_text, next_text), ~14 µs a tokenizer call, ~0.5 ms an iteration of a batch of 4 on the run's clock.
    lru_cache is safe to share between threads (the page decodes in a worker thread)."""
    one = functools.lru_cache(maxsize=1 << 16)(lambda token: decode([token]))
    return lambda ids: one(ids[0]) if len(ids) == 1 else decode(ids)


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
