"""`python -m specviz ...`: generate, transcribe and compare; the benchmarks are in specviz.cli.bench."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from tqdm import tqdm

from specviz.cli import bench as cli_bench, common, evaluate as cli_eval
from specviz import machine, memory
from specviz.speech.audio import AudioError
from specviz.evaluation.on_ray import RayUnavailable
from specviz.runs.compare import compare, hf_assisted_runs, noise, source_runner
from specviz.config import DRAFT_KINDS, GAMMA_POLICIES, MODES, SpecConfig
from specviz.models.loading import ModelLoadError
from specviz.traces.prediction import predict, sentence
from specviz.text.prompts import InputError
from specviz.decoding.records import Finished, Iteration, Prefilling
from specviz.runs.decode import run
from specviz.sampling import InvalidLogitsError
from specviz.runs.settings import SPEECH, TEXT, add_flags
from specviz.text.source import article_source
from specviz.traces.trace import TraceFormatError


def _decode_with_bar(source, cfg: SpecConfig, args: argparse.Namespace, what: str, meta: dict):
    """Run the shared entry point with a progress bar over every sequence's tokens."""
    total = cfg.max_new_tokens * len(source.sequences)
    with tqdm(total=total, desc=f"{cfg.mode} {what}", unit="tok", file=sys.stderr) as bar:
        def advance(event, trace):
            if isinstance(event, Prefilling):
                bar.set_postfix_str(f"prefill: the {event.model} read {event.read} of {event.total} prompt tokens")
            elif isinstance(event, Iteration):
                bar.update(sum(d.emitted for d in event.decisions))
                bar.set_postfix(γ=event.step.gamma, batch=len(event.step.sequences),
                                accepted="/".join(str(d.n_accepted) for d in event.decisions))
            elif isinstance(event, Finished):  # what an early EOS leaves of the budget will not come
                bar.total -= cfg.max_new_tokens - len(trace.sequences[event.sequence].output_ids)
                bar.refresh()
        return run(source, cfg, batch_size=args.batch_size, meta=meta, on_event=advance)



def _print_result(trace) -> None:
    if len(trace.sequences) == 1:
        print(trace.output_text)
    else:
        for group, text in trace.texts().items():
            print(f"[{group}]\n{text}\n")
    print()
    for key, value in trace.summary().items():
        print(f"  {key:32s} {value:.4g}" if isinstance(value, float) else f"  {key:32s} {value}")
    if (p := predict(trace)) is not None:
        print(f"  {'predicted_speedup':32s} {p.speedup:.4g}  (from the measured call costs; a prediction)")
        print(f"\n{sentence(p)}")



def cmd_generate(args: argparse.Namespace) -> int:
    articles = common.articles(args)
    cfg = common.config(args, TEXT)
    pair = common.load_text(args)
    source = article_source(pair, articles, cfg, args.sequences)
    trace = _decode_with_bar(source, cfg, args, "decoding", {"input": [text for _, text in articles]})
    _print_result(trace)
    if args.trace:
        trace.save(args.trace)
        print(f"trace written to {args.trace}", file=sys.stderr)
    return 0



