"""`python -m specviz ...`: generate, compare."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tqdm import tqdm

from . import machine
from .compare import compare
from .config import GAMMA_POLICIES, MODES, SamplingConfig, SpecConfig
from .engine import run_speculative
from .models import DEFAULT, ModelLoadError, ModelPair, load_pair
from .prompts import InputError, max_prompt_tokens, sample_article, summarization_prompt
from .sampling import InvalidLogitsError
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


def _add_common(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("input")
    src.add_argument("input", nargs="?", help="article file to summarize, '-' for stdin; default: the bundled sample")
    src.add_argument("--max-new-tokens", type=int, default=128)
    m = p.add_argument_group("models")
    m.add_argument("--draft", default=DEFAULT, help="hub id, local directory, .gguf file, or 'default' (embedded)")
    m.add_argument("--target", default=DEFAULT, help="hub id, local directory, .gguf file, or 'default' (embedded)")
    m.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    m.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    s = p.add_argument_group("sampling (applied identically to draft and target)")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--seed", type=int, default=0)
    v = p.add_argument_group("speculation")
    v.add_argument("--gamma-policy", default="hf", choices=GAMMA_POLICIES)
    v.add_argument("--gamma", type=int, default=None, help="initial γ (default: the policy's own)")
    v.add_argument("--lenience", type=float, default=1.0, help="Leviathan A.5; 1 = exact")
    v.add_argument("--sigmoid-alpha", type=float, default=-1e4)
    v.add_argument("--sigmoid-beta", type=float, default=1e4)


def _config(args: argparse.Namespace, mode: str) -> SpecConfig:
    return SpecConfig(
        mode=mode,
        sampling=SamplingConfig(args.temperature, args.top_k, args.top_p),
        gamma_policy=args.gamma_policy,
        gamma_init=args.gamma,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        lenience=args.lenience,
        sigmoid_alpha=args.sigmoid_alpha,
        sigmoid_beta=args.sigmoid_beta,
    )


def _read_article(arg: str | None) -> str:
    if arg is None:
        return sample_article()
    if arg == "-":
        return sys.stdin.read()
    path = Path(arg)
    if not path.is_file():
        raise InputError(f"no such file: {arg}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{arg} is not UTF-8 text; give an article as a text file") from None


def _checked_article(arg: str | None) -> str:
    """Read the article and refuse an empty one before minutes go into loading models."""
    article = _read_article(arg)
    if not article.strip():
        raise InputError("the article is empty: give a file with some text to summarize")
    return article


def _load(args: argparse.Namespace) -> ModelPair:
    progress = _LoadProgress()
    try:
        return load_pair(args.draft, args.target, device=args.device, dtype=args.dtype, progress=progress)
    finally:
        progress.close()


def _prompt(args: argparse.Namespace, pair: ModelPair, article: str) -> list[int]:
    context = getattr(pair.target.config, "max_position_embeddings", 32768)
    return summarization_prompt(pair.tokenizer, article, max_prompt_tokens(context, args.max_new_tokens))


def cmd_generate(args: argparse.Namespace) -> int:
    cfg = _config(args, args.mode)
    article = _checked_article(args.input)
    pair = _load(args)
    prompt_ids = _prompt(args, pair, article)
    with tqdm(total=cfg.max_new_tokens, desc=f"{cfg.mode} decoding", unit="tok", file=sys.stderr) as bar:
        def advance(record, trace):
            bar.update(record.emitted)
            bar.set_postfix(γ=record.gamma, accepted=record.n_accepted)
        trace = run_speculative(pair, prompt_ids, cfg, on_iteration=advance, meta={"input": article})
    print(trace.output_text)
    print()
    for key, value in trace.summary().items():
        print(f"  {key:32s} {value:.4g}" if isinstance(value, float) else f"  {key:32s} {value}")
    if args.trace:
        trace.save(args.trace)
        print(f"trace written to {args.trace}", file=sys.stderr)
    return 0


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def cmd_compare(args: argparse.Namespace) -> int:
    cfg = _config(args, "exact")
    article = _checked_article(args.input)
    pair = _load(args)
    prompt_ids = _prompt(args, pair, article)
    with tqdm(desc="compare", unit="run", file=sys.stderr, total=4 + 2 * args.hf_assisted) as bar:
        def stage(name: str) -> None:
            bar.set_postfix_str(name)
            bar.update(0 if bar.n == 0 and not bar.postfix else 1)
        rows, _ = compare(pair, prompt_ids, cfg, hf_assisted=args.hf_assisted, on_stage=stage)
        bar.update(bar.total - bar.n)
    header = f"{'run':30s} {'tok/s':>7s} {'speedup':>8s} {'α':>6s} {'tok/iter':>8s} {'verify ms':>9s}  = target-only"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r.name:30s} {r.tokens_per_s:7.2f} {r.speedup:7.2f}× {_fmt(r.alpha, '6.3f'):>6s} "
              f"{_fmt(r.tokens_per_iteration, '8.2f'):>8s} {_fmt(r.median_verify_ms, '9.2f'):>9s}  {'yes' if r.equals_target_only else 'no'}")
    print(f"\n{pair.draft_name} → {pair.target_name}, {str(pair.dtype).removeprefix('torch.')}, {machine.describe()}")
    if args.json:
        report = {
            "machine": machine.describe(),
            "draft": pair.draft_name,
            "target": pair.target_name,
            "dtype": str(pair.dtype).removeprefix("torch."),
            "prompt_tokens": len(prompt_ids),
            "config": cfg.to_dict(),
            "rows": [r.as_dict() for r in rows],
        }
        Path(args.json).write_text(json.dumps(report, indent=2, ensure_ascii=False))
        print(f"table written to {args.json}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m specviz", description="Speculative decoding you can watch.")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="summarize an article with speculative decoding")
    _add_common(g)
    g.add_argument("--mode", default="exact", choices=MODES)
    g.add_argument("--trace", metavar="FILE", help="write the JSON trace here")
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("compare", help="target-only vs baseline vs exact vs sigmoid on one input and seed")
    _add_common(c)
    c.add_argument("--json", metavar="FILE", help="write the table as JSON here")
    c.add_argument("--hf-assisted", action="store_true", help="also time transformers' generate(assistant_model=...)")
    c.set_defaults(func=cmd_compare)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (InputError, ModelLoadError, InvalidLogitsError, TraceFormatError, ValueError) as e:
        print(f"specviz: error: {e}", file=sys.stderr)
        return 2
