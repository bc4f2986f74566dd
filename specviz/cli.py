"""`python -m specviz ...`: generate, transcribe, compare, and the benchmarks."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from tqdm import tqdm

from . import machine
from .audio import AudioError, load_audio, windows
from .compare import compare, hf_assisted_runs, noise, source_runner
from .config import (DRAFT_KINDS, GAMMA_POLICIES, MODES, SamplingConfig, SpecConfig, default_sigmoid_range,
                     draft_defaults)
from .gamma import default_policy
from .prediction import predict, sentence
from .models import DEFAULT, WEIGHTS, ModelLoadError, ModelPair, load_pair
from .prompts import InputError, check_article_size, sample_article
from .records import Finished, Iteration
from .runs import DEFAULT_BATCH, run
from .sampling import InvalidLogitsError
from .text import article_source
from .trace import TraceFormatError


class _LoadProgress:
    """Model-loading progress on stderr: a bar for stages with a known length, a line for the others."""

    def __init__(self) -> None:
        self.bar: tqdm | None = None
        self.stage = ""

    def __call__(self, message: str, fraction: float | None) -> None:
        if message != self.stage:
            self.close()
            self.stage = message
            if fraction is None:
                print(f"specviz: {message}", file=sys.stderr)
            else:
                self.bar = tqdm(total=100, desc=message, unit="%", file=sys.stderr, leave=False)
        if self.bar is not None and fraction is not None:
            self.bar.update(round(100 * fraction) - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _add_common(p: argparse.ArgumentParser, inputs: str = "text") -> None:
    """Options every command shares; inputs is 'text', 'audio' or 'either'."""
    audio = inputs != "text"
    src = p.add_argument_group("input")
    if inputs == "audio":
        src.add_argument("inputs", nargs="+", metavar="AUDIO",
                         help="audio files (WAV, FLAC, OGG, MP3, ... anything libsndfile reads), decoded as one batch")
    else:
        src.add_argument("inputs", nargs="*", metavar="ARTICLE" if not audio else "INPUT",
                         help="article files to summarize as one batch ('-' for stdin)"
                         + ("; or audio files to transcribe" if audio else "") + "; default: the bundled sample article")
    src.add_argument("--max-new-tokens", type=int, default=128, help="per sequence")
    if inputs != "audio":
        src.add_argument("--num-sequences", type=int, default=1,
                         help="samples drawn per article (BASS: several responses to one prompt; needs --temperature > 0)")
    if audio:
        src.add_argument("--language", default="en", help="spoken language for a multilingual Whisper (default en)")
    m = p.add_argument_group("models")
    m.add_argument("--draft", default=DEFAULT, help="hub id, local directory, .gguf file, or 'default' (embedded); "
                   "speech also takes 'layers:0,1,2,4,5' (a draft made of the target's own decoder layers)")
    m.add_argument("--target", default=DEFAULT, help="hub id, local directory, .gguf file, or 'default' (embedded)")
    m.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"],
                   help="default: fp32 on the CPU (no fast bf16 matrix multiply there), bf16 for the text pair on CUDA; "
                   "fp32 for Whisper")
    m.add_argument("--weights", default="auto", choices=WEIGHTS,
                   help="text models on the CPU: 'packed' multiplies straight from a GGUF model's quantized blocks "
                   "(specviz's CPU kernel; fp32 activations), 'dense' uses the dequantized fp32 weights (the same "
                   "model, ~5× the memory traffic per step); auto: packed wherever the model comes from a GGUF file")
    m.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    m.add_argument("--draft-int8", action=argparse.BooleanOptionalAction, default=None,
                   help="int8 draft weights (default: on for the CPU, where its step is the fastest measured; "
                   "--no-draft-int8: the draft follows --weights; the target is never quantized)")
    m.add_argument("--draft-kind", default=None, choices=DRAFT_KINDS,
                   help="who drafts: the draft model, prompt lookup (n-gram match on prompt and output, no draft "
                   "model), or lookup where an n-gram matches and the model elsewhere (default: measured per task)")
    m.add_argument("--lookup-ngram", type=int, default=None,
                   help="with lookup+model: the shortest suffix match that replaces the model's draft")
    m.add_argument("--draft-vocab", type=int, default=None,
                   help="tokens the draft model's head scores (the first K ids, specials and the prompt's tokens; "
                   "0 = all); the target keeps its full head, so output stays exact (default: measured per task)")
    s = p.add_argument_group("sampling (applied identically to draft and target)")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--seed", type=int, default=0)
    v = p.add_argument_group("speculation")
    v.add_argument("--batch-size", type=int, default=DEFAULT_BATCH,
                   help=f"sequences decoded together at most (default {DEFAULT_BATCH}); more run in consecutive groups")
    v.add_argument("--gamma-policy", default=None, choices=GAMMA_POLICIES,
                   help="default: bass when several sequences decode together, else hf. cost: the γ with the best expected "
                        "tokens/s from the measured call costs, 0 (a plain target step) when none pays")
    v.add_argument("--gamma", type=int, default=None, help="initial γ (default: the policy's own)")
    v.add_argument("--lenience", type=float, default=1.0, help="Leviathan A.5; 1 = exact")
    v.add_argument("--verify-backend", default="auto", choices=["auto", "torch", "cuda"],
                   help="auto: CuPy kernels for exact/sigmoid on CUDA when they work; torch: never")
    v.add_argument("--draft-confidence", type=float, default=0.0,
                   help="stop drafting when the draft's probability of its token is below this (0 = off)")
    v.add_argument("--sigmoid-alpha", type=float, default=None, help="default: -1e4 for text, -1e3 for speech")
    v.add_argument("--sigmoid-beta", type=float, default=None, help="default: 1e4 for text, 1e3 for speech")


def _config(args: argparse.Namespace, mode: str, batch: int, speech: bool = False) -> SpecConfig:
    """Settings from the command line; sigmoid α/β default to Wagner et al.'s value for the task, the γ policy
    to the task's default (specviz.gamma.default_policy)."""
    scale = default_sigmoid_range(speech)
    drafts = draft_defaults(speech)
    if args.batch_size < 1:
        raise InputError(f"--batch-size must be >= 1, got {args.batch_size}")
    return SpecConfig(
        mode=mode,
        sampling=SamplingConfig(args.temperature, args.top_k, args.top_p),
        gamma_policy=args.gamma_policy or default_policy(min(batch, args.batch_size)),
        gamma_init=args.gamma,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        lenience=args.lenience,
        draft_confidence=args.draft_confidence,
        verify_backend=args.verify_backend,
        draft_kind=args.draft_kind or drafts.draft_kind,
        lookup_ngram=args.lookup_ngram or drafts.lookup_ngram,
        draft_vocab=drafts.draft_vocab if args.draft_vocab is None else args.draft_vocab,
        sigmoid_alpha=-scale if args.sigmoid_alpha is None else args.sigmoid_alpha,
        sigmoid_beta=scale if args.sigmoid_beta is None else args.sigmoid_beta,
    )


