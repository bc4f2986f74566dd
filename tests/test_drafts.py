"""The cheaper drafts: prompt lookup, the reduced-vocabulary draft head, and their combination.

Exactness in two forms: greedy fp32 decoding with each draft equals target-only decoding token for token
(tiny random models with the real vocabulary size, single sequences and ragged batches), and the
verifier's output follows p when q is zero on most of the vocabulary (chi-square goodness of fit, fixed
seeds, with the sample size and tolerance stated as in test_verify_statistics).
"""

from __future__ import annotations

import dataclasses

import json

import numpy as np
import pytest
import torch
from torch import nn

from specviz.config import SamplingConfig, SpecConfig
from specviz.decoding.drafts import SubsetHead, lookup, one_hot_logits, subset_ids
from specviz.models.quant import quantize_draft_int8
from specviz.decoding.records import LOOKUP, MODEL, REJECTED
from specviz.traces.json_format import load_trace, loads_trace

from conftest import EOS, VOCAB, decode
from test_verify_statistics import FAMILY_ALPHA, POWER, Pair, gof_failure, probs_of, run_copies, samples_to_detect_tv

MAX_NEW = 40
EOS_SET = frozenset({EOS})


# ---- prompt lookup ----------------------------------------------------------------------------------

def test_lookup_without_a_match_proposes_nothing():
    assert lookup([1, 2, 3, 4, 5], 4, EOS_SET) == []
    assert lookup([], 4, EOS_SET) == [] and lookup([7], 4, EOS_SET) == []


def test_lookup_continues_the_latest_longest_match():
    tokens = [9, 1, 2, 3, 4, 8, 1, 2, 5, 6, 0, 1, 2]
    # the 2-gram (1, 2) recurs at 1 and 6: the latest (6) wins; no 3-gram (0, 1, 2) recurs
    assert lookup(tokens, 3, EOS_SET) == [5, 6, 0]
    # a longer match beats a later shorter one: (3, 1, 2) at 3 vs only (1, 2) later
    assert lookup([3, 1, 2, 7, 7, 5, 1, 2, 6, 3, 1, 2], 2, EOS_SET) == [7, 7]
    assert lookup(tokens, 1, EOS_SET) == [5]
    assert lookup(tokens, 3, EOS_SET, min_ngram=3) == []


def test_lookup_match_at_the_very_end_of_the_context():
    # the suffix (4, 5) recurs just before itself: the proposal is what followed, up to the end
    assert lookup([4, 5, 4, 5], 6, EOS_SET) == [4, 5]
    assert lookup([1, 4, 5, 4, 5], 1, EOS_SET) == [4]


def test_lookup_stops_after_an_eos_inside_the_match():
    assert lookup([1, 2, 3, EOS, 7, 8, 1, 2], 5, EOS_SET) == [3, EOS]


