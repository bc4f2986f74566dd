"""The embedded Qwen2.5-Coder pair (converted on first use): greedy fp32 exactness and a sane summary."""

from __future__ import annotations

import pytest

from specviz.config import SpecConfig
from specviz.engine import run_speculative, run_target_only
from specviz.models import load_pair
from specviz.prompts import sample_article, summarization_prompt

pytestmark = pytest.mark.real

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def pair():
    return load_pair(dtype="fp32", device="cpu")


@pytest.fixture(scope="module")
def prompt(pair):
    first_paragraphs = "\n\n".join(sample_article().split("\n\n")[:2])
    return summarization_prompt(pair.tokenizer, first_paragraphs, 4096)


@pytest.fixture(scope="module")
def reference(pair, prompt):
    return run_target_only(pair, prompt, SpecConfig(max_new_tokens=NEW_TOKENS))


def test_pair_shares_the_vocabulary(pair):
    assert pair.vocab_size == 151_936
    assert pair.tokenizer.eos_token_id == 151645 or 151645 in (pair.target.generation_config.eos_token_id or [])


def test_target_only_summarizes(reference):
    assert "Harbor City" in reference.output_text or "bike" in reference.output_text.lower()


@pytest.mark.parametrize("mode", ["baseline", "exact"])
def test_greedy_fp32_speculative_equals_target_only(pair, prompt, reference, mode):
    trace = run_speculative(pair, prompt, SpecConfig(mode=mode, gamma_policy="hf", max_new_tokens=NEW_TOKENS))
    assert trace.output_ids == reference.output_ids
    s = trace.summary()
    assert s["acceptance_rate"] > 0.3  # a real draft of the same family agrees often
    assert s["target_forward_passes"] < NEW_TOKENS