def cmd_compare(args: argparse.Namespace) -> int:
    kinds = {common.is_audio(a) for a in args.inputs}
    if len(kinds) > 1:
        raise InputError("compare takes articles or audio files, not both in one batch")
    if kinds == {True}:
        from specviz.speech.asr import SpeechSource

        if args.hf_assisted:
            raise InputError("--hf-assisted compares text generation only")
        clips = common.clips(args.inputs)
        pair = common.load_speech(args)
        cfg = common.config(args, SPEECH, mode="exact")
        source = SpeechSource(pair, clips, args.language, cfg.draft_vocab)
        extra = {}
    else:
        articles = common.articles(args)
        cfg = common.config(args, TEXT, mode="exact")
        pair = common.load_text(args)
        source = article_source(pair, articles, cfg, args.sequences)
        if args.hf_assisted and len(source.sequences) > 1:
            raise InputError("--hf-assisted runs one sequence: transformers' assisted generation has no batch > 1")
        extra = hf_assisted_runs(pair, source.sequences[0].prompt_ids, cfg) if args.hf_assisted else {}
    runner = source_runner(source, args.batch_size)
    extra = {**_draft_variants(args, pair, cfg, clips if kinds == {True} else None),
             **_policy_variants(args, cfg, runner), **extra}
    names = f"{pair.draft_name} → {pair.target_name}"
    modes = tuple(args.modes)
    with tqdm(desc="compare", unit="run", file=sys.stderr, total=1 + (1 + len(modes) + len(extra)) * args.repeat) as bar:
        started = []

        def stage(name: str) -> None:
            if started:
                bar.update(1)
            started.append(name)
            bar.set_postfix_str(name)

        rows, traces = compare(runner, cfg, modes=modes, extra=extra,
                               repeat=args.repeat, on_stage=stage)
        bar.update(1)
    wer = {}
    if args.reference_file:
        from specviz.speech.asr import word_error_rate

        reference = Path(args.reference_file).read_text(encoding="utf-8")
        wer = {name: word_error_rate(reference, trace.output_text) for name, trace in traces.items()}
    header = (f"{'run':30s} {'tok/s':>7s} {'tok/s/seq':>9s} {'end to end':>10s} {'(min–max)':>11s} {'decoding':>8s} "
              f"{'predicted':>9s} {'α':>6s} "
              f"{'tok/iter':>8s} {'verify ms':>9s}  = target-only" + ("    WER" if wer else ""))
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r.name:30s} {r.tokens_per_s:7.2f} {r.tokens_per_s_per_sequence:9.2f} {r.speedup_end_to_end:9.2f}× "
              f"{f'{r.speedup_end_to_end_min:.2f}–{r.speedup_end_to_end_max:.2f}':>11s} {r.speedup_decode:7.2f}× "
              f"{common.fmt(r.predicted_speedup, '8.2f'):>8s}"
              f"{'×' if r.predicted_speedup is not None else ' '} {common.fmt(r.alpha, '6.3f'):>6s} {common.fmt(r.tokens_per_iteration, '8.2f'):>8s} "
              f"{common.fmt(r.median_verify_ms, '9.2f'):>9s}  {'yes' if r.equals_target_only else 'no ':13s}"
              + (f" {wer[r.name]:6.3f}" if wer else ""))
    if args.repeat > 1:
        print(f"\nspeedups (end to end: prefill included; decoding: prefill left out): median over {args.repeat} "
              f"rounds of the per-round ratio; tokens/s varied by up to "
              f"{100 * noise(rows):.0f}% between rounds")
    dtype = str(pair.dtype).removeprefix("torch.")
    batch = min(args.batch_size, len(source.sequences))
    weights = getattr(pair, "target_weights", "")
    encoder = source.meta().get("target_encoder")  # speech: what the encoder runs in (speech.encoder)
    print(f"\n{names}, {dtype}, {len(source.sequences)} sequences in batches of {batch}, {machine.describe()}"
          + (f"\ntarget: {weights} · draft: {pair.draft_weights}" if weights else "")
          + (f"\nencoder: {encoder}" if encoder else ""))
    if args.json:
        report = {"machine": machine.describe(), "models": names, "dtype": dtype, "target_weights": weights,
                  **({"target_encoder": encoder} if encoder else {}),
                  "draft_weights": getattr(pair, "draft_weights", ""),
                  "inputs": args.inputs or ["sample article"], "sequences": len(source.sequences), "batch_size": batch,
                  "repeat": args.repeat, "statistic": "tokens/s: the median run by wall time; speedup_end_to_end and speedup_decode: the "
                  "median of per-round ratios to target-only; after one untimed warm-up run", "noise": noise(rows),
                  "config": cfg.to_dict(), "rows": [{**r.to_dict(), **({"wer": wer[r.name]} if wer else {})} for r in rows],
                  "runs": {name: trace.summary() for name, trace in traces.items()}}
        Path(args.json).write_text(json.dumps(report, indent=2, ensure_ascii=False))
        print(f"table written to {args.json}", file=sys.stderr)
    return 0


def _draft_variants(args: argparse.Namespace, pair, cfg: SpecConfig, clips) -> dict:
    """Extra compare runs, one per --drafts entry 'KIND[:K]' (e.g. lookup+model:32768), in the first mode."""
    out = {}
    for spec in args.drafts or []:
        kind, _, k = spec.partition(":")
        if kind not in DRAFT_KINDS or (k and not k.isdigit()):
            raise InputError(f"--drafts takes KIND[:K] with KIND one of {', '.join(DRAFT_KINDS)}, got {spec!r}")
        variant = dataclasses.replace(cfg, mode=args.modes[0], draft_kind=kind,
                                      draft_vocab=int(k) if k else cfg.draft_vocab)
        if clips is not None:
            from specviz.speech.asr import SpeechSource

            source = SpeechSource(pair, clips, args.language, variant.draft_vocab)
        else:
            source = article_source(pair, common.articles(args), variant, args.sequences)
        head = "" if kind == "lookup" else f" · K={variant.draft_vocab}" if variant.draft_vocab else " · all tokens"
        name = f"{variant.mode} · {kind}{head}"
        out[name] = lambda source=source, variant=variant: run(source, variant, batch_size=args.batch_size)
    return out


