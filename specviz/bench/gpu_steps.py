"""What a decoding step costs on a GPU (project issue 40), through the product's own decoder and its step paths:
transformers' forward, the static forward eagerly, and its CUDA graphs (specviz/models/graphed.py).

Models are random weights of given configs (the real weights do not travel to a GPU machine): per-step costs
say nothing about α but everything about where an iteration's time goes. Per model and path: one row (and B
rows) scoring W new tokens after a prompt of `context` tokens, each call followed by a rollback so the context
stays put; median of `reps` calls after warm-up, host wall time (synchronized) and GPU time (CUDA events).
Beside them: verification at the same shapes, a BASS iteration at B = 8, and the speedup Leviathan's model
predicts from these costs at the α measured on the CPU for the bundled articles (a prediction, labelled so).

    python -m specviz.bench.gpu_steps --configs draft=CFG.json target=CFG.json target7b=CFG.json --json OUT
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from specviz.models import graphed
from specviz.text.source import CausalLMDecoder
from specviz.theory import expected_tokens

WIDTHS = (1, 2, 3, 4, 5, 6, 8, 12, 16)
VARIANTS = {  # mode -> (environment, what it is)
    "graphs": ({}, "the default: CUDA graphs, split attention kernels, each projection on the faster of its kernel and cuBLAS"),
    "graphs-cublas": ({"SPECVIZ_STEP_LINEAR": "cublas"}, "graphs, split attention, every projection on cuBLAS"),
    "graphs-matmul": ({"SPECVIZ_STEP_ATTENTION": "matmul", "SPECVIZ_STEP_LINEAR": "cublas"},
                      "graphs, attention as two batched products around a softmax, cuBLAS projections"),
    "graphs-sdpa": ({"SPECVIZ_STEP_ATTENTION": "sdpa", "SPECVIZ_STEP_LINEAR": "cublas"},
                    "graphs, torch's sdpa, cuBLAS projections"),
    "eager": ({}, "the default's kernels launched one by one (no graphs)"),
    "transformers": ({}, "transformers' own forward"),
}
DEFAULT_MODE = "graphs"  # the product's default step path: its figures are the goals' figures


def random_model(config: dict, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    """A causal LM of this config with random weights, on the GPU."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**config)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


def _decoder_after(model: torch.nn.Module, batch: int, width: int, context: int
                   ) -> tuple[CausalLMDecoder, list[list[int]]]:
    """A decoder of `batch` rows holding a random `context`-token prompt each, and a feed of `width` tokens a row."""
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (context,), generator=g).tolist()
    decoder = CausalLMDecoder(model, vocab, batch)
    decoder.prefill([prompt] * batch)
    return decoder, [torch.randint(0, vocab, (width,), generator=g).tolist()] * batch


