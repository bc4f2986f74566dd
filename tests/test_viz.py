"""The token view, the why-panel and the figures, on small traces built by hand: what each shows, that every
trace string reaches the page escaped, and that replay (upto) shows only the iterations so far."""

from __future__ import annotations

import dataclasses
import html
import re
from html.parser import HTMLParser

import plotly.graph_objects as go
import pytest

from specviz.figures.plots import (GAMMA_COLORS, acceptance_figure, batch_figure, compare_figure, gamma_figure, theory_figure, timing_figure, verify_figure)
from specviz.runs.compare import Row
from specviz.decoding.records import (ACCEPTED, BONUS, DISCARDED, REJECTED, RESAMPLED, Decision, Examined, StepRecord, TopTokens)
from specviz.figures.token_view import token_html
from specviz.traces.trace import SequenceTrace, Trace
from specviz.figures.why_panel import why_html

HOSTILE = '"><img src=x onerror=alert(1)>'


def _step(index: int, gamma: int, verify_s: float = 50e-6) -> StepRecord:
    return StepRecord(index=index, gamma=gamma, sequences=[0], draft_s=0.01, target_s=0.05, verify_s=verify_s,
                      end_s=0.1 * (index + 1), real_tokens=gamma + 1, pad_tokens=0, cache_slots=10, cache_holes=1)


def _top(ids: list[int], probs: list[float], texts: list[str] | None = None) -> TopTokens:
    return TopTokens(ids, texts or [f"t{i}" for i in ids], probs, round(1 - sum(probs), 6))


def _rejecting(why: bool, texts: list[str] | None = None) -> Decision:
    """Iteration 0: draft 1 accepted, draft 2 rejected (u 0.51 > 0.16), drafts 3 and 4 discarded (the first
    would have passed its own test, the second not); "R" resampled from the residual."""
    texts = texts or ["a", "b", "c", "d"]
    examined = [
        Examined(0, _top([10, 30], [0.6, 0.2]), _top([10, 30], [0.5, 0.3]), None, None, None),
        Examined(1, _top([30, 31], [0.5, 0.2]), _top([11, 30], [0.625, 0.1]), _top([20, 30], [0.7, 0.2], ["R", "z"]),
                 None, None),
    ]
    return Decision(step=0, sequence=0, gamma=4, draft_ids=[10, 11, 12, 13], draft_text=texts,
                    q=[0.5, 0.625, 0.4, 0.9], p=[0.6, 0.1, 0.5, 0.3], accept_prob=[1.0, 0.16, 1.0, 0.333],
                    uniform=[0.2, 0.51, 0.3, 0.9], outcome=[ACCEPTED, REJECTED, DISCARDED, DISCARDED], n_accepted=1,
                    next_id=20, next_text="R", next_kind=RESAMPLED, emitted=2, why=examined if why else [])


def _bonus() -> Decision:
    """Iteration 1: both drafts accepted, "B" drawn from p at the bonus position."""
    examined = [Examined(0, _top([14], [0.9]), _top([14], [0.8]), None, None, None),
                Examined(1, _top([15], [0.7]), _top([15], [0.6]), None, None, None),
                Examined(2, _top([40, 41], [0.55, 0.25]), None, _top([40, 41], [0.55, 0.25], ["B", "y"]), None, None)]
    return Decision(step=1, sequence=0, gamma=2, draft_ids=[14, 15], draft_text=["e", "f"], q=[0.8, 0.6], p=[0.9, 0.7],
                    accept_prob=[1.0, 1.0], uniform=[0.2, 0.9], outcome=[ACCEPTED, ACCEPTED], n_accepted=2, next_id=40,
                    next_text="B", next_kind=BONUS, emitted=3, why=examined)


