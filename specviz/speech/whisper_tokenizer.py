"""Whisper's tokenizer and processor from faster-whisper files, restoring the BPE merges tokenizer.json lacks."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

from tokenizers import AddedToken, Tokenizer
from transformers import WhisperFeatureExtractor, WhisperProcessor, WhisperTokenizerFast

from specviz.speech.ct2_format import CT2FormatError


def _repair_merges(tokenizer_json: dict) -> list[str]:
    """Restore BPE merges missing from a byte-level tokenizer.json whose merges follow the vocabulary order
    (merge k makes token 256 + k, as in Whisper's and GPT-2's BPE). Returns the restored tokens.

    The shipped Whisper tokenizer.json lacks the first merge ("Ġ t" -> "Ġt", id 256), so " this" would encode
    as "Ġ" + "this" instead of the single token 341 that Whisper was trained on."""
    model = tokenizer_json.get("model", {})
    if model.get("type") != "BPE":
        return []
    vocab: dict[str, int] = model["vocab"]
    merges = model["merges"]
    as_pairs = bool(merges) and not isinstance(merges[0], str)
    pairs = [tuple(m) if as_pairs else tuple(m.split(" ", 1)) for m in merges]
    produced = [vocab.get(a + b) for a, b in pairs]
    inverse = {i: t for t, i in vocab.items()}
    if not pairs or any(p is None or q is None or p >= q for p, q in zip(produced, produced[1:])):
        return []  # merges not in id order: nothing to infer from
    have = set(produced)
    restored: list[str] = []
    for token_id in range(256, max(produced)):
        if token_id in have or token_id not in inverse:
            continue
        token = inverse[token_id]
        splits = [(token[:k], token[k:]) for k in range(1, len(token))
                  if vocab.get(token[:k], token_id) < token_id and vocab.get(token[k:], token_id) < token_id]
        if len(splits) != 1:
            continue  # ambiguous or not a merge product (e.g. an empty or special entry)
        position = sum(1 for p in produced if p < token_id)
        pairs.insert(position, splits[0])
        produced.insert(position, token_id)
        restored.append(token)
    if restored:
        model["merges"] = [list(p) for p in pairs] if as_pairs else [" ".join(p) for p in pairs]
    return restored


def whisper_tokenizer(
    tokenizer_json: str | os.PathLike, vocabulary: Sequence[str] | None = None, vocab_size: int | None = None
) -> WhisperTokenizerFast:
    """A WhisperTokenizerFast from a faster-whisper tokenizer.json, with Whisper's special tokens declared and the
    timestamp tokens <|0.00|>..<|30.00|> added (the file stops at <|notimestamps|>), so len(tokenizer) equals
    the model's vocabulary."""
    data = json.loads(Path(tokenizer_json).read_text(encoding="utf-8"))
    _repair_merges(data)
    specials = [t["content"] for t in data.get("added_tokens", []) if t.get("special")]
    tokenizer = WhisperTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(data)),
        unk_token="<|endoftext|>", bos_token="<|endoftext|>", eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=[s for s in specials if s != "<|endoftext|>"],
        model_max_length=1024,
    )
    first = len(tokenizer)
    size = vocab_size if vocab_size is not None else (len(vocabulary) if vocabulary is not None else first)
    if vocabulary is not None:
        extra = list(vocabulary[first:size])
    else:
        extra = [f"<|{0.02 * i:.2f}|>" for i in range(size - first)]
    if extra:
        # Not special: WhisperTokenizer finds timestamps as ids above the last special id, and decode() drops them.
        tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in extra])
    if vocabulary is not None:
        vocab = tokenizer.get_vocab()
        wrong = [t for i, t in enumerate(vocabulary[:size]) if vocab.get(t) != i and t]
        if wrong:
            raise CT2FormatError(f"tokenizer.json and the vocabulary disagree on {len(wrong)} tokens, e.g. {wrong[:3]}")
    return tokenizer


def whisper_processor(tokenizer: WhisperTokenizerFast, num_mel_bins: int = 80) -> WhisperProcessor:
    """Whisper's processor: 16 kHz log-mel features (30 s windows) and the tokenizer."""
    features = WhisperFeatureExtractor(feature_size=num_mel_bins, sampling_rate=16_000, hop_length=160,
                                       chunk_length=30, n_fft=400)
    return WhisperProcessor(feature_extractor=features, tokenizer=tokenizer)


def read_vocabulary(directory: Path) -> list[str] | None:
    """The vocabulary of a faster-whisper directory (vocabulary.json or vocabulary.txt), None without one."""
    if (directory / "vocabulary.json").exists():
        return list(json.loads((directory / "vocabulary.json").read_text(encoding="utf-8")))
    if (directory / "vocabulary.txt").exists():
        text = (directory / "vocabulary.txt").read_text(encoding="utf-8")
        # split on "\n" only: str.splitlines() would also break tokens holding \x85, \u2028 and the like
        lines = text.split("\n")
        return lines[:-1] if lines and lines[-1] == "" else lines
    return None