def _read_article(arg: str) -> str:
    if arg == "-":
        return sys.stdin.read()
    path = Path(arg)
    if not path.is_file():
        raise InputError(f"no such file: {arg}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{arg} is not UTF-8 text; give an article as a text file") from None


def _articles(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(label, text) per article; refuses an empty one before minutes go into loading models."""
    if not args.inputs:
        return [("sample article", sample_article())]
    if args.inputs.count("-") > 1:
        raise InputError("stdin ('-') can be read only once")
    out = []
    for arg in args.inputs:
        text = _read_article(arg)
        label = "stdin" if arg == "-" else Path(arg).name
        if not text.strip():
            raise InputError(f"the article is empty ({label}): give a file with some text to summarize")
        check_article_size(text)
        out.append((label, text))
    return out


def _load(args: argparse.Namespace) -> ModelPair:
    progress = _LoadProgress()
    try:
        return load_pair(args.draft, args.target, device=args.device, dtype=args.dtype,
                         draft_int8=args.draft_int8, weights=args.weights, progress=progress)
    finally:
        progress.close()


def _decode_with_bar(source, cfg: SpecConfig, args: argparse.Namespace, what: str, meta: dict):
    """Run the shared entry point with a progress bar over every sequence's tokens."""
    total = cfg.max_new_tokens * len(source.sequences)
    with tqdm(total=total, desc=f"{cfg.mode} {what}", unit="tok", file=sys.stderr) as bar:
        def advance(event, trace):
            if isinstance(event, Iteration):
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
    articles = _articles(args)
    cfg = _config(args, args.mode, len(articles) * args.num_sequences)
    pair = _load(args)
    source = article_source(pair, articles, cfg, args.num_sequences)
    trace = _decode_with_bar(source, cfg, args, "decoding", {"input": [text for _, text in articles]})
    _print_result(trace)
    if args.trace:
        trace.save(args.trace)
        print(f"trace written to {args.trace}", file=sys.stderr)
    return 0


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


AUDIO_SUFFIXES = {".wav", ".flac", ".ogg", ".oga", ".opus", ".mp3", ".aiff", ".aif", ".au", ".caf", ".w64", ".rf64"}


def _is_audio(arg: str | None) -> bool:
    return arg is not None and Path(arg).suffix.lower() in AUDIO_SUFFIXES


def _clips(paths: list[str]) -> list[tuple[str, "np.ndarray"]]:
    return [(Path(p).name, load_audio(p)) for p in paths]


def cmd_compare(args: argparse.Namespace) -> int:
    kinds = {_is_audio(a) for a in args.inputs}
    if len(kinds) > 1:
        raise InputError("compare takes articles or audio files, not both in one batch")
    if kinds == {True}:
        from .asr import SpeechSource

        if args.hf_assisted:
            raise InputError("--hf-assisted compares text generation only")
        clips = _clips(args.inputs)
        pair = _load_speech(args)
        cfg = _config(args, "exact", _window_count(clips), speech=True)
        source = SpeechSource(pair, clips, args.language, cfg.draft_vocab)
        extra = {}
    else:
        articles = _articles(args)
        cfg = _config(args, "exact", len(articles) * args.num_sequences)
        pair = _load(args)
        source = article_source(pair, articles, cfg, args.num_sequences)
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
        from .asr import word_error_rate

        reference = Path(args.reference_file).read_text(encoding="utf-8")
        wer = {name: word_error_rate(reference, trace.output_text) for name, trace in traces.items()}
    header = (f"{'run':30s} {'tok/s':>7s} {'tok/s/seq':>9s} {'speedup':>8s} {'(min–max)':>11s} {'predicted':>9s} {'α':>6s} "
              f"{'tok/iter':>8s} {'verify ms':>9s}  = target-only" + ("    WER" if wer else ""))
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r.name:30s} {r.tokens_per_s:7.2f} {r.tokens_per_s_per_sequence:9.2f} {r.speedup:7.2f}× "
              f"{f'{r.speedup_min:.2f}–{r.speedup_max:.2f}':>11s} {_fmt(r.predicted_speedup, '8.2f'):>8s}"
              f"{'×' if r.predicted_speedup is not None else ' '} {_fmt(r.alpha, '6.3f'):>6s} {_fmt(r.tokens_per_iteration, '8.2f'):>8s} "
              f"{_fmt(r.median_verify_ms, '9.2f'):>9s}  {'yes' if r.equals_target_only else 'no ':13s}"
              + (f" {wer[r.name]:6.3f}" if wer else ""))
    if args.repeat > 1:
        print(f"\nspeedup: median over {args.repeat} rounds of the per-round ratio; tokens/s varied by up to "
              f"{100 * noise(rows):.0f}% between rounds")
    dtype = str(pair.dtype).removeprefix("torch.")
    batch = min(args.batch_size, len(source.sequences))
    weights = getattr(pair, "target_weights", "")
    print(f"\n{names}, {dtype}, {len(source.sequences)} sequences in batches of {batch}, {machine.describe()}"
          + (f"\ntarget: {weights} · draft: {pair.draft_weights}" if weights else ""))
    if args.json:
        report = {"machine": machine.describe(), "models": names, "dtype": dtype, "target_weights": weights,
                  "draft_weights": getattr(pair, "draft_weights", ""),
                  "inputs": args.inputs or ["sample article"], "sequences": len(source.sequences), "batch_size": batch,
                  "repeat": args.repeat, "statistic": "tokens/s: the median run by wall time; speedup: the median of per-round ratios to "
                  "target-only; after one untimed warm-up run", "noise": noise(rows),
                  "config": cfg.to_dict(), "rows": [{**r.as_dict(), **({"wer": wer[r.name]} if wer else {})} for r in rows],
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
            from .asr import SpeechSource

            source = SpeechSource(pair, clips, args.language, variant.draft_vocab)
        else:
            source = article_source(pair, _articles(args), variant, args.num_sequences)
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


def _window_count(clips: list) -> int:
    """Sequences a speech batch will have: one per 30 s window of every clip."""
    return sum(len(windows(audio)) for _, audio in clips)


def _load_speech(args: argparse.Namespace):
    from .asr import load_speech_pair

    progress = _LoadProgress()
    try:
        return load_speech_pair(args.target, args.draft, device=args.device, dtype=args.dtype or "fp32",
                                draft_int8=args.draft_int8, progress=progress)
    finally:
        progress.close()


def cmd_transcribe(args: argparse.Namespace) -> int:
    from .asr import SpeechSource, word_error_rate

    reference = args.reference
    if args.reference_file:
        reference = Path(args.reference_file).read_text(encoding="utf-8")
    if reference and len(args.inputs) > 1:
        raise InputError("a reference transcript needs exactly one audio file")
    clips = _clips(args.inputs)
    pair = _load_speech(args)
    cfg = _config(args, args.mode, _window_count(clips), speech=True)
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


def cmd_bench_speech_draft(args: argparse.Namespace) -> int:
    from .bench import speech_draft_layers
    from .asr import parse_layers

    clips = _clips(args.inputs)
    cfg = _config(args, "exact", 1, speech=True)
    pair = _load_speech(args)
    reference = Path(args.reference_file).read_text(encoding="utf-8") if args.reference_file else None
    layer_sets = [parse_layers(spec) for spec in args.layers]
    rows = speech_draft_layers(pair, clips, layer_sets, cfg, reference, repeat=args.repeat)
    print(f"{'draft':28s} {'α':>6s} {'accept':>7s} {'tok/iter':>8s} {'decode s':>9s} {'speedup':>8s}")
    for r in rows:
        print(f"{r['draft']:28s} {_fmt(r.get('alpha'), '6.3f'):>6s} {_fmt(r.get('acceptance_rate'), '7.3f'):>7s} "
              f"{_fmt(r.get('tokens_per_iteration'), '8.2f'):>8s} {r['decode_s']:9.3f} {r['speedup']:7.2f}×")
    print(f"\n{pair.target_name}, {str(pair.dtype).removeprefix('torch.')}, {machine.describe()}")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine.describe(), "input": args.inputs, "repeat": args.repeat,
                                               "statistic": "median decode time (prefill excluded), after a warm-up",
                                               "config": cfg.to_dict(), "rows": rows}, indent=2))
    return 0


