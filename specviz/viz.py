"""Figures, the colored-token view and the why-panel, built from a trace alone (never from a model).

Token colours follow Leviathan et al. Figure 1: accepted drafts green, rejected red and struck through,
the resampled correction blue; the bonus token (all γ accepted) has its own colour; drafts after a
rejection are grey.

Every string of a trace is untrusted (a trace may be a shared JSON file): it is html-escaped wherever it
reaches markup or a plotly label, and class names come from fixed tables, never from a trace.
"""

from __future__ import annotations

import html
import math
import statistics
from dataclasses import dataclass

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from . import theory
from .cost import CostModel, expected_speedup
from .prediction import predict
from .records import ACCEPTED, BONUS, DISCARDED, REJECTED, RESAMPLED, TARGET, Decision, Examined, TopTokens
from .trace import Trace, json_number

COLORS = {ACCEPTED: "#1a7f37", REJECTED: "#cf222e", DISCARDED: "#8c959f", RESAMPLED: "#0969da", BONUS: "#8250df"}
TIMING_COLORS = {"draft": "#54aeff", "target": "#fd8c73", "verify": "#2da44e"}
# One colour per γ of the theory curves, the same in both of its subplots.
GAMMA_COLORS = {1: "#0969da", 2: "#1a7f37", 3: "#bf8700", 5: "#cf222e", 7: "#8250df", 10: "#57606a"}
PREDICTED_COLOR, MEASURED_COLOR = "#24292f", "#e16f24"


TOKEN_CSS = """
.sv-tokens { font-family: ui-monospace, SFMono-Regular, Menlo, monospace; font-size: 13px; line-height: 1.9;
             overflow-x: auto; }
.sv-line { white-space: nowrap; width: max-content; min-width: 100%; }
.sv-iter { color: #57606a; display: inline-block; min-width: 8ch; padding-right: 1ch; position: sticky; left: 0;
           z-index: 1; background: var(--background-fill-primary, #fff); }
.sv-tok { padding: 1px 3px; margin: 0 1px; border-radius: 3px; white-space: pre; }
.sv-click { cursor: pointer; }
.sv-click:hover { outline: 1px solid #57606a; }
.sv-selected { outline: 2px solid #0969da; }
.sv-accepted { background: #dafbe1; color: #1a7f37; }
.sv-rejected { background: #ffebe9; color: #cf222e; text-decoration: line-through; }
.sv-discarded { color: #8c959f; text-decoration: line-through; }
.sv-resampled { background: #ddf4ff; color: #0969da; font-weight: 600; }
.sv-bonus { background: #fbefff; color: #8250df; font-weight: 600; }
.sv-legend { display: flex; flex-wrap: wrap; gap: 2px 1em; white-space: normal; }
.sv-prompt { background: #eaeef2; color: #57606a; }
.sv-window { color: #57606a; font-style: italic; }
.sv-step { color: #57606a; font-size: 11px; margin-top: 6px; border-top: 1px solid #d0d7de; white-space: normal; }
.sv-target { background: #eaeef2; color: #24292f; }
.sv-note { color: #57606a; font-size: 11px; margin-left: 0.8em; }
@media (max-width: 600px) {
  .sv-tokens { font-size: 12px; }
}
"""

# The why-panel (why_html): bars are plain HTML, so the panel needs no plotly.
WHY_CSS = """
.sv-why { font-size: 13px; line-height: 1.5; }
.sv-why-empty { color: #57606a; font-style: italic; }
.sv-why-head { font-weight: 600; margin-bottom: 4px; overflow-wrap: anywhere; }
.sv-why-line { margin: 4px 0; overflow-wrap: anywhere; }
.sv-why-ok { color: #1a7f37; font-weight: 600; }
.sv-why-bad { color: #cf222e; font-weight: 600; }
.sv-why-info { color: #57606a; }
.sv-why-warn { background: #fff8c5; border-left: 4px solid #bf8700; padding: 4px 8px; }
.sv-why-same { background: #f6f8fa; border-left: 4px solid #8c959f; padding: 4px 8px; }
.sv-why-dists { display: flex; flex-wrap: wrap; gap: 12px; margin: 6px 0; }
.sv-why-dist { flex: 1 1 220px; min-width: 0; }
.sv-why-title { font-weight: 600; font-size: 12px; }
.sv-bar { display: flex; align-items: center; gap: 4px; font-family: ui-monospace, SFMono-Regular, Menlo, monospace;
          font-size: 12px; }
.sv-bar-tok { flex: 0 0 7em; overflow: hidden; text-overflow: ellipsis; white-space: pre; }
.sv-bar-track { flex: 1 1 auto; background: #eaeef2; height: 10px; border-radius: 2px; min-width: 40px; }
.sv-bar-fill { display: block; height: 100%; border-radius: 2px; min-width: 1px; }
.sv-fill-p { background: #fd8c73; }
.sv-fill-q { background: #54aeff; }
.sv-fill-r { background: #0969da; }
.sv-bar-val { flex: 0 0 auto; min-width: 3.5em; text-align: right; white-space: nowrap; }
.sv-bar-mark { font-weight: 700; outline: 2px solid #24292f; outline-offset: -1px; }
.sv-bar-rest, .sv-bar-note { color: #57606a; font-size: 12px; }
"""