def _lookup_by_definition(tokens: list[int], limit: int, eos: frozenset[int], min_ngram: int,
                          max_ngram: int = 3) -> list[int]:
    """lookup's contract read literally: the longest suffix first, then its latest earlier start, every start
    tried in turn."""
    for n in range(min(max(max_ngram, min_ngram), len(tokens) - 1), min_ngram - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tokens[len(tokens) - n:]:
                follow = tokens[start + n:start + n + limit]
                cut = next((i + 1 for i, t in enumerate(follow) if t in eos), len(follow))
                return follow[:cut]
    return []


def test_lookup_agrees_with_its_definition_on_random_sequences():
    """lookup finds candidates through the last token's earlier occurrences; on 3,000 random sequences over small
    alphabets (many repeats, suffixes recurring at every length, EOS inside continuations) it proposes what
    trying every start would."""
    rng = np.random.default_rng(0)
    found = 0
    for case in range(3000):
        alphabet = int(rng.integers(2, 12))
        tokens = rng.integers(0, alphabet, size=int(rng.integers(0, 60))).tolist()
        limit, min_ngram = int(rng.integers(1, 9)), int(rng.integers(1, 4))
        eos = frozenset({int(rng.integers(0, alphabet))}) if case % 3 == 0 else EOS_SET
        expected = _lookup_by_definition(tokens, limit, eos, min_ngram)
        assert lookup(tokens, limit, eos, min_ngram=min_ngram) == expected, (tokens, limit, min_ngram)
        found += bool(expected)
    assert 1000 < found < 3000  # both outcomes, often


def test_one_hot_logits_are_a_deterministic_q():
    logits = one_hot_logits([[5, 7], [3], []], 2, 16, torch.device("cpu"))
    q = logits.softmax(-1)
    assert q[0, 0, 5] == 1 and q[0, 1, 7] == 1 and q[1, 0, 3] == 1
    assert torch.all(logits[1, 1] == 0) and torch.all(logits[2] == 0)  # padding: finite, never read


# ---- the reduced head -------------------------------------------------------------------------------

def test_subset_ids_keep_specials_and_prompt_tokens():
    ids = subset_ids(100, 10, {3, 50, 99, 150})
    assert ids.tolist() == list(range(10)) + [50, 99]
    assert len(subset_ids(100, 0, {5})) == 100 and len(subset_ids(100, 100, set())) == 100


@pytest.mark.parametrize("int8", [False, True])
def test_subset_head_scores_its_rows_and_nothing_else(int8):
    torch.manual_seed(0)
    head = nn.Linear(32, 300, bias=False)
    if int8:
        head = quantize_draft_int8(nn.Sequential(head))[0]
    ids = subset_ids(300, 40, {250, 299})
    sub = SubsetHead(head, ids, 300)
    hidden = torch.randn(2, 3, 32)
    full = head(hidden).float()
    out = sub(hidden)
    assert out.shape == (2, 3, 300) and sub.size == 42
    assert torch.allclose(out[..., ids], full[..., ids], atol=1e-5)
    outside = torch.ones(300, dtype=torch.bool)
    outside[ids] = False
    assert torch.all(out[..., outside] == float("-inf"))


# ---- greedy fp32 equality on the engine ----------------------------------------------------------------

def _repeating_prompts() -> list[list[int]]:
    """Prompts whose tail recurs earlier (as summaries copy their article), so lookup has matches."""
    g = torch.Generator().manual_seed(23)
    out = []
    for n in (10, 6, 14):
        seg = torch.randint(0, VOCAB - 1, (n,), generator=g).tolist()
        out.append(seg + seg + seg[:3])
    return out


@pytest.fixture(scope="module")
def repeating_alone(tiny_pair):
    cfg = SpecConfig(max_new_tokens=MAX_NEW)
    return [decode(tiny_pair, [p], cfg, target_only=True).outputs[0] for p in _repeating_prompts()]


CASES = {
    "lookup": dict(draft_kind="lookup"),
    "lookup+model": dict(draft_kind="lookup+model", lookup_ngram=2),
    "subset head": dict(draft_vocab=3000),
    "lookup+model, subset head": dict(draft_kind="lookup+model", lookup_ngram=1, draft_vocab=3000),
    "priced (cost policy)": dict(draft_kind="priced", gamma_policy="cost", gamma_init=None),
}


@pytest.mark.parametrize("mode", ["baseline", "exact"])
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_equality_with_each_draft(tiny_pair, repeating_alone, mode, case):
    """Each prompt alone and the three as one ragged batch: every output equals target-only's."""
    prompts = _repeating_prompts()
    cfg = dataclasses.replace(SpecConfig(mode=mode, max_new_tokens=MAX_NEW, gamma_policy="constant", gamma_init=4),
                              **CASES[case])
    alone = [decode(tiny_pair, [p], cfg).outputs[0] for p in prompts]
    batched = decode(tiny_pair, prompts, cfg)
    assert alone == repeating_alone and batched.outputs == repeating_alone
    drafters = {d.drafter for d in batched.decisions()}
    if "lookup" in case:  # a priced run's mix follows this machine's measured costs: equality is what it owes
        assert LOOKUP in drafters
        assert any(REJECTED in d.outcome for d in batched.decisions() if d.drafter == LOOKUP)
    if case == "lookup+model" or "subset" in case:
        assert MODEL in drafters
    if "subset" in case:
        # the target's token lay outside the draft's 3,000 (+ prompt) tokens: q = 0 there, so a resample
        # from the residual had to produce it
        head = set(subset_ids(VOCAB, 3000, {t for p in prompts for t in p} | {EOS}).tolist())
        assert any(t not in head for out in repeating_alone for t in out)
        assert batched.meta["draft_vocab_size"] < VOCAB


def test_every_draft_kind_has_one_proposer():
    """The driver knows no kinds: each SpecConfig.draft_kind maps to one Proposer class, which says whether
    the driver must open a draft model for it; "priced" is the cost policy's choice among them each iteration."""
    from specviz.config import DRAFT_KINDS, PRICED, PRICED_KINDS
    from specviz.decoding.proposers import PROPOSERS, LookupThenModel, ModelDraft, PromptLookup, uses_draft_model

    assert sorted(PROPOSERS) == sorted(set(DRAFT_KINDS) - {PRICED}) == sorted(PRICED_KINDS)
    assert PROPOSERS == {"model": ModelDraft, "lookup": PromptLookup, "lookup+model": LookupThenModel}
    assert [uses_draft_model(k) for k in ("model", "lookup", "lookup+model", PRICED)] == [True, False, True, True]
    with pytest.raises(ValueError, match="unknown draft kind 'ngram'"):
        uses_draft_model("ngram")


def test_prompt_lookup_proposes_for_every_row():
    """Lookup alone: a row with a match proposes its continuation, a row without one repeats its last token;
    q is one-hot on each proposal and zero-padded beyond it."""
    from specviz.decoding.proposers import DraftSetup, make_proposers
    from specviz.decoding.source import Vocabulary

    setup = DraftSetup(cfg=SpecConfig(draft_kind="lookup"), vocab=Vocabulary(str, EOS_SET, 16),
                       device=torch.device("cpu"), generator=torch.Generator(), draft=None)
    (proposer,) = make_proposers(setup).values()
    proposal = proposer.propose([[1, 2, 3, 1, 2], [4, 5, 6]], [3, 3])
    assert proposal.tokens == [[3, 1, 2], [6]] and proposal.drafters == [LOOKUP, LOOKUP]
    # the --lookup-ngram match first (what lookup+model and a priced run's plan see), then the shorter ones
    history = [1, 2, 3, 4, 10, 11, 7, 2, 3, 4, 12, 13, 1, 2, 3, 4]
    setup = dataclasses.replace(setup, cfg=SpecConfig(draft_kind="lookup", lookup_ngram=4))
    (proposer,) = make_proposers(setup).values()
    assert proposer.propose([history], [2]).tokens == [[10, 11]]  # a 3-gram alone would continue with 12 13
    assert proposal.lengths == [3, 1] and proposal.width == 3 and proposal.model_forwards == 0
    assert torch.equal(proposal.logits, one_hot_logits([[3, 1, 2], [6]], 3, 16, torch.device("cpu")))
    assert proposal.padded(torch.device("cpu")).tolist() == [[3, 1, 2], [6, 0, 0]]


def test_lookup_alone_needs_no_draft_model(tiny_pair, repeating_alone, monkeypatch):
    """With lookup alone the draft model is never opened; rows without a match still propose a token."""
    calls = []
    original = type(tiny_pair.draft).forward
    monkeypatch.setattr(type(tiny_pair.draft), "forward", lambda self, *a, **k: calls.append(self is tiny_pair.draft)
                        or original(self, *a, **k))
    trace = decode(tiny_pair, _repeating_prompts(), SpecConfig(draft_kind="lookup", max_new_tokens=MAX_NEW))
    assert trace.outputs == repeating_alone
    assert not any(calls)
    assert all(d.gamma >= 1 and d.drafter == LOOKUP for d in trace.decisions())


def test_the_drafter_survives_a_trace_round_trip(tiny_pair, tmp_path):
    trace = decode(tiny_pair, _repeating_prompts()[:1], SpecConfig(draft_kind="lookup+model", max_new_tokens=12))
    path = tmp_path / "t.json"
    trace.save(path)
    loaded = load_trace(path)
    assert [d.drafter for d in loaded.decisions()] == [d.drafter for d in trace.decisions()]


# ---- goodness of fit when q is zero on most of the vocabulary -----------------------------------------

SUBSET_V = 512
SUBSET_K = 64
SUBSET_TV = 0.02


def _subset_pair(sampling: SamplingConfig, int8: bool) -> tuple[Pair, np.ndarray]:
    """A real SubsetHead (64 + 2 of 512 tokens) as the draft; the target puts ~40% of its mass outside S."""
    g = torch.Generator().manual_seed(99)
    head = nn.Linear(16, SUBSET_V, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(SUBSET_V, 16, generator=g))
    if int8:
        head = quantize_draft_int8(nn.Sequential(head))[0]
    ids = subset_ids(SUBSET_V, SUBSET_K, {300, 511})
    hidden = torch.randn(1, 1, 16, generator=g) * 0.5
    draft = SubsetHead(head, ids, SUBSET_V)(hidden)[0]  # [1, V]
    target = torch.randn(2, SUBSET_V, generator=g)
    target[0, ids] += 1.5  # most but not all of p inside S
    outside = np.ones(SUBSET_V, dtype=bool)
    outside[ids.numpy()] = False
    return Pair(f"subset_{'int8' if int8 else 'fp32'}", draft, target, sampling), outside


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.8, top_k=200,
                                                                                          top_p=0.95)],
                         ids=["t1", "t0.8_k200_p0.95"])
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("mode", ["baseline", "exact"])
def test_subset_draft_output_follows_the_target(mode, int8, sampling):
    """The first emitted token follows p although q = 0 outside S: tokens outside S come only from the
    residual, with p's probability. Sample size: enough to detect TV 0.02 with power 0.99 at level
    FAMILY_ALPHA / 8 (eight cases)."""
    pair, outside = _subset_pair(sampling, int8)
    p = probs_of(pair.target_logits[0], sampling)
    alpha = FAMILY_ALPHA / 8
    n = samples_to_detect_tv(SUBSET_TV, int((p > 0).sum()) - 1, alpha, POWER)
    out = run_copies(mode, pair, n, seed=4242, **({} if mode == "baseline" else {"tile_size": SUBSET_V}))
    counts = torch.bincount(out.first_token, minlength=SUBSET_V).numpy()
    assert p[outside].sum() > 0.2  # the case must put real mass where the draft cannot go
    assert (failure := gof_failure(counts, p, alpha)) is None, failure
    assert counts[outside].sum() > 0


