"""llama.cpp beside specviz on the same GGUF files (docs/benchmarks.md, "llama.cpp side by side").

A benchmark-only peer: `llama-cpp-python` is imported here alone, never by the product, and is not in the
README's requirements (`pip install llama-cpp-python` builds llama.cpp for this CPU). Every figure is taken
side by side in one process, the two engines' calls alternating, so the host's drift falls on both:

- a call's cost: the prompt read (prefill), then M tokens scored after it with the logits of all M (what a
  verification needs), rolled back after each call; target and draft;
- greedy decoding of `max_new_tokens`: each engine's target alone, and speculation on its own steps. specviz's
  with its defaults (runs.decode.run); llama.cpp's by the greedy loop below (draft γ tokens, score γ + 1 with
  the target, keep the agreeing prefix and the target's next token), since its Python package ships only prompt
  lookup. A prompt read before is reused by both engines (specviz's prompt cache; here the KV cache kept up
  to it), so that the decoding runs compare decoding; the prompt read itself is the calls' prefill row.

llama.cpp is not batch invariant (its matmuls pick kernels by batch size), so its speculative output may part
from its own target-only output where two logits nearly tie; `equal` says whether it did. The drafts differ in
weights: specviz's is its 4-bit re-quantization (models/quant.py), llama.cpp's the GGUF's own Q5_0/Q8_0 blocks.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from specviz.cache import cache_dir
from specviz.config import SpecConfig
from specviz.models.loading import EMBEDDED, ModelLoadError, ModelPair, assemble_gguf
from specviz.runs.decode import run
from specviz.text.source import CausalLMDecoder, TextSource, prompt_sequences, text_vocabulary

INSTALL = "pip install llama-cpp-python (a benchmark-only peer, not a specviz requirement)"


def embedded_gguf(name: str, directory: Path | None = None) -> Path:
    """The embedded model's GGUF file, assembled once from its part packages into `directory` (default: the
    specviz cache's gguf/), reused while its size matches."""
    spec = EMBEDDED[name]
    directory = directory or cache_dir() / "gguf"
    path = directory / spec.gguf_file
    if path.exists() and path.stat().st_size == spec.size:
        return path
    directory.mkdir(parents=True, exist_ok=True)
    return assemble_gguf(spec, directory)


def load_llama(path: Path, threads: int, context: int):
    """A llama.cpp model on `threads` threads, keeping the logits of every scored token (verification's need)."""
    try:
        from llama_cpp import Llama
    except ImportError:
        raise ModelLoadError(f"llama.cpp's Python package is not installed: {INSTALL}") from None
    return Llama(model_path=str(path), n_ctx=context, n_batch=512, n_threads=threads, n_threads_batch=threads,
                 logits_all=True, verbose=False)


class LlamaSide:
    """One llama.cpp model as the benchmark drives it: `n_tokens` is how much of its KV cache is kept (setting it
    rolls back, Llama.eval drops the slots past it), `scores` rows hold the logits by position."""

    def __init__(self, llm):
        self.llm = llm
        # the prompt whose keys and values the cache starts with, and its last token's logits: a later read of the
        # same prompt rewinds to it, as specviz's prompt cache (models/prompt_cache.py) reuses a prompt read
        self._prompt: tuple[int, ...] = ()
        self._prompt_logits: np.ndarray | None = None
        self._last: np.ndarray | None = None

    @property
    def fed(self) -> int:
        return self.llm.n_tokens

    def rewind(self, n: int) -> None:
        self.llm.n_tokens = n

    def read(self, tokens: list[int], reuse: bool = True) -> None:
        """A prompt read into an empty cache: only its last token's logits are computed (as specviz's prefill
        keeps one). With `reuse`, the prompt read last is not read again (its cache entries stay below the rest)."""
        if reuse and tuple(tokens) == self._prompt and self._prompt_logits is not None:
            self.rewind(len(tokens))
            self._last = self._prompt_logits.copy()
            return
        self.rewind(0)
        self.llm._logits_all = False  # Llama's own switch, read by eval for this batch only
        try:
            self.llm.eval(tokens)
        finally:
            self.llm._logits_all = True
        self._last = np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.llm.n_vocab(),)).copy()
        self._prompt, self._prompt_logits = tuple(tokens), self._last.copy()

    def score(self, tokens: list[int]) -> np.ndarray:
        """Feed tokens after the kept cache -> logits [len(tokens), V] (a view of the model's buffer)."""
        start = self.llm.n_tokens
        self._last = None  # next_greedy reads the scored rows from now on
        self.llm.eval(tokens)
        return self.llm.scores[start: start + len(tokens)]

    def next_greedy(self) -> int:
        """The argmax after the last fed token (after `read` or `score`)."""
        if self._last is not None:
            token, self._last = int(np.argmax(self._last)), None
            return token
        return int(np.argmax(self.llm.scores[self.llm.n_tokens - 1]))


