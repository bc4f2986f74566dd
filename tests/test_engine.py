"""The decoding driver on tiny random models (fp32): greedy equality for one sequence and for ragged batches,
slotted KV caches, sequences leaving the batch, stopping, and the records it yields."""

from __future__ import annotations

import pytest
import torch

from specviz.config import GAMMA_POLICIES, SamplingConfig, SpecConfig
from specviz.decoding.source import Vocabulary
from specviz.models.loading import ModelPair
from specviz.text.prompts import InputError
from specviz.decoding.records import ACCEPTED, BONUS, DISCARDED, REJECTED, RESAMPLED, Finished, Iteration
from specviz.runs.decode import run
from specviz.text.source import CausalLMDecoder, TextSource, prompt_sequences

from conftest import EOS, VOCAB, decode, prompts_source, tiny_qwen

MAX_NEW = 40


@pytest.fixture(scope="module")
def reference(tiny_pair, prompt_ids):
    return decode(tiny_pair, [prompt_ids], SpecConfig(max_new_tokens=MAX_NEW), target_only=True)


@pytest.fixture(scope="module")
def alone(tiny_pair, batch_prompts):
    """Each batch prompt decoded by itself, target-only: what every batched run must reproduce."""
    cfg = SpecConfig(max_new_tokens=MAX_NEW)
    return [decode(tiny_pair, [p], cfg, target_only=True).outputs[0] for p in batch_prompts]


@pytest.mark.parametrize("mode", ["baseline", "exact"])
@pytest.mark.parametrize("policy", [p for p in GAMMA_POLICIES if p != "cost"])  # cost: tests/test_cost.py
def test_greedy_speculative_equals_target_only(tiny_pair, prompt_ids, reference, mode, policy):
    trace = decode(tiny_pair, [prompt_ids], SpecConfig(mode=mode, gamma_policy=policy, max_new_tokens=MAX_NEW))
    assert trace.outputs == reference.outputs
    assert len(trace.outputs[0]) == MAX_NEW
    # the pair must exercise both branches, or equality would prove little
    kinds = {d.next_kind for d in trace.decisions()}
    assert kinds == {BONUS, RESAMPLED}, kinds


@pytest.mark.parametrize("mode", ["baseline", "exact"])
@pytest.mark.parametrize("policy", ["constant", "hf", "bass"])
def test_batched_greedy_equals_each_sequence_alone(tiny_pair, batch_prompts, alone, mode, policy):
    """Three different prompts (12, 5 and 21 tokens) in one batch: every sequence's output is, token for
    token, its own single-sequence target-only output, although the rows accept different counts."""
    trace = decode(tiny_pair, batch_prompts, SpecConfig(mode=mode, gamma_policy=policy, max_new_tokens=MAX_NEW))
    assert trace.outputs == alone
    assert trace.batch_size == 3
    ragged = [s for s in trace.steps if len({d.n_accepted for d in trace.decisions() if d.step == s.index}) > 1]
    assert ragged, "the rows never accepted different counts in one iteration: the test would prove little"
    assert any(s.cache_holes > 0 for s in trace.steps)  # rejected drafts and left padding stay as masked holes


def test_identical_prompts_share_one_prefill(tiny_pair, batch_prompts, alone):
    """Rows 0 and 2 repeat one prompt: it is prefilled once and copied; every row still decodes exactly."""
    prompts = [batch_prompts[0], batch_prompts[1], batch_prompts[0]]
    for target_only in (False, True):
        trace = decode(tiny_pair, prompts, SpecConfig(mode="exact", max_new_tokens=MAX_NEW), target_only=target_only)
        assert trace.outputs == [alone[0], alone[1], alone[0]]


def test_batched_target_only_equals_each_sequence_alone(tiny_pair, batch_prompts, alone):
    assert decode(tiny_pair, batch_prompts, SpecConfig(max_new_tokens=MAX_NEW), target_only=True).outputs == alone


