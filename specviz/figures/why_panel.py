"""The why-panel: for one clicked token, the acceptance test in numbers and the distributions behind it.

Every string of a trace is untrusted (a trace may be a shared JSON file): it is html-escaped wherever it
reaches markup, and class names come from this module's own tables, never from a trace.
"""

from __future__ import annotations

import html
import math

from specviz.figures.notation import Notation, notation, passes_own_test, verdict
from specviz.decoding.records import ACCEPTED, BONUS, DISCARDED, REJECTED, RESAMPLED, Decision, Examined, TopTokens
from specviz.figures.token_view import visible
from specviz.traces.trace import Trace

# Bars are plain HTML, so the panel needs no plotly.
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
    d = trace.decisions_by_step().get((step_i, seq_i))
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
    return (f'<div class="{row_class}"><span class="sv-bar-tok">{visible(text)}</span>'
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
        rows.append(f'<div class="sv-bar-note">{mark_label} token “{visible(mark_text)}” is outside the top '
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
        what = f"draft {k + 1} of {d.gamma}: “{visible(d.draft_text[k])}” ({html.escape(d.outcome[k])})"
    else:
        what = f"{html.escape(d.next_kind)} token: “{visible(d.next_text)}”"
    return _line(f"{where} · {what}", "sv-why-head")


def _recorded(d: Decision, k: int, n: Notation) -> str:
    return _line(f"recorded: {n.p}(x) = {d.p[k]:.4g} · {n.q}(x) = {d.q[k]:.4g} · accept prob min(1, {n.ratio}) = "
                 f"{d.accept_prob[k]:.4g} · uniform u = {d.uniform[k]:.4g}"
                 + (f" · lenience l = {n.lenience:g}" if n.lenience != 1 else ""), "sv-why-info")


def _sigmoid_vs_exact(d: Decision, k: int, e: Examined, n: Notation) -> str:
    """The sigmoid's decision beside what exact verification would have done with the same uniform."""
    u, x = d.uniform[k], d.draft_ids[k]
    exact = Notation(sigmoid=False, lenience=n.lenience)
    exact_outcome = ACCEPTED if u <= e.exact_accept_prob else REJECTED
    differ = exact_outcome != d.outcome[k]
    lines = [
        f"sigmoid: p̂(x) = {d.p[k]:.4g}, q̂(x) = {d.q[k]:.4g}; "
        f"{html.escape(verdict(u, d.accept_prob[k], d.outcome[k], n))}",
        f"exact (softmax): p(x) {_prob_in(e.p, x)}, q(x) {_prob_in(e.q, x)}; "
        f"{html.escape(verdict(u, e.exact_accept_prob, 'exact would have ' + exact_outcome, exact))}",
    ]
    if e.sigmoid_tv is not None:
        lines.append(f"total-variation distance of p̂ (normalized) from p: {e.sigmoid_tv:.3f}")
    lines.append("⚠ sigmoid and exact decide differently here" if differ else "sigmoid and exact agree here")
    return _line("<br>".join(lines), "sv-why-warn" if differ else "sv-why-same")


def _why_examined(d: Decision, k: int, n: Notation) -> list[str]:
    outcome = d.outcome[k]
    parts = [_line(html.escape(verdict(d.uniform[k], d.accept_prob[k], outcome, n)),
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
        parts.append(_line(f"so “{visible(d.next_text)}” was resampled from the residual {n.residual}, "
                           f"normalized:"))
        parts.append(_dists(_bars(f"residual {n.residual}", e.drawn_from, "r", d.next_id, d.next_text, "drawn")))
    return parts


def _why_discarded(d: Decision, k: int, n: Notation) -> list[str]:
    passed = passes_own_test(d, k)
    own = html.escape(verdict(d.uniform[k], d.accept_prob[k], "would have " + ("passed" if passed else "failed"), n))
    return [_line(f"never examined: drafted after the rejection at draft {d.n_accepted + 1}, where verification "
                  f"stopped, so it was thrown away unseen.", "sv-why-empty"),
            _line(f"its own test (same recorded uniform): {own}", "sv-why-info")]


def _next_intro(d: Decision, n: Notation) -> tuple[int, str, str] | None:
    """(examined position, explanation, title of its distribution) of the token verification added."""
    k = d.n_accepted
    if d.next_kind == RESAMPLED and k < d.gamma:
        test = html.escape(verdict(d.uniform[k], d.accept_prob[k], REJECTED, n))
        return k, (f"draft {k + 1} (“{visible(d.draft_text[k])}”) was rejected ({test}), so this token was "
                   f"drawn from the residual {n.residual}, normalized: the mass where the target wants more than "
                   f"the draft gave."), f"residual {n.residual}"
    if d.next_kind == BONUS:
        return d.gamma, (f"bonus: all {d.gamma} drafts were accepted, so the target's distribution after them "
                         f"gives one more token for free, drawn from {n.p}."), f"{n.p} after the last draft"
    return None  # target-only, or a loaded trace whose kind and counts disagree


def _why_next(d: Decision, n: Notation) -> list[str]:
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
    n = notation(trace)
    if k == d.gamma:
        body = _why_next(d, n)
    elif d.outcome[k] == DISCARDED:
        body = _why_discarded(d, k, n)
    else:
        body = _why_examined(d, k, n)
    return f'<div class="sv-why">{_header(trace, d, k)}{"".join(body)}</div>'