def cmd_bench_batch(args: argparse.Namespace) -> int:
    from .bench import batch_scaling

    articles = _articles(args)
    if len(articles) != 1:
        raise InputError("bench-batch draws B samples of one article: give one article (or none for the sample)")
    cfg = _config(args, args.mode, 1)
    pair = _load(args)
    with tqdm(total=len(args.batches) * 2 * args.repeat, desc="bench-batch", unit="run", file=sys.stderr) as bar:
        def on_run(name: str) -> None:
            bar.set_postfix_str(name)
            bar.update(1)
        rows = batch_scaling(pair, articles[0][1], args.batches, cfg, repeat=args.repeat, policy=args.gamma_policy,
                             on_run=on_run)
    print(f"{'B':>2s} {'policy':6s} {'run':12s} {'tok/s':>7s} {'tok/s/seq':>9s} {'decode tok/s/seq':>16s} "
          f"{'α':>6s} {'tok/iter/seq':>12s} {'target calls':>12s} {'padding':>7s} {'holes':>6s}")
    for r in rows:
        for name in ("target_only", "speculative"):
            m = r[name]
            print(f"{r['batch']:2d} {r['gamma_policy']:6s} {name:12s} {m['tokens_per_s']:7.2f} "
                  f"{m['tokens_per_s_per_sequence']:9.3f} {m['decode_tokens_per_s_per_sequence']:16.3f} "
                  f"{_fmt(m['alpha'], '6.3f'):>6s} {_fmt(m['tokens_per_iteration_per_sequence'], '12.2f'):>12s} "
                  f"{m['target_calls']:12d} {_fmt(m['padding_fraction'], '7.3f'):>7s} {_fmt(m['cache_hole_fraction'], '6.3f'):>6s}")
        print(f"   speedup: total {r['speedup_total']:.2f}×, per sequence {r['speedup_per_sequence']:.2f}× "
              f"(decode only {r['speedup_decode_per_sequence']:.2f}×)")
    dtype = str(pair.dtype).removeprefix("torch.")
    print(f"\n{pair.draft_name} → {pair.target_name}, {dtype}, {machine.describe()}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "machine": machine.describe(), "models": f"{pair.draft_name} → {pair.target_name}", "dtype": dtype,
            "input": args.inputs or ["sample article"], "repeat": args.repeat, "config": cfg.to_dict(),
            "statistic": "per side, the median run by decode time of `repeat` interleaved rounds, after a warm-up",
            "rows": rows}, indent=2))
        print(f"results written to {args.json}", file=sys.stderr)
    return 0