def test_summary_and_page_say_which_draft_ran(tiny_pair):
    from specviz.figures.report import summary_markdown

    prompts = _repeating_prompts()
    mixed = decode(tiny_pair, prompts, SpecConfig(draft_kind="lookup+model", draft_vocab=3000, max_new_tokens=20))
    s = mixed.summary()
    assert 0 < s["lookup_share"] < 1 and s["cost_ratio"] > 0
    line = summary_markdown(mixed)
    assert "drafted by lookup+model" in line and "prompt lookup drafted" in line
    assert f"draft head over {mixed.meta['draft_vocab_size']:,} of {VOCAB:,} tokens" in line
    assert "measured c = " in line
    alone = decode(tiny_pair, prompts, SpecConfig(draft_kind="lookup", max_new_tokens=20))
    assert alone.summary()["lookup_share"] == 1 and alone.summary()["cost_ratio"] is None
    assert "measured c = " not in summary_markdown(alone) and "draft head" not in summary_markdown(alone)
    # the γ figure marks who drafted each iteration
    from specviz.figures.plots import gamma_figure
    names = {t.name for t in gamma_figure(mixed).data}
    assert names & {"drafted by prompt lookup", "by both (rows differ)"}  # lookup drafted somewhere
    assert names & {"drafted by the model", "by both (rows differ)"}  # and the model
    from specviz.traces.prediction import predict, sentence
    assert "Prompt lookup drafted 100% of the drafting iterations" in sentence(predict(alone))  # why it paid
    priced = decode(tiny_pair, prompts, SpecConfig(draft_kind="priced", gamma_policy="cost", max_new_tokens=20))
    assert "whichever the cost policy priced best" in summary_markdown(priced)
    assert "γ and who drafted followed this machine's measured call costs" in summary_markdown(priced)
    unpriced = decode(tiny_pair, prompts[:1], SpecConfig(draft_kind="priced", gamma_policy="hf", max_new_tokens=8))
    assert "priced by no policy" in summary_markdown(unpriced)  # only the cost policy prices who drafts


