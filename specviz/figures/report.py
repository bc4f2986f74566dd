"""What the page writes about a trace: the run summary, its measured speedup, the sigmoid warning, the
comparison notes. Built from a trace alone (a loaded trace is untrusted: every string is escaped).
"""

from __future__ import annotations

import html
import time
from typing import Any

from specviz import speedup
from specviz.config import PRICED
from specviz.traces.prediction import predict, sentence
from specviz.speedup import Speedup
from specviz.traces.trace import Trace, json_number

# sigmoid is called far from exact when its acceptance exceeds exact's on the same draws by more than this
# share of the examined drafts, or when p̂ differs from p by more than this total variation on average.
SIGMOID_FAR_INFLATION = 0.05
SIGMOID_FAR_TV = 0.1


def number(meta: dict, key: str) -> float | None:
    return json_number(meta.get(key)) if isinstance(meta, dict) else None


def reference_meta(reference: Trace, reused: bool, measured_at: float, prefill_s: float | None = None
                   ) -> dict[str, Any]:
    """What a run keeps (trace.meta["target_only"]) about the target-only run it is measured against.
    prefill_s: what target-only's end to end counts for reading the input in place of its own prefill (the
    run's prefill less its draft's reading: the same target reading the same input, timed in the run), so that
    both sides of the end-to-end speedup read the input once even where target-only found it in the prompt
    cache; None: its own."""
    prefill = reference.prefill_s if prefill_s is None else prefill_s
    total = prefill + reference.decode_s
    return {"tokens_per_s": reference.new_tokens / total if total > 0 else 0.0,
            "decode_tokens_per_s": reference.decode_tokens_per_s, "prefill_s": prefill,
            "prefill_timed_in_the_run": prefill_s is not None, "new_tokens": reference.new_tokens, "reused": reused,
            "measured_at": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(measured_at)),
            "outputs": reference.outputs}


def prefill_without_draft(trace: Trace) -> float:
    """The run's prefill less its draft's reading of the input: what target-only pays to read the same input
    (the target's prefill, and for speech the audio's encoding)."""
    by_model = trace.meta.get("prefill_s_by_model")
    draft = number(by_model, "draft") if isinstance(by_model, dict) else None
    return max(0.0, trace.prefill_s - (draft or 0.0))


def measured_speedup(trace: Trace) -> Speedup | None:
    """The run's speedup over the target-only reference recorded in the trace (meta["target_only"])."""
    ref = trace.target_only
    if ref is None or not trace.decode_tokens_per_s:
        return None
    return speedup.measured(trace.decode_tokens_per_s, trace.tokens_per_s, number(ref, "decode_tokens_per_s"),
                            number(ref, "tokens_per_s"))


def _speedup_line(trace: Trace) -> str:
    if trace.mode == "target-only":
        return ""
    measured = measured_speedup(trace)
    if measured is None:
        return ("Speedup not measured: tick “Measure the speedup against target-only” to run target-only on the "
                "same input and settings once.")
    ref = trace.target_only
    verdict = "faster" if measured.decode > 1.02 else "slower" if measured.decode < 0.98 else "no faster"
    same = ref.get("outputs") == trace.outputs
    output_note = ("identical output" if same else
                   "different output (sampling: both follow the target's distribution, from different draws)"
                   if trace.temperature else "different output")
    when = html.escape(str(ref.get("measured_at", "")))[:40]
    how = (f"target-only reused from a run at {when}" if ref.get("reused") else
           f"at {when}, in turns with this run of ~0.5 s each, nothing drawn during either")
    load = (" · **measured while another session was working on this server: both runs shared the cores with it, "
            "so the figure may be off**" if ref.get("other_sessions_running") is True else "")
    return (f"**Measured: {measured.decode:.2f}× target-only's decoding speed ({verdict})**, "
            f"{measured.end_to_end:.2f}× end to end (prefill included; target-only's counted as this run's "
            f"without the draft's) · target-only decoded "
            f"{number(ref, 'decode_tokens_per_s'):.2f} tokens/s on the same input and settings "
            f"({how}; {output_note}){load} · Compare repeats runs and shows their spread")


