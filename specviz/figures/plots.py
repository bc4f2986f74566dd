"""The run's plotly figures: γ, acceptance, timing, verification, batch raggedness, comparison and theory.

Built from a trace alone (never from a model). Trace strings are untrusted: any that reach a plotly label
or hover text are html-escaped.
"""

from __future__ import annotations

import html
import statistics

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from specviz import theory
from specviz.runs.compare import Row
from specviz.decoding.expectation import expected_speedup
from specviz.traces.prediction import predict
from specviz.config import LOOKUP_THEN_MODEL
from specviz.decoding.records import (ACCEPTED, BONUS, DISCARDED, LOOKUP, MODEL, REJECTED, RESAMPLED, Decision,
                                     drafted_by)
from specviz.traces.trace import Trace

COLORS = {ACCEPTED: "#1a7f37", REJECTED: "#cf222e", DISCARDED: "#8c959f", RESAMPLED: "#0969da", BONUS: "#8250df"}
TIMING_COLORS = {"draft": "#54aeff", "target": "#fd8c73", "verify": "#2da44e"}
# One colour per γ of the theory curves, the same in both of its subplots.
GAMMA_COLORS = {1: "#0969da", 2: "#1a7f37", 3: "#bf8700", 5: "#cf222e", 7: "#8250df", 10: "#57606a"}
PREDICTED_COLOR, MEASURED_COLOR = "#24292f", "#e16f24"


def phone_layout(fig: go.Figure, title: str, height: int = 320, top: int = 60) -> go.Figure:
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
    trace = trace.until(upto)
    rows = _steps_with(trace)
    policy = html.escape(str(trace.config.get("gamma_policy", "?"))[:40])
    batched = len(trace.sequences) > 1
    x = [step.index for step, _ in rows]
    fig = go.Figure(go.Bar(x=x, y=[sum(d.n_accepted for d in ds) / len(ds) if ds else 0 for _, ds in rows],
                           name="accepted (mean over sequences)" if batched else "accepted", opacity=0.5,
                           marker_color=COLORS[ACCEPTED]))
    # hvh: the level changes half-way between iterations, so each bar sits under its own γ
    fig.add_trace(go.Scatter(x=x, y=[step.gamma for step, _ in rows], mode="lines", name="γ (drafted)",
                             line_shape="hvh", line_color="#24292f"))
    # who drafted each iteration, a marker on its γ: where a run mixes proposers (lookup+model, priced), the
    # figure shows which one each iteration used, and plain steps (γ = 0) as their own
    for who, label in ((MODEL, "drafted by the model"), (LOOKUP, "drafted by prompt lookup"),
                       (LOOKUP_THEN_MODEL, "by both (rows differ)"), ("", "plain target step")):
        chosen = [(step.index, step.gamma) for step, ds in rows if drafted_by(ds) == who]
        if chosen:
            fig.add_trace(go.Scatter(x=[i for i, _ in chosen], y=[g for _, g in chosen], mode="markers", name=label,
                                     marker=dict(color=DRAFTER_COLORS[who], size=7)))
    fig.update_xaxes(title="iteration")
    fig.update_yaxes(title="tokens per iteration", rangemode="tozero")
    return phone_layout(fig, f"γ per iteration and who drafted (policy: {policy})")


DRAFTER_COLORS = {MODEL: "#24292f", LOOKUP: "#bf8700", LOOKUP_THEN_MODEL: "#8250df", "": "#8c959f"}


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
    trace = trace.until(upto)
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
    return phone_layout(fig, f"acceptance<br><sup>{_ALPHA_NOTE}</sup>", height=820, top=105)


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
    steps = trace.until(upto).steps
    x = [s.index for s in steps]
    fig = go.Figure()
    for part in ("draft", "target", "verify"):
        fig.add_trace(go.Bar(x=x, y=[1e3 * getattr(s, f"{part}_s") for s in steps], name=part,
                             marker_color=TIMING_COLORS[part], hovertemplate="%{y:.2f} ms<extra>" + part + "</extra>"))
    fig.update_layout(barmode="stack")
    fig.update_xaxes(title="iteration")
    fig.update_yaxes(title="ms per iteration")
    return phone_layout(fig, "time per iteration")