@pytest.mark.parametrize("gamma", [1, 2, 4, 7, 12])
def test_greedy_equality_at_several_gammas(tiny_pair, prompt_ids, reference, gamma):
    for mode in ("baseline", "exact"):
        cfg = SpecConfig(mode=mode, gamma_policy="constant", gamma_init=gamma, max_new_tokens=MAX_NEW)
        trace = decode(tiny_pair, [prompt_ids], cfg)
        assert trace.outputs == reference.outputs, (mode, gamma)
        emitted = 0
        for d in trace.decisions():
            assert d.gamma == min(gamma, MAX_NEW - emitted)
            emitted += d.emitted


def test_eight_sequences_at_gamma_one(tiny_pair, batch_prompts):
    prompts = [p[: 4 + i] for i, p in enumerate(batch_prompts * 3)][:8]
    cfg = SpecConfig(mode="exact", gamma_policy="constant", gamma_init=1, max_new_tokens=12)
    trace = decode(tiny_pair, prompts, cfg)
    assert trace.batch_size == 8
    assert trace.outputs == [decode(tiny_pair, [p], cfg, target_only=True).outputs[0] for p in prompts]
    assert all(d.gamma == 1 for d in trace.decisions())


def test_groups_beyond_the_batch_size(tiny_pair, batch_prompts, alone):
    """batch_size 2 for three sequences: two groups, one after the other, same outputs."""
    trace = decode(tiny_pair, batch_prompts, SpecConfig(mode="exact", max_new_tokens=MAX_NEW), batch_size=2)
    assert trace.outputs == alone and trace.prefill_passes == 2
    assert max(len(s.sequences) for s in trace.steps) == 2


def test_a_batch_where_every_row_rejects_its_first_draft(tiny_pair, batch_prompts, alone):
    """An unrelated draft (another random model) is wrong almost always: iterations where every row
    rejects at once must still leave each sequence exact."""
    pair = ModelPair(tiny_qwen(5), tiny_pair.target, tiny_pair.tokenizer, "unrelated", "tiny", VOCAB)
    trace = decode(pair, batch_prompts, SpecConfig(mode="exact", gamma_policy="constant", gamma_init=3,
                                                   max_new_tokens=MAX_NEW))
    assert trace.outputs == alone
    by_step = {}
    for d in trace.decisions():
        by_step.setdefault(d.step, []).append(d.n_accepted)
    assert any(len(ns) == 3 and max(ns) == 0 for ns in by_step.values())


def test_a_sequence_that_ends_early_leaves_the_batch(tiny_pair, batch_prompts, alone):
    """Make a token that sequence 1 produces early the EOS: sequence 1 stops there and leaves the batch;
    the others continue unchanged (their outputs do not contain that token before their own end)."""
    stop = alone[1][3]
    expected = [out[: out.index(stop) + 1] if stop in out else out for out in alone]
    assert len(expected[1]) == 4 and any(len(e) > 4 for e in expected)
    source = prompts_source(tiny_pair, batch_prompts)
    source.vocab = Vocabulary(source.vocab.decode, frozenset({stop}), source.vocab.size)
    events = []
    trace = run(source, SpecConfig(mode="exact", max_new_tokens=MAX_NEW), on_event=lambda e, t: events.append(e))
    assert trace.outputs == expected
    finished = [e for e in events if isinstance(e, Finished)]
    assert finished[0].sequence == 1 and finished[0].reason == "eos"
    after = [e.step for e in events[events.index(finished[0]):] if isinstance(e, Iteration)]
    assert after and all(1 not in s.sequences for s in after)