def _trace(decisions: list[Decision], mode: str = "exact", lenience: float = 1.0, label: str = "article") -> Trace:
    meta = {"mode": mode, "config": {"gamma_policy": "constant", "lenience": lenience,
                                     "sampling": {"temperature": 1.0, "top_k": 0, "top_p": 1.0}}}
    steps = [_step(d.step, d.gamma, verify_s=40e-6 * (d.step + 1)) for d in decisions]
    seq = SequenceTrace(0, label, "input", {}, [1, 2], [t for d in decisions for t in d.tokens], "", decisions,
                        "length", 0.3)
    return Trace(meta=meta, sequences=[seq], steps=steps, prefill_s=0.05, prefill_passes=1, total_s=0.3)


@pytest.fixture
def exact() -> Trace:
    return _trace([_rejecting(why=True), _bonus()])


@pytest.fixture
def old() -> Trace:
    return _trace([_rejecting(why=False)])


@pytest.fixture
def sigmoid() -> Trace:
    """Sigmoid accepted draft 1 (u 0.51 ≤ min(1, p̂/q̂)); exact's min(1, p/q) = 0.16 would have rejected it."""
    examined = [Examined(0, _top([10, 30], [0.05, 0.6]), _top([10, 30], [0.31, 0.2]), None, 0.16, 0.23),
                Examined(1, _top([40], [0.5]), None, _top([40], [0.6], ["B"]), None, 0.1)]
    d = Decision(step=0, sequence=0, gamma=1, draft_ids=[10], draft_text=["a"], q=[0.25], p=[0.3], accept_prob=[1.0],
                 uniform=[0.51], outcome=[ACCEPTED], n_accepted=1, next_id=40, next_text="B", next_kind=BONUS,
                 emitted=2, why=examined)
    return _trace([d], mode="sigmoid")


class _Markup(HTMLParser):
    """The elements and attributes a browser would build from the markup."""

    def __init__(self, text: str):
        super().__init__()
        self.tags: list[tuple[str, dict[str, str]]] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def _clickable(markup: str) -> list[dict[str, str]]:
    return [attrs for tag, attrs in _Markup(markup).tags if "sv-click" in attrs.get("class", "").split()]


def _text(markup: str) -> str:
    """What the reader sees: tags dropped, entities shown as their characters."""
    return html.unescape(re.sub(r"<[^>]+>", "", markup))


# ---- the token view ------------------------------------------------------------------------------------


def test_tokens_carry_numeric_positions_for_clicks(exact):
    spans = _clickable(token_html(exact))
    where = [(int(a["data-step"]), int(a["data-seq"]), int(a["data-pos"])) for a in spans]
    # four drafts and the resampled token (at position γ = 4), then two drafts and the bonus (position γ = 2)
    assert where == [(0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 0, 3), (0, 0, 4), (1, 0, 0), (1, 0, 1), (1, 0, 2)]
    assert all(re.fullmatch(r"\d+", a[k]) for a in spans for k in ("data-step", "data-seq", "data-pos"))
    assert all({"sv-tok", "sv-click"} <= set(a["class"].split()) for a in spans)
    legend = [a for tag, a in _Markup(token_html(exact)).tags if "sv-tok" in a.get("class", "")][:5]
    assert not any("data-step" in a for a in legend)  # the legend is not clickable


def test_tooltips_say_what_was_examined_and_what_was_not(exact):
    tips = [a["title"] for a in _clickable(token_html(exact))]
    accepted, rejected, discarded, after, resampled = tips[:5]
    assert "p(x)=0.6" in accepted and "q(x)=0.5" in accepted and "uniform=0.2" in accepted
    assert "u = 0.20 ≤ min(1, p(x)/q(x)) = 1.00: accepted" in accepted
    assert "u = 0.51 > p(x)/q(x) = 0.16: rejected" in rejected
    for tip in (discarded, after):
        assert "never examined" in tip and "rejection at draft 2" in tip
        assert "p(x)=" not in tip and "uniform" not in tip  # no numbers as if they were used
    assert "resampled from the residual max(0, p − q)" in resampled
    assert "bonus: all 2 drafts accepted; drawn from p" in tips[-1]


def test_discarded_note_counts_drafts_that_would_have_passed(exact):
    markup = token_html(exact)
    assert "1/2 discarded would have passed" in markup  # u 0.3 ≤ 1.0 passes, u 0.9 > 0.333 fails
    assert markup.count("discarded would have passed") == 1  # iteration 1 discarded nothing