def _policy_variants(args: argparse.Namespace, cfg: SpecConfig, runner) -> dict:
    """Extra compare runs, one per --policies entry 'POLICY[:γ]' (e.g. cost, constant:3), in the first mode."""
    out = {}
    for spec in args.policies or []:
        name, _, gamma = spec.partition(":")
        if name not in GAMMA_POLICIES or (gamma and not gamma.isdigit()) or gamma == "0":
            raise InputError(f"--policies takes POLICY[:γ] with POLICY one of {', '.join(GAMMA_POLICIES)} and γ ≥ 1, "
                             f"got {spec!r}")
        variant = dataclasses.replace(cfg, mode=args.modes[0], gamma_policy=name,
                                      gamma_init=int(gamma) if gamma else None)
        out[f"{variant.mode} · γ {spec}"] = lambda variant=variant: runner(variant, False)
    return out



def cmd_transcribe(args: argparse.Namespace) -> int:
    from specviz.speech.asr import SpeechSource, word_error_rate

    reference = args.reference
    if args.reference_file:
        reference = Path(args.reference_file).read_text(encoding="utf-8")
    if reference and len(args.inputs) > 1:
        raise InputError("a reference transcript needs exactly one audio file")
    clips = common.clips(args.inputs)
    pair = common.load_speech(args)
    cfg = common.config(args, SPEECH)
    source = SpeechSource(pair, clips, args.language, cfg.draft_vocab)
    meta = {"input": [name for name, _ in clips]}
    if reference:
        meta["reference"] = reference
    trace = _decode_with_bar(source, cfg, args, "transcribing", meta)
    if reference:
        trace.meta["wer"] = word_error_rate(reference, trace.output_text)
    _print_result(trace)
    if reference:
        print(f"  {'wer':32s} {trace.meta['wer']:.4g}")
    if args.trace:
        trace.save(args.trace)
        print(f"trace written to {args.trace}", file=sys.stderr)
    return 0



def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m specviz", description="Speculative decoding you can watch.")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="summarize an article with speculative decoding")
    common.add_common(g)
    add_flags(g, ["mode"])
    g.add_argument("--trace", metavar="FILE", help="write the JSON trace here")
    g.set_defaults(func=cmd_generate)
    t = sub.add_parser("transcribe", help="transcribe an audio file with speculative Whisper decoding")
    common.add_common(t, "audio")
    add_flags(t, ["mode"])
    t.add_argument("--reference", help="reference transcript, for WER")
    t.add_argument("--reference-file", help="file holding the reference transcript, for WER")
    t.add_argument("--trace", metavar="FILE", help="write the JSON trace here")
    t.set_defaults(func=cmd_transcribe)
    c = sub.add_parser("compare", help="target-only vs baseline vs exact vs sigmoid on one input (text or audio)")
    common.add_common(c, "either")
    c.add_argument("--json", metavar="FILE", help="write the table as JSON here")
    c.add_argument("--hf-assisted", action="store_true", help="also time transformers' generate(assistant_model=...)")
    c.add_argument("--repeat", type=int, default=1, help="rounds of all runs; each row reports its median run")
    c.add_argument("--reference-file", help="reference transcript of an audio input: adds each run's WER")
    c.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES, help="verification modes to run")
    c.add_argument("--drafts", nargs="+", metavar="KIND[:K]",
                   help="extra runs in the first mode with other drafts, e.g. model lookup lookup+model:32768")
    c.add_argument("--policies", nargs="+", metavar="POLICY[:γ]",
                   help="extra runs in the first mode with other γ policies, e.g. cost hf constant:1 constant:3")
    c.set_defaults(func=cmd_compare)
    cli_bench.add_commands(sub)
    cli_eval.add_command(sub)
    return parser



def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    memory.reuse_freed_memory()
    try:
        return args.func(args)
    except (InputError, AudioError, ModelLoadError, InvalidLogitsError, TraceFormatError, ValueError, OSError,
            RayUnavailable) as e:
        print(f"specviz: error: {e}", file=sys.stderr)
        return 2