# ---- notation ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Notation:
    """How this trace's verifier wrote its test: the sigmoid's p̂, q̂ or the softmax p, q, and lenience l."""

    sigmoid: bool
    lenience: float

    @property
    def p(self) -> str:
        return "p̂" if self.sigmoid else "p"

    @property
    def q(self) -> str:
        return "q̂" if self.sigmoid else "q"

    @property
    def ratio(self) -> str:
        if self.lenience == 1:
            return f"{self.p}(x)/{self.q}(x)"
        return f"{self.p}(x)/(l·{self.q}(x))"

    @property
    def residual(self) -> str:
        return f"max(0, {self.p} − {'l·' if self.lenience != 1 else ''}{self.q})"


def _config(trace: Trace) -> dict:
    config = trace.meta.get("config")
    return config if isinstance(config, dict) else {}


def _notation(trace: Trace) -> _Notation:
    config = _config(trace)
    sampling = config.get("sampling")
    temperature = json_number(sampling.get("temperature")) if isinstance(sampling, dict) else None
    # Greedy sigmoid compares one-hot argmaxes like exact, so only sampled sigmoid runs record p̂ and q̂.
    sigmoid = trace.meta.get("mode") == "sigmoid" and temperature != 0
    lenience = json_number(config.get("lenience"))
    return _Notation(sigmoid, lenience if lenience is not None and 0 < lenience <= 1 else 1.0)


def _pair(u: float, a: float) -> tuple[str, str]:
    """u and a with enough decimals that the printed values order as the numbers do."""
    for digits in range(2, 7):
        us, as_ = f"{u:.{digits}f}", f"{a:.{digits}f}"
        if (us == as_) == (u == a):
            break
    return us, as_


def _verdict(u: float, a: float, outcome: str, n: _Notation) -> str:
    """'u = 0.51 > p(x)/q(x) = 0.16: rejected' (u ≤ a accepts; a = min(1, ratio), so a < 1 shows the ratio)."""
    us, as_ = _pair(u, a)
    test = f"min(1, {n.ratio})" if u <= a else n.ratio
    return f"u = {us} {'≤' if u <= a else '>'} {test} = {as_}: {outcome}"


def _passes_own_test(d: Decision, k: int) -> bool:
    return d.uniform[k] <= d.accept_prob[k]


# ---- the token view ------------------------------------------------------------------------------------


def _visible(text: str) -> str:
    return html.escape(text.replace("\n", "⏎").replace("\t", "⇥")) or "∅"


# Class names come from this table, never from a trace's strings (a loaded trace is untrusted input).
_TOKEN_CLASS = {ACCEPTED: "sv-accepted", REJECTED: "sv-rejected", DISCARDED: "sv-discarded", RESAMPLED: "sv-resampled",
                BONUS: "sv-bonus", TARGET: "sv-target"}


def _token(text: str, kind: str, tip: str, where: tuple[int, int, int] | None = None) -> str:
    """A token span; `where` = (step, sequence, position) makes it clickable for the why-panel."""
    classes = f"sv-tok {_TOKEN_CLASS.get(kind, 'sv-discarded')}"
    data = ""
    if where is not None:
        step, seq, pos = (int(v) for v in where)  # integers formatted here, never trace text
        classes += " sv-click"
        data = f' data-step="{step}" data-seq="{seq}" data-pos="{pos}"'
    return f'<span class="{classes}"{data} title="{html.escape(tip, quote=True)}">{_visible(text)}</span>'


def _draft_tip(d: Decision, k: int, n: _Notation) -> str:
    outcome = d.outcome[k]
    if outcome == DISCARDED:
        return (f"discarded: drafted after the rejection at draft {d.n_accepted + 1}, so never examined "
                f"(click to see whether its own test would have passed)")
    return (f"{outcome}: {n.p}(x)={d.p[k]:.4g}  {n.q}(x)={d.q[k]:.4g}  accept prob={d.accept_prob[k]:.4g}  "
            f"uniform={d.uniform[k]:.4g} · {_verdict(d.uniform[k], d.accept_prob[k], outcome, n)}")


def _next_tip(d: Decision, n: _Notation) -> str:
    if d.next_kind == RESAMPLED:
        return f"resampled from the residual {n.residual} (normalized) after draft {d.n_accepted + 1} was rejected"
    if d.next_kind == BONUS:
        return f"bonus: all {d.gamma} drafts accepted; drawn from {n.p}"
    return "target-only: drawn from p; nothing drafted or verified"


def _discard_note(d: Decision) -> str:
    """'2/3 discarded would have passed': drafts after a rejection whose own test (u ≤ accept prob) passed."""
    discarded = [k for k, o in enumerate(d.outcome) if o == DISCARDED]
    if not discarded:
        return ""
    passed = sum(_passes_own_test(d, k) for k in discarded)
    return (f'<span class="sv-note" title="drafts after a rejection are never examined; these passed their own '
            f'test u ≤ accept prob">{passed}/{len(discarded)} discarded would have passed</span>')


def _decision_spans(d: Decision, n: _Notation) -> str:
    spans = [_token(tok, d.outcome[k], _draft_tip(d, k, n), (d.step, d.sequence, k))
             for k, tok in enumerate(d.draft_text)]
    spans.append(_token(d.next_text, d.next_kind, _next_tip(d, n), (d.step, d.sequence, d.gamma)))
    return "".join(spans) + _discard_note(d)


def decisions_by_step(trace: Trace) -> dict[tuple[int, int], Decision]:
    """(step index, sequence index) -> that sequence's decision in that iteration."""
    return {(d.step, d.sequence): d for s in trace.sequences for d in s.decisions}


def _replay(trace: Trace, upto: int | None) -> Trace:
    """The trace as it stood before iteration `upto` (replay); the whole trace when upto is None."""
    return trace if upto is None else trace.until(max(0, upto))


