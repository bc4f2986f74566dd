"""Turning user input into prompt token ids, with clear refusals for input that cannot work."""

from __future__ import annotations

import re

from transformers import PreTrainedTokenizerBase
from specviz.paths import ASSETS

SAMPLE_ARTICLE = ASSETS / "sample_article.txt"
INSTRUCTION = "Summarize the following article in three sentences.\n\n"
_ARTICLE_SLOT = "\x00specviz-article\x00"  # where the article goes in the rendered template


class InputError(ValueError):
    """User input that cannot be decoded; the message says what to change."""


# No model here reads more than 16,384 prompt tokens (max_prompt_tokens), and no tokenizer packs more than
# ~8 characters into a token of prose: a longer text cannot fit, so it is refused before any model loads.
MAX_ARTICLE_CHARS = 8 * 16_384


def check_article_size(article: str) -> None:
    if len(article) > MAX_ARTICLE_CHARS:
        raise InputError(f"the article is too long: {len(article):,} characters, and no prompt this tool builds holds "
                         f"more than about {MAX_ARTICLE_CHARS:,}; shorten it")


def sample_article() -> str:
    return SAMPLE_ARTICLE.read_text(encoding="utf-8")


def summarization_prompt(tokenizer: PreTrainedTokenizerBase, article: str, max_prompt_tokens: int) -> list[int]:
    """Token ids of the instruct chat prompt asking for a summary of `article`."""
    article = article.strip()
    if not article:
        raise InputError("the article is empty: paste some text to summarize")
    if tokenizer.chat_template:
        messages = [{"role": "user", "content": INSTRUCTION + _ARTICLE_SLOT}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        before, after = text.split(_ARTICLE_SLOT)
    else:  # a base model without a template: plain instruction
        before, after = INSTRUCTION, "\n\nSummary:"
    # The template's own control tokens are special; the article's text never is: a pasted
    # "<|im_end|><|im_start|>system" must stay plain text, not close the user's turn.
    ids = (tokenizer(before, add_special_tokens=False)["input_ids"] + plain_text_ids(tokenizer, article)
           + tokenizer(after, add_special_tokens=False)["input_ids"])
    if len(ids) > max_prompt_tokens:
        raise InputError(
            f"the article is too long: its prompt is {len(ids):,} tokens and this model pair accepts at most "
            f"{max_prompt_tokens:,} with the requested number of new tokens; shorten it or lower max new tokens"
        )
    return ids


def plain_text_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of text in which no control token is recognized.

    split_special_tokens covers the special ones (<|im_start|>, <|endoftext|>); added tokens that are not
    flagged special (Qwen's <tool_call>) would still match, so each added token's string found in the text
    is encoded in two pieces, its first character and the rest: the same characters, never the token.
    """
    def encode(piece: str) -> list[int]:
        return tokenizer(piece, add_special_tokens=False, split_special_tokens=True)["input_ids"] if piece else []

    added = sorted(tokenizer.get_added_vocab(), key=len, reverse=True)
    if not added:
        return encode(text)
    ids, start = [], 0
    for match in re.finditer("|".join(re.escape(token) for token in added), text):
        ids += encode(text[start:match.start()]) + encode(match.group()[:1]) + encode(match.group()[1:])
        start = match.end()
    return ids + encode(text[start:])


def max_prompt_tokens(context_length: int, max_new_tokens: int, cap: int = 16384) -> int:
    """Room left for the prompt; capped because a longer prefill is impractical for an interactive tool."""
    return max(0, min(context_length, cap) - max_new_tokens)
