"""The why-panel's data: the distributions recorded at each examined position (specviz.decoding.explain), the
sigmoid-vs-exact gap, the replay prefix, and trace versions 2 and 3 round-tripping with them."""

from __future__ import annotations

import json

import pytest
import torch

from specviz.config import MAX_EXPLAIN_TOP, SamplingConfig, SpecConfig
from specviz.decoding.explain import examine
from specviz.decoding.records import DISCARDED
from specviz.traces.trace import SCHEMA_VERSION, Trace, TraceFormatError
from specviz.traces.json_format import load_trace, loads_trace

from conftest import VOCAB, decode

SAMPLED = SamplingConfig(temperature=1.0)


def _decode_id(ids: list[int]) -> str:
    return f"t{ids[0]}"


def test_examine_records_softmax_residual_and_bonus_exactly():
    """On a 7-token vocabulary with top = 7, every recorded distribution is the full one: p and q are the
    softmax of the temperature-scaled logits, the rejection's entry is max(0, p − l·q) normalized, the
    bonus's is p."""
    g = torch.Generator().manual_seed(3)
    V, gamma = 7, 3
    draft_logits = torch.randn(2, gamma, V, generator=g)
    target_logits = torch.randn(2, gamma + 1, V, generator=g)
    drafts = [[1, 2, 3], [4, 5, 6]]
    sampling = SamplingConfig(temperature=0.7)
    why = examine(drafts, [1, 3], draft_logits, target_logits, sampling, lenience=0.5, sigmoid=None, top=V,
                  decode=_decode_id)
    assert [e.position for e in why[0]] == [0, 1] and [e.position for e in why[1]] == [0, 1, 2, 3]

    def full(top) -> torch.Tensor:
        out = torch.zeros(V, dtype=torch.float64)
        out[top.ids] = torch.tensor(top.probs, dtype=torch.float64)
        return out

    p = (target_logits / 0.7).double().softmax(-1)
    q = (draft_logits / 0.7).double().softmax(-1)
    for b, rows in enumerate(why):
        for e in rows:
            assert torch.allclose(full(e.p), p[b, e.position], atol=1e-6)
            assert e.p.texts == [f"t{i}" for i in e.p.ids] and e.p.probs == sorted(e.p.probs, reverse=True)
            assert abs(sum(e.p.probs) + e.p.rest - 1) < 1e-5
            if e.position < gamma:
                assert torch.allclose(full(e.q), q[b, e.position], atol=1e-6)
            assert e.exact_accept_prob is None and e.sigmoid_tv is None
    assert [e.drawn_from is None for e in why[0]] == [True, False]  # rejected at position 1 of row 0
    residual = (p[0, 1] - 0.5 * q[0, 1]).clamp(min=0)
    assert torch.allclose(full(why[0][1].drawn_from), residual / residual.sum(), atol=1e-6)
    assert why[1][-1].q is None  # the bonus position: nothing drafted there
    assert torch.allclose(full(why[1][-1].drawn_from), p[1, 3], atol=1e-6)


def test_examine_top_n_bounds_and_rest_mass():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(1, 2, 500, generator=g)
    why = examine([[9]], [0], logits[:, :1], logits, SAMPLED, lenience=1.0, sigmoid=None, top=5, decode=_decode_id)
    e = why[0][0]
    assert len(e.p.ids) == len(e.q.ids) == len(e.drawn_from.ids) == 5
    assert e.p.rest == pytest.approx(1 - sum(e.p.probs), abs=1e-6) and e.p.rest > 0.5


def test_sigmoid_records_exact_verdict_and_tv():
    g = torch.Generator().manual_seed(5)
    draft_logits = 3 * torch.randn(1, 2, 50, generator=g)
    target_logits = 3 * torch.randn(1, 3, 50, generator=g)
    why = examine([[1, 2]], [2], draft_logits, target_logits, SAMPLED, lenience=1.0, sigmoid=(-1e4, 1e4), top=50,
                  decode=_decode_id)
    p = target_logits.softmax(-1)
    q = draft_logits.softmax(-1)
    for e, x in zip(why[0][:2], (1, 2)):
        k = e.position
        assert e.exact_accept_prob == pytest.approx(min(1.0, float(p[0, k, x] / q[0, k, x])), rel=1e-5)
        p_hat = torch.sigmoid(target_logits[0, k] / 2e4)
        assert e.sigmoid_tv == pytest.approx(0.5 * float((p_hat / p_hat.sum() - p[0, k]).abs().sum()), rel=1e-4)
    assert why[0][2].exact_accept_prob is None and why[0][2].sigmoid_tv > 0.5  # near-uniform p̂ vs peaked p


