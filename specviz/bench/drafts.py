"""What each cheaper draft would accept, measured along the target's own output (teacher forcing).

One target-only greedy run gives the output; one forward of each model over prompt + output gives, at every
output position, the target's and the draft's next-token logits in the true context. From those:

- per draft-vocabulary size K (the first K ids in merge order ∪ specials, with or without the prompt's
  tokens): how often the draft's argmax over its subset is the target's token (greedy acceptance of one
  draft), and α = Σ_x min(p(x), q_K(x)) at temperature 1 (Leviathan et al.'s acceptance rate);
- for prompt lookup with suffixes of n tokens: how often it proposes something, and how many of its
  proposed tokens the target's greedy output continues with (γ = 8);
- the model draft's greedy run length for comparison: consecutive positions where its argmax is the target's.

And, timed separately, the draft's step time per K (one token fed at the end of the prompt, median of
repeats). Nothing here decides anything in a run; it chooses defaults (docs/benchmarks.md).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

from specviz.decoding.drafts import lookup, special_ids, subset_head, subset_ids

GAMMA = 8


def _agreement(draft_logits: torch.Tensor, target_logits: torch.Tensor, ids: torch.Tensor) -> tuple[float, float]:
    """draft_logits, target_logits [n, V]; ids LongTensor[K]: (greedy agreement, α at temperature 1)."""
    restricted = torch.full_like(draft_logits, float("-inf"))
    restricted[:, ids] = draft_logits[:, ids]
    agree = (restricted.argmax(-1) == target_logits.argmax(-1)).float().mean().item()
    p, q = target_logits.double().softmax(-1), restricted.double().softmax(-1)
    return agree, torch.minimum(p, q).sum(-1).mean().item()


def _lookup_stats(prompt: list[int], output: list[int], n: int, eos: frozenset[int]) -> dict[str, float]:
    hits, kept = 0, 0
    for i in range(len(output)):
        proposal = lookup(prompt + output[:i], GAMMA, eos, min_ngram=n)
        if proposal:
            hits += 1
            for a, b in zip(proposal, output[i:]):
                if a != b:
                    break
                kept += 1
    return {"ngram": n, "hit_rate": hits / len(output), "kept_per_hit": kept / hits if hits else 0.0}


def _run_lengths(agree: list[bool]) -> float:
    """Mean, over positions, of how many drafts in a row from there the target would keep (capped at γ)."""
    out = []
    for i in range(len(agree)):
        k = 0
        while k < GAMMA and i + k < len(agree) and agree[i + k]:
            k += 1
        out.append(k)
    return sum(out) / len(out)


def acceptance_table(draft_logits: torch.Tensor, target_logits: torch.Tensor, prompt: list[int], output: list[int],
                     vocab_size: int, specials: set[int], eos: frozenset[int], ks: list[int]) -> dict[str, Any]:
    """draft_logits, target_logits [n, V] at the n output positions (teacher-forced)."""
    rows = []
    for k in ks:
        for with_prompt in (True, False):
            ids = subset_ids(vocab_size, k, specials | (set(prompt) if with_prompt else set()))
            agree, alpha = _agreement(draft_logits, target_logits, ids)
            rows.append({"k": k, "prompt_tokens": with_prompt, "size": len(ids), "greedy_agreement": agree,
                         "alpha_t1": alpha})
            if k == 0:
                break
    full_agree = (draft_logits.argmax(-1) == target_logits.argmax(-1)).tolist()
    return {"positions": len(output), "vocab": rows, "model_run_length": _run_lengths(full_agree),
            "lookup": [_lookup_stats(prompt, output, n, eos) for n in (1, 2, 3)]}


def time_steps(step: Callable[[], None], repeat: int) -> float:
    """Median seconds of `step` after one warm-up call."""
    step()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.inference_mode()
def text_draft_figures(pair, prompt: list[int], output: list[int], ks: list[int], repeat: int) -> dict[str, Any]:
    """The acceptance table and the draft's step time per K for a causal-LM pair."""
    from specviz.text.source import CausalLMDecoder, draft_kv_dtype, text_vocabulary

    full = torch.tensor([prompt + output], device=pair.device)
    span = slice(len(prompt) - 1, len(prompt) - 1 + len(output))
    target_logits = pair.target(full).logits[0, span, : pair.vocab_size].float()
    draft_logits = pair.draft(full).logits[0, span, : pair.vocab_size].float()
    vocab = text_vocabulary(pair)
    specials = special_ids(pair.tokenizer) | vocab.eos
    table = acceptance_table(draft_logits, target_logits, prompt, output, pair.vocab_size, specials, vocab.eos, ks)
    steps = []
    for k in ks:
        head = subset_head(pair.draft, pair.vocab_size, k, specials | set(prompt))
        decoder = CausalLMDecoder(pair.draft, pair.vocab_size, 1, head, kv_dtype=draft_kv_dtype(pair.draft))
        decoder.prefill([prompt[:-1]])

        def step() -> None:
            decoder.forward([[prompt[-1]]], 1)
            decoder.rollback([len(prompt) - 1])

        steps.append({"k": k, "size": pair.vocab_size if head is None else head.size,
                      "draft_step_ms": 1000 * time_steps(step, repeat)})
    return {**table, "draft_steps": steps}


@torch.inference_mode()
def speech_draft_figures(source, output: list[int], ks: list[int], repeat: int) -> dict[str, Any]:
    """The same for a Whisper source of one window: teacher-forced decoders over prompt + transcript."""
    from specviz.speech.asr import WhisperDecoder

    pair, prompt = source.pair, source.sequences[0].prompt_ids
    _, target = source.decoders([0], with_draft=False)
    full = prompt + output
    positions = torch.arange(len(full))[None]

    def logits_of(model) -> torch.Tensor:
        decoder = WhisperDecoder(model, target.encoder_out, len(prompt), source.suppress, source.begin)
        return decoder._run(torch.tensor([full]), torch.ones(1, len(full), dtype=torch.bool), positions,
                            len(output), decoder.cache, [0])[0]

    target_logits, draft_logits = logits_of(pair.target), logits_of(pair.draft)
    tok = pair.processor.tokenizer
    specials = special_ids(tok) | set(prompt)
    table = acceptance_table(draft_logits, target_logits, prompt, output, pair.vocab_size, specials,
                             source.vocab.eos, ks)
    steps = []
    at = min(40, len(full) - 1)  # time a step in the middle of a typical window's transcript
    for k in ks:
        head = subset_head(pair.draft, pair.vocab_size, k, specials)
        decoder = WhisperDecoder(pair.draft, target.encoder_out, len(prompt), source.suppress, source.begin, head)
        decoder.prefill([full[:at]])

        def step() -> None:
            decoder.forward([[full[at]]], 1)
            decoder.rollback([at])

        steps.append({"k": k, "size": pair.vocab_size if head is None else head.size,
                      "draft_step_ms": 1000 * time_steps(step, repeat)})
    t_decoder = WhisperDecoder(pair.target, target.encoder_out, len(prompt), source.suppress, source.begin)
    t_decoder.prefill([full[:at]])

    def target_step() -> None:
        t_decoder.forward([[full[at]]], 1)
        t_decoder.rollback([at])

    return {**table, "draft_steps": steps, "target_step_ms": 1000 * time_steps(target_step, repeat)}