def cmd_bench_steps(args: argparse.Namespace) -> int:
    """One model call's cost by weights format: prefill, and a step scoring M tokens (docs/benchmarks.md)."""
    import torch

    from .bench_models import linear_params, step_costs, weight_bytes
    from .models import load_model, parse_dtype
    from .prompts import max_prompt_tokens, summarization_prompt
    from .quant import quantize_draft_int8

    article = _articles(args)[0][1]
    device = torch.device(args.device or "cpu")
    variants = [(role, w) for role in ("target", "draft") for w in args.weights_list]
    if "dense" in args.weights_list:
        variants.append(("draft", "dense int8"))
    rows = []
    for role, weights in tqdm(variants, desc="bench-steps", unit="model", file=sys.stderr):
        name = args.target if role == "target" else args.draft
        model, tokenizer, label = load_model(name, role, device=device, dtype=parse_dtype(args.dtype or "fp32"),
                                             weights=weights.split()[0])
        if weights == "dense int8":
            model = quantize_draft_int8(model)
        prompt = summarization_prompt(tokenizer, article, max_prompt_tokens(32768, 128))
        costs = step_costs(model, model.config.vocab_size, prompt[:-1], args.tokens, repeat=args.repeat)
        rows.append({"role": role, "model": label, "weights": weights, "bytes_per_step": weight_bytes(model),
                     "linear_macs_per_token": linear_params(model), **costs})
        del model
    print(f"{'role':6s} {'weights':11s} {'GB/step':>7s} {'prefill s':>9s} " + " ".join(f"{m:>9d}" for m in args.tokens)
          + "   (ms per step scoring M tokens; × its 1-token step)")
    for r in rows:
        cells = " ".join(f"{1e3 * s['seconds']:6.0f}" + (f" {s['ratio']:.1f}×" if s['tokens'] != 1 else "   ")
                         for s in r["steps"])
        print(f"{r['role']:6s} {r['weights']:11s} {r['bytes_per_step'] / 1e9:7.2f} {r['prefill_s']:9.2f} {cells}")
    print(f"\n{machine.describe()}; prompt {rows[0]['prompt_tokens']} tokens; median of {args.repeat} after 2 warm-ups")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine.describe(), "repeat": args.repeat,
                                               "statistic": "median seconds per call after 2 warm-up calls",
                                               "rows": rows}, indent=2))
        print(f"results written to {args.json}", file=sys.stderr)
    return 0