def token_html(trace: Trace, upto: int | None = None) -> str:
    """One line per iteration and sequence (a lane per sequence in a batch); hovering a token shows p(x), q(x),
    its acceptance probability and the uniform; each token carries data-step/-seq/-pos for the why-panel.
    upto: only iterations with index < upto (replay)."""
    trace = _replay(trace, upto)
    n = _notation(trace)
    legend = "".join(_token(k, k, k) for k in (ACCEPTED, REJECTED, RESAMPLED, BONUS, DISCARDED))
    lines = [f'<div class="sv-legend">{legend}</div>']
    prompt_text = trace.meta.get("prompt_text")
    if isinstance(prompt_text, str) and prompt_text:  # speech: the decoder prompt, marked as prompt
        lines.append(f'<div class="sv-line"><span class="sv-iter">prompt</span>'
                     f'<span class="sv-tok sv-prompt" title="decoder prompt, not decoded">{_visible(prompt_text)}</span></div>')
    several = len(trace.sequences) > 1
    batched = trace.batch_size > 1
    by_step = decisions_by_step(trace)
    current = None
    for step in trace.steps:
        members = [s for s in step.sequences if (step.index, s) in by_step]
        if batched:
            lines.append(f'<div class="sv-step">#{step.index} γ={step.gamma} · one target call for '
                         f'{len(members)} sequence{"s" if len(members) != 1 else ""}</div>')
        elif several and members and members[0] != current:  # one after another: mark where each starts
            current = members[0]
            lines.append(f'<div class="sv-line sv-window">{_visible(trace.sequences[current].label)}</div>')
        for s in members:
            d = by_step[(step.index, s)]
            head = f"s{s + 1} γ={d.gamma}" if batched else f"#{step.index} γ={d.gamma}"
            label = html.escape(trace.sequences[s].label, quote=True)
            lines.append(f'<div class="sv-line sv-lane"><span class="sv-iter" title="{label}">{head}</span>'
                         f"{_decision_spans(d, n)}</div>")
    return f'<div class="sv-tokens">{"".join(lines)}</div>'


# ---- the why-panel -------------------------------------------------------------------------------------

_CLICK_MESSAGE = "Click a token in the token view to see why verification kept, rejected or drew it."
_NOT_RECORDED = "The distributions were not recorded for this iteration (an older trace, or recording was off)."
_VERDICT_CLASS = {ACCEPTED: "sv-why-ok", REJECTED: "sv-why-bad"}
_FILL_CLASS = {"p": "sv-fill-p", "q": "sv-fill-q", "r": "sv-fill-r"}


def _as_index(value: object) -> int | None:
    """An index from the page (an int, or a string or float its script sent), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    try:
        number = float(value) if isinstance(value, (float, str)) else math.nan
    except ValueError:
        return None
    return int(number) if math.isfinite(number) and number.is_integer() else None


def _locate(trace: Trace, step: object, seq: object, pos: object) -> tuple[Decision, int] | None:
    step_i, seq_i, pos_i = _as_index(step), _as_index(seq), _as_index(pos)
    d = decisions_by_step(trace).get((step_i, seq_i))
    if d is None or pos_i is None or not 0 <= pos_i <= d.gamma:
        return None
    return d, pos_i


def _examined_at(d: Decision, k: int) -> Examined | None:
    return next((e for e in d.why if e.position == k), None)


def _line(text: str, css: str = "sv-why-line") -> str:
    """A line of the panel; text is already escaped, css comes from this module's own names."""
    return f'<div class="{css}">{text}</div>'


def _bar_row(text: str, prob: float, fill: str, mark_label: str | None) -> str:
    width = min(100.0, max(0.0, 100.0 * prob))  # absolute scale, so p and q bars compare
    mark = f" ◀ {mark_label}" if mark_label else ""
    row_class = "sv-bar sv-bar-mark" if mark_label else "sv-bar"
    return (f'<div class="{row_class}"><span class="sv-bar-tok">{_visible(text)}</span>'
            f'<span class="sv-bar-track"><span class="sv-bar-fill {_FILL_CLASS[fill]}" style="width: {width:.1f}%">'
            f'</span></span><span class="sv-bar-val">{prob:.3f}{mark}</span></div>')


WHY_ROWS = 10  # bars shown per distribution (the trace keeps up to explain_top); the marked token always shows


def _bars(title: str, top: TopTokens, fill: str, mark_id: int, mark_text: str, mark_label: str) -> str:
    """Horizontal bars of a distribution's top tokens (width = probability), the marked token outlined."""
    rows = [f'<div class="sv-why-title">{html.escape(title)}</div>']
    entries = list(zip(top.ids, top.texts, top.probs))
    shown = [k for k, (tid, _, _) in enumerate(entries) if k < WHY_ROWS or tid == mark_id]
    rows += [_bar_row(entries[k][1], entries[k][2], fill, mark_label if entries[k][0] == mark_id else None)
             for k in shown]
    if mark_id not in top.ids:
        rows.append(f'<div class="sv-bar-note">{mark_label} token “{_visible(mark_text)}” is outside the top '
                    f'{len(top.ids)} recorded</div>')
    hidden = sum(prob for k, (_, _, prob) in enumerate(entries) if k not in shown)
    rows.append(f'<div class="sv-bar-rest">other tokens: {top.rest + hidden:.3f}</div>')
    return f'<div class="sv-why-dist">{"".join(rows)}</div>'