def verify_figure(trace: Trace, upto: int | None = None) -> go.Figure:
    """Verification time per call (µs, its distribution with the median) above its share of all iteration time."""
    steps = [s for s in trace.until(upto).steps if s.gamma > 0]  # target-only steps verify nothing
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
    return phone_layout(fig, "verification: time per call and share of the iteration", height=420)


def batch_figure(trace: Trace, upto: int | None = None) -> go.Figure:
    """Accepted drafts per sequence per iteration (one target call per column), and what raggedness costs:
    padding fed beside real tokens, and masked holes in the KV caches."""
    trace = trace.until(upto)
    by_step = trace.decisions_by_step()
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
    fig = phone_layout(fig, f"batch of {trace.batch_size}: ragged acceptance", top=70)
    fig.update_layout(height=440 + 18 * len(trace.sequences))
    return fig


def _rate_stats(row: Row) -> tuple[float, float | None, float | None]:
    """(bar height, min, max) of a comparison row's tokens/s: the median over rounds when rounds are given."""
    runs = row.tokens_per_s_runs
    if not runs:
        return row.tokens_per_s, None, None
    return statistics.median(runs), min(runs), max(runs)


def _speedup_label(row: Row) -> str:
    """'1.52× end to end (1.40–1.61) · 1.83× decoding': the medians over rounds, the end-to-end one with its
    range (one round has no range)."""
    span = f" ({row.speedup_end_to_end_min:.2f}–{row.speedup_end_to_end_max:.2f})" \
        if len(row.tokens_per_s_runs) > 1 else ""
    return f"{row.speedup_end_to_end:.2f}× end to end{span} · {row.speedup_decode:.2f}× decoding"


def compare_figure(rows: list[Row]) -> go.Figure:
    """Tokens/s (median over rounds, min–max error bars, labelled with both speedups over target-only) and the
    median verify time of each run in a comparison."""
    names = [html.escape(str(r.name)) for r in rows]
    stats = [_rate_stats(r) for r in rows]
    rounds = max((len(r.tokens_per_s_runs) for r in rows), default=0)
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
    spec = [(name, r.median_verify_ms) for name, r in zip(names, rows) if r.median_verify_ms is not None]
    fig.add_trace(go.Bar(y=[name for name, _ in spec], x=[1e3 * ms for _, ms in spec],
                         orientation="h", name="verify µs", marker_color=TIMING_COLORS["verify"],
                         text=[f"{1e3 * ms:.0f} µs" for _, ms in spec], textposition="auto"), 2, 1)
    fig.update_yaxes(title="run", autorange="reversed")
    fig.update_xaxes(title="tokens per second", rangemode="tozero", row=1, col=1)
    fig.update_xaxes(title="µs per verify call (median)", rangemode="tozero", row=2, col=1)
    fig.update_layout(showlegend=False)
    how = f"median of {rounds} rounds, bars span min–max" if rounds > 1 else "one round"
    return phone_layout(fig, f"modes side by side<br><sup>same input and seed; {how}</sup>",
                   height=260 + 56 * max(1, len(rows)), top=80)


def _measured_cost_curve(fig: go.Figure, trace: Trace, alphas: list[float], alpha: float) -> None:
    """Beside Leviathan's flat-cost curves: the speedup vs α on this run's measured costs at its most common
    γ (a target call's price grows with the tokens it scores), and what those costs predict for the run."""
    p, costs = predict(trace), trace.costs
    if p is None or costs is None:  # predict() is None without costs; the test tells the type checker too
        return
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
    trace = trace.until(upto)
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
    return phone_layout(fig, "theory (Leviathan et al. §3): prediction vs measurement", height=360, top=70)