def prediction_markdown(trace: Trace) -> str:
    """The predicted speedup from the run's measured costs, where an iteration's time went, and why."""
    p = predict(trace)
    if p is None:
        return ""
    ms = {k: 1e3 * v for k, v in p.split_s.items()}
    rows = f" (batch of {p.batch})" if p.batch > 1 else ""
    priced = "measured by target-only" if p.plain_from == "reference" else "priced from the run's cost table"
    return (f"**Predicted: {p.speedup:.2f}×** from this run's measured call costs and α by draft position (a "
            f"prediction, beside the measurement above) · a drafting iteration{rows} at γ = {p.gamma}, medians: draft "
            f"{ms['draft']:.0f} ms + target {ms['target']:.0f} ms + verify {ms['verify']:.1f} ms + other "
            f"{ms['other']:.1f} ms, against {1e3 * p.plain_s:.0f} ms per target-only step ({priced}) · tokens per "
            f"iteration: {p.measured_tokens_per_iteration:.2f} kept, {p.tokens_per_iteration:.2f} predicted  \n"
            f"{html.escape(sentence(p))}")


GLANCE_CSS = """
.sv-glance { display: flex; flex-wrap: wrap; gap: 8px; margin: 4px 0 10px; }
.sv-card { flex: 1 1 120px; border: 1px solid #d0d7de; border-radius: 8px; padding: 6px 10px; min-width: 110px; }
.sv-card .sv-value { font-size: 26px; font-weight: 700; line-height: 1.2; }
.sv-card .sv-label { font-size: 12px; color: #57606a; }
.sv-card.sv-good .sv-value { color: #1a7f37; }
.sv-card.sv-bad .sv-value { color: #cf222e; }
"""


def _card(label: str, value: str, note: str = "", tone: str = "") -> str:
    return (f'<div class="sv-card {tone}"><div class="sv-label">{label}</div><div class="sv-value">{value}</div>'
            f'<div class="sv-label">{note}</div></div>')


def who_drafted(trace: Trace, s: dict[str, Any]) -> str:
    """Who proposed the drafts, in words: the draft model, prompt lookup, or both with lookup's share."""
    kind = str(trace.config.get("draft_kind", "model"))
    share = s.get("lookup_share") or 0.0
    if kind == "lookup" or share >= 0.995:
        return "prompt lookup"
    if share > 0.005:
        return f"lookup {100 * share:.0f}% · model {100 * (1 - share):.0f}%"
    return "draft model"


def glance_html(trace: Trace) -> str:
    """The run at a glance, before the sentences: measured speedup and its verdict, tokens/s of both runs, α,
    tokens per iteration and who drafted, as large figures that wrap on a phone. Numbers only from the trace."""
    s = trace.summary()
    cards = []
    measured = measured_speedup(trace) if trace.mode != "target-only" else None
    if measured is not None:
        verdict = "faster" if measured.decode > 1.02 else "slower" if measured.decode < 0.98 else "no faster"
        tone = "sv-good" if measured.decode > 1.02 else "sv-bad" if measured.decode < 0.98 else ""
        ref = trace.target_only
        basis = "target-only reused" if ref.get("reused") else "timed in turns"
        if ref.get("other_sessions_running") is True:
            basis += ", under another session's load"
        cards.append(_card("measured speedup (decoding)", f"{measured.decode:.2f}×",
                           f"{verdict} than target-only · {measured.end_to_end:.2f}× with prefill · {basis}", tone))
    elif trace.mode != "target-only" and (p := predict(trace)) is not None:
        cards.append(_card("predicted speedup (not measured)", f"{p.speedup:.2f}×", "from this run's measured costs"))
    ref = trace.target_only
    reference = f"target-only {number(ref, 'decode_tokens_per_s'):.1f}" if ref and measured is not None else "decoding"
    cards.append(_card("tokens/s", f"{s['decode_tokens_per_s']:.1f}", reference))
    if "alpha" in s:
        cards.append(_card("α", f"{s['alpha']:.2f}", "chance a draft passes"))
        cards.append(_card("tokens / iteration", f"{s['tokens_per_iteration']:.2f}",
                           f"Leviathan predicts {s['predicted_tokens_per_iteration']:.2f}"))
        policy = html.escape(str(trace.config.get("gamma_policy", "")))[:20]
        cards.append(_card("who drafted", html.escape(who_drafted(trace, s)), f"γ policy {policy}"))
    return f'<div class="sv-glance">{"".join(cards)}</div>'


