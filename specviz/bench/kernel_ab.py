"""A change to the CPU kernels against the project's own, side by side in one process (docs/benchmarks.md,
"Roofline"): the project's library and one built from another copy of kernels/cpu/ (specviz.native.load_variant)
take turns call by call, on the embedded target's decoding step after an article's prompt (`--role draft`: the
draft a text run steps, 4-bit with its reduced head and fp16 keys and values).

A variant can also be the code before a change (`git show HEAD~1:kernels/cpu/...` into a folder): then "variant /
project" reads old over new.

Why: on a shared 2-core host the same code's one-token step moved 31.9–49.6 ms between `bench-steps` runs ten
minutes apart (2026-11-27); alternating the two libraries call by call puts every slow spell on both, so a few
percent can be told from noise. Each round times every (library, tokens) once, the order of the two libraries
flipping from round to round; medians over the rounds after two warm-up rounds. The rows at an unchanged shape
(one token, for a change at several rows) are the control: their ratio says how far apart two equal codes read.

    cp -r kernels/cpu /tmp/variant && $EDITOR /tmp/variant/qmatmul_cpu.cpp
    python -m specviz.bench.kernel_ab /tmp/variant --tokens 1 2 4 --rounds 24
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from specviz import native

WARMUP_ROUNDS = 2


def alternate(calls: dict[str, object], step, tokens: list[int], rounds: int) -> dict[str, dict[int, float]]:
    """calls: name -> a library; step(m) runs one decoding call of m tokens (and undoes it). -> name -> tokens ->
    median ms over `rounds`, every (library, m) once a round, the libraries' order flipped every round."""
    names = list(calls)
    times: dict[tuple[str, int], list[float]] = {(n, m): [] for n in names for m in tokens}
    for r in range(WARMUP_ROUNDS + rounds):
        for m in tokens:
            for name in (names if r % 2 == 0 else names[::-1]):
                with native.using(calls[name]):
                    t0 = time.perf_counter()
                    step(m)
                    elapsed = time.perf_counter() - t0
                if r >= WARMUP_ROUNDS:
                    times[(name, m)].append(elapsed * 1e3)
    return {n: {m: statistics.median(times[(n, m)]) for m in tokens} for n in names}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variant", type=Path, help="a copy of kernels/cpu/ with the change")
    p.add_argument("--article", type=Path, default=None, help="the prompt's article (default: the bundled sample)")
    p.add_argument("--role", choices=("target", "draft"), default="target")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--rounds", type=int, default=24)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    from specviz.models.loading import load_pair
    from specviz.paths import ASSETS
    from specviz.runs.settings import Settings
    from specviz.text.source import article_source

    variant = native.load_variant(args.variant)
    article = (args.article or ASSETS / "sample_article.txt").read_text()
    # the pair and the decoders a summarizing run builds (the draft: 4-bit, its reduced head, fp16 keys and values)
    pair = load_pair(device="cpu")
    source = article_source(pair, [("article", article)], Settings().spec("summarize"))
    draft, target = source.decoders([0], True)
    decoder, label = (target, pair.target_name) if args.role == "target" else (draft, pair.draft_name)
    prompt = source.sequences[0].prompt_ids[:-1]
    decoder.prefill([prompt])
    fed = decoder.fed(0)
    feed = prompt[-1:] + prompt[: max(args.tokens)]

    def step(m: int) -> None:
        decoder.forward([feed[:m]], m)
        decoder.rollback([fed])

    with torch.inference_mode():
        ms = alternate({"project": native.library(), "variant": variant}, step, args.tokens, args.rounds)
    rows = [{"tokens": m, "project_ms": ms["project"][m], "variant_ms": ms["variant"][m],
             "variant_over_project": ms["variant"][m] / ms["project"][m]} for m in args.tokens]
    for r in rows:
        print(f"{args.role} {r['tokens']:>2} tokens: project {r['project_ms']:.1f} ms, variant {r['variant_ms']:.1f} ms,"
              f" variant / project {r['variant_over_project']:.3f}")
    if args.json:
        from specviz.machine import describe
        args.json.write_text(json.dumps({"machine": describe(), "model": label, "role": args.role,
                                         "prompt_tokens": len(prompt), "rounds": args.rounds, "rows": rows,
                                         "command": "python -m specviz.bench.kernel_ab " + " ".join(argv or sys.argv[1:])},
                                        indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
