"""The decoding loop: speculative decoding with KV caches, and the target-only reference.

State is explicit (`DecodeState`): the tokens so far and each model's KV cache. Invariant between
iterations: each cache holds a prefix of `tokens`; the tokens after it are fed on the next forward.
`speculate` is a generator that yields one IterationRecord per iteration, so the page can draw and the
CLI can advance a progress bar as decoding goes; `run_speculative` collects them into a Trace.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

import torch
from transformers import DynamicCache

from .config import SpecConfig
from .machine import device_name
from .gamma import Feedback, make_policy
from .models import ModelPair
from .sampling import check_logits, draw
from .trace import ACCEPTED, BONUS, DISCARDED, REJECTED, RESAMPLED, IterationRecord, Trace
from .verify import verify


class Stopwatch:
    """Wall-clock seconds; synchronizes CUDA first so that queued kernels are counted where they run."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


class Decoder(Protocol):
    """One model's side of the loop: feeds tokens after what its KV cache holds, and rolls the cache back."""

    def length(self) -> int: ...

    def forward(self, ids: list[int], keep: int) -> torch.Tensor: ...  # logits [keep, V]

    def crop(self, length: int) -> None: ...


class CausalLMDecoder:
    """A decoder-only transformers model with a DynamicCache."""

    def __init__(self, model, vocab: int):
        self.model, self.vocab, self.cache = model, vocab, DynamicCache()

    def length(self) -> int:
        return self.cache.get_seq_length()

    def forward(self, ids: list[int], keep: int) -> torch.Tensor:
        input_ids = torch.tensor([ids], device=self.model.device)
        out = self.model(input_ids=input_ids, past_key_values=self.cache, use_cache=True, logits_to_keep=keep)
        return out.logits[0, -keep:, : self.vocab]

    def crop(self, length: int) -> None:
        extra = self.length() - length
        if extra > 0:
            self.cache.crop(-extra)  # transformers 5 takes the number of tokens to drop, as a negative int


@dataclass
class DecodeState:
    tokens: list[int]  # prompt followed by everything generated so far
    prompt_len: int
    draft: Decoder
    target: Decoder

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    def pending(self, decoder: Decoder) -> list[int]:
        """The tokens this decoder has not seen yet."""
        return self.tokens[decoder.length():]


@torch.inference_mode()
def prefill(pair: ModelPair, prompt_ids: list[int], *, with_draft: bool = True) -> tuple[DecodeState, float]:
    """Fill both caches with all prompt tokens but the last (which the first step feeds). Returns seconds."""
    if len(prompt_ids) < 1:
        raise ValueError("the prompt is empty")
    clock = Stopwatch(pair.device)
    state = DecodeState(list(prompt_ids), len(prompt_ids), CausalLMDecoder(pair.draft, pair.vocab_size),
                        CausalLMDecoder(pair.target, pair.vocab_size))
    t0 = clock.now()
    if len(prompt_ids) > 1:
        state.target.forward(prompt_ids[:-1], 1)
        if with_draft:
            state.draft.forward(prompt_ids[:-1], 1)
    return state, clock.now() - t0


@dataclass(frozen=True)
class Vocabulary:
    """What the loop needs to know about tokens: how to show them and which end the output."""

    decode: Callable[[list[int]], str]
    eos: frozenset[int]


def text_vocabulary(pair: ModelPair) -> Vocabulary:
    ids = set()
    eos = pair.target.generation_config.eos_token_id if pair.target.generation_config else None
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if pair.tokenizer.eos_token_id is not None:
        ids.add(pair.tokenizer.eos_token_id)
    return Vocabulary(lambda t: pair.tokenizer.decode(t), frozenset(ids))


def _limit(tokens: list[int], budget: int, eos: frozenset[int]) -> tuple[list[int], bool]:
    """Cut tokens at the first EOS (kept) and at the budget; report whether an EOS ended them."""
    for i, t in enumerate(tokens[:budget]):
        if t in eos:
            return tokens[: i + 1], True
    return tokens[:budget], False