@pytest.fixture(scope="module")
def sampled_trace(tiny_pair, batch_prompts) -> Trace:
    cfg = SpecConfig(sampling=SamplingConfig(temperature=0.3), max_new_tokens=16, seed=2, gamma_policy="constant",
                     gamma_init=4, explain_top=MAX_EXPLAIN_TOP)
    return decode(tiny_pair, batch_prompts, cfg)


def test_engine_records_why_consistent_with_the_verifier(sampled_trace):
    """p(x) and q(x) the verifier used equal the recorded distributions' entries for the drafted token;
    exactly the examined positions are explained; the next token has mass where it was drawn from."""
    checked = 0
    for d in sampled_trace.drafted():
        n = d.n_accepted
        assert [e.position for e in d.why] == list(range(n + 1))
        assert all(o == DISCARDED for o in d.outcome[n + 1:])
        for e in d.why:
            k = e.position
            if k < d.gamma:
                x = d.draft_ids[k]
                if x in e.p.ids:
                    assert e.p.probs[e.p.ids.index(x)] == pytest.approx(d.p[k], rel=1e-4, abs=1e-7)
                    checked += 1
                if x in e.q.ids:
                    assert e.q.probs[e.q.ids.index(x)] == pytest.approx(d.q[k], rel=1e-4, abs=1e-7)
            assert (e.drawn_from is not None) == (k == n)
        drawn = d.why[-1].drawn_from
        if d.next_id in drawn.ids:
            assert drawn.probs[drawn.ids.index(d.next_id)] > 0
    assert checked > 10


def test_explanation_time_is_recorded_and_left_out_of_the_clock(sampled_trace, tiny_pair, batch_prompts):
    steps = sampled_trace.steps
    assert all(s.explain_s > 0 for s in steps)
    assert sampled_trace.summary()["explain_s"] == pytest.approx(sum(s.explain_s for s in steps))
    # the run's clock stopped meanwhile: what the timed parts leave unexplained is less than the recording took
    untimed = sampled_trace.total_s - sampled_trace.prefill_s - sum(s.draft_s + s.target_s + s.verify_s for s in steps)
    assert 0 <= untimed < 0.5 * sum(s.explain_s for s in steps)
    off = decode(tiny_pair, batch_prompts, SpecConfig(sampling=SAMPLED, max_new_tokens=8, explain_top=0))
    assert all(not d.why for d in off.drafted()) and all(s.explain_s == 0 for s in off.steps)


def test_sigmoid_gap_measures_inflation(tiny_pair, batch_prompts, sampled_trace):
    assert sampled_trace.sigmoid_gap() is None  # exact: nothing to measure
    cfg = SpecConfig(mode="sigmoid", sampling=SAMPLED, max_new_tokens=16, seed=2, gamma_policy="constant",
                     gamma_init=4)
    trace = decode(tiny_pair, batch_prompts, cfg)
    gap = trace.summary()["sigmoid_gap"]
    # with the text defaults p̂ ≈ q̂ ≈ 0.5 everywhere: sigmoid accepts nearly every draft, exact does not
    assert gap["accepted"] >= 0.9 * gap["examined"]
    assert gap["exact_would_accept"] < gap["accepted"] and gap["inflation"] > 0.05
    assert 0.3 < gap["mean_tv"] <= 1 and gap["max_tv"] >= gap["mean_tv"]