def _dists(*columns: str) -> str:
    return f'<div class="sv-why-dists">{"".join(columns)}</div>'


def _prob_in(top: TopTokens | None, token: int) -> str:
    """'= 0.05', or a note when the token is not among the recorded top tokens."""
    if top is None or token not in top.ids:
        return "not among the recorded top tokens"
    return f"= {top.probs[top.ids.index(token)]:.4g}"


def _header(trace: Trace, d: Decision, k: int) -> str:
    label = html.escape(trace.sequences[d.sequence].label[:60])
    where = f"iteration {d.step} · sequence s{d.sequence + 1} ({label})"
    if k < d.gamma:
        what = f"draft {k + 1} of {d.gamma}: “{_visible(d.draft_text[k])}” ({html.escape(d.outcome[k])})"
    else:
        what = f"{html.escape(d.next_kind)} token: “{_visible(d.next_text)}”"
    return _line(f"{where} · {what}", "sv-why-head")


def _recorded(d: Decision, k: int, n: _Notation) -> str:
    return _line(f"recorded: {n.p}(x) = {d.p[k]:.4g} · {n.q}(x) = {d.q[k]:.4g} · accept prob min(1, {n.ratio}) = "
                 f"{d.accept_prob[k]:.4g} · uniform u = {d.uniform[k]:.4g}"
                 + (f" · lenience l = {n.lenience:g}" if n.lenience != 1 else ""), "sv-why-info")


def _sigmoid_vs_exact(d: Decision, k: int, e: Examined, n: _Notation) -> str:
    """The sigmoid's decision beside what exact verification would have done with the same uniform."""
    u, x = d.uniform[k], d.draft_ids[k]
    exact = _Notation(sigmoid=False, lenience=n.lenience)
    exact_outcome = ACCEPTED if u <= e.exact_accept_prob else REJECTED
    differ = exact_outcome != d.outcome[k]
    lines = [
        f"sigmoid: p̂(x) = {d.p[k]:.4g}, q̂(x) = {d.q[k]:.4g}; "
        f"{html.escape(_verdict(u, d.accept_prob[k], d.outcome[k], n))}",
        f"exact (softmax): p(x) {_prob_in(e.p, x)}, q(x) {_prob_in(e.q, x)}; "
        f"{html.escape(_verdict(u, e.exact_accept_prob, 'exact would have ' + exact_outcome, exact))}",
    ]
    if e.sigmoid_tv is not None:
        lines.append(f"total-variation distance of p̂ (normalized) from p: {e.sigmoid_tv:.3f}")
    lines.append("⚠ sigmoid and exact decide differently here" if differ else "sigmoid and exact agree here")
    return _line("<br>".join(lines), "sv-why-warn" if differ else "sv-why-same")


def _why_examined(d: Decision, k: int, n: _Notation) -> list[str]:
    outcome = d.outcome[k]
    parts = [_line(html.escape(_verdict(d.uniform[k], d.accept_prob[k], outcome, n)),
                   _VERDICT_CLASS.get(outcome, "sv-why-info")), _recorded(d, k, n)]
    e = _examined_at(d, k)
    if e is None:
        return parts + [_line(_NOT_RECORDED, "sv-why-empty")]
    if e.exact_accept_prob is not None:
        parts.append(_sigmoid_vs_exact(d, k, e, n))
    x, text = d.draft_ids[k], d.draft_text[k]
    columns = [_bars("target p (softmax)", e.p, "p", x, text, "drafted")]
    if e.q is not None:
        columns.append(_bars("draft q (softmax)", e.q, "q", x, text, "drafted"))
    parts.append(_dists(*columns))
    if e.drawn_from is not None:  # the rejected position: where the correction came from
        parts.append(_line(f"so “{_visible(d.next_text)}” was resampled from the residual {n.residual}, "
                           f"normalized:"))
        parts.append(_dists(_bars(f"residual {n.residual}", e.drawn_from, "r", d.next_id, d.next_text, "drawn")))
    return parts


def _why_discarded(d: Decision, k: int, n: _Notation) -> list[str]:
    passed = _passes_own_test(d, k)
    own = html.escape(_verdict(d.uniform[k], d.accept_prob[k], "would have " + ("passed" if passed else "failed"), n))
    return [_line(f"never examined: drafted after the rejection at draft {d.n_accepted + 1}, where verification "
                  f"stopped, so it was thrown away unseen.", "sv-why-empty"),
            _line(f"its own test (same recorded uniform): {own}", "sv-why-info")]


def _next_intro(d: Decision, n: _Notation) -> tuple[int, str, str] | None:
    """(examined position, explanation, title of its distribution) of the token verification added."""
    k = d.n_accepted
    if d.next_kind == RESAMPLED and k < d.gamma:
        verdict = html.escape(_verdict(d.uniform[k], d.accept_prob[k], REJECTED, n))
        return k, (f"draft {k + 1} (“{_visible(d.draft_text[k])}”) was rejected ({verdict}), so this token was "
                   f"drawn from the residual {n.residual}, normalized: the mass where the target wants more than "
                   f"the draft gave."), f"residual {n.residual}"
    if d.next_kind == BONUS:
        return d.gamma, (f"bonus: all {d.gamma} drafts were accepted, so the target's distribution after them "
                         f"gives one more token for free, drawn from {n.p}."), f"{n.p} after the last draft"
    return None  # target-only, or a loaded trace whose kind and counts disagree