def summary_markdown(trace: Trace) -> str:
    s = trace.summary()
    lines = []
    if trace.stopped:
        lines.append(f"**Stopped** after {len(trace.steps)} iterations: the trace holds what was decoded so far.")
    reused = number(trace.meta, "prompts_reused")
    prefill = f"prefill {s['prefill_s']:.2f} s" + (" (prompt read before: its keys and values reused)" if reused else "")
    lines.append(f"**{html.escape(str(s['mode']))[:40]}** · {s['new_tokens']} tokens · {prefill} · "
                 f"decoding {s['decode_s']:.2f} s → **{s['decode_tokens_per_s']:.2f} tokens/s decoding** "
                 f"({s['tokens_per_s']:.2f} tokens/s with prefill) · {s['target_forward_passes']} target forward passes")
    if line := _speedup_line(trace):
        lines.append(line)
    if line := prediction_markdown(trace):
        lines.append(line)
    if s["sequences"] > 1:
        line = (f"{s['sequences']} sequences, batch of {trace.batch_size} · {s['tokens_per_s_per_sequence']:.2f} tokens/s "
                f"per sequence (each sequence's tokens over the time until it finished)")
        if s.get("padding_fraction") is not None:
            line += (f" · raggedness: {100 * s['padding_fraction']:.1f}% of the tokens fed were padding, "
                     f"{100 * (s.get('cache_hole_fraction') or 0):.1f}% of KV-cache entries were masked holes")
        lines.append(line)
    if "alpha" in s:
        lines.append(f"α ≈ {s['alpha']:.3f} (mean of min(1, p/q) over the drafts verification examined: the chance "
                     f"a draft passes) · acceptance rate {s['acceptance_rate']:.3f} (accepted / drafted: drafts after a "
                     f"rejection count as not accepted) · tokens per iteration {s['tokens_per_iteration']:.2f} "
                     f"(Leviathan predicts {s['predicted_tokens_per_iteration']:.2f} from α and γ)"
                     + (f" · median verify {1e3 * s['median_verify_ms']:.0f} µs per call"
                        if s.get("median_verify_ms") is not None else ""))
    if (wer := number(trace.meta, "wer")) is not None:
        lines.append(f"WER against the reference: {wer:.3f}")
    if (rouge := number(trace.meta, "rouge1")) is not None:
        lines.append(f"ROUGE-1 F against the reference: {rouge:.3f}")
    names = {k: html.escape(str(trace.meta.get(k)))[:200] for k in ("draft", "target", "device", "dtype")}
    lines.append(f"draft {names['draft']} → target {names['target']} on {names['device']}, {names['dtype']}")
    weights = {k: html.escape(str(trace.meta.get(k) or ""))[:200]
               for k in ("draft_weights", "target_weights", "target_encoder")}
    if weights["target_weights"]:
        lines.append(f"the target's linear layers: {weights['target_weights']} · the draft's: {weights['draft_weights']}"
                     + (f" · the encoder: {weights['target_encoder']}" if weights["target_encoder"] else ""))
    if "alpha" in s:
        lines.append(draft_line(trace, s))
    priced = trace.config.get("draft_kind") == PRICED
    if trace.config.get("gamma_policy") == "cost":
        what = "γ and who drafted" if priced else "γ"
        lines.append(f"{what} followed this machine's measured call costs (the cost policy), so the same seed can "
                     f"take other choices elsewhere; the trace keeps every one, and “Run the loaded trace again "
                     "exactly” repeats the run.")
    elif trace.config.get("gamma_policy") == "replay":
        lines.append(("γ and who drafted were" if priced else "γ was") + " read from a trace's schedule (a run decoded "
                     "again exactly), not chosen by a policy.")
    if s.get("explain_s"):
        lines.append(f"Recording the distributions for “why?” took {s['explain_s']:.2f} s, left out of every time above.")
    if s.get("calibration_s"):
        lines.append(f"Timing this machine's calls for the cost policy (a first calibration, or a spot check of the "
                     f"cached one) took {s['calibration_s']:.2f} s before decoding, left out of every time above.")
    # the cards as a block of their own, the sentences as the paragraph after them
    return glance_html(trace) + "\n\n" + "  \n".join(lines)


