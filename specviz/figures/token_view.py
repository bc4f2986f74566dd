"""The colored-token view: one line per iteration and sequence, each token's test in its tooltip.

Token colours follow Leviathan et al. Figure 1: accepted drafts green, rejected red and struck through,
the resampled correction blue; the bonus token (all γ accepted) has its own colour; drafts after a
rejection are grey. Each token carries its (step, sequence, position) for the why-panel.

Every string of a trace is untrusted (a trace may be a shared JSON file): it is html-escaped wherever it
reaches markup, and class names come from fixed tables, never from a trace.
"""

from __future__ import annotations

import html

from specviz.figures.notation import Notation, notation, passes_own_test, verdict
from specviz.decoding.records import ACCEPTED, BONUS, DISCARDED, REJECTED, RESAMPLED, TARGET, Decision
from specviz.traces.trace import Trace

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


def visible(text: str) -> str:
    """A token's text, escaped, with newlines, tabs and the empty token made visible."""
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
    return f'<span class="{classes}"{data} title="{html.escape(tip, quote=True)}">{visible(text)}</span>'


def _draft_tip(d: Decision, k: int, n: Notation) -> str:
    outcome = d.outcome[k]
    if outcome == DISCARDED:
        return (f"discarded: drafted after the rejection at draft {d.n_accepted + 1}, so never examined "
                f"(click to see whether its own test would have passed)")
    return (f"{outcome}: {n.p}(x)={d.p[k]:.4g}  {n.q}(x)={d.q[k]:.4g}  accept prob={d.accept_prob[k]:.4g}  "
            f"uniform={d.uniform[k]:.4g} · {verdict(d.uniform[k], d.accept_prob[k], outcome, n)}")


def _next_tip(d: Decision, n: Notation) -> str:
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
    passed = sum(passes_own_test(d, k) for k in discarded)
    return (f'<span class="sv-note" title="drafts after a rejection are never examined; these passed their own '
            f'test u ≤ accept prob">{passed}/{len(discarded)} discarded would have passed</span>')


def _decision_spans(d: Decision, n: Notation) -> str:
    spans = [_token(tok, d.outcome[k], _draft_tip(d, k, n), (d.step, d.sequence, k))
             for k, tok in enumerate(d.draft_text)]
    spans.append(_token(d.next_text, d.next_kind, _next_tip(d, n), (d.step, d.sequence, d.gamma)))
    return "".join(spans) + _discard_note(d)


def token_html(trace: Trace, upto: int | None = None) -> str:
    """One line per iteration and sequence (a lane per sequence in a batch); hovering a token shows p(x), q(x),
    its acceptance probability and the uniform; each token carries data-step/-seq/-pos for the why-panel.
    upto: only iterations with index < upto (replay)."""
    trace = trace.until(upto)
    n = notation(trace)
    legend = "".join(_token(k, k, k) for k in (ACCEPTED, REJECTED, RESAMPLED, BONUS, DISCARDED))
    lines = [f'<div class="sv-legend">{legend}</div>']
    prompt_text = trace.meta.get("prompt_text")
    if isinstance(prompt_text, str) and prompt_text:  # speech: the decoder prompt, marked as prompt
        lines.append(f'<div class="sv-line"><span class="sv-iter">prompt</span>'
                     f'<span class="sv-tok sv-prompt" title="decoder prompt, not decoded">{visible(prompt_text)}</span></div>')
    several = len(trace.sequences) > 1
    batched = trace.batch_size > 1
    by_step = trace.decisions_by_step()
    current = None
    for step in trace.steps:
        members = [s for s in step.sequences if (step.index, s) in by_step]
        if batched:
            lines.append(f'<div class="sv-step">#{step.index} γ={step.gamma} · one target call for '
                         f'{len(members)} sequence{"s" if len(members) != 1 else ""}</div>')
        elif several and members and members[0] != current:  # one after another: mark where each starts
            current = members[0]
            lines.append(f'<div class="sv-line sv-window">{visible(trace.sequences[current].label)}</div>')
        for s in members:
            d = by_step[(step.index, s)]
            head = f"s{s + 1} γ={d.gamma}" if batched else f"#{step.index} γ={d.gamma}"
            label = html.escape(trace.sequences[s].label, quote=True)
            lines.append(f'<div class="sv-line sv-lane"><span class="sv-iter" title="{label}">{head}</span>'
                         f"{_decision_spans(d, n)}</div>")
    return f'<div class="sv-tokens">{"".join(lines)}</div>'