def test_upto_hides_later_iterations(exact):
    first = token_html(exact, upto=1)
    assert {a["data-step"] for a in _clickable(first)} == {"0"}
    assert "#1 γ=2" not in first and "#0 γ=4" in first
    assert _clickable(token_html(exact, upto=0)) == []
    assert len(gamma_figure(exact, upto=1).data[0].x) == 1
    assert len(timing_figure(exact, upto=1).data[0].x) == 1
    assert len(verify_figure(exact, upto=1).data[0].x) == 1


def test_hostile_strings_stay_text():
    evil = _trace([_rejecting(why=True, texts=[HOSTILE, "b", HOSTILE, "</span><script>x()</script>"])],
                  label=HOSTILE)
    evil.sequences[0].decisions[0].why[1].drawn_from.texts[1] = HOSTILE
    evil.meta["prompt_text"] = HOSTILE
    pieces = [token_html(evil)] + [why_html(evil, 0, 0, k) for k in range(5)]
    for markup in pieces:
        tags = _Markup(markup).tags
        assert {tag for tag, _ in tags} <= {"div", "span", "br"}
        assert {name for _, attrs in tags for name in attrs} <= {"class", "title", "style", "data-step", "data-seq",
                                                                 "data-pos"}
        assert all(c.startswith("sv-") for _, attrs in tags for c in attrs.get("class", "").split())
        assert "<img" not in markup and "<script" not in markup
    assert HOSTILE in _text(pieces[1])  # shown to the reader as text
    assert any(attrs.get("title") == HOSTILE for _, attrs in _Markup(pieces[0]).tags)  # the lane's label, escaped


# ---- the why-panel -------------------------------------------------------------------------------------


def test_why_accepted_shows_verdict_and_both_distributions(exact):
    markup = why_html(exact, 0, 0, 0)
    text = _text(markup)
    assert "iteration 0 · sequence s1 (article) · draft 1 of 4: “a” (accepted)" in text
    assert "u = 0.20 ≤ min(1, p(x)/q(x)) = 1.00: accepted" in text
    assert "target p (softmax)" in text and "draft q (softmax)" in text
    assert markup.count("sv-bar-mark") == 2  # the drafted token outlined in p and in q
    assert 'style="width: 60.0%"' in markup and 'style="width: 50.0%"' in markup
    assert "other tokens: 0.200" in text and "residual" not in text


def test_why_rejected_shows_the_residual_and_the_drawn_token(exact):
    markup = why_html(exact, 0, 0, 1)
    text = _text(markup)
    assert "u = 0.51 > p(x)/q(x) = 0.16: rejected" in text
    assert "drafted token “b” is outside the top 2" in text  # the target's top two at draft 2 lack it
    assert "0.625 ◀ drafted" in text  # the draft's favourite
    assert "“R” was resampled from the residual max(0, p − q)" in text
    assert "0.700 ◀ drawn" in text
    assert markup.count("sv-bar-mark") == 2  # b in q, R in the residual


def test_why_resampled_and_bonus_tokens_say_what_they_were_drawn_from(exact):
    resampled = _text(why_html(exact, 0, 0, 4))
    assert "resampled token: “R”" in resampled
    assert "draft 2 (“b”) was rejected (u = 0.51 > p(x)/q(x) = 0.16: rejected)" in resampled
    assert "0.700 ◀ drawn" in resampled
    bonus = _text(why_html(exact, 1, 0, 2))
    assert "bonus token: “B”" in bonus and "all 2 drafts were accepted" in bonus and "drawn from p" in bonus
    assert "0.550 ◀ drawn" in bonus and "other tokens: 0.200" in bonus


