"""Text on the shared driver: a causal-LM decoder over a slotted KV cache, and articles as sequences."""

from __future__ import annotations

import torch

from specviz.config import SpecConfig
from specviz.decoding.decoder import SlottedDecoder
from specviz.decoding.drafts import SubsetHead, draft_head_size, special_ids, subset_head
from specviz.machine import device_name
from specviz.models.graphed import StaticCache
from specviz.models.kv_cache import BufferedCache
from specviz.models.loading import ModelPair
from specviz.models.prompt_cache import PromptCache
from specviz.text.prompts import InputError, max_prompt_tokens, summarization_prompt
from specviz.decoding.source import SequenceSpec, Vocabulary, unique_names, with_token_texts_kept


class CausalLMDecoder(SlottedDecoder):
    """A decoder-only transformers model (Qwen2, Llama, ...) on a BufferedCache: keys and values written in place
    into preallocated buffers, where DynamicCache would copy the whole cache at every step (issue 29)."""

    def __init__(self, model, vocab: int, batch: int, head: SubsetHead | None = None,
                 prompt_cache: PromptCache | None = None, kv_dtype: torch.dtype = torch.float32):
        self.model, self.vocab, self.head = model, vocab, head
        self.kv_dtype = kv_dtype  # what the native layers keep keys and values as (draft_kv_dtype)
        # the lean forward is attached only to packed models on the batch-invariant attention
        self.reads_in_pieces = getattr(model, "lean_forward", None) is not None
        self._max_batch = batch  # rows a static cache holds: a shared prefill's rows are copied up to this
        super().__init__(batch, model.device, prompt_cache)

    def _new_cache(self) -> BufferedCache:
        graphed = getattr(self.model, "graphed_forward", None)  # set by models.graphed.attach on CUDA
        if graphed is not None:
            return StaticCache(graphed, self._max_batch)
        return BufferedCache(kv_dtype=self.kv_dtype, pooled=True)  # a decoding cache: on 2 MB pages

    def _new_prompt_cache(self) -> BufferedCache:
        # a prompt's entry is stored for reuse: exactly its own slots, not a workspace
        return BufferedCache(kv_dtype=self.kv_dtype)

    def _run(self, input_ids, attention_mask, position_ids, keep, cache, rows) -> torch.Tensor:
        graphed = getattr(self.model, "graphed_forward", None)
        if graphed is not None:
            return graphed.logits(input_ids, attention_mask, position_ids, keep, cache, self.head, self.vocab)
        lean = getattr(self.model, "lean_forward", None)  # set by models.lean.attach where it applies
        if lean is not None:
            if self.head is None:
                return lean.logits(input_ids, attention_mask, position_ids, cache, keep)[..., : self.vocab]
            return self.head(lean.hidden(input_ids, attention_mask, position_ids, cache, keep))
        inputs = dict(input_ids=input_ids, attention_mask=attention_mask.long(), position_ids=position_ids,
                      past_key_values=cache, use_cache=True)
        if self.head is None:
            return self.model(**inputs, logits_to_keep=keep).logits[:, -keep:, : self.vocab]
        # the reduced draft head: the base model's hidden states, then only the head's rows
        return self.head(self.model.base_model(**inputs).last_hidden_state[:, -keep:])


def draft_kv_dtype(model) -> torch.dtype:
    """fp16 keys and values for a draft model on the native layers (half the bytes its attention reads: over an
    836-token document its step 9.91 → 8.95 ms), fp32 otherwise. Exactness does not depend on the draft's
    numbers, only on verification using the q it drew from; the target keeps fp32, the model both runs decode."""
    lean = getattr(model, "lean_forward", None)
    return torch.float16 if lean is not None and lean.native is not None else torch.float32


def text_vocabulary(pair: ModelPair) -> Vocabulary:
    ids = set()
    eos = pair.target.generation_config.eos_token_id if pair.target.generation_config else None
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if pair.tokenizer.eos_token_id is not None:
        ids.add(pair.tokenizer.eos_token_id)
    return Vocabulary(with_token_texts_kept(pair.tokenizer.decode), frozenset(ids), pair.vocab_size)


class TextSource:
    """Prompts for a causal-LM pair: each one decoded num_sequences times (BASS: several samples per prompt)."""

    def __init__(self, pair: ModelPair, sequences: list[SequenceSpec], draft_vocab: int = 0):
        self.pair, self.sequences = pair, sequences
        self.vocab = text_vocabulary(pair)
        self.device = pair.device
        # one reduced head for the run: the first draft_vocab ids, the specials, and every prompt's tokens
        prompt_tokens = {t for s in sequences for t in s.prompt_ids}
        self.draft_head = subset_head(pair.draft, pair.vocab_size, draft_vocab,
                                      special_ids(pair.tokenizer) | self.vocab.eos | prompt_tokens)

    def decoders(self, rows: list[int], with_draft: bool) -> tuple[CausalLMDecoder | None, CausalLMDecoder]:
        pair = self.pair
        draft = (CausalLMDecoder(pair.draft, pair.vocab_size, len(rows), self.draft_head, pair.draft_prompts,
                                 draft_kv_dtype(pair.draft)) if with_draft else None)
        return draft, CausalLMDecoder(pair.target, pair.vocab_size, len(rows), prompt_cache=pair.target_prompts)

    def detokenize(self, ids: list[int]) -> str:
        return self.pair.tokenizer.decode(ids, skip_special_tokens=True)

    def meta(self) -> dict:
        pair = self.pair
        return {"task": "summarize", "draft": pair.draft_name, "target": pair.target_name,
                "device": device_name(pair.device), "dtype": str(pair.dtype).removeprefix("torch."),
                "vocab_size": pair.vocab_size, "draft_vocab_size": draft_head_size(self.draft_head, pair.vocab_size),
                "draft_weights": pair.draft_weights, "target_weights": pair.target_weights}


def prompt_sequences(prompts: list[tuple[str, list[int]]], num_sequences: int, cfg: SpecConfig) -> list[SequenceSpec]:
    """(label, prompt ids) per input -> num_sequences sequences each. Greedy decoding gives the same output
    every time, so asking it for several samples of one input is refused."""
    if num_sequences < 1:
        raise InputError(f"the number of sequences per input must be >= 1, got {num_sequences}")
    if num_sequences > 1 and cfg.sampling.greedy:
        raise InputError(f"{num_sequences} sequences per input with greedy decoding would be {num_sequences} copies "
                         "of one output; set a temperature above 0 to draw different samples")
    out = []
    labels = unique_names([label for label, _ in prompts])
    for i, (label, (_, ids)) in enumerate(zip(labels, prompts)):
        for k in range(num_sequences):
            name = label if num_sequences == 1 else f"{label} · sample {k + 1}"
            out.append(SequenceSpec(list(ids), name, name, {"input": i, "sample": k}))
    return out


def article_source(pair: ModelPair, articles: list[tuple[str, str]], cfg: SpecConfig,
                   num_sequences: int = 1) -> TextSource:
    """A source that summarizes each (label, article), num_sequences samples each."""
    context = getattr(pair.target.config, "max_position_embeddings", 32768)
    limit = max_prompt_tokens(context, cfg.max_new_tokens)
    prompts = []
    for label, article in articles:
        try:
            prompts.append((label, summarization_prompt(pair.tokenizer, article, limit)))
        except InputError as e:
            raise InputError(f"{label}: {e}" if len(articles) > 1 else str(e)) from None
    return TextSource(pair, prompt_sequences(prompts, num_sequences, cfg), cfg.draft_vocab)