def test_slotted_cache_rows_compute_what_they_compute_alone(tiny_pair, batch_prompts):
    """Ragged feeds, rollbacks and a row leaving: each row's logits equal a decoder that only ever saw it."""
    model = tiny_pair.target
    batch = CausalLMDecoder(model, VOCAB, 3)
    single = [CausalLMDecoder(model, VOCAB, 1) for _ in range(3)]
    batch.prefill([p[:-1] for p in batch_prompts])
    for d, p in zip(single, batch_prompts):
        d.prefill([p[:-1]])
    g = torch.Generator().manual_seed(3)
    feeds = [[p[-1]] for p in batch_prompts]
    rows = [0, 1, 2]
    for step in range(6):
        out = batch.forward(feeds, max(len(f) for f in feeds))
        for i, r in enumerate(rows):
            n = len(feeds[i])
            if n:  # a row that feeds nothing this step only gets a padding slot
                own = single[r].forward([feeds[i]], n)[0]
                torch.testing.assert_close(out[i, -n:], own, rtol=1e-4, atol=1e-4)
        keep = [batch.fed(i) - int(torch.randint(0, len(f) + 1, (1,), generator=g)) if f else batch.fed(i)
                for i, f in enumerate(feeds)]
        keep = [max(k, batch.fed(i) - len(f)) for i, (k, f) in enumerate(zip(keep, feeds))]
        for i, r in enumerate(rows):
            single[r].rollback([keep[i]])
        batch.rollback(keep)
        for i, r in enumerate(rows):
            assert batch.fed(i) == single[r].fed(0)
        if step == 3:  # row 1 leaves
            batch.select([0, 2])
            rows = [0, 2]
        feeds = [torch.randint(0, VOCAB - 1, (int(torch.randint(0, 4, (1,), generator=g)),), generator=g).tolist()
                 for _ in rows]
        if not any(feeds):
            feeds[0] = [5]
    slots, holes = batch.cache_use()
    assert 0 <= holes < slots


def test_trace_records_are_consistent(tiny_pair, batch_prompts):
    cfg = SpecConfig(mode="exact", sampling=SamplingConfig(temperature=1.0), max_new_tokens=MAX_NEW, seed=3,
                     draft_confidence=0.002)
    trace = decode(tiny_pair, batch_prompts, cfg)
    for seq in trace.sequences:
        emitted = []
        for d in seq.decisions:
            n = d.n_accepted
            assert d.outcome[:n] == [ACCEPTED] * n
            if n < d.gamma:
                assert d.outcome[n] == REJECTED and set(d.outcome[n + 1:]) <= {DISCARDED}
                assert d.next_kind == RESAMPLED
                assert d.uniform[n] > d.accept_prob[n]  # the rejection is visible in the numbers
            else:
                assert d.next_kind == BONUS
            assert all(u <= a for u, a in zip(d.uniform[:n], d.accept_prob[:n]))
            assert all(0 <= a <= 1 for a in d.accept_prob)
            assert all(abs(a - min(1.0, p / q)) < 1e-5 for a, p, q in zip(d.accept_prob, d.p, d.q))
            emitted += d.tokens
        assert emitted == seq.output_ids
        assert seq.finish in ("eos", "length") and seq.finished_s > 0
    for step in trace.steps:
        assert step.draft_s > 0 and step.target_s > 0 and step.verify_s > 0
        assert step.real_tokens > 0 and step.pad_tokens >= 0 and 0 <= step.cache_holes <= step.cache_slots
    assert any(s.pad_tokens > 0 for s in trace.steps)  # rows drafted different counts: padding was fed
    s = trace.summary()
    assert s["target_forward_passes"] == len(trace.steps) + 1
    drafted = trace.drafted()
    assert s["tokens_per_iteration"] == pytest.approx(sum(d.n_accepted + 1 for d in drafted) / len(drafted))
    assert 0 < s["padding_fraction"] < 1


def test_sampled_runs_repeat_with_the_same_seed(tiny_pair, batch_prompts):
    cfg = SpecConfig(mode="exact", sampling=SamplingConfig(temperature=0.8, top_k=50), max_new_tokens=24, seed=11)
    a = decode(tiny_pair, batch_prompts, cfg)
    b = decode(tiny_pair, batch_prompts, cfg)
    c = decode(tiny_pair, batch_prompts, SpecConfig(**{**cfg.__dict__, "seed": 12}))
    assert a.outputs == b.outputs
    assert a.outputs != c.outputs


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
    spec = decode(pair, [prompt_ids], SpecConfig(mode="exact", max_new_tokens=20))
    ref = decode(pair, [prompt_ids], SpecConfig(max_new_tokens=20), target_only=True)
    assert spec.outputs == ref.outputs == [[EOS]]
    assert spec.sequences[0].finish == "eos"


