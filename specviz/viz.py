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
from .trace import ACCEPTED, BONUS, DISCARDED, REJECTED, Trace

COLORS = {ACCEPTED: "#1a7f37", REJECTED: "#cf222e", DISCARDED: "#8c959f", "resampled": "#0969da", BONUS: "#8250df"}
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
"""


def _visible(text: str) -> str:
    return html.escape(text.replace("\n", "⏎").replace("\t", "⇥")) or "∅"


def token_html(trace: Trace) -> str:
    """One line per iteration; hovering a token shows p(x), q(x), its acceptance probability and the uniform."""
    legend = "".join(
        f'<span class="sv-tok sv-{k}">{k}</span>' for k in (ACCEPTED, REJECTED, "resampled", BONUS, DISCARDED)
    )
    lines = [f'<div class="sv-legend">{legend}</div>']
    prompt_text = trace.meta.get("prompt_text")
    if prompt_text:  # speech: the decoder prompt, marked as prompt
        lines.append(f'<div class="sv-line"><span class="sv-iter">prompt</span>'
                     f'<span class="sv-tok sv-prompt" title="decoder prompt, not decoded">{_visible(prompt_text)}</span></div>')
    window = None
    for it in trace.iterations:
        if it.window != window and trace.iterations[-1].window > 0:  # long audio: mark each 30 s window
            window = it.window
            lines.append(f'<div class="sv-line sv-window">audio window {window}</div>')
        spans = []
        for tok, outcome, p, q, a, u in zip(it.draft_text, it.outcome, it.p, it.q, it.accept_prob, it.uniform):
            tip = f"{outcome}: p(x)={p:.4g}  q(x)={q:.4g}  accept prob={a:.4g}  uniform={u:.4g}"
            spans.append(f'<span class="sv-tok sv-{outcome}" title="{html.escape(tip)}">{_visible(tok)}</span>')
        tip = f"{it.next_kind} token sampled by the verifier"
        spans.append(f'<span class="sv-tok sv-{it.next_kind}" title="{tip}">{_visible(it.next_text)}</span>')
        lines.append(f'<div class="sv-line"><span class="sv-iter">#{it.index} γ={it.gamma}</span>{"".join(spans)}</div>')
    return f'<div class="sv-tokens">{"".join(lines)}</div>'


def _layout(fig: go.Figure, title: str) -> go.Figure:
    fig.update_layout(title=title, template="plotly_white", height=320, margin=dict(l=50, r=20, t=50, b=40),
                      legend=dict(orientation="h", y=-0.2))
    return fig


def gamma_figure(trace: Trace) -> go.Figure:
    its = trace.iterations
    policy = trace.meta.get("config", {}).get("gamma_policy", "?")
    fig = go.Figure(go.Scatter(x=[i.index for i in its], y=[i.gamma for i in its], mode="lines+markers",
                               name="γ", line_shape="hv"))
    fig.add_trace(go.Bar(x=[i.index for i in its], y=[i.n_accepted for i in its], name="accepted", opacity=0.4,
                         marker_color=COLORS[ACCEPTED]))
    fig.update_xaxes(title="iteration")
    fig.update_yaxes(title="tokens", rangemode="tozero")
    return _layout(fig, f"γ per iteration (policy: {policy})")


def acceptance_figure(trace: Trace) -> go.Figure:
    its = trace.iterations
    fig = make_subplots(rows=1, cols=3, subplot_titles=("acceptance per iteration", "by draft position",
                                                        "tokens per iteration"))
    x = [i.index for i in its]
    fig.add_trace(go.Scatter(x=x, y=[i.n_accepted / i.gamma for i in its], mode="markers", name="accepted / γ"), 1, 1)
    running, examined_sum, examined_n = [], 0.0, 0
    for it in its:
        probs = [a for a, o in zip(it.accept_prob, it.outcome) if o != DISCARDED]
        examined_sum += sum(probs)
        examined_n += len(probs)
        running.append(examined_sum / examined_n)
    fig.add_trace(go.Scatter(x=x, y=running, mode="lines", name="running α"), 1, 1)

    max_gamma = max((i.gamma for i in its), default=0)
    reached = [sum(1 for i in its if i.gamma > k and i.outcome[k] != DISCARDED) for k in range(max_gamma)]
    kept = [sum(1 for i in its if i.gamma > k and i.outcome[k] == ACCEPTED) for k in range(max_gamma)]
    fig.add_trace(go.Bar(x=list(range(1, max_gamma + 1)), y=[a / r if r else None for a, r in zip(kept, reached)],
                         name="P(accept | reached)", marker_color=COLORS[ACCEPTED]), 1, 2)

    alpha = trace.alpha_estimate() or 0.0
    fig.add_trace(go.Scatter(x=x, y=[i.n_accepted + 1 for i in its], mode="markers", name="measured"), 1, 3)
    fig.add_trace(go.Scatter(x=x, y=[theory.expected_tokens(alpha, i.gamma) for i in its], mode="lines",
                             name=f"Leviathan (α={alpha:.2f})"), 1, 3)
    fig.update_yaxes(range=[0, 1.05], row=1, col=1)
    fig.update_yaxes(range=[0, 1.05], row=1, col=2)
    fig.update_xaxes(title="iteration", row=1, col=1)
    fig.update_xaxes(title="draft position", row=1, col=2)
    fig.update_xaxes(title="iteration", row=1, col=3)
    return _layout(fig, "acceptance")


def timing_figure(trace: Trace) -> go.Figure:
    its = trace.iterations
    x = [i.index for i in its]
    fig = go.Figure()
    for part in ("draft", "target", "verify"):
        fig.add_trace(go.Bar(x=x, y=[1e3 * getattr(i, f"{part}_s") for i in its], name=part,
                             marker_color=TIMING_COLORS[part]))
    fig.update_layout(barmode="stack")
    fig.update_xaxes(title="iteration")
    fig.update_yaxes(title="ms")
    return _layout(fig, "time per iteration")


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
    its = trace.iterations
    gammas = [1, 2, 3, 5, 7, 10]
    draft_per_token = sum(i.draft_s for i in its) / max(1, sum(i.gamma for i in its))
    target_per_call = statistics.median(i.target_s for i in its) if its else 1.0
    c = draft_per_token / target_per_call if target_per_call else 0.0
    fig = make_subplots(rows=1, cols=2, subplot_titles=("expected tokens per iteration", f"walltime factor (c = {c:.2f})"))
    for g in gammas:
        fig.add_trace(go.Scatter(x=alphas, y=[theory.expected_tokens(a, g) for a in alphas], mode="lines",
                                 name=f"γ={g}", legendgroup=f"g{g}"), 1, 1)
        fig.add_trace(go.Scatter(x=alphas, y=[theory.walltime_factor(a, g, c) for a in alphas], mode="lines",
                                 name=f"γ={g}", legendgroup=f"g{g}", showlegend=False), 1, 2)
    alpha = trace.alpha_estimate()
    if alpha is not None and its:
        tokens = sum(i.n_accepted + 1 for i in its) / len(its)
        mean_gamma = sum(i.gamma for i in its) / len(its)
        fig.add_trace(go.Scatter(x=[alpha], y=[tokens], mode="markers", marker=dict(size=12, symbol="star", color="black"),
                                 name=f"this run (mean γ={mean_gamma:.1f})"), 1, 1)
        fig.add_trace(go.Scatter(x=[alpha], y=[tokens / (mean_gamma * c + 1)], mode="markers",
                                 marker=dict(size=12, symbol="star", color="black"), showlegend=False), 1, 2)
    fig.update_xaxes(title="α")
    return _layout(fig, "theory (Leviathan et al. §3) and this run")