@torch.inference_mode()
def step_costs(model, vocab: int, llama: LlamaSide, prompt: list[int], tokens: list[int], repeat: int,
               warmup: int = 2) -> dict:
    """One model's calls in both engines, alternating: prefill of `prompt` (median of 2 after one warm-up each)
    and M tokens scored after it, for M in `tokens` -> {"prefill_s": {engine: s}, "steps": [{"tokens": M,
    "specviz_s", "llama_cpp_s"}]}."""
    def specviz_prefill() -> CausalLMDecoder:
        decoder = CausalLMDecoder(model, vocab, 1)
        decoder.prefill([prompt])
        return decoder

    def llama_prefill() -> None:
        llama.read(prompt, reuse=False)

    prefill = {"specviz": [], "llama_cpp": []}
    for i in range(3):  # the first of each is a warm-up
        t0 = time.perf_counter()
        decoder = specviz_prefill()
        t1 = time.perf_counter()
        llama_prefill()
        t2 = time.perf_counter()
        if i:
            prefill["specviz"].append(t1 - t0)
            prefill["llama_cpp"].append(t2 - t1)
    fed = decoder.fed(0)
    feed = prompt[-1:] + prompt[:max(tokens)]  # real tokens, as in bench.steps
    rows = []
    for m in tokens:
        def ours(m=m) -> None:
            decoder.forward([feed[:m]], m)
            decoder.rollback([fed])

        def theirs(m=m) -> None:
            llama.score(feed[:m])
            llama.rewind(len(prompt))

        for _ in range(warmup):
            ours()
            theirs()
        a, b = [], []
        for _ in range(repeat):  # alternating, so that a drift of the host's speed falls on both
            a.append(_timed(ours))
            b.append(_timed(theirs))
        rows.append({"tokens": m, "specviz_s": statistics.median(a), "llama_cpp_s": statistics.median(b)})
    for row in rows:
        row["specviz_ratio"] = row["specviz_s"] / rows[0]["specviz_s"]
        row["llama_cpp_ratio"] = row["llama_cpp_s"] / rows[0]["llama_cpp_s"]
    return {"prompt_tokens": len(prompt), "prefill_s": {k: statistics.median(v) for k, v in prefill.items()},
            "steps": rows}