def test_why_discarded_is_never_examined(exact):
    passed = _text(why_html(exact, 0, 0, 2))
    assert "never examined: drafted after the rejection at draft 2" in passed
    assert "u = 0.30 ≤ min(1, p(x)/q(x)) = 1.00: would have passed" in passed
    assert "sv-bar" not in why_html(exact, 0, 0, 2)  # nothing was recorded for it
    failed = _text(why_html(exact, 0, 0, 3))
    assert "u = 0.90 > p(x)/q(x) = 0.33: would have failed" in failed


def test_why_without_recorded_distributions(old):
    text = _text(why_html(old, 0, 0, 1))
    assert "u = 0.51 > p(x)/q(x) = 0.16: rejected" in text
    assert "p(x) = 0.1 · q(x) = 0.625" in text and "uniform u = 0.51" in text
    assert "distributions were not recorded" in text and "sv-bar" not in why_html(old, 0, 0, 1)
    assert "distributions were not recorded" in _text(why_html(old, 0, 0, 4))


def test_why_sigmoid_against_exact(sigmoid):
    markup = why_html(sigmoid, 0, 0, 0)
    text = _text(markup)
    assert "sigmoid: p̂(x) = 0.3, q̂(x) = 0.25; u = 0.51 ≤ min(1, p̂(x)/q̂(x)) = 1.00: accepted" in text
    assert "exact (softmax): p(x) = 0.05, q(x) = 0.31; u = 0.51 > p(x)/q(x) = 0.16: exact would have rejected" in text
    assert "total-variation distance of p̂ (normalized) from p: 0.230" in text
    assert "sv-why-warn" in markup and "decide differently" in text
    tip = _clickable(token_html(sigmoid))[0]["title"]
    assert "p̂(x)=0.3" in tip and "q̂(x)=0.25" in tip


def test_why_with_lenience_names_l():
    trace = _trace([_rejecting(why=True)], lenience=0.5)
    text = _text(why_html(trace, 0, 0, 1))
    assert "u = 0.51 > p(x)/(l·q(x)) = 0.16: rejected" in text and "lenience l = 0.5" in text
    assert "max(0, p − l·q)" in text


@pytest.mark.parametrize("where", [(9, 0, 0), (0, 3, 0), (0, 0, 5), (0, 0, -1), ("x", 0, 0), (None, 0, 0),
                                   (0.5, 0, 0), (float("nan"), 0, 0), (10**400, 0, 0), ("1e400", 0, 0)])
def test_why_for_no_token_asks_for_a_click(exact, where):
    assert "Click a token" in why_html(exact, *where)


def test_why_accepts_indices_as_the_page_sends_them(exact):
    assert why_html(exact, "0", "0", "1") == why_html(exact, 0, 0, 1)


def test_target_only_token():
    d = Decision(step=0, sequence=0, gamma=0, draft_ids=[], draft_text=[], q=[], p=[], accept_prob=[], uniform=[],
                 outcome=[], n_accepted=0, next_id=5, next_text="t", next_kind="target", emitted=1)
    trace = _trace([d], mode="target-only")
    assert [a["data-pos"] for a in _clickable(token_html(trace))] == ["0"]
    text = _text(why_html(trace, 0, 0, 0))
    assert "target token: “t”" in text and "nothing was verified" in text
    assert list(verify_figure(trace).data[0].x) == []  # target-only iterations verify nothing


# ---- figures -------------------------------------------------------------------------------------------


def _axes(fig: go.Figure) -> dict[str, dict]:
    layout = fig.layout.to_plotly_json()
    return {k: v for k, v in layout.items() if re.fullmatch(r"[xy]axis\d*", k)}


def test_every_axis_of_every_figure_has_a_title(exact):
    rows = [_row("exact", 10.0, [], 1.5, 1.5, 1.5, 2.0, 0.05)]
    figures = [gamma_figure(exact), acceptance_figure(exact), timing_figure(exact),
               verify_figure(exact), batch_figure(exact), theory_figure(exact, measured_speedup=1.2),
               compare_figure(rows)]
    for fig in figures:
        axes = _axes(fig)
        assert axes, fig.layout.title.text
        for name, axis in axes.items():
            assert axis.get("title", {}).get("text"), (fig.layout.title.text, name)
        assert fig.layout.legend.orientation == "h" and fig.layout.autosize