def test_token_limit_is_exact(tiny_pair, batch_prompts):
    for limit in (1, 2, 5, 9):
        cfg = SpecConfig(mode="exact", gamma_init=7, gamma_policy="constant", max_new_tokens=limit)
        trace = decode(tiny_pair, batch_prompts, cfg)
        assert [len(o) for o in trace.outputs] == [limit] * 3


def test_one_token_prompts(tiny_pair):
    """A prompt of one token leaves nothing to prefill; the first step feeds it."""
    cfg = SpecConfig(mode="exact", max_new_tokens=8)
    trace = decode(tiny_pair, [[7], [9, 11, 13]], cfg)
    assert trace.outputs == [decode(tiny_pair, [p], cfg, target_only=True).outputs[0] for p in ([7], [9, 11, 13])]


def test_empty_prompt_is_refused(tiny_pair):
    with pytest.raises(ValueError, match="empty"):
        decode(tiny_pair, [[1, 2], []], SpecConfig())


def test_several_samples_need_sampling():
    with pytest.raises(InputError, match="temperature"):
        prompt_sequences([("a", [1, 2])], 3, SpecConfig())
    specs = prompt_sequences([("a", [1, 2]), ("b", [3])], 2, SpecConfig(sampling=SamplingConfig(temperature=1.0)))
    assert [s.label for s in specs] == ["a · sample 1", "a · sample 2", "b · sample 1", "b · sample 2"]
    twice = prompt_sequences([("a.txt", [1]), ("a.txt", [2])], 1, SpecConfig())  # one file given twice: two outputs
    assert [s.group for s in twice] == ["a.txt", "a.txt #2"]


def test_samples_of_one_prompt_differ_and_each_is_exact_in_distribution(tiny_pair, prompt_ids):
    """BASS's use case: N samples of one prompt in one batch are N different draws."""
    cfg = SpecConfig(mode="exact", sampling=SamplingConfig(temperature=1.0), max_new_tokens=16, seed=2)
    source = TextSource(tiny_pair, prompt_sequences([("p", prompt_ids)], 4, cfg))
    trace = run(source, cfg)
    assert len({tuple(o) for o in trace.outputs}) == 4


def test_draft_confidence_stops_rows_at_different_points_and_stays_exact(tiny_pair, batch_prompts, alone):
    cfg = SpecConfig(mode="exact", gamma_policy="constant", gamma_init=8, max_new_tokens=MAX_NEW,
                     draft_confidence=0.002)  # about the median draft confidence of the tiny pair
    trace = decode(tiny_pair, batch_prompts, cfg)
    assert trace.outputs == alone
    by_step = {}
    for d in trace.decisions():
        by_step.setdefault(d.step, []).append(d.gamma)
    assert any(len(set(g)) > 1 for g in by_step.values())  # rows of one iteration drafted different counts
    assert all(1 <= d.gamma <= 8 for d in trace.decisions())


def test_rows_after_leaving_keep_rows_in_place_and_fill_from_the_end():
    """Rows that stay keep their places where they can; each leaver's place goes to a row past the new end."""
    from specviz.decoding.engine import _rows_after_leaving

    assert _rows_after_leaving([True] * 4) == [0, 1, 2, 3]
    assert _rows_after_leaving([False, True, True, True]) == [3, 1, 2]
    assert _rows_after_leaving([True, False, False, True]) == [0, 3]
    assert _rows_after_leaving([True, True, False, False]) == [0, 1]
    assert _rows_after_leaving([False, False, False, True]) == [3]
    assert _rows_after_leaving([False, False]) == []
    for stays in ([True, False, True, False, True], [False, True, False, True, True, False]):
        rows = _rows_after_leaving(stays)
        assert sorted(rows) == [r for r, s in enumerate(stays) if s]
        assert all(r == i or r >= len(rows) for i, r in enumerate(rows))  # what the caches move in place