def _timed(call: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    call()
    return time.perf_counter() - t0


@dataclass
class Decoded:
    """One greedy run: its new tokens, the prompt read's seconds and the decoding's (prefill left out)."""

    tokens: list[int]
    prefill_s: float
    decode_s: float
    iterations: int = 0
    accepted: int = 0  # drafted tokens kept (speculation only)
    drafted: int = 0

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / (self.prefill_s + self.decode_s)

    @property
    def decode_tokens_per_s(self) -> float:
        return len(self.tokens) / self.decode_s


def llama_greedy(target: LlamaSide, prompt: list[int], new_tokens: int, stop: frozenset[int]) -> Decoded:
    """llama.cpp's target alone, one token per step."""
    t0 = time.perf_counter()
    target.read(prompt)
    t1 = time.perf_counter()
    out = [target.next_greedy()]
    while len(out) < new_tokens and out[-1] not in stop:
        target.score(out[-1:])
        out.append(target.next_greedy())
    return Decoded(out, t1 - t0, time.perf_counter() - t1)


def llama_speculative(target: LlamaSide, draft: LlamaSide, prompt: list[int], new_tokens: int, gamma: int,
                      stop: frozenset[int]) -> Decoded:
    """Greedy speculation on llama.cpp's own steps, a constant γ: the draft proposes γ tokens one step each,
    the target scores the last kept token and the γ proposals in one call, the agreeing prefix is kept and the
    target's own next token after it. The draft catches up on the kept tokens it has not fed."""
    t0 = time.perf_counter()
    target.read(prompt)
    draft.read(prompt)
    draft.next_greedy()  # the draft's read is for its cache; the first token is the target's
    t1 = time.perf_counter()
    out = [target.next_greedy()]
    drafted_fed = len(prompt)  # tokens of prompt + out the draft's cache holds
    iterations = accepted = drafted = 0
    while len(out) < new_tokens and out[-1] not in stop:
        sequence = prompt + out
        draft.rewind(drafted_fed)
        draft.score(sequence[drafted_fed:])
        proposal = [draft.next_greedy()]
        for _ in range(min(gamma, new_tokens - len(out)) - 1):
            draft.score(proposal[-1:])
            proposal.append(draft.next_greedy())
        drafted_fed = len(sequence) + len(proposal) - 1
        logits = target.score([out[-1]] + proposal)  # [γ + 1, V]
        choices = logits.argmax(-1).tolist()
        kept = next((i for i, (p, c) in enumerate(zip(proposal, choices)) if p != c), len(proposal))
        emitted = proposal[:kept] + [choices[kept]]
        end = next((i + 1 for i, token in enumerate(emitted) if token in stop), len(emitted))
        emitted = emitted[:min(end, new_tokens - len(out))]  # nothing past a stop token or the budget
        kept = min(kept, len(emitted))
        out += emitted
        target.rewind(len(sequence) + kept)  # the scored last token and the kept proposals stay
        drafted_fed = min(drafted_fed, len(sequence) + kept)
        iterations, accepted, drafted = iterations + 1, accepted + kept, drafted + len(proposal)
    return Decoded(out, t1 - t0, time.perf_counter() - t1, iterations, accepted, drafted)


def specviz_greedy(pair: ModelPair, label: str, prompt: list[int], cfg: SpecConfig, target_only: bool) -> Decoded:
    """specviz's run on the same prompt (the defaults but greedy and the token budget)."""
    source = TextSource(pair, prompt_sequences([(label, prompt)], 1, cfg), cfg.draft_vocab)
    trace = run(source, cfg, target_only=target_only)
    sequence = trace.sequences[0]
    drafted = [d for d in sequence.decisions if d.gamma]
    return Decoded(list(sequence.output_ids), trace.prefill_s, trace.total_s - trace.prefill_s,
                   len(sequence.decisions), sum(d.n_accepted for d in drafted), sum(d.gamma for d in drafted))


def decode_rounds(pair: ModelPair, target: LlamaSide, draft: LlamaSide, label: str, prompt: list[int],
                  cfg: SpecConfig, gammas: list[int], rounds: int) -> dict:
    """`rounds` interleaved rounds of every run on one prompt -> {run name: [Decoded per round]}."""
    stop = text_vocabulary(pair).eos
    jobs: dict[str, Callable[[], Decoded]] = {
        "specviz target-only": lambda: specviz_greedy(pair, label, prompt, cfg, True),
        "specviz speculative": lambda: specviz_greedy(pair, label, prompt, cfg, False),
        "llama.cpp target-only": lambda: llama_greedy(target, prompt, cfg.max_new_tokens, stop),
    }
    for g in gammas:
        jobs[f"llama.cpp speculative γ={g}"] = lambda g=g: llama_speculative(target, draft, prompt,
                                                                              cfg.max_new_tokens, g, stop)
    specviz_greedy(pair, label, prompt, replace(cfg, max_new_tokens=4), False)  # one-off setup, untimed
    target.read(prompt)  # and llama.cpp's prompt read, so that neither engine's first round reads its prompt
    draft.read(prompt)
    out: dict[str, list[Decoded]] = {name: [] for name in jobs}
    for _ in range(rounds):
        for name, job in jobs.items():
            out[name].append(job())
    return out

