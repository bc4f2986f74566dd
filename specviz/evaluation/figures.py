"""A sweep's figures: each run's score against its verification time saved (Wagner's trade-off), and
verification time per call against γ (Wagner's Figure 3)."""

from __future__ import annotations

import html

import plotly.graph_objects as go

from specviz.evaluation.results import Summary
from specviz.figures.plots import phone_layout

MODE_COLORS = {"baseline": "#8c959f", "exact": "#1a7f37", "sigmoid": "#cf222e", "target-only": "#0969da"}
METRIC_NAMES = {"rouge1": "ROUGE-1 (higher is better)", "wer": "WER (lower is better)"}


def tradeoff_figure(rows: list[Summary]) -> go.Figure:
    """One point per run: its mean score (bars: 95% bootstrap interval) against how much verification
    time it saved over baseline (Wagner's Δ% profiling time)."""
    fig = go.Figure()
    metric = next((s.metric for s in rows if s.metric), "")
    for mode in ("baseline", "exact", "sigmoid"):
        shown = [s for s in rows if s.mode == mode and s.score is not None and s.verify_reduction_pct is not None]
        if not shown:
            continue
        fig.add_trace(go.Scatter(
            x=[s.verify_reduction_pct for s in shown], y=[s.score for s in shown], mode="markers+text", name=mode,
            text=[html.escape(s.variant.removeprefix(mode + " · ")) + (f" T={s.temperature:g}" if s.temperature else "")
                  for s in shown], textposition="top center", marker=dict(size=11, color=MODE_COLORS[mode]),
            error_y=dict(type="data", symmetric=False,
                         array=[s.score_ci[1] - s.score if s.score_ci else 0 for s in shown],
                         arrayminus=[s.score - s.score_ci[0] if s.score_ci else 0 for s in shown])))
    fig.update_xaxes(title="verification time saved vs baseline (Δ%, per call)", zeroline=True)
    fig.update_yaxes(title=METRIC_NAMES.get(metric, "score"))
    return phone_layout(fig, "score vs verification time saved<br><sup>one point per run, mean over the data set, "
                        "bars: 95% bootstrap interval</sup>", height=380, top=80)


def verify_gamma_figure(rows: list[Summary]) -> go.Figure:
    """Median µs per verification call at each γ, per run (Wagner's Figure 3)."""
    fig = go.Figure()
    for s in rows:
        if not s.gamma_verify_us:
            continue
        gammas = sorted(s.gamma_verify_us)
        fig.add_trace(go.Scatter(x=gammas, y=[s.gamma_verify_us[g] for g in gammas], mode="lines+markers",
                                 name=html.escape(s.variant) + (f" T={s.temperature:g}" if s.temperature else ""),
                                 line=dict(color=MODE_COLORS.get(s.mode))))
    fig.update_xaxes(title="γ (tokens drafted in the iteration)", dtick=1)
    fig.update_yaxes(title="µs per verification call (median)", rangemode="tozero")
    return phone_layout(fig, "verification time per call vs γ<br><sup>median over the calls at each γ, all examples</sup>",
                   height=360, top=80)