def _why_next(d: Decision, n: _Notation) -> list[str]:
    intro = _next_intro(d, n)
    if intro is None:
        return [_line("the target's own token, drawn from p; nothing was verified.")]
    k, text, title = intro
    e = _examined_at(d, k)
    parts = [_line(text)]
    if e is None or e.drawn_from is None:
        return parts + [_line(_NOT_RECORDED, "sv-why-empty")]
    if e.sigmoid_tv is not None:
        parts.append(_line(f"total-variation distance of p̂ (normalized) from p here: {e.sigmoid_tv:.3f}",
                           "sv-why-info"))
    return parts + [_dists(_bars(title, e.drawn_from, "r", d.next_id, d.next_text, "drawn"))]


def why_html(trace: Trace, step: int, seq: int, pos: int) -> str:
    """The why-panel for the token at (iteration, sequence, draft position; γ = the token verification added):
    the test in numbers, the distributions behind it, and what a discarded draft's own test would have said.
    Anything that names no token gives a short 'click a token' message."""
    found = _locate(trace, step, seq, pos)
    if found is None:
        return f'<div class="sv-why">{_line(_CLICK_MESSAGE, "sv-why-empty")}</div>'
    d, k = found
    n = _notation(trace)
    if k == d.gamma:
        body = _why_next(d, n)
    elif d.outcome[k] == DISCARDED:
        body = _why_discarded(d, k, n)
    else:
        body = _why_examined(d, k, n)
    return f'<div class="sv-why">{_header(trace, d, k)}{"".join(body)}</div>'


# ---- figures -------------------------------------------------------------------------------------------


def _layout(fig: go.Figure, title: str, height: int = 320, top: int = 60) -> go.Figure:
    """Phone-friendly defaults: container width, horizontal legend below, small subplot titles."""
    fig.update_layout(title=dict(text=title, x=0.01, xanchor="left", font=dict(size=14)), template="plotly_white",
                      autosize=True, height=height, margin=dict(l=55, r=15, t=top, b=40), font=dict(size=11),
                      legend=dict(orientation="h", x=0, xanchor="left", y=-0.3, yanchor="top"))
    fig.update_annotations(font_size=11)
    return fig


def _steps_with(trace: Trace) -> list[tuple]:
    """(step, its decisions that drafted) for every iteration, in order."""
    by_step: dict[int, list[Decision]] = {}
    for d in trace.drafted():
        by_step.setdefault(d.step, []).append(d)
    return [(step, by_step.get(step.index, [])) for step in trace.steps]


def gamma_figure(trace: Trace, upto: int | None = None) -> go.Figure:
    """γ per iteration as a step line centred on each iteration's bar of accepted drafts."""
    trace = _replay(trace, upto)
    rows = _steps_with(trace)
    policy = html.escape(str(_config(trace).get("gamma_policy", "?"))[:40])
    batched = len(trace.sequences) > 1
    x = [step.index for step, _ in rows]
    fig = go.Figure(go.Bar(x=x, y=[sum(d.n_accepted for d in ds) / len(ds) if ds else 0 for _, ds in rows],
                           name="accepted (mean over sequences)" if batched else "accepted", opacity=0.5,
                           marker_color=COLORS[ACCEPTED]))
    # hvh: the level changes half-way between iterations, so each bar sits under its own γ
    fig.add_trace(go.Scatter(x=x, y=[step.gamma for step, _ in rows], mode="lines+markers", name="γ (drafted)",
                             line_shape="hvh", line_color="#24292f"))
    fig.update_xaxes(title="iteration")
    fig.update_yaxes(title="tokens per iteration", rangemode="tozero")
    return _layout(fig, f"γ per iteration (policy: {policy})")


_ALPHA_NOTE = ("α: mean of min(1, p/q) over examined drafts (the chance a draft passes)<br>"
               "acceptance rate: accepted / drafted (drafts after a rejection count as not accepted)")


def _running_alpha(rows: list[tuple]) -> list[float | None]:
    running, total, count = [], 0.0, 0
    for _, ds in rows:
        probs = [a for d in ds for a in d.examined_accept_probs]
        total += sum(probs)
        count += len(probs)
        running.append(total / count if count else None)
    return running