def test_bad_draft_settings_get_clear_messages(tmp_path):
    from specviz.cli.commands import _draft_variants, build_parser
    from specviz.text.prompts import InputError
    from specviz.traces.trace import TraceFormatError

    with pytest.raises(ValueError, match="unknown draft kind 'ngram'"):
        SpecConfig(draft_kind="ngram")
    with pytest.raises(ValueError, match="n-gram must be between 1 and 8"):
        SpecConfig(lookup_ngram=0)
    with pytest.raises(ValueError, match="draft vocabulary size must be >= 0"):
        SpecConfig(draft_vocab=-5)
    article = tmp_path / "a.txt"
    article.write_text("Some text to summarize.")
    args = build_parser().parse_args(["compare", str(article), "--drafts", "lookup:many"])
    with pytest.raises(InputError, match="--drafts takes KIND"):  # refused before any run starts
        _draft_variants(args, None, SpecConfig(), None)
    trace = loads_trace(_tiny_trace_json()).to_dict()
    trace["sequences"][0]["decisions"][0]["drafter"] = "oracle"
    with pytest.raises(TraceFormatError, match="drafter 'oracle'; expected one of model, lookup"):
        loads_trace(json.dumps(trace))


def _tiny_trace_json() -> str:
    from specviz.decoding.source import SequenceSpec
    from specviz.decoding.records import Completed, Decision, Iteration, Prefilled, StepRecord
    from specviz.traces.trace import TraceBuilder

    builder = TraceBuilder({"mode": "exact"}, [SequenceSpec([1, 2], "s", "s", {})], lambda ids: " ".join(map(str, ids)))
    builder.add(Prefilled([0], 0.1))
    step = StepRecord(index=0, gamma=1, sequences=[0], draft_s=0.01, target_s=0.02, verify_s=0.001, end_s=0.2,
                      real_tokens=2, pad_tokens=0, cache_slots=4, cache_holes=0)
    decision = Decision(step=0, sequence=0, gamma=1, draft_ids=[5], draft_text=["5"], q=[1.0], p=[0.5],
                        accept_prob=[0.5], uniform=[0.2], outcome=["accepted"], n_accepted=1, next_id=6,
                        next_text="6", next_kind="bonus", emitted=2, drafter=LOOKUP)
    builder.add(Iteration(step, [decision]))
    builder.add(Completed(0.3))
    return json.dumps(builder.trace.to_dict())