def test_gamma_line_sits_on_its_bars(exact):
    bars, line, *markers = gamma_figure(exact).data
    assert list(bars.x) == list(line.x) == [0, 1]
    assert list(line.y) == [4, 2] and list(bars.y) == [1, 2]
    assert line.line.shape == "hvh"
    # who drafted, a marker on each iteration's γ: here the model both times
    assert [(m.name, list(m.x), list(m.y)) for m in markers] == [("drafted by the model", [0, 1], [4, 2])]


def test_acceptance_explains_alpha_and_rate(exact):
    fig = acceptance_figure(exact)
    assert "the chance a draft passes" in fig.layout.title.text
    assert "drafts after a rejection count as not accepted" in fig.layout.title.text
    rate = next(t for t in fig.data if t.name == "acceptance rate")
    assert list(rate.y) == [0.25, 1.0]  # 1 of 4, 2 of 2
    alpha = next(t for t in fig.data if t.name == "running α")
    assert alpha.y[0] == pytest.approx((1.0 + 0.16) / 2)  # the discarded drafts are not examined


def test_theory_marks_prediction_and_measurement(exact):
    fig = theory_figure(exact)
    names = [t.name for t in fig.data]
    assert "predicted from this run's α and c" in names
    assert "measured (vs target-only)" not in names
    assert fig.layout.title.text == "theory (Leviathan et al. §3): prediction vs measurement"
    measured = theory_figure(exact, measured_speedup=1.7)
    marker = next(t for t in measured.data if t.name == "measured (vs target-only)")
    assert list(marker.y) == [1.7] and marker.xaxis == "x2" and marker.marker.symbol == "diamond"
    assert marker.x[0] == pytest.approx(exact.alpha_estimate())
    assert "predicted from this run's α and c" in [t.name for t in theory_figure(exact, upto=1).data]


def test_theory_gamma_colours_match_across_subplots(exact):
    curves = [t for t in theory_figure(exact).data if t.name.startswith("γ=")]
    by_name: dict[str, set] = {}
    for t in curves:
        by_name.setdefault(t.name, set()).add(t.line.color)
    assert len(curves) == 2 * len(by_name) == 2 * len(GAMMA_COLORS)
    assert all(len(colors) == 1 for colors in by_name.values())
    assert len({c for colors in by_name.values() for c in colors}) == len(by_name)


def test_verify_figure_shows_microseconds_and_share(exact):
    fig = verify_figure(exact)
    box = fig.data[0]
    assert [round(x) for x in box.x] == [40, 80]  # µs per call
    shares = {t.name.split()[0]: t.x[0] for t in fig.data[1:]}
    assert sum(shares.values()) == pytest.approx(100)
    assert shares["verify"] == pytest.approx(100 * 120e-6 / (0.02 + 0.1 + 120e-6))
    assert any("median 60 µs" in a.text for a in fig.layout.annotations)


def _row(name: str, tokens_per_s: float, runs: list[float], e2e: float, low: float, high: float, decode: float,
         verify_ms: float | None) -> Row:
    return Row(name=name, tokens_per_s=tokens_per_s, tokens_per_s_per_sequence=tokens_per_s, speedup_end_to_end=e2e,
               speedup_end_to_end_min=low, speedup_end_to_end_max=high, speedup_decode=decode, alpha=None,
               tokens_per_iteration=None, median_verify_ms=verify_ms, equals_target_only=True, new_tokens=8, total_s=1.0,
               output_text="", tokens_per_s_runs=runs, decode_tokens_per_s=tokens_per_s)