def acceptance_figure(trace: Trace, upto: int | None = None) -> go.Figure:
    """Acceptance rate and running α per iteration; P(accept) by draft position; measured vs predicted tokens."""
    trace = _replay(trace, upto)
    rows = [(step, ds) for step, ds in _steps_with(trace) if ds]
    fig = make_subplots(rows=3, cols=2, specs=[[{"colspan": 2}, None], [{}, {}], [{}, {}]], vertical_spacing=0.16,
                        horizontal_spacing=0.2,
                        subplot_titles=("per iteration", "by draft position", "tokens per iteration",
                                        "drafts accepted per iteration", "by sequence"))
    x = [step.index for step, _ in rows]
    fig.add_trace(go.Scatter(x=x, y=[sum(d.n_accepted for d in ds) / max(1, sum(d.gamma for d in ds)) for _, ds in rows],
                             mode="markers", name="acceptance rate", marker_color=COLORS[ACCEPTED],
                             hovertemplate="iteration %{x}: accepted / drafted = %{y:.2f}<extra></extra>"), 1, 1)
    fig.add_trace(go.Scatter(x=x, y=_running_alpha(rows), mode="lines", name="running α", line_color="#24292f",
                             hovertemplate="α so far = %{y:.3f}: mean min(1, p/q) over examined drafts"
                                           "<extra></extra>"), 1, 1)

    drafted = trace.drafted()
    max_gamma = max((d.gamma for d in drafted), default=0)
    reached = [sum(1 for d in drafted if d.gamma > k and d.outcome[k] != DISCARDED) for k in range(max_gamma)]
    kept = [sum(1 for d in drafted if d.gamma > k and d.outcome[k] == ACCEPTED) for k in range(max_gamma)]
    fig.add_trace(go.Bar(x=list(range(1, max_gamma + 1)), y=[a / r if r else None for a, r in zip(kept, reached)],
                         name="P(accept | examined)", marker_color=COLORS[ACCEPTED], opacity=0.7,
                         hovertemplate="draft %{x}: accepted / examined = %{y:.2f}<extra></extra>"), 2, 1)

    alpha = trace.alpha_estimate() or 0.0
    fig.add_trace(go.Scatter(x=x, y=[sum(d.n_accepted + 1 for d in ds) / len(ds) for _, ds in rows], mode="markers",
                             name="measured tokens", marker_color=COLORS[RESAMPLED]), 2, 2)
    fig.add_trace(go.Scatter(x=x, y=[sum(theory.expected_tokens(alpha, d.gamma) for d in ds) / len(ds) for _, ds in rows],
                             mode="lines", name=f"predicted (Leviathan, α = {alpha:.2f})", line_color="#24292f"), 2, 2)
    _per_sequence(fig, trace)
    fig.update_yaxes(range=[0, 1.05], title="share of drafts", row=1, col=1)
    fig.update_yaxes(range=[0, 1.05], title="probability", row=2, col=1)
    fig.update_yaxes(title="tokens per iteration", rangemode="tozero", row=2, col=2)
    fig.update_xaxes(title="iteration", row=1, col=1)
    fig.update_xaxes(title="draft position", row=2, col=1)
    fig.update_xaxes(title="iteration", row=2, col=2)
    return _layout(fig, f"acceptance<br><sup>{_ALPHA_NOTE}</sup>", height=820, top=105)


def _per_sequence(fig: go.Figure, trace: Trace) -> None:
    """Row 3: how many drafts each iteration kept (0 … γ), a histogram per sequence, and each sequence's own
    acceptance rate and α (a batch's token-averaged rate hides a sequence whose draft fails)."""
    drafted = trace.drafted()
    if not drafted:
        return
    sequences = sorted({d.sequence for d in drafted})
    top = max(d.gamma for d in drafted)
    many = len(sequences) > 1
    for i in sequences:
        mine = [d for d in drafted if d.sequence == i]
        counts = [sum(d.n_accepted == k for d in mine) for k in range(top + 1)]
        name = f"sequence {i + 1}" if many else "iterations"
        fig.add_trace(go.Bar(x=list(range(top + 1)), y=counts, name=name, legendgroup=f"s{i}", showlegend=many,
                             hovertemplate=f"{name}: %{{y}} iterations kept %{{x}} drafts<extra></extra>"), 3, 1)
    rates, alphas = [], []
    for i in sequences:
        mine = [d for d in drafted if d.sequence == i]
        rates.append(sum(d.n_accepted for d in mine) / max(1, sum(d.gamma for d in mine)))
        alphas.append(trace.alpha_estimate(i))
    labels = [f"seq {i + 1}" for i in sequences]
    fig.add_trace(go.Bar(x=labels, y=rates, name="acceptance rate (accepted / drafted)", marker_color=COLORS[ACCEPTED],
                         hovertemplate="%{x}: accepted / drafted = %{y:.2f}<extra></extra>"), 3, 2)
    fig.add_trace(go.Scatter(x=labels, y=alphas, mode="markers", name="α of the sequence", marker_color="#24292f",
                             hovertemplate="%{x}: α = %{y:.3f}<extra></extra>"), 3, 2)
    fig.update_layout(barmode="group")
    fig.update_xaxes(title="drafts accepted", dtick=1, row=3, col=1)
    fig.update_yaxes(title="iterations", rangemode="tozero", row=3, col=1)
    fig.update_xaxes(title="sequence", row=3, col=2)
    fig.update_yaxes(range=[0, 1.05], title="per sequence", row=3, col=2)


def timing_figure(trace: Trace, upto: int | None = None) -> go.Figure:
    """Draft, target and verify time of each iteration, stacked."""
    steps = _replay(trace, upto).steps
    x = [s.index for s in steps]
    fig = go.Figure()
    for part in ("draft", "target", "verify"):
        fig.add_trace(go.Bar(x=x, y=[1e3 * getattr(s, f"{part}_s") for s in steps], name=part,
                             marker_color=TIMING_COLORS[part], hovertemplate="%{y:.2f} ms<extra>" + part + "</extra>"))
    fig.update_layout(barmode="stack")
    fig.update_xaxes(title="iteration")
    fig.update_yaxes(title="ms per iteration")
    return _layout(fig, "time per iteration")