def _timed(decoder: CausalLMDecoder, feed: list[list[int]], context: int, reps: int, warmup: int
           ) -> dict[str, float]:
    """Median host ms and GPU ms (CUDA events) of decoder.forward(feed), each call rolled back to `context`."""
    width, host, gpu = len(feed[0]), [], []
    for i in range(warmup + reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        decoder.forward(feed, width)
        end.record()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        decoder.rollback([context] * len(feed))
        if i >= warmup:
            host.append(wall * 1e3)
            gpu.append(start.elapsed_time(end))
    return {"ms": statistics.median(host), "gpu_ms": statistics.median(gpu)}


@torch.inference_mode()
def time_step(model: torch.nn.Module, batch: int, width: int, context: int, reps: int, warmup: int = 5
              ) -> dict[str, float]:
    """Median ms of one decoder forward of `width` new tokens in each of `batch` rows after `context` tokens."""
    decoder, feed = _decoder_after(model, batch, width, context)
    return _timed(decoder, feed, context, reps, warmup)


@torch.inference_mode()
def profile_step(model: torch.nn.Module, batch: int, width: int, context: int, reps: int = 10) -> dict:
    """Where one decoder forward's GPU time goes, kernel by kernel (torch.profiler over `reps` calls after warm-up):
    per kernel name, launches and µs per step; beside them the step's GPU time by CUDA events, so the gap between
    the kernels (launch latency, idle SMs) is the difference."""
    from torch.profiler import ProfilerActivity, profile

    decoder, feed = _decoder_after(model, batch, width, context)
    for _ in range(5):
        decoder.forward(feed, width)
        decoder.rollback([context] * batch)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            decoder.forward(feed, width)
            decoder.rollback([context] * batch)
        torch.cuda.synchronize()
    kernels = []
    for evt in prof.key_averages():
        if getattr(evt, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        total = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)
        kernels.append({"kernel": evt.key[:120], "per_step": evt.count / reps, "us_per_step": total / reps,
                        "us_each": total / max(evt.count, 1)})
    kernels.sort(key=lambda k: -k["us_per_step"])
    try:  # the profiler's own table too, in case its events name device work otherwise on this torch
        table = prof.key_averages().table(sort_by="device_time_total", row_limit=30)
    except Exception as e:  # noqa: BLE001
        table = f"{type(e).__name__}: {e}"
    timed = _timed(decoder, feed, context, reps=20, warmup=0)  # the same decoder, warm already
    return {"kernels": kernels, "kernel_us_per_step": sum(k["us_per_step"] for k in kernels),
            "launches_per_step": sum(k["per_step"] for k in kernels), "step_gpu_us": timed["gpu_ms"] * 1e3,
            "table": table}


@torch.inference_mode()
def time_verify(batch: int, gamma: int, vocab: int, dtype: torch.dtype, reps: int = 200) -> dict[str, float]:
    """Median ms of one exact verification (T = 0.8) at these shapes, through specviz.verify as the engine calls it."""
    from specviz.config import SamplingConfig
    from specviz.verify import verify

    g = torch.Generator(device="cuda").manual_seed(0)
    tl = (2 * torch.randn(batch, gamma + 1, vocab, generator=g, device="cuda")).to(dtype)
    dl = (tl[:, :gamma].float() + torch.randn(batch, gamma, vocab, generator=g, device="cuda")).to(dtype)
    tokens = torch.randint(0, vocab, (batch, gamma), generator=g, device="cuda")
    sampling = SamplingConfig(temperature=0.8)
    out = []
    for i in range(20 + reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        verify("exact", tokens, dl, tl, sampling, g).host()
        if i >= 20:
            out.append((time.perf_counter() - t0) * 1e3)
    return {"ms": statistics.median(out)}


def predicted_speedup(alpha: float, draft_ms: float, score_ms: dict[int, float], verify_ms: float,
                      max_gamma: int = 15) -> tuple[float, int]:
    """Leviathan's expected speedup with measured costs: max over γ of E[tokens]·t(1) / (γ·t_draft + t(γ+1) + t_verify),
    t(W) the target's cost of scoring W tokens (interpolated between measured widths)."""
    widths = sorted(score_ms)

    def t(w: int) -> float:
        lo = max(x for x in widths if x <= w)
        hi = min((x for x in widths if x >= w), default=lo)
        return score_ms[lo] if hi == lo else score_ms[lo] + (score_ms[hi] - score_ms[lo]) * (w - lo) / (hi - lo)

    best = max(range(1, max_gamma + 1),
               key=lambda gm: expected_tokens(alpha, gm) * t(1) / (gm * draft_ms + t(gm + 1) + verify_ms))
    return expected_tokens(alpha, best) * t(1) / (best * draft_ms + t(best + 1) + verify_ms), best


def step_goals(costs: dict, mode: str, verify: dict, alphas: dict[str, float], out: dict) -> dict[str, float]:
    """Issue 40's step goals from one mode's measured costs (predictions land in out["predicted…"] by mode)."""
    g_ = costs.get("target", {}).get(mode, {})
    d_ = costs.get("draft", {}).get(mode, {})
    t7 = costs.get("target7b", {}).get(mode, {})
    goals = {}
    if g_ and d_:
        goals["draft_over_target"] = d_["B1W1"]["ms"] / g_["B1W1"]["ms"]
        goals["six_over_one"] = g_["B1W6"]["ms"] / g_["B1W1"]["ms"]
        if "B8G4" in verify:
            goals["bass8_iteration_over_target_only"] = (
                4 * d_["B8W1"]["ms"] + g_["B8W5"]["ms"] + verify["B8G4"]["ms"]) / g_["B8W1"]["ms"]
    if t7 and d_:
        goals["draft_over_target_7b"] = d_["B1W1"]["ms"] / t7["B1W1"]["ms"]
    for label, target in (("", g_), ("_7b", t7)):
        if not (target and d_ and "B1G5" in verify):
            continue
        scores = {int(k.split("W")[1]): v["ms"] for k, v in target.items() if k.startswith("B1W")}
        preds = {a: predicted_speedup(alpha, d_["B1W1"]["ms"], scores, verify["B1G5"]["ms"])
                 for a, alpha in alphas.items()}
        out.setdefault("predicted" + label, {})[mode] = {a: {"speedup": s, "gamma": gm} for a, (s, gm) in preds.items()}
        if preds:
            goals["predicted_speedup" + label] = statistics.median(s for s, _ in preds.values())
    return goals


def bundled_alphas(results: Path) -> dict[str, float]:
    """α of the exact run per bundled article and temperature, as measured on the CPU (docs/results)."""
    out = {}
    for f in sorted(glob.glob(str(results / "compare-text-cpu-wide-*.json"))):
        name = Path(f).stem.removeprefix("compare-text-cpu-wide-")
        out[name] = json.loads(Path(f).read_text())["runs"]["exact"]["alpha"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", required=True, help="NAME=config.json (names: draft, target, target7b)")
    p.add_argument("--context", type=int, default=800)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--modes", nargs="+", default=["graphs", "graphs-cublas", "graphs-matmul", "eager", "transformers"],
                   choices=list(VARIANTS), help="; ".join(f"{k}: {v[1]}" for k, v in VARIANTS.items()))
    p.add_argument("--profile", nargs="*", default=[], metavar="NAME/MODE",
                   help="also profile these models' one-token steps kernel by kernel (e.g. draft/graphs draft/eager)")
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)
    dtype = torch.bfloat16
    out: dict = {"machine": torch.cuda.get_device_name(0), "torch": torch.__version__, "dtype": "bf16",
                 "context": args.context, "command": "python -m specviz.bench.gpu_steps " + " ".join(argv or sys.argv[1:]),
                 "steps": {}, "errors": {}}

    def save() -> None:
        Path(args.json).write_text(json.dumps(out, indent=1))

    costs: dict[str, dict] = {}
    for seed, item in enumerate(args.configs):
        name, path = item.split("=", 1)
        try:
            model = random_model(json.loads(Path(path).read_text()), dtype, seed)
        except Exception as e:  # noqa: BLE001 (a model that does not fit is recorded, the rest still measured)
            out["errors"][name] = f"{type(e).__name__}: {e}"
            continue
        costs[name] = {}
        # the 7B-class target beside the goals' modes only (its transformers figures take a minute)
        for mode in args.modes if name != "target7b" else [m for m in args.modes if m.startswith("graphs")]:
            for key in ("SPECVIZ_STEP_ATTENTION", "SPECVIZ_STEP_LINEAR"):
                os.environ.pop(key, None)
            os.environ.update(VARIANTS[mode][0])
            graphed.attach(model, mode.split("-")[0])
            if model.graphed_forward is not None:
                described = out.setdefault("fused_kernels", {})[f"{name}/{mode}"] = model.graphed_forward.ops.describe()
                print(name, mode, "projections:", described["linear"], described["linear_why"],
                      {s: {k: round(v, 1) for k, v in t.items()} for s, t in described["linear_us"].items()}, flush=True)
            rows = {}
            for batch, widths in ((1, WIDTHS), (8, (1, 5))):
                for w in widths:
                    if not mode.startswith("graphs") and w not in (1, 5, 6):  # the slow paths: the goals' shapes
                        continue
                    try:
                        rows[f"B{batch}W{w}"] = time_step(model, batch, w, args.context, args.reps)
                    except Exception as e:  # noqa: BLE001
                        out["errors"][f"{name}/{mode}/B{batch}W{w}"] = f"{type(e).__name__}: {e}"
            costs[name][mode] = rows
            out["steps"] = costs
            save()
            print(name, mode, {k: round(v["ms"], 3) for k, v in rows.items()}, flush=True)
            if f"{name}/{mode}" in args.profile:
                try:
                    prof = out.setdefault("profile", {})[f"{name}/{mode}"] = profile_step(model, 1, 1, args.context)
                    print(f"  profile {name}/{mode}: {prof['launches_per_step']:.0f} kernels, "
                          f"{prof['kernel_us_per_step']:.0f} µs in kernels of a {prof['step_gpu_us']:.0f} µs step; top:",
                          [(k["kernel"][:40], round(k["per_step"]), round(k["us_each"], 1)) for k in prof["kernels"][:8]],
                          flush=True)
                except Exception as e:  # noqa: BLE001
                    out["errors"][f"profile/{name}/{mode}"] = f"{type(e).__name__}: {e}"
                save()
        del model
        torch.cuda.empty_cache()

    vocab = 151936
    out["verify"] = {}
    for b, g in ((1, 5), (8, 4)):
        try:
            out["verify"][f"B{b}G{g}"] = time_verify(b, g, vocab, dtype)
        except Exception as e:  # noqa: BLE001 (the step figures stand without it; the goals needing it are left out)
            out["errors"][f"verify/B{b}G{g}"] = f"{type(e).__name__}: {e}"
    out["alphas_cpu"] = alphas = bundled_alphas(Path(__file__).resolve().parents[2] / "docs" / "results")
    out["goals_by_mode"] = {mode: step_goals(costs, mode, out["verify"], alphas, out)
                            for mode in args.modes if mode.startswith("graphs")}
    goals = out["goals_by_mode"].get(DEFAULT_MODE, {})
    out["goals"] = goals
    save()
    print(json.dumps(out["goals_by_mode"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