def test_compare_figure_error_bars_from_rounds():
    rows = [_row("target-only", 10.0, [9.0, 10.0, 12.0], 1.0, 1.0, 1.0, 1.0, None),
            _row("exact", 15.0, [14.0, 16.0, 15.0], 1.5, 1.4, 1.6, 1.9, 0.04)]
    fig = compare_figure(rows)
    bars = fig.data[0]
    assert list(bars.x) == [10.0, 15.0]  # medians of the rounds
    assert list(bars.error_x.array) == [2.0, 1.0] and list(bars.error_x.arrayminus) == [1.0, 1.0]
    assert list(bars.text) == ["1.00× end to end (1.00–1.00) · 1.00× decoding",
                               "1.50× end to end (1.40–1.60) · 1.90× decoding"]
    assert "median of 3 rounds" in fig.layout.title.text
    assert list(fig.data[1].x) == [pytest.approx(40.0)]  # verify in µs
    one_round = compare_figure([dataclasses.replace(r, tokens_per_s_runs=[r.tokens_per_s]) for r in rows])
    assert one_round.data[0].error_x.array is None
    assert list(one_round.data[0].text) == ["1.00× end to end · 1.00× decoding", "1.50× end to end · 1.90× decoding"]
    assert "one round" in one_round.layout.title.text
    bare = compare_figure([dataclasses.replace(r, tokens_per_s_runs=[]) for r in rows])
    assert list(bare.data[0].x) == [10.0, 15.0] and bare.data[0].error_x.array is None


def test_why_panel_shows_ten_bars_and_always_the_drafted_token():
    """Of 20 recorded tokens the panel draws 10, plus the drafted one when it ranks lower; the hidden ones'
    mass joins "other tokens"."""
    from specviz.decoding.records import TopTokens
    from specviz.figures.why_panel import WHY_ROWS, _bars

    probs = [0.5 / 20] * 20
    top = TopTokens(ids=list(range(20)), texts=[f"t{i}" for i in range(20)], probs=probs, rest=0.5)
    html_out = _bars("p", top, "p", 15, "t15", "drafted")
    rows = re.compile(r'class="sv-bar( sv-bar-mark)?"')
    assert len(rows.findall(html_out)) == WHY_ROWS + 1 == 11
    assert "t15" in html_out and "t16" not in html_out
    assert "other tokens: 0.725" in html_out  # 0.5 + 9 hidden × 0.025
    outside = _bars("p", top, "p", 99, "x", "drafted")
    assert "outside the top 20 recorded" in outside and len(rows.findall(outside)) == 10


# ---- the summary at a glance ---------------------------------------------------------------------------


def _cards(html_text: str) -> dict[str, str]:
    """label → value of each glance card."""
    found = re.findall(r'<div class="sv-card[^"]*"><div class="sv-label">(.*?)</div><div class="sv-value">(.*?)</div>',
                       html_text)
    return dict(found)


def test_glance_leads_with_measured_figures_and_labels_a_prediction(exact):
    from specviz.figures.report import glance_html, summary_markdown

    # not measured: no "measured" card; a prediction is only shown labelled as one (none without a cost table)
    cards = _cards(glance_html(exact))
    assert not any("measured speedup" in label for label in cards)
    assert cards["α"] == f"{exact.summary()['alpha']:.2f}" and cards["who drafted"] == "draft model"
    assert cards["tokens / iteration"] == f"{exact.summary()['tokens_per_iteration']:.2f}"
    measured = dataclasses.replace(exact, meta={**exact.meta, "target_only": {
        "tokens_per_s": exact.tokens_per_s / 2, "decode_tokens_per_s": exact.decode_tokens_per_s / 2,
        "prefill_s": 0.0, "new_tokens": exact.new_tokens, "reused": False, "outputs": exact.outputs}})
    cards = _cards(glance_html(measured))
    assert cards["measured speedup (decoding)"] == "2.00×"
    assert "faster than target-only" in glance_html(measured)
    assert summary_markdown(measured).startswith('<div class="sv-glance">')  # figures first, sentences after
    target_only = _trace([Decision(step=0, sequence=0, gamma=0, draft_ids=[], draft_text=[], q=[], p=[],
                                   accept_prob=[], uniform=[], outcome=[], n_accepted=0, next_id=5, next_text="t",
                                   next_kind="target", emitted=1)], mode="target-only")
    assert set(_cards(glance_html(target_only))) == {"tokens/s"}
