"""Figures and the colored-token view, built from a trace alone (never from a model).

Token colours follow Leviathan et al. Figure 1: accepted drafts green, rejected red and struck through,
the resampled correction blue; the bonus token (all γ accepted) has its own colour; drafts after a
rejection are grey.
"""

from __future__ import annotations

import html
import statistics

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from . import theory
from .records import ACCEPTED, BONUS, DISCARDED, REJECTED, RESAMPLED, TARGET, Decision
from .trace import Trace

COLORS = {ACCEPTED: "#1a7f37", REJECTED: "#cf222e", DISCARDED: "#8c959f", RESAMPLED: "#0969da", BONUS: "#8250df"}
TIMING_COLORS = {"draft": "#54aeff", "target": "#fd8c73", "verify": "#2da44e"}

TOKEN_CSS = """
.sv-tokens { font-family: ui-monospace, SFMono-Regular, Menlo, monospace; font-size: 13px; line-height: 1.9; }
.sv-line { white-space: nowrap; overflow-x: auto; }
.sv-iter { color: #57606a; display: inline-block; width: 4.5em; }
.sv-tok { padding: 1px 3px; margin: 0 1px; border-radius: 3px; white-space: pre; }
.sv-accepted { background: #dafbe1; color: #1a7f37; }
.sv-rejected { background: #ffebe9; color: #cf222e; text-decoration: line-through; }
.sv-discarded { color: #8c959f; text-decoration: line-through; }
.sv-resampled { background: #ddf4ff; color: #0969da; font-weight: 600; }
.sv-bonus { background: #fbefff; color: #8250df; font-weight: 600; }
.sv-legend span { margin-right: 1em; }
.sv-prompt { background: #eaeef2; color: #57606a; }
.sv-window { color: #57606a; font-style: italic; }
.sv-step { color: #57606a; font-size: 11px; margin-top: 6px; border-top: 1px solid #d0d7de; }
.sv-target { background: #eaeef2; color: #24292f; }
"""


def _visible(text: str) -> str:
    return html.escape(text.replace("\n", "⏎").replace("\t", "⇥")) or "∅"


# Class names come from this table, never from a trace's strings (a loaded trace is untrusted input).
_TOKEN_CLASS = {ACCEPTED: "sv-accepted", REJECTED: "sv-rejected", DISCARDED: "sv-discarded", RESAMPLED: "sv-resampled",
                BONUS: "sv-bonus", TARGET: "sv-target"}


def _token(text: str, kind: str, tip: str) -> str:
    return (f'<span class="sv-tok {_TOKEN_CLASS.get(kind, "sv-discarded")}" title="{html.escape(tip, quote=True)}">'
            f"{_visible(text)}</span>")


def _decision_spans(d: Decision) -> str:
    spans = [_token(tok, outcome, f"{outcome}: p(x)={p:.4g}  q(x)={q:.4g}  accept prob={a:.4g}  uniform={u:.4g}")
             for tok, outcome, p, q, a, u in zip(d.draft_text, d.outcome, d.p, d.q, d.accept_prob, d.uniform)]
    spans.append(_token(d.next_text, d.next_kind, f"{d.next_kind} token sampled by the verifier"))
    return "".join(spans)


def decisions_by_step(trace: Trace) -> dict[tuple[int, int], Decision]:
    """(step index, sequence index) -> that sequence's decision in that iteration."""
    return {(d.step, d.sequence): d for s in trace.sequences for d in s.decisions}


def token_html(trace: Trace) -> str:
    """One line per iteration and sequence (a lane per sequence in a batch); hovering a token shows p(x), q(x),
    its acceptance probability and the uniform."""
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
                         f"{_decision_spans(d)}</div>")
    return f'<div class="sv-tokens">{"".join(lines)}</div>'


def _layout(fig: go.Figure, title: str) -> go.Figure:
    fig.update_layout(title=title, template="plotly_white", height=320, margin=dict(l=50, r=20, t=50, b=40),
                      legend=dict(orientation="h", y=-0.2))
    return fig


def _steps_with(trace: Trace) -> list[tuple]:
    """(step, its decisions that drafted) for every iteration, in order."""
    by_step: dict[int, list[Decision]] = {}
    for d in trace.drafted():
        by_step.setdefault(d.step, []).append(d)
    return [(step, by_step.get(step.index, [])) for step in trace.steps]