def test_until_is_the_run_so_far(sampled_trace):
    full = sampled_trace
    assert full.until(len(full.steps)) is full
    part = full.until(3)
    assert len(part.steps) == 3 and part.total_s == full.steps[2].end_s
    for s, f in zip(part.sequences, full.sequences):
        assert all(d.step < 3 for d in s.decisions)
        assert f.output_ids[: len(s.output_ids)] == s.output_ids
        assert s.output_text == "".join(t for d in s.decisions
                                        for t in (d.draft_text[: d.n_accepted] + [d.next_text])[: d.emitted])
    assert full.until(0).new_tokens == 0


def test_version_3_round_trip_and_version_2_still_loads(sampled_trace, tmp_path):
    path = tmp_path / "v3.json"
    sampled_trace.save(path)
    data = json.loads(path.read_text())
    assert data["schema_version"] == SCHEMA_VERSION == 3
    assert load_trace(path) == sampled_trace
    for s in data["sequences"]:  # what a version-2 writer produced
        for d in s["decisions"]:
            del d["why"]
    for step in data["steps"]:
        del step["explain_s"]
    data["schema_version"] = 2
    old = loads_trace(json.dumps(data))
    assert old.outputs == sampled_trace.outputs and not any(d.why for d in old.decisions())


@pytest.mark.parametrize("edit, message", [
    (lambda w: w[0]["p"].update(probs=[1.5] * len(w[0]["p"]["probs"])), "outside"),
    (lambda w: w[0]["p"].update(ids=w[0]["p"]["ids"][:-1]), "one length"),
    (lambda w: w.reverse(), "increase"),
    (lambda w: w[0].update(p=None), "must be a JSON object"),
    (lambda w: w[0].update(sigmoid_tv="far"), "sigmoid_tv"),
    (lambda w: w[0]["q"].update(ids=list(range(MAX_EXPLAIN_TOP + 1)), texts=["x"] * (MAX_EXPLAIN_TOP + 1),
                                probs=[0.0] * (MAX_EXPLAIN_TOP + 1)), "at most"),
])
def test_malformed_why_is_refused(sampled_trace, edit, message):
    data = sampled_trace.to_dict()
    decision = next(d for s in data["sequences"] for d in s["decisions"] if len(d["why"]) >= 2)
    edit(decision["why"])
    with pytest.raises(TraceFormatError, match=message):
        loads_trace(json.dumps(data))


def test_explain_top_is_bounded():
    with pytest.raises(ValueError, match="explain_top"):
        SpecConfig(explain_top=MAX_EXPLAIN_TOP + 1)
    assert VOCAB > MAX_EXPLAIN_TOP  # the tiny pair's vocabulary is wider than the bound, so top-N is a real cut


def test_bonus_exactly_when_every_draft_was_accepted(sampled_trace):
    data = sampled_trace.to_dict()
    decision = next(d for s in data["sequences"] for d in s["decisions"] if d["n_accepted"] < d["gamma"])
    decision["next_kind"] = "bonus"
    with pytest.raises(TraceFormatError, match="bonus exactly when"):
        loads_trace(json.dumps(data))


def test_top_k_through_chunk_maxima_equals_torch_topk():
    """The why-panel's top-k over wide rows (explain._topk: only the chunks whose maxima lead are searched) gives
    torch.topk's values in its order, and ids that hold them, on random rows, rows with ties, one-hot rows and
    sparse residuals, at the target's and the reduced draft head's widths."""
    from specviz.decoding.explain import _topk

    g = torch.Generator().manual_seed(0)
    for V in (151936, 32768):
        random_rows = torch.randn(6, V, generator=g).softmax(-1)
        tied = torch.randint(0, 4, (3, V), generator=g).float()  # many equal values
        one_hot = torch.zeros(2, V)
        one_hot[0, 5], one_hot[1, V - 1] = 1.0, 1.0
        sparse = torch.zeros(2, V)
        sparse[:, torch.randperm(V, generator=g)[:7]] = torch.rand(2, 7, generator=g)
        for rows in (random_rows, tied, one_hot, sparse):
            for k in (1, 5, 20):
                values, ids = _topk(rows, k)
                want = rows.topk(k, dim=-1)
                assert torch.equal(values, want.values)
                assert torch.equal(rows.gather(-1, ids), values)
                assert all(len(set(r)) == k for r in ids.tolist())  # k distinct tokens a row
                if rows is random_rows:
                    assert torch.equal(ids, want.indices)