def cmd_bench_drafts(args: argparse.Namespace) -> int:
    from .bench_drafts import speech_draft_figures, text_draft_figures

    if len(args.inputs) > 1:
        raise InputError("bench-drafts measures one input")
    audio = bool(args.inputs) and _is_audio(args.inputs[0])
    cfg = _config(args, "exact", 1, speech=audio)
    if audio:
        from .asr import SpeechSource

        pair = _load_speech(args)
        source = SpeechSource(pair, _clips(args.inputs)[:1], args.language)
        if len(source.sequences) > 1:
            raise InputError("bench-drafts measures one 30 s window: give a clip of at most 30 s")
        output = run(source, cfg, target_only=True).outputs[0]
        figures = speech_draft_figures(source, output, args.ks, args.repeat)
    else:
        articles = _articles(args)
        pair = _load(args)
        source = article_source(pair, articles[:1], cfg)
        output = run(source, cfg, target_only=True).outputs[0]
        figures = text_draft_figures(pair, source.sequences[0].prompt_ids, output, args.ks, args.repeat)
    print(f"{'K':>7s} {'+prompt':>7s} {'size':>7s} {'greedy agree':>12s} {'α (T=1)':>8s}")
    for r in figures["vocab"]:
        print(f"{r['k'] or 'all':>7} {str(r['prompt_tokens']):>7s} {r['size']:7d} {r['greedy_agreement']:12.3f} "
              f"{r['alpha_t1']:8.3f}")
    print(f"model draft: {figures['model_run_length']:.2f} tokens kept in a row per position (γ = 8, greedy)")
    for r in figures["lookup"]:
        print(f"lookup n ≥ {r['ngram']}: proposes at {r['hit_rate']:.1%} of positions, {r['kept_per_hit']:.2f} tokens "
              "kept per proposal")
    for r in figures["draft_steps"]:
        print(f"draft step, head of {r['size']:,} tokens: {r['draft_step_ms']:.1f} ms")
    if "target_step_ms" in figures:
        print(f"target step: {figures['target_step_ms']:.1f} ms")
    dtype = str(pair.dtype).removeprefix("torch.")
    print(f"\n{pair.draft_name} → {pair.target_name}, {dtype}, {len(output)} output tokens, {machine.describe()}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "machine": machine.describe(), "models": f"{pair.draft_name} → {pair.target_name}", "dtype": dtype,
            "input": args.inputs or ["sample article"], "repeat": args.repeat, "config": cfg.to_dict(),
            "statistic": "teacher-forced along the target-only greedy output; step times: median of `repeat`",
            **figures}, indent=2))
        print(f"results written to {args.json}", file=sys.stderr)
    return 0