def gamma_figure(trace: Trace) -> go.Figure:
    rows = _steps_with(trace)
    config = trace.meta.get("config")
    policy = config.get("gamma_policy", "?") if isinstance(config, dict) else "?"
    batched = len(trace.sequences) > 1
    x = [step.index for step, _ in rows]
    fig = go.Figure(go.Scatter(x=x, y=[step.gamma for step, _ in rows], mode="lines+markers", name="γ", line_shape="hv"))
    fig.add_trace(go.Bar(x=x, y=[sum(d.n_accepted for d in ds) / len(ds) if ds else 0 for _, ds in rows],
                         name="accepted (mean over sequences)" if batched else "accepted", opacity=0.4,
                         marker_color=COLORS[ACCEPTED]))
    fig.update_xaxes(title="iteration")
    fig.update_yaxes(title="tokens", rangemode="tozero")
    return _layout(fig, f"γ per iteration (policy: {policy})")


def acceptance_figure(trace: Trace) -> go.Figure:
    rows = [(step, ds) for step, ds in _steps_with(trace) if ds]
    fig = make_subplots(rows=1, cols=3, subplot_titles=("acceptance per iteration", "by draft position",
                                                        "tokens per iteration"))
    x = [step.index for step, _ in rows]
    fig.add_trace(go.Scatter(x=x, y=[sum(d.n_accepted for d in ds) / max(1, sum(d.gamma for d in ds)) for _, ds in rows],
                             mode="markers", name="accepted / drafted"), 1, 1)
    running, examined_sum, examined_n = [], 0.0, 0
    for _, ds in rows:
        probs = [a for d in ds for a, o in zip(d.accept_prob, d.outcome) if o != DISCARDED]
        examined_sum += sum(probs)
        examined_n += len(probs)
        running.append(examined_sum / examined_n if examined_n else None)
    fig.add_trace(go.Scatter(x=x, y=running, mode="lines", name="running α"), 1, 1)

    drafted = trace.drafted()
    max_gamma = max((d.gamma for d in drafted), default=0)
    reached = [sum(1 for d in drafted if d.gamma > k and d.outcome[k] != DISCARDED) for k in range(max_gamma)]
    kept = [sum(1 for d in drafted if d.gamma > k and d.outcome[k] == ACCEPTED) for k in range(max_gamma)]
    fig.add_trace(go.Bar(x=list(range(1, max_gamma + 1)), y=[a / r if r else None for a, r in zip(kept, reached)],
                         name="P(accept | reached)", marker_color=COLORS[ACCEPTED]), 1, 2)

    alpha = trace.alpha_estimate() or 0.0
    fig.add_trace(go.Scatter(x=x, y=[sum(d.n_accepted + 1 for d in ds) / len(ds) for _, ds in rows], mode="markers",
                             name="measured"), 1, 3)
    fig.add_trace(go.Scatter(x=x, y=[sum(theory.expected_tokens(alpha, d.gamma) for d in ds) / len(ds) for _, ds in rows],
                             mode="lines", name=f"Leviathan (α={alpha:.2f})"), 1, 3)
    fig.update_yaxes(range=[0, 1.05], row=1, col=1)
    fig.update_yaxes(range=[0, 1.05], row=1, col=2)
    fig.update_xaxes(title="iteration", row=1, col=1)
    fig.update_xaxes(title="draft position", row=1, col=2)
    fig.update_xaxes(title="iteration", row=1, col=3)
    return _layout(fig, "acceptance")


def timing_figure(trace: Trace) -> go.Figure:
    steps = trace.steps
    x = [s.index for s in steps]
    fig = go.Figure()
    for part in ("draft", "target", "verify"):
        fig.add_trace(go.Bar(x=x, y=[1e3 * getattr(s, f"{part}_s") for s in steps], name=part,
                             marker_color=TIMING_COLORS[part]))
    fig.update_layout(barmode="stack")
    fig.update_xaxes(title="iteration")
    fig.update_yaxes(title="ms")
    return _layout(fig, "time per iteration")


