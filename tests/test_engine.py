"""The decoding loop on tiny random models (fp32): greedy equality, caches, stopping, the trace it yields."""

from __future__ import annotations

import pytest
import torch

from specviz.config import GAMMA_POLICIES, SamplingConfig, SpecConfig
from specviz.engine import prefill, run_speculative, run_target_only, speculate, text_vocabulary
from specviz.models import ModelPair
from specviz.trace import ACCEPTED, BONUS, DISCARDED, REJECTED, RESAMPLED

from conftest import EOS, VOCAB, tiny_qwen

MAX_NEW = 40


@pytest.fixture(scope="module")
def reference(tiny_pair, prompt_ids):
    return run_target_only(tiny_pair, prompt_ids, SpecConfig(max_new_tokens=MAX_NEW))


@pytest.mark.parametrize("mode", ["baseline", "exact"])
@pytest.mark.parametrize("policy", GAMMA_POLICIES)
def test_greedy_speculative_equals_target_only(tiny_pair, prompt_ids, reference, mode, policy):
    trace = run_speculative(tiny_pair, prompt_ids, SpecConfig(mode=mode, gamma_policy=policy, max_new_tokens=MAX_NEW))
    assert trace.output_ids == reference.output_ids
    assert len(trace.output_ids) == MAX_NEW
    # the pair must exercise both branches, or equality would prove little
    kinds = {it.next_kind for it in trace.iterations}
    assert kinds == {BONUS, RESAMPLED}, kinds


@pytest.mark.parametrize("gamma", [1, 2, 4, 7, 12])
def test_greedy_equality_at_several_gammas(tiny_pair, prompt_ids, reference, gamma):
    for mode in ("baseline", "exact"):
        cfg = SpecConfig(mode=mode, gamma_policy="constant", gamma_init=gamma, max_new_tokens=MAX_NEW)
        trace = run_speculative(tiny_pair, prompt_ids, cfg)
        assert trace.output_ids == reference.output_ids, (mode, gamma)
        assert all(it.gamma == min(gamma, MAX_NEW - sum(p.emitted for p in trace.iterations[: it.index]))
                   for it in trace.iterations)


def test_caches_hold_exactly_the_context(tiny_pair, prompt_ids):
    """After every iteration both caches cover a prefix of the tokens, and the target's all but the last."""
    state, _ = prefill(tiny_pair, prompt_ids)
    cfg = SpecConfig(mode="exact", gamma_policy="constant", gamma_init=4, max_new_tokens=30)
    for record in speculate(state, cfg, text_vocabulary(tiny_pair), tiny_pair.device):
        t_len = state.target.length()
        d_len = state.draft.length()
        assert t_len == len(state.tokens) - 1
        assert len(state.tokens) - 2 <= d_len <= len(state.tokens) - 1  # -2 after a bonus: x_γ was never fed
        assert d_len == len(state.tokens) - (2 if record.next_kind == BONUS else 1)


def test_trace_records_are_consistent(tiny_pair, prompt_ids):
    cfg = SpecConfig(mode="exact", sampling=SamplingConfig(temperature=1.0), max_new_tokens=MAX_NEW, seed=3)
    trace = run_speculative(tiny_pair, prompt_ids, cfg)
    emitted = []
    for it in trace.iterations:
        n = it.n_accepted
        assert it.outcome[:n] == [ACCEPTED] * n
        if n < it.gamma:
            assert it.outcome[n] == REJECTED and set(it.outcome[n + 1:]) <= {DISCARDED}
            assert it.next_kind == RESAMPLED
            assert it.uniform[n] > it.accept_prob[n]  # the rejection is visible in the numbers
        else:
            assert it.next_kind == BONUS
        assert all(u <= a for u, a in zip(it.uniform[:n], it.accept_prob[:n]))
        assert all(0 <= a <= 1 for a in it.accept_prob)
        assert all(abs(a - min(1.0, p / q)) < 1e-5 for a, p, q in zip(it.accept_prob, it.p, it.q))
        emitted += (it.draft_ids[:n] + [it.next_id])[: it.emitted]
        assert it.draft_s > 0 and it.target_s > 0 and it.verify_s > 0
    assert emitted == trace.output_ids
    s = trace.summary()
    assert s["target_forward_passes"] == len(trace.iterations) + 1
    assert s["tokens_per_iteration"] == pytest.approx(sum(it.n_accepted + 1 for it in trace.iterations) / len(trace.iterations))


def test_sampled_runs_repeat_with_the_same_seed(tiny_pair, prompt_ids):
    cfg = SpecConfig(mode="exact", sampling=SamplingConfig(temperature=0.8, top_k=50), max_new_tokens=24, seed=11)
    a = run_speculative(tiny_pair, prompt_ids, cfg)
    b = run_speculative(tiny_pair, prompt_ids, cfg)
    c = run_speculative(tiny_pair, prompt_ids, SpecConfig(**{**cfg.__dict__, "seed": 12}))
    assert a.output_ids == b.output_ids
    assert a.output_ids != c.output_ids


def test_stops_at_eos(tokenizer, prompt_ids):
    """A target whose head always prefers EOS ends after one token, in both loops."""
    target = tiny_qwen(0)
    head = torch.nn.Linear(64, VOCAB, bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.fill_(-1.0)
        head.bias[EOS] = 1.0
    target.lm_head = head
    pair = ModelPair(target, target, tokenizer, "eos", "eos", VOCAB)
    spec = run_speculative(pair, prompt_ids, SpecConfig(mode="exact", max_new_tokens=20))
    ref = run_target_only(pair, prompt_ids, SpecConfig(max_new_tokens=20))
    assert spec.output_ids == ref.output_ids == [EOS]


def test_token_limit_is_exact(tiny_pair, prompt_ids):
    for limit in (1, 2, 5, 9):
        trace = run_speculative(tiny_pair, prompt_ids, SpecConfig(mode="exact", gamma_init=7, gamma_policy="constant", max_new_tokens=limit))
        assert len(trace.output_ids) == limit


def test_empty_prompt_is_refused(tiny_pair):
    with pytest.raises(ValueError, match="empty"):
        run_speculative(tiny_pair, [], SpecConfig())


def test_draft_confidence_stops_drafting_early_and_stays_exact(tiny_pair, prompt_ids, reference):
    cfg = SpecConfig(mode="exact", gamma_policy="constant", gamma_init=8, max_new_tokens=MAX_NEW, draft_confidence=0.9)
    trace = run_speculative(tiny_pair, prompt_ids, cfg)
    assert trace.output_ids == reference.output_ids
    assert any(it.gamma < 8 for it in trace.iterations[:-1])  # some drafts ended on a doubtful token
    assert all(1 <= it.gamma <= 8 for it in trace.iterations)