def cmd_bench_verify(args: argparse.Namespace) -> int:
    import torch

    from .bench import verify_microbench

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    print(f"{'V':>7s} {'B':>2s} {'γ':>3s} {'dtype':5s} {'mode':8s} {'path':6s} {'call µs':>9s} {'no-check':>9s} "
          f"{'GPU µs':>8s} {'host µs':>8s} {'× base':>7s} {'floor MB':>9s} {'GB/s':>7s}")

    def us(v: float | None, width: int) -> str:
        return f"{v:{width}.1f}" if v is not None else f"{'-':>{width}s}"

    def show(r: dict) -> None:
        speedup = f"{r['speedup']:7.2f}" if r["speedup"] is not None else f"{'-':>7s}"
        print(f"{r['V']:7d} {r['B']:2d} {r['gamma']:3d} {r['dtype']:5s} {r['mode']:8s} {r['path']:6s} "
              f"{us(r['call_us'], 9)} {us(r['nocheck_us'], 9)} {us(r['gpu_us'], 8)} {us(r['host_us'], 8)} {speedup} "
              f"{r['floor_bytes'] / 1e6:9.2f} {r['achieved_GBps']:7.1f}", flush=True)

    rows = verify_microbench(device, vocabs=args.vocab, gammas=args.gamma, batches=args.batch, dtypes=args.dtype,
                             warmup=args.warmup, iters=args.iters, top_k=args.top_k, top_p=args.top_p,
                             on_case=show)
    print(f"\n{machine.describe()}; median of {args.iters} calls after {args.warmup} warm-up calls. call: wall time "
          "until the results are on the host (kernel path: with its input checks, one readback); no-check: "
          "the kernels with check=False until the stream is idle; GPU: CUDA events around the kernel launches; "
          "host = call - GPU; × base: the baseline's call time over this row's")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine.describe(), "device": str(device),
                                               "warmup": args.warmup, "iters": args.iters, "top_k": args.top_k, "top_p": args.top_p,
                                               "rows": rows}, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m specviz", description="Speculative decoding you can watch.")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="summarize an article with speculative decoding")
    _add_common(g)
    g.add_argument("--mode", default="exact", choices=MODES)
    g.add_argument("--trace", metavar="FILE", help="write the JSON trace here")
    g.set_defaults(func=cmd_generate)
    t = sub.add_parser("transcribe", help="transcribe an audio file with speculative Whisper decoding")
    _add_common(t, "audio")
    t.add_argument("--mode", default="exact", choices=MODES)
    t.add_argument("--reference", help="reference transcript, for WER")
    t.add_argument("--reference-file", help="file holding the reference transcript, for WER")
    t.add_argument("--trace", metavar="FILE", help="write the JSON trace here")
    t.set_defaults(func=cmd_transcribe)
    c = sub.add_parser("compare", help="target-only vs baseline vs exact vs sigmoid on one input (text or audio)")
    _add_common(c, "either")
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
    b = sub.add_parser("bench-speech-draft", help="acceptance and speed of self-speculative Whisper drafts by layer set")
    _add_common(b, "audio")
    b.add_argument("--layers", nargs="+", default=["layers:0,1,2,4,5", "layers:0,1,2,3,5", "layers:0,1,2,3,4",
                                                   "layers:0,1,2,5", "layers:0,1,4,5", "layers:0,5"])
    b.add_argument("--reference-file", help="reference transcript, for the target's WER")
    b.add_argument("--repeat", type=int, default=3)
    b.add_argument("--json", metavar="FILE")
    b.set_defaults(func=cmd_bench_speech_draft)
    bb = sub.add_parser("bench-batch", help="batched speculative vs batched target-only decoding for several batch sizes")
    _add_common(bb)
    bb.add_argument("--mode", default="exact", choices=MODES)
    bb.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    bb.add_argument("--repeat", type=int, default=3)
    bb.add_argument("--json", metavar="FILE")
    bb.set_defaults(func=cmd_bench_batch)
    bs = sub.add_parser("bench-steps", help="a model call's cost by weights format: prefill and a step scoring M tokens")
    _add_common(bs)
    bs.add_argument("--weights-list", nargs="+", default=["packed", "dense"], choices=["packed", "dense"])
    bs.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 6, 8, 16])
    bs.add_argument("--repeat", type=int, default=5)
    bs.add_argument("--json", metavar="FILE")
    bs.set_defaults(func=cmd_bench_steps)
    bd = sub.add_parser("bench-drafts", help="acceptance vs draft vocabulary size, prompt-lookup hit rate, draft step "
                        "times, teacher-forced along the target's output (text or one audio window)")
    _add_common(bd, "either")
    bd.add_argument("--ks", type=int, nargs="+", default=[0, 1024, 4096, 8192, 16384, 32768],
                    help="draft vocabulary sizes (0 = all)")
    bd.add_argument("--repeat", type=int, default=9, help="timed draft steps per size")
    bd.add_argument("--json", metavar="FILE")
    bd.set_defaults(func=cmd_bench_drafts)
    bv = sub.add_parser("bench-verify", help="µs per verification call: modes × paths × V × γ × B × dtype")
    bv.add_argument("--device", default=None)
    bv.add_argument("--vocab", type=int, nargs="+", default=[51_865, 151_936, 256_000])
    bv.add_argument("--gamma", type=int, nargs="+", default=[1, 5, 10, 20])
    bv.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    bv.add_argument("--dtype", nargs="+", default=["fp16", "fp32"], choices=["fp16", "bf16", "fp32"])
    bv.add_argument("--warmup", type=int, default=10)
    bv.add_argument("--iters", type=int, default=50)
    bv.add_argument("--top-k", type=int, default=0, help="add top-k to the sampling (in-kernel on the kernel path)")
    bv.add_argument("--top-p", type=float, default=1.0, help="add top-p to the sampling (in-kernel on the kernel path)")
    bv.add_argument("--json", metavar="FILE")
    bv.set_defaults(func=cmd_bench_verify)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (InputError, AudioError, ModelLoadError, InvalidLogitsError, TraceFormatError, ValueError, OSError) as e:
        print(f"specviz: error: {e}", file=sys.stderr)
        return 2