def batch_figure(trace: Trace) -> go.Figure:
    """Accepted drafts per sequence per iteration (one target call per column), and what raggedness costs:
    padding fed beside real tokens, and masked holes in the KV caches."""
    by_step = decisions_by_step(trace)
    steps = trace.steps
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.65, 0.35], vertical_spacing=0.08,
                        subplot_titles=("accepted drafts per sequence (blank: not in the batch)", "cost of raggedness"))
    labels = [f"s{s.index + 1}" for s in trace.sequences]
    z = [[by_step[(st.index, s.index)].n_accepted if (st.index, s.index) in by_step else None for st in steps]
         for s in trace.sequences]
    hover = [[f"{html.escape(s.label)}<br>iteration {st.index}: accepted {by_step[(st.index, s.index)].n_accepted} of "
              f"{by_step[(st.index, s.index)].gamma}" if (st.index, s.index) in by_step else "" for st in steps]
             for s in trace.sequences]
    fig.add_trace(go.Heatmap(x=[st.index for st in steps], y=labels, z=z, text=hover, hoverinfo="text",
                             colorscale="Greens", colorbar=dict(title="accepted", len=0.6, y=0.7)), 1, 1)
    fed = [st.real_tokens + st.pad_tokens for st in steps]
    fig.add_trace(go.Scatter(x=[st.index for st in steps], y=[st.pad_tokens / f if f else 0 for st, f in zip(steps, fed)],
                             mode="lines", name="padding / tokens fed"), 2, 1)
    fig.add_trace(go.Scatter(x=[st.index for st in steps],
                             y=[st.cache_holes / st.cache_slots if st.cache_slots else 0 for st in steps],
                             mode="lines", name="KV-cache holes / entries"), 2, 1)
    fig.update_yaxes(title="sequence", autorange="reversed", row=1, col=1)
    fig.update_yaxes(title="share", range=[0, 1], row=2, col=1)
    fig.update_xaxes(title="iteration", row=2, col=1)
    fig = _layout(fig, f"batch of {trace.batch_size}: ragged acceptance")
    fig.update_layout(height=360 + 18 * len(trace.sequences))
    return fig


def compare_figure(rows: list[dict]) -> go.Figure:
    """Tokens/s and median verify time of each run in a comparison (rows as in specviz.compare.Row)."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("tokens / s", "median verify time per iteration (ms)"))
    names = [r["name"] for r in rows]
    fig.add_trace(go.Bar(x=names, y=[r["tokens_per_s"] for r in rows], name="tokens/s",
                         text=[f"{r['speedup']:.2f}×" for r in rows], textposition="outside"), 1, 1)
    spec = [r for r in rows if r.get("median_verify_ms") is not None]
    fig.add_trace(go.Bar(x=[r["name"] for r in spec], y=[r["median_verify_ms"] for r in spec], name="verify ms"), 1, 2)
    fig.update_layout(showlegend=False)
    return _layout(fig, "modes side by side (same input and seed)")


def theory_figure(trace: Trace) -> go.Figure:
    """Leviathan's curves with this run's measured point: E[tokens/iteration] and the walltime factor vs α."""
    alphas = [a / 100 for a in range(0, 100)]
    rows = [(step, ds) for step, ds in _steps_with(trace) if ds]
    drafted = [d for _, ds in rows for d in ds]
    gammas = [1, 2, 3, 5, 7, 10]
    draft_forwards = sum(max(d.gamma for d in ds) for _, ds in rows)  # the batch drafts its rows together
    draft_per_token = sum(step.draft_s for step, _ in rows) / max(1, draft_forwards)
    target_per_call = statistics.median(step.target_s for step, _ in rows) if rows else 1.0
    c = draft_per_token / target_per_call if target_per_call else 0.0
    fig = make_subplots(rows=1, cols=2, subplot_titles=("expected tokens per iteration", f"walltime factor (c = {c:.2f})"))
    for g in gammas:
        fig.add_trace(go.Scatter(x=alphas, y=[theory.expected_tokens(a, g) for a in alphas], mode="lines",
                                 name=f"γ={g}", legendgroup=f"g{g}"), 1, 1)
        fig.add_trace(go.Scatter(x=alphas, y=[theory.walltime_factor(a, g, c) for a in alphas], mode="lines",
                                 name=f"γ={g}", legendgroup=f"g{g}", showlegend=False), 1, 2)
    alpha = trace.alpha_estimate()
    if alpha is not None and drafted:
        tokens = sum(d.n_accepted + 1 for d in drafted) / len(drafted)
        mean_gamma = sum(d.gamma for d in drafted) / len(drafted)
        fig.add_trace(go.Scatter(x=[alpha], y=[tokens], mode="markers", marker=dict(size=12, symbol="star", color="black"),
                                 name=f"this run (mean γ={mean_gamma:.1f})"), 1, 1)
        fig.add_trace(go.Scatter(x=[alpha], y=[tokens / (mean_gamma * c + 1)], mode="markers",
                                 marker=dict(size=12, symbol="star", color="black"), showlegend=False), 1, 2)
    fig.update_xaxes(title="α")
    return _layout(fig, "theory (Leviathan et al. §3) and this run")
