"""`python -m specviz bench-*`: the benchmarks behind docs/benchmarks.md, each printing a table and
optionally writing its JSON."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from specviz.cli import common
from specviz.config import TEXT_DRAFT, SpecConfig
from specviz import machine
from specviz.text.prompts import InputError
from specviz.runs.decode import run
from specviz.runs.settings import SPEECH, TEXT, add_flags
from specviz.text.source import article_source
from specviz.models.loading import ModelPair

if TYPE_CHECKING:  # the speech stack loads only for the speech benchmarks
    from specviz.speech.asr import SpeechPair


def _report_pair(args: argparse.Namespace, pair: ModelPair | SpeechPair, cfg: SpecConfig, statistic: str,
                 results: dict, about_run: str = "") -> None:
    """The closing line of a benchmark on a draft/target pair (models, dtype, `about_run`, machine), and with
    --json its file: what was measured, on what and how, then `results`."""
    dtype = str(pair.dtype).removeprefix("torch.")
    print(f"\n{pair.draft_name} → {pair.target_name}, {dtype}{about_run}, {machine.describe()}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "machine": machine.describe(), "models": f"{pair.draft_name} → {pair.target_name}", "dtype": dtype,
            "input": args.inputs or ["sample article"], "repeat": args.repeat, "config": cfg.to_dict(),
            "statistic": statistic, **results}, indent=2))
        print(f"results written to {args.json}", file=sys.stderr)


def cmd_bench_speech_draft(args: argparse.Namespace) -> int:
    from specviz.bench.measure import speech_draft_layers
    from specviz.speech.asr import parse_layers

    clips = common.clips(args.inputs)
    cfg = common.config(args, SPEECH, mode="exact")
    pair = common.load_speech(args)
    reference = Path(args.reference_file).read_text(encoding="utf-8") if args.reference_file else None
    layer_sets = [parse_layers(spec) for spec in args.layers]
    rows = speech_draft_layers(pair, clips, layer_sets, cfg, reference, repeat=args.repeat)
    print(f"{'draft':28s} {'α':>6s} {'accept':>7s} {'tok/iter':>8s} {'decode s':>9s} {'speedup':>8s}")
    for r in rows:
        print(f"{r['draft']:28s} {common.fmt(r.get('alpha'), '6.3f'):>6s} {common.fmt(r.get('acceptance_rate'), '7.3f'):>7s} "
              f"{common.fmt(r.get('tokens_per_iteration'), '8.2f'):>8s} {r['decode_s']:9.3f} {r['speedup']:7.2f}×")
    print(f"\n{pair.target_name}, {str(pair.dtype).removeprefix('torch.')}, {machine.describe()}")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine.describe(), "input": args.inputs, "repeat": args.repeat,
                                               "statistic": "median decode time (prefill excluded), after a warm-up",
                                               "config": cfg.to_dict(), "rows": rows}, indent=2))
    return 0


def cmd_bench_batch(args: argparse.Namespace) -> int:
    from specviz.bench.measure import batch_scaling

    articles = common.articles(args)
    if len(articles) != 1:
        raise InputError("bench-batch draws B samples of one article: give one article (or none for the sample)")
    cfg = common.config(args, TEXT)
    pair = common.load_text(args)
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
                  f"{common.fmt(m['alpha'], '6.3f'):>6s} {common.fmt(m['tokens_per_iteration_per_sequence'], '12.2f'):>12s} "
                  f"{m['target_calls']:12d} {common.fmt(m['padding_fraction'], '7.3f'):>7s} {common.fmt(m['cache_hole_fraction'], '6.3f'):>6s}")
        print(f"   speedup: total {r['speedup_total']:.2f}×, per sequence {r['speedup_per_sequence']:.2f}× "
              f"(decode only {r['speedup_decode_per_sequence']:.2f}×)")
    _report_pair(args, pair, cfg, "per side, the median run by decode time of `repeat` interleaved rounds, after a "
                 "warm-up", {"rows": rows})
    return 0


REDUCED = "4-bit 32K"  # bench-steps' row for the 4-bit draft scoring the 32,768-token head a text run's draft scores


def cmd_bench_steps(args: argparse.Namespace) -> int:
    """One model call's cost by weights format: prefill, and a step scoring M tokens, against this machine's
    read bandwidth and int8 peak (docs/benchmarks.md, "Roofline")."""
    import torch

    from specviz.bench.roofline import int8_peak, read_bandwidth
    from specviz.bench.steps import linear_params, step_costs, weight_bytes
    from specviz.decoding.drafts import special_ids, subset_head
    from specviz.models import lean
    from specviz.models import cpu_kernels
    from specviz.models.loading import load_model, parse_dtype
    from specviz.models.quant import quantize_draft_int8, quantize_draft_q4
    from specviz.text.prompts import max_prompt_tokens, summarization_prompt
    from specviz.text.source import draft_kv_dtype

    article = common.articles(args)[0][1]
    device = torch.device(args.device or "cpu")
    variants = [(role, w) for role in ("target", "draft") for w in args.weights_list]
    if "packed-a8" in args.weights_list:  # the CPU's default draft (models/quant.py), and with the head a run scores
        variants += [("draft", "4-bit"), ("draft", REDUCED)]
    if "dense" in args.weights_list:
        variants.append(("draft", "dense int8"))
    bandwidth, peak = read_bandwidth(), int8_peak()
    isa = cpu_kernels.isa() if cpu_kernels.available() else "no specviz kernels"
    rows = []
    for role, weights in tqdm(variants, desc="bench-steps", unit="model", file=sys.stderr):
        name = args.target if role == "target" else args.draft
        base = "dense" if weights in ("4-bit", REDUCED, "dense int8") else weights
        model, tokenizer, label = load_model(name, role, device=device, dtype=parse_dtype(args.dtype or "fp32"),
                                             weights=base)
        if weights == "dense int8":
            model = quantize_draft_int8(model)
        elif weights in ("4-bit", REDUCED):
            model = lean.attach(quantize_draft_q4(model))
        prompt = summarization_prompt(tokenizer, article, max_prompt_tokens(32768, 128))
        head = (subset_head(model, model.config.vocab_size, TEXT_DRAFT.draft_vocab, special_ids(tokenizer) | set(prompt))
                if weights == REDUCED else None)
        kv = draft_kv_dtype(model) if role == "draft" else torch.float32  # the keys and values a run keeps
        costs = step_costs(model, model.config.vocab_size, prompt[:-1], args.tokens, repeat=args.repeat, head=head,
                           kv_dtype=kv)
        rows.append({"role": role, "model": label, "weights": weights, "bytes_per_step": weight_bytes(model, head),
                     "linear_macs_per_token": linear_params(model, head), **costs})
        del model
    print(f"{'role':6s} {'weights':11s} {'GB/step':>7s} {'prefill s':>9s} " + " ".join(f"{m:>9d}" for m in args.tokens)
          + "   (ms per step scoring M tokens; × its 1-token step)")
    for r in rows:
        cells = " ".join(f"{1e3 * s['seconds']:6.0f}" + (f" {s['ratio']:.1f}×" if s['tokens'] != 1 else "   ")
                         for s in r["steps"])
        print(f"{r['role']:6s} {r['weights']:11s} {r['bytes_per_step'] / 1e9:7.2f} {r['prefill_s']:9.2f} {cells}")
    peak_words = f"int8 peak {peak / 1e9:.0f} GMAC/s ({isa} dot products in registers)" if peak else "no int8 kernels"
    print(f"\nroofline: read bandwidth {bandwidth / 1e9:.1f} GB/s (a 1 GiB sum), {peak_words}")
    print(f"{'role':6s} {'weights':11s} {'M':>3s} {'ms':>6s} {'GB/s':>6s} {'of bw':>6s} {'GMAC/s':>7s} {'of peak':>7s} "
          f"{'in linear layers':>16s}")
    for r in rows:
        for s in r["steps"]:
            s["read_GBps"] = r["bytes_per_step"] / s["seconds"] / 1e9
            s["GMACps"] = r["linear_macs_per_token"] * s["tokens"] / s["seconds"] / 1e9
            of_peak = f"{s['GMACps'] * 1e9 / peak:7.0%}" if peak else f"{'-':>7s}"
            print(f"{r['role']:6s} {r['weights']:11s} {s['tokens']:3d} {1e3 * s['seconds']:6.1f} {s['read_GBps']:6.1f} "
                  f"{s['read_GBps'] * 1e9 / bandwidth:6.0%} {s['GMACps']:7.1f} {of_peak} {s['linear_share']:16.0%}")
    timed = [(r, s) for r in rows for s in r["steps"] if "outside" in s]
    if timed:
        kinds = list(timed[0][1]["outside"])
        print("\noutside the linear layers, by kind (native layers' clocks; share of a step)")
        print(f"{'role':6s} {'weights':11s} {'M':>3s} " + " ".join(f"{k:>12s}" for k in kinds))
        for r, s in timed:
            print(f"{r['role']:6s} {r['weights']:11s} {s['tokens']:3d} "
                  + " ".join(f"{s['outside'][k]:12.1%}" for k in kinds))
    print(f"\n{machine.describe()}; prompt {rows[0]['prompt_tokens']} tokens; median of {args.repeat} after 2 warm-ups")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine.describe(), "repeat": args.repeat,
                                               "read_bandwidth_Bps": bandwidth, "int8_peak_MACps": peak,
                                               "isa": isa,
                                               "statistic": "median seconds per call after 2 warm-up calls",
                                               "rows": rows}, indent=2))
        print(f"results written to {args.json}", file=sys.stderr)
    return 0


def cmd_bench_drafts(args: argparse.Namespace) -> int:
    from specviz.bench.drafts import speech_draft_figures, text_draft_figures

    if len(args.inputs) > 1:
        raise InputError("bench-drafts measures one input")
    audio = bool(args.inputs) and common.is_audio(args.inputs[0])
    cfg = common.config(args, SPEECH if audio else TEXT, mode="exact")
    if audio:
        from specviz.speech.asr import SpeechSource

        pair = common.load_speech(args)
        source = SpeechSource(pair, common.clips(args.inputs)[:1], args.language)
        if len(source.sequences) > 1:
            raise InputError("bench-drafts measures one 30 s window: give a clip of at most 30 s")
        output = run(source, cfg, target_only=True).outputs[0]
        figures = speech_draft_figures(source, output, args.ks, args.repeat)
    else:
        articles = common.articles(args)
        pair = common.load_text(args)
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
    _report_pair(args, pair, cfg, "teacher-forced along the target-only greedy output; step times: median of "
                 "`repeat`", figures, f", {len(output)} output tokens")
    return 0


def cmd_bench_verify(args: argparse.Namespace) -> int:
    import torch

    from specviz.bench.measure import verify_microbench

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



def cmd_bench_llama_cpp(args: argparse.Namespace) -> int:
    """specviz and llama.cpp on the same GGUF files, side by side in one process (specviz/bench/llama_cpp.py):
    each model's prefill and M-token calls, then greedy decoding (target alone, speculation) per article."""
    import statistics

    import torch

    from specviz.bench import llama_cpp
    from specviz.models.loading import DEFAULT_DRAFT, DEFAULT_TARGET
    from specviz.text.prompts import max_prompt_tokens, summarization_prompt

    if args.draft != "default" or args.target != "default":
        raise InputError("bench-llama-cpp reads the embedded pair's own GGUF files: leave --draft/--target as default")
    articles = common.articles(args)
    cfg = common.config(args, TEXT)
    if min(args.gammas) < 1:
        raise InputError(f"llama.cpp's speculation needs γ ≥ 1 (its target alone is always measured), got {args.gammas}")
    if not cfg.sampling.greedy:
        raise InputError("bench-llama-cpp compares greedy decoding (its speculative loop keeps the argmax): "
                         "leave --temperature at 0")
    pair = common.load_text(args)
    threads = torch.get_num_threads()
    limit = max_prompt_tokens(32768, cfg.max_new_tokens)
    prompts = [(label, summarization_prompt(pair.tokenizer, text, limit)) for label, text in articles]
    context = max(len(p) for _, p in prompts) + cfg.max_new_tokens + max(args.gammas + args.tokens) + 16
    sides = {role: llama_cpp.LlamaSide(llama_cpp.load_llama(llama_cpp.embedded_gguf(name), threads, context))
             for role, name in (("target", DEFAULT_TARGET), ("draft", DEFAULT_DRAFT))}
    label, prompt = prompts[0]
    steps = {}
    for role in tqdm(("target", "draft"), desc="bench-llama-cpp calls", unit="model", file=sys.stderr):
        model = pair.target if role == "target" else pair.draft
        steps[role] = llama_cpp.step_costs(model, pair.vocab_size, sides[role], prompt[:-1], args.tokens,
                                           args.repeat)
    print(f"calls after {label}'s prompt ({len(prompt) - 1} tokens): ms per call scoring M tokens (× its 1-token call)")
    print(f"{'model':6s} {'engine':9s} {'prefill tok/s':>13s} " + " ".join(f"{m:>12d}" for m in args.tokens))
    for role, r in steps.items():
        for engine in ("specviz", "llama_cpp"):
            cells = " ".join(f"{1e3 * s[engine + '_s']:6.1f} {s[engine + '_ratio']:4.2f}×" for s in r["steps"])
            print(f"{role:6s} {engine:9s} {r['prompt_tokens'] / r['prefill_s'][engine]:13.0f} {cells}")
    for engine in ("specviz", "llama_cpp"):
        ratio = steps["draft"]["steps"][0][engine + "_s"] / steps["target"]["steps"][0][engine + "_s"]
        print(f"draft / target, one token, {engine}: {ratio:.3f}")

    decoding = {}
    for label, prompt in tqdm(prompts, desc="bench-llama-cpp decoding", unit="article", file=sys.stderr):
        runs = llama_cpp.decode_rounds(pair, sides["target"], sides["draft"], label, prompt, cfg, args.gammas,
                                       args.rounds)
        decoding[label] = runs
    print(f"\ngreedy, {cfg.max_new_tokens} new tokens at most, median of {args.rounds} interleaved rounds: "
          "speedup over the same engine's target alone (end to end / decoding only)")
    print(f"{'input':16s} {'run':28s} {'tok/s':>6s} {'decode tok/s':>12s} {'speedup':>15s} {'kept/drafted':>12s} "
          f"{'= own target-only':>17s}")
    table = {}
    for label, runs in decoding.items():
        rows = []
        for name, decoded in runs.items():
            engine = name.split(" ")[0]
            reference = runs[f"{engine} target-only"]
            end = [d.tokens_per_s / r.tokens_per_s for d, r in zip(decoded, reference)]
            dec = [d.decode_tokens_per_s / r.decode_tokens_per_s for d, r in zip(decoded, reference)]
            median = sorted(decoded, key=lambda d: d.decode_s)[len(decoded) // 2]
            row = {"run": name, "tokens_per_s": statistics.median(d.tokens_per_s for d in decoded),
                   "decode_tokens_per_s": statistics.median(d.decode_tokens_per_s for d in decoded),
                   "speedup_end_to_end": statistics.median(end), "speedup_decode": statistics.median(dec),
                   "new_tokens": len(median.tokens), "iterations": median.iterations,
                   "accepted": median.accepted, "drafted": median.drafted,
                   "equals_target_only": all(d.tokens == reference[0].tokens for d in decoded)}
            rows.append(row)
            kept = f"{row['accepted']}/{row['drafted']}" if row["drafted"] else "-"
            print(f"{label[:16]:16s} {name:28s} {row['tokens_per_s']:6.2f} {row['decode_tokens_per_s']:12.2f} "
                  f"{row['speedup_end_to_end']:6.2f}×/{row['speedup_decode']:5.2f}× {kept:>12s} "
                  f"{'yes' if row['equals_target_only'] else 'no':>17s}")
        table[label] = rows
    from importlib.metadata import version

    peer = (f"llama-cpp-python {version('llama-cpp-python')}, {threads} threads, the GGUF files' own blocks (draft: "
            "Q5_0/Q8_0; specviz's draft: its 4-bit re-quantization)")
    print(f"\n{pair.draft_name} → {pair.target_name}; {peer}; {machine.describe()}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "machine": machine.describe(), "peer": peer, "models": f"{pair.draft_name} → {pair.target_name}",
            "repeat": args.repeat, "rounds": args.rounds, "config": cfg.to_dict(),
            "statistic": "calls: median of `repeat` after 2 warm-ups, the engines alternating; decoding: medians of "
                         "`rounds` interleaved rounds after one untimed specviz run",
            "calls": steps, "decoding": table}, indent=2))
        print(f"results written to {args.json}", file=sys.stderr)
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    """The bench-* subcommands."""
    b = sub.add_parser("bench-speech-draft", help="acceptance and speed of self-speculative Whisper drafts by layer set")
    common.add_common(b, "audio")
    b.add_argument("--layers", nargs="+", default=["layers:0,1,2,4,5", "layers:0,1,2,3,5", "layers:0,1,2,3,4",
                                                   "layers:0,1,2,5", "layers:0,1,4,5", "layers:0,5"])
    b.add_argument("--reference-file", help="reference transcript, for the target's WER")
    b.add_argument("--repeat", type=int, default=3)
    b.add_argument("--json", metavar="FILE")
    b.set_defaults(func=cmd_bench_speech_draft)
    bb = sub.add_parser("bench-batch", help="batched speculative vs batched target-only decoding for several batch sizes")
    common.add_common(bb)
    add_flags(bb, ["mode"])
    bb.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    bb.add_argument("--repeat", type=int, default=3)
    bb.add_argument("--json", metavar="FILE")
    bb.set_defaults(func=cmd_bench_batch)
    bs = sub.add_parser("bench-steps", help="a model call's cost by weights format: prefill and a step scoring M tokens")
    common.add_common(bs)
    bs.add_argument("--weights-list", nargs="+", default=["packed", "packed-a8", "dense"],
                    choices=["packed", "packed-a8", "dense"])
    bs.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 6, 8, 16])
    bs.add_argument("--repeat", type=int, default=5)
    bs.add_argument("--json", metavar="FILE")
    bs.set_defaults(func=cmd_bench_steps)
    bd = sub.add_parser("bench-drafts", help="acceptance vs draft vocabulary size, prompt-lookup hit rate, draft step "
                        "times, teacher-forced along the target's output (text or one audio window)")
    common.add_common(bd, "either")
    bd.add_argument("--ks", type=int, nargs="+", default=[0, 1024, 4096, 8192, 16384, 32768],
                    help="draft vocabulary sizes (0 = all)")
    bd.add_argument("--repeat", type=int, default=9, help="timed draft steps per size")
    bd.add_argument("--json", metavar="FILE")
    bd.set_defaults(func=cmd_bench_drafts)
    bl = sub.add_parser("bench-llama-cpp", help="specviz beside llama.cpp on the same GGUF files: calls and greedy "
                        "decoding, side by side (needs llama-cpp-python, a benchmark-only package)")
    common.add_common(bl)
    bl.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8])
    bl.add_argument("--gammas", type=int, nargs="+", default=[2, 4], help="llama.cpp speculation's constant γs")
    bl.add_argument("--repeat", type=int, default=7, help="timed calls per M and engine")
    bl.add_argument("--rounds", type=int, default=3, help="interleaved decoding rounds per article")
    bl.add_argument("--json", metavar="FILE")
    bl.set_defaults(func=cmd_bench_llama_cpp)
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