def draft_line(trace: Trace, s: dict[str, Any]) -> str:
    """Which draft ran, the vocabulary its head scored, and what a draft step cost against a target call."""
    config = trace.config
    kind = str(config.get("draft_kind", "model"))
    vocab, size = number(trace.meta, "vocab_size"), number(trace.meta, "draft_vocab_size")
    if kind == PRICED and config.get("gamma_policy") in ("cost", "replay"):
        first = ("drafted, at each iteration, by whichever the cost policy priced best (prompt lookup, the draft "
                 "model, both, or none: a plain step)")
    elif kind == PRICED:  # only the cost policy prices who drafts; the others keep lookup else model
        first = "drafted by prompt lookup where a continuation was found, else the draft model (priced by no policy)"
    else:
        first = f"drafted by {html.escape(kind)[:40]}"
    parts = [first]
    if s.get("lookup_share") and kind != "lookup":
        parts.append(f"prompt lookup drafted {100 * s['lookup_share']:.0f}% of the proposals")
    if kind != "lookup" and size is not None and vocab is not None:
        parts.append(f"draft head over {int(size):,} of {int(vocab):,} tokens" if size < vocab
                     else f"draft head over all {int(vocab):,} tokens")
    if s.get("cost_ratio") is not None:
        parts.append(f"measured c = {s['cost_ratio']:.2f} (seconds per draft step / per target call)")
    return " · ".join(parts)


def sigmoid_warning(trace: Trace) -> str:
    """HTML for a sampled sigmoid run: how far its decisions are from exact's on the same draws; a visible
    warning when they are far. Empty for any other run."""
    gap = trace.sigmoid_gap()
    if gap is None:
        return ""
    far = gap["inflation"] > SIGMOID_FAR_INFLATION or gap["mean_tv"] > SIGMOID_FAR_TV
    n = gap["examined"]
    text = (f"sigmoid accepted {gap['accepted']} of the {n} drafts it examined; exact verification, with the same "
            f"uniforms, would have accepted {gap['exact_would_accept']} ({100 * gap['inflation']:+.1f} points of "
            f"acceptance; {gap['disagreements']} decisions differ). Its p̂ differs from the target's p by a total "
            f"variation of {gap['mean_tv']:.2f} on average (at most {gap['max_tv']:.2f}).")
    if far:
        return (f'<div class="sv-warning" role="alert"><b>⚠ sigmoid is far from exact here</b>: {text} The output '
                f"does not follow the target's distribution; α and the speedup shown are not comparable with exact "
                f"runs. Narrow the sigmoid range or use exact.</div>")
    return f'<div class="sv-note">sigmoid is close to exact on this run: {text}</div>'


def sigmoid_drift(traces: dict[str, Trace]) -> str:
    """How far sigmoid strays from exact in a comparison: output agreement and acceptance inflation."""
    exact, sigmoid = traces.get("exact"), traces.get("sigmoid")
    if not exact or not sigmoid:
        return ""
    a_ids = [t for ids in exact.outputs for t in ids]
    b_ids = [t for ids in sigmoid.outputs for t in ids]
    same = sum(a == b for a, b in zip(a_ids, b_ids))
    n = max(len(a_ids), len(b_ids), 1)
    first_diff = next((i for i, (a, b) in enumerate(zip(a_ids, b_ids)) if a != b), None)
    ra, rb = exact.acceptance_rate() or 0.0, sigmoid.acceptance_rate() or 0.0
    sampled = bool(exact.temperature)
    line = (f"**sigmoid vs exact** ({'sampled' if sampled else 'greedy: sigmoid cannot differ from exact'}): "
            f"{same}/{n} output tokens identical"
            + (f" (first difference at token {first_diff})" if first_diff is not None else "")
            + f"; acceptance rate {rb:.3f} vs {ra:.3f} ({rb - ra:+.3f}).")
    if (gap := sigmoid.sigmoid_gap()) is not None:
        line += (f" On the same draws exact would have accepted {gap['exact_would_accept']} of the "
                 f"{gap['accepted']} drafts sigmoid accepted; mean TV(p̂, p) {gap['mean_tv']:.2f}.")
    return line


def compare_note(rounds: int, noise: float, decoding: str) -> str:
    """What the comparison table's numbers are and how noisy they came out."""
    if rounds < 2:
        spread = "one round: no spread measured; the same comparison twice can differ by tens of percent on a loaded machine"
    else:
        spread = (f"{rounds} interleaved rounds: each speedup is the median of per-round ratios (decoding: "
                  f"prefill left out; end to end: prefill included), the end-to-end one with the lowest and highest "
                  f"beside it; tokens/s varied by up to {100 * noise:.0f}% between rounds")
        if noise > 0.15:
            spread += " (**noisy**: differences smaller than that are not measured)"
    return (f"Decoding: {html.escape(decoding)}. {spread}. Columns: *decoding ×* and *end to end ×* are speedups over "
            f"target-only in the same round (without and with prefill), *tokens/s* counts prefill, *verify µs* is the "
            f"median verification call. Verification is a small share of each iteration on a CPU: its time cannot "
            f"explain large tokens/s gaps.")