@torch.inference_mode()
def speculate(
    state: DecodeState, cfg: SpecConfig, vocab: Vocabulary, device: torch.device
) -> Iterator[IterationRecord]:
    """Run speculative iterations until EOS or cfg.max_new_tokens, yielding each as it completes."""
    clock = Stopwatch(device)
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    policy = make_policy(cfg.gamma_policy, cfg.gamma_init)
    index = 0
    while len(state.generated) < cfg.max_new_tokens:
        budget = cfg.max_new_tokens - len(state.generated)
        gamma = max(1, min(policy.current(), budget))

        t0 = clock.now()
        draft_ids: list[int] = []
        draft_logits = []
        feed = state.pending(state.draft)
        for _ in range(gamma):
            z = state.draft.forward(feed, 1)[0]
            check_logits(z, "draft")
            x = int(draw(z, cfg.sampling, generator))
            draft_ids.append(x)
            draft_logits.append(z)
            feed = [x]
            if cfg.draft_confidence and float(z.float().softmax(-1)[x]) < cfg.draft_confidence:
                break  # the draft doubts this token: later ones would likely be rejected anyway
        gamma = len(draft_ids)
        t1 = clock.now()
        target_logits = state.target.forward(state.pending(state.target) + draft_ids, gamma + 1)
        t2 = clock.now()
        result = verify(
            cfg.mode, torch.tensor([draft_ids], device=device), torch.stack(draft_logits)[None], target_logits[None],
            cfg.sampling, generator, lenience=cfg.lenience, sigmoid_alpha=cfg.sigmoid_alpha, sigmoid_beta=cfg.sigmoid_beta,
            backend=cfg.verify_backend,
        )
        n, next_id = int(result.n_accepted[0]), int(result.next_token[0])
        t3 = clock.now()

        kept = len(state.tokens) + n  # both caches may keep the context plus the accepted drafts
        state.target.crop(kept)
        state.draft.crop(kept)
        emitted, hit_eos = _limit(draft_ids[:n] + [next_id], budget, vocab.eos)
        state.tokens.extend(emitted)

        accept_prob = result.accept_prob[0].tolist()
        policy.update(Feedback(gamma, [n], accept_prob[: n + 1], t1 - t0, t2 - t1))
        yield IterationRecord(
            index=index,
            gamma=gamma,
            draft_ids=draft_ids,
            draft_text=[vocab.decode([i]) for i in draft_ids],
            q=result.q_draft[0].tolist(),
            p=result.p_draft[0].tolist(),
            accept_prob=accept_prob,
            uniform=result.uniforms[0].tolist(),
            outcome=[ACCEPTED] * n + ([REJECTED] if n < gamma else []) + [DISCARDED] * max(0, gamma - n - 1),
            n_accepted=n,
            next_id=next_id,
            next_text=vocab.decode([next_id]),
            next_kind=BONUS if n == gamma else RESAMPLED,
            emitted=len(emitted),
            draft_s=t1 - t0,
            target_s=t2 - t1,
            verify_s=t3 - t2,
        )
        index += 1
        if hit_eos:
            break


@torch.inference_mode()
def autoregressive(state: DecodeState, cfg: SpecConfig, vocab: Vocabulary, device: torch.device) -> Iterator[int]:
    """Target-only reference on the same stack and sampling: yields each new token."""
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    while len(state.generated) < cfg.max_new_tokens:
        z = state.target.forward(state.pending(state.target), 1)[0]
        check_logits(z, "target")
        x = int(draw(z, cfg.sampling, generator))
        state.tokens.append(x)
        yield x
        if x in vocab.eos:
            break


def _meta(pair: ModelPair, cfg: SpecConfig, mode: str) -> dict:
    return {
        "mode": mode,
        "config": cfg.to_dict(),
        "draft": pair.draft_name,
        "target": pair.target_name,
        "device": device_name(pair.device),
        "dtype": str(pair.dtype).removeprefix("torch."),
        "vocab_size": pair.vocab_size,
    }


def run_speculative(
    pair: ModelPair,
    prompt_ids: list[int],
    cfg: SpecConfig,
    on_iteration: Callable[[IterationRecord, Trace], None] | None = None,
    meta: dict | None = None,
) -> Trace:
    """Speculative decoding from prompt to trace; on_iteration sees each record as it arrives."""
    clock = Stopwatch(pair.device)
    t0 = clock.now()
    state, prefill_s = prefill(pair, prompt_ids)
    trace = Trace(meta={**_meta(pair, cfg, cfg.mode), **(meta or {})}, prompt_ids=list(prompt_ids),
                  output_ids=[], output_text="", prefill_s=prefill_s)
    for record in speculate(state, cfg, text_vocabulary(pair), pair.device):
        trace.iterations.append(record)
        trace.output_ids = list(state.generated)
        trace.total_s = clock.now() - t0
        if on_iteration:
            trace.output_text = pair.tokenizer.decode(trace.output_ids, skip_special_tokens=True)
            on_iteration(record, trace)
    trace.output_ids = list(state.generated)
    trace.output_text = pair.tokenizer.decode(trace.output_ids, skip_special_tokens=True)
    trace.total_s = clock.now() - t0
    return trace


def run_target_only(
    pair: ModelPair,
    prompt_ids: list[int],
    cfg: SpecConfig,
    on_token: Callable[[int], None] | None = None,
    meta: dict | None = None,
) -> Trace:
    """The autoregressive reference, timed the same way; a trace without iterations."""
    clock = Stopwatch(pair.device)
    t0 = clock.now()
    state, prefill_s = prefill(pair, prompt_ids, with_draft=False)
    for x in autoregressive(state, cfg, text_vocabulary(pair), pair.device):
        if on_token:
            on_token(x)
    total = clock.now() - t0
    return Trace(
        meta={**_meta(pair, cfg, "target-only"), **(meta or {})},
        prompt_ids=list(prompt_ids),
        output_ids=list(state.generated),
        output_text=pair.tokenizer.decode(state.generated, skip_special_tokens=True),
        prefill_s=prefill_s,
        total_s=total,
    )