def verify_figure(trace: Trace, upto: int | None = None) -> go.Figure:
    """Verification time per call (µs, its distribution with the median) above its share of all iteration time."""
    steps = [s for s in _replay(trace, upto).steps if s.gamma > 0]  # target-only steps verify nothing
    micros = [1e6 * s.verify_s for s in steps]
    totals = {part: sum(getattr(s, f"{part}_s") for s in steps) for part in ("draft", "target", "verify")}
    whole = sum(totals.values())
    fig = make_subplots(rows=2, cols=1, row_heights=[0.6, 0.4], vertical_spacing=0.45,
                        subplot_titles=("verification time per call", "share of iteration time"))
    fig.add_trace(go.Box(x=micros, name="verify", orientation="h", boxpoints="all", jitter=0.4, pointpos=0,
                         marker_color=TIMING_COLORS["verify"], showlegend=False,
                         hovertemplate="%{x:.0f} µs<extra></extra>"), 1, 1)
    if micros:
        median = statistics.median(micros)
        fig.add_annotation(x=median, y=0, xref="x", yref="y", text=f"median {median:.0f} µs", showarrow=True,
                           arrowhead=2, ay=-28)
    for part, seconds in totals.items():
        share = 100 * seconds / whole if whole else 0.0
        # .3g: a verify share of 0.04% still reads as a number, not 0.0%
        fig.add_trace(go.Bar(x=[share], y=["all"], orientation="h", name=f"{part} {share:.3g}%",
                             marker_color=TIMING_COLORS[part],
                             hovertemplate=f"{part}: {seconds:.3f} s, %{{x:.2f}}% of iteration time<extra></extra>"),
                      2, 1)
    fig.update_layout(barmode="stack")
    fig.update_xaxes(title=f"µs per verify call ({len(micros)} calls)", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title="calls", showticklabels=False, row=1, col=1)
    fig.update_xaxes(title="% of draft + target + verify seconds", range=[0, 100], row=2, col=1)
    fig.update_yaxes(title="iterations", row=2, col=1)
    return _layout(fig, "verification: time per call and share of the iteration", height=420)


def batch_figure(trace: Trace, upto: int | None = None) -> go.Figure:
    """Accepted drafts per sequence per iteration (one target call per column), and what raggedness costs:
    padding fed beside real tokens, and masked holes in the KV caches."""
    trace = _replay(trace, upto)
    by_step = decisions_by_step(trace)
    steps = trace.steps
    fig = make_subplots(rows=2, cols=1, row_heights=[0.6, 0.4], vertical_spacing=0.3,
                        subplot_titles=("accepted drafts per sequence (blank: not in batch)", "cost of raggedness"))
    labels = [f"s{s.index + 1}" for s in trace.sequences]
    z = [[by_step[(st.index, s.index)].n_accepted if (st.index, s.index) in by_step else None for st in steps]
         for s in trace.sequences]
    hover = [[f"{html.escape(s.label)}<br>iteration {st.index}: accepted {by_step[(st.index, s.index)].n_accepted} of "
              f"{by_step[(st.index, s.index)].gamma}" if (st.index, s.index) in by_step else "" for st in steps]
             for s in trace.sequences]
    fig.add_trace(go.Heatmap(x=[st.index for st in steps], y=labels, z=z, text=hover, hoverinfo="text",
                             colorscale="Greens", colorbar=dict(title="accepted", len=0.55, y=0.75)), 1, 1)
    fed = [st.real_tokens + st.pad_tokens for st in steps]
    fig.add_trace(go.Scatter(x=[st.index for st in steps], y=[st.pad_tokens / f if f else 0 for st, f in zip(steps, fed)],
                             mode="lines", name="padding / tokens fed"), 2, 1)
    fig.add_trace(go.Scatter(x=[st.index for st in steps],
                             y=[st.cache_holes / st.cache_slots if st.cache_slots else 0 for st in steps],
                             mode="lines", name="KV-cache holes / entries"), 2, 1)
    fig.update_yaxes(title="sequence", autorange="reversed", row=1, col=1)
    fig.update_yaxes(title="share", range=[0, 1], row=2, col=1)
    fig.update_xaxes(title="iteration", row=1, col=1)
    fig.update_xaxes(title="iteration", matches="x", row=2, col=1)  # zooming one zooms both
    fig = _layout(fig, f"batch of {trace.batch_size}: ragged acceptance", top=70)
    fig.update_layout(height=440 + 18 * len(trace.sequences))
    return fig


def _rate_stats(row: dict) -> tuple[float, float | None, float | None]:
    """(bar height, min, max) of a comparison row's tokens/s: the median over rounds when rounds are given."""
    runs = row.get("tokens_per_s_runs") or []
    if not runs:
        return row["tokens_per_s"], None, None
    return statistics.median(runs), min(runs), max(runs)


def _speedup_label(row: dict) -> str:
    """'1.52× (1.40–1.61)': the median speedup and its range over rounds (one round has no range)."""
    low, high = row.get("speedup_min"), row.get("speedup_max")
    several = len(row.get("tokens_per_s_runs") or []) > 1
    span = f" ({low:.2f}–{high:.2f})" if several and low is not None and high is not None else ""
    return f"{row['speedup']:.2f}×{span}"


