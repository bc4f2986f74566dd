"""Turning user input into prompt token ids, with clear refusals for input that cannot work."""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedTokenizerBase

ASSETS = Path(__file__).resolve().parent.parent / "assets"
SAMPLE_ARTICLE = ASSETS / "sample_article.txt"
INSTRUCTION = "Summarize the following article in three sentences.\n\n"


class InputError(ValueError):
    """User input that cannot be decoded; the message says what to change."""


def sample_article() -> str:
    return SAMPLE_ARTICLE.read_text(encoding="utf-8")


def summarization_prompt(tokenizer: PreTrainedTokenizerBase, article: str, max_prompt_tokens: int) -> list[int]:
    """Token ids of the instruct chat prompt asking for a summary of `article`."""
    article = article.strip()
    if not article:
        raise InputError("the article is empty: paste some text to summarize")
    messages = [{"role": "user", "content": INSTRUCTION + article}]
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:  # a base model without a template: plain instruction
        text = INSTRUCTION + article + "\n\nSummary:"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) > max_prompt_tokens:
        raise InputError(
            f"the article is too long: its prompt is {len(ids):,} tokens and this model pair accepts at most "
            f"{max_prompt_tokens:,} with the requested number of new tokens; shorten it or lower max new tokens"
        )
    return ids


def max_prompt_tokens(context_length: int, max_new_tokens: int, cap: int = 16384) -> int:
    """Room left for the prompt; capped because a longer prefill is impractical for an interactive tool."""
    return max(0, min(context_length, cap) - max_new_tokens)
