"""Shared fixtures: tiny random Qwen2 models with the real 151,936-token vocabulary, built from configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from specviz.models.loading import ModelPair

VOCAB = 151_936
EOS = VOCAB - 1


def pytest_configure(config):
    config.addinivalue_line("markers", "real: runs the embedded real model pair (slow: converts it on first use)")
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one")
    config.addinivalue_line("markers", "browser: drives the page in headless Chromium")
    config.addinivalue_line("markers", "load: many sessions at once against the running page (gradio_client)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def word_tokenizer(vocab_size: int = VOCAB, prefix: str = "w") -> PreTrainedTokenizerFast:
    """A word-level tokenizer whose token i is the word f'{prefix}{i}'; the last id is EOS."""
    vocab = {f"{prefix}{i}": i for i in range(vocab_size - 1)}
    vocab["<eos>"] = vocab_size - 1
    tok = Tokenizer(WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<eos>")


def save_tokenizer(tok: PreTrainedTokenizerFast, path) -> None:
    """Save so that AutoTokenizer reloads this word-level tokenizer, not the model type's own class."""
    tok.save_pretrained(path)
    config_path = Path(path) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config))


def tiny_qwen(seed: int, layers: int = 2, vocab_size: int = VOCAB) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=True, eos_token_id=vocab_size - 1, initializer_range=0.2,
    )
    return Qwen2ForCausalLM(config).float().eval()


def perturbed_copy(model, noise: float, seed: int):
    """The same architecture with every weight jittered: a draft that agrees often but not always."""
    draft = type(model)(model.config).float().eval()
    draft.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(noise * p.std() * torch.randn(p.shape, generator=g))
    return draft


def tiny_llama(seed: int) -> LlamaForCausalLM:
    """Like tiny_qwen, but a model type whose saved directories reload our word-level tokenizer as is
    (transformers 5 swaps in Qwen2's own tokenizer class for a qwen2 directory)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True, eos_token_id=EOS,
        initializer_range=0.2,
    )
    return LlamaForCausalLM(config).float().eval()


def save_tiny_pair(root: Path) -> tuple[str, str]:
    """A tiny random Llama draft/target pair saved as local checkpoints under root; (draft dir, target dir).
    Reloading registers <eos> once more, so the tokenizer is 64 short of the heads (as Qwen's heads are wider)."""
    target = tiny_llama(0)
    draft = perturbed_copy(target, noise=0.03, seed=1)
    tok = word_tokenizer(VOCAB - 64)
    for name, model in (("draft", draft), ("target", target)):
        model.save_pretrained(root / name)
        save_tokenizer(tok, root / name)
    return str(root / "draft"), str(root / "target")


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    return word_tokenizer()


@pytest.fixture(scope="session")
def tiny_pair(tokenizer) -> ModelPair:
    target = tiny_qwen(0)
    draft = perturbed_copy(target, noise=0.03, seed=1)
    return ModelPair(draft, target, tokenizer, "tiny-draft", "tiny-target", VOCAB)


@pytest.fixture(scope="session")
def prompt_ids() -> list[int]:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, VOCAB - 1, (12,), generator=g).tolist()


def prompts_source(pair: ModelPair, prompts: list[list[int]], draft_vocab: int = 0):
    """A text source over raw prompt ids, one sequence each."""
    from specviz.decoding.source import SequenceSpec
    from specviz.text.source import TextSource

    return TextSource(pair, [SequenceSpec(list(p), f"p{i}", f"p{i}", {}) for i, p in enumerate(prompts)], draft_vocab)


def decode(pair: ModelPair, prompts: list[list[int]], cfg, **kwargs):
    """Decode raw prompts as one batch (or groups of batch_size) on the shared driver; returns the trace."""
    from specviz.runs.decode import run

    return run(prompts_source(pair, prompts, cfg.draft_vocab), cfg, **kwargs)


@pytest.fixture(scope="session")
def batch_prompts() -> list[list[int]]:
    """Three different prompts of different lengths."""
    g = torch.Generator().manual_seed(17)
    return [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in (12, 5, 21)]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> tuple[str, str]:
    """A tiny random draft/target pair saved as local checkpoints (one per test module), typed into the
    page's model fields by the tests that drive the running app."""
    return save_tiny_pair(tmp_path_factory.mktemp("page-models"))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`python app.py` on a free loopback port for one test module (tests/pageclient.py)."""
    from pageclient import app_server

    with app_server(tmp_path_factory.mktemp("page-app")) as running:
        yield running