def compare_figure(rows: list[dict]) -> go.Figure:
    """Tokens/s (median over rounds, min–max error bars, labelled with the speedup over target-only) and the
    median verify time of each run in a comparison (rows as in specviz.compare.Row)."""
    names = [html.escape(str(r["name"])) for r in rows]
    stats = [_rate_stats(r) for r in rows]
    rounds = max((len(r.get("tokens_per_s_runs") or []) for r in rows), default=0)
    fig = make_subplots(rows=2, cols=1, vertical_spacing=0.25,
                        subplot_titles=("tokens / s (label: speedup over target-only)", "median verify time per call"))
    error = None
    if rounds > 1:
        error = dict(type="data", symmetric=False, color="#24292f",
                     array=[hi - mid if hi is not None else 0 for mid, _, hi in stats],
                     arrayminus=[mid - lo if lo is not None else 0 for mid, lo, _ in stats])
    fig.add_trace(go.Bar(y=names, x=[mid for mid, _, _ in stats], orientation="h", name="tokens/s", error_x=error,
                         text=[_speedup_label(r) for r in rows], textposition="inside", insidetextanchor="start",
                         marker_color=COLORS[ACCEPTED], opacity=0.85), 1, 1)
    spec = [(name, r) for name, r in zip(names, rows) if r.get("median_verify_ms") is not None]
    fig.add_trace(go.Bar(y=[name for name, _ in spec], x=[1e3 * r["median_verify_ms"] for _, r in spec],
                         orientation="h", name="verify µs", marker_color=TIMING_COLORS["verify"],
                         text=[f"{1e3 * r['median_verify_ms']:.0f} µs" for _, r in spec], textposition="auto"), 2, 1)
    fig.update_yaxes(title="run", autorange="reversed")
    fig.update_xaxes(title="tokens per second", rangemode="tozero", row=1, col=1)
    fig.update_xaxes(title="µs per verify call (median)", rangemode="tozero", row=2, col=1)
    fig.update_layout(showlegend=False)
    how = f"median of {rounds} rounds, bars span min–max" if rounds > 1 else "one round"
    return _layout(fig, f"modes side by side<br><sup>same input and seed; {how}</sup>",
                   height=260 + 56 * max(1, len(rows)), top=80)


def _measured_cost_curve(fig: go.Figure, trace: Trace, alphas: list[float], alpha: float) -> None:
    """Beside Leviathan's flat-cost curves: the speedup vs α on this run's measured costs at its most common
    γ (a target call's price grows with the tokens it scores), and what those costs predict for the run."""
    p = predict(trace)
    if p is None:
        return
    costs = CostModel.from_dict(trace.meta["costs"])  # predict() accepted it
    rows = p.batch
    fig.add_trace(go.Scatter(
        x=alphas, y=[expected_speedup(costs, rows, p.gamma, [[a]] * rows) for a in alphas], mode="lines",
        name=f"measured costs, γ={p.gamma}", line=dict(color=MEASURED_COLOR, dash="dash", width=2),
        hovertemplate=f"γ = {p.gamma} on this machine's measured call costs: α = %{{x:.2f}} → %{{y:.2f}}×"
                      "<extra></extra>"), 1, 2)
    fig.add_trace(go.Scatter(
        x=[alpha], y=[p.speedup], mode="markers", name="predicted from measured costs",
        marker=dict(size=12, symbol="triangle-up", color=MEASURED_COLOR),
        hovertemplate="predicted %{y:.2f}× from the measured call costs and α by draft position<extra></extra>"),
        1, 2)


def theory_figure(trace: Trace, upto: int | None = None, measured_speedup: float | None = None) -> go.Figure:
    """Leviathan's curves (E[tokens per iteration] and the walltime factor vs α, one colour per γ) with what
    they predict for this run's α, γ and c, and the speedup measured against target-only when given."""
    trace = _replay(trace, upto)
    alphas = [a / 100 for a in range(0, 100)]
    c = trace.cost_ratio() or 0.0
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.2,
                        subplot_titles=("E[tokens per iteration]", f"walltime factor (c = {c:.2f})"))
    for g, color in GAMMA_COLORS.items():
        fig.add_trace(go.Scatter(x=alphas, y=[theory.expected_tokens(a, g) for a in alphas], mode="lines",
                                 name=f"γ={g}", legendgroup=f"g{g}", line_color=color), 1, 1)
        fig.add_trace(go.Scatter(x=alphas, y=[theory.walltime_factor(a, g, c) for a in alphas], mode="lines",
                                 name=f"γ={g}", legendgroup=f"g{g}", showlegend=False, line_color=color), 1, 2)
    alpha = trace.alpha_estimate()
    drafted = trace.drafted()
    if alpha is not None and drafted:
        tokens = sum(theory.expected_tokens(alpha, d.gamma) for d in drafted) / len(drafted)
        mean_gamma = sum(d.gamma for d in drafted) / len(drafted)
        star = dict(size=13, symbol="star", color=PREDICTED_COLOR)
        fig.add_trace(go.Scatter(x=[alpha], y=[tokens], mode="markers", marker=star, legendgroup="predicted",
                                 name="predicted from this run's α and c",
                                 hovertemplate=f"predicted: α = {alpha:.2f}, mean γ = {mean_gamma:.1f} → "
                                               f"{tokens:.2f} tokens per iteration<extra></extra>"), 1, 1)
        fig.add_trace(go.Scatter(x=[alpha], y=[tokens / (mean_gamma * c + 1)], mode="markers", marker=star,
                                 legendgroup="predicted", showlegend=False, name="predicted from this run's α and c",
                                 hovertemplate=f"predicted speedup %{{y:.2f}}× (α = {alpha:.2f}, "
                                               f"mean γ = {mean_gamma:.1f}, c = {c:.2f})<extra></extra>"), 1, 2)
        _measured_cost_curve(fig, trace, alphas, alpha)
        if measured_speedup is not None:
            fig.add_trace(go.Scatter(x=[alpha], y=[measured_speedup], mode="markers", name="measured (vs target-only)",
                                     marker=dict(size=12, symbol="diamond", color=MEASURED_COLOR,
                                                 line=dict(width=1, color="#24292f")),
                                     hovertemplate="measured speedup %{y:.2f}× over target-only<extra></extra>"), 1, 2)
    fig.update_xaxes(title="α (acceptance probability)", range=[0, 1])
    fig.update_yaxes(title="tokens per iteration", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title="speedup vs target-only (×)", rangemode="tozero", row=1, col=2)
    return _layout(fig, "theory (Leviathan et al. §3): prediction vs measurement", height=360, top=70)
