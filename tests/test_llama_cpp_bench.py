"""The llama.cpp side-by-side benchmark's own logic (specviz/bench/llama_cpp.py), without llama.cpp: its greedy
speculative loop must emit exactly what greedy decoding of the same target emits, for any γ and draft, and
count what it kept. The engine is replaced by a deterministic language model with the same cache interface
(`LlamaSide`'s rewind/read/score/next_greedy), whose next token depends on the whole context."""

from __future__ import annotations

import numpy as np
import pytest

from specviz.bench.llama_cpp import llama_greedy, llama_speculative

VOCAB = 50
STOP = frozenset({7})


class ContextModel:
    """Logits that are a fixed function of every token before: a cache of fed tokens, rolled back by rewind."""

    def __init__(self, seed: int, agree_with: "ContextModel | None" = None, noise: float = 0.0):
        self.seed, self.agree_with, self.noise = seed, agree_with, noise
        self.tokens: list[int] = []
        self.calls = 0

    def _logits(self, context: list[int]) -> np.ndarray:
        rng = np.random.default_rng([self.seed, *context])
        own = rng.standard_normal(VOCAB)
        if self.agree_with is None:
            return own
        return self.agree_with._logits(context) + self.noise * own  # a draft: the target's, perturbed

    @property
    def fed(self) -> int:
        return len(self.tokens)

    def rewind(self, n: int) -> None:
        assert 0 <= n <= len(self.tokens), "rewinding past what the cache holds"
        del self.tokens[n:]

    def read(self, tokens: list[int]) -> None:
        self.tokens = list(tokens)

    def score(self, tokens: list[int]) -> np.ndarray:
        self.calls += 1
        rows = []
        for t in tokens:
            self.tokens.append(t)
            rows.append(self._logits(self.tokens))
        return np.stack(rows)

    def next_greedy(self) -> int:
        return int(np.argmax(self._logits(self.tokens)))


@pytest.mark.parametrize("gamma", [1, 2, 4, 7])
@pytest.mark.parametrize("noise", [0.0, 0.5, 3.0])
def test_the_speculative_loop_emits_what_greedy_decoding_emits(gamma, noise):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    for seed in range(4):
        target = ContextModel(seed)
        greedy = llama_greedy(target, prompt, 40, STOP)
        draft = ContextModel(100 + seed, agree_with=target, noise=noise)
        target_calls = target.calls
        spec = llama_speculative(target, draft, prompt, 40, gamma, STOP)
        assert spec.tokens == greedy.tokens
        assert spec.accepted <= spec.drafted and spec.iterations == target.calls - target_calls
        if noise == 0.0:  # a draft that is the target: every drafted token kept but those past the stop token
            assert spec.drafted - spec.accepted <= gamma
            assert spec.iterations <= -(-len(greedy.tokens) // (gamma + 1)) + 1
        assert target.fed <= len(prompt) + len(spec.tokens)  # the target's cache holds kept tokens only


def test_the_benchmark_refuses_what_it_cannot_compare_before_loading_a_model(monkeypatch, capsys):
    from specviz.cli import commands as cli

    monkeypatch.setattr("specviz.cli.common.load_text", lambda args: pytest.fail("loaded models before refusing"))
    for argv, says in ((["--gammas", "0"], "γ ≥ 1"), (["--temperature", "0.8"], "greedy"),
                       (["--target", "someone/else"], "embedded pair")):
        assert cli.main(["bench-llama-cpp", *argv]) == 2
        assert says in capsys.readouterr().err


def test_without_llama_cpp_the_benchmark_says_how_to_install_it(monkeypatch):
    import sys
    from pathlib import Path

    from specviz.bench.llama_cpp import load_llama
    from specviz.models.loading import ModelLoadError

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # not importable, whatever this machine has
    with pytest.raises(ModelLoadError, match="pip install llama-cpp-python"):
        load_llama(Path("model.gguf"), 2, 64)
