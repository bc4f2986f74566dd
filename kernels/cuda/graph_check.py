"""GPU check of the graphed verification (graphs.py), in one short run: are its decisions the eager kernels'
decisions, and what does a call cost against baseline and the eager kernels (issue 40: ≤ 40 µs of host time
per call, ≥ 5× baseline at V = 151,936, γ = 5, B = 1, fp32).

    python3 kernels/cuda/graph_check.py --json OUT.json

Parts (each catches its own errors, recorded under "errors", so one failure does not hide the others):
- correctness: on random logits (a few shapes, fp32 / bf16 / fp16, both modes, a filter), the graphed call's
  outputs against `launch` with the uniforms the graph drew (bitwise), replays drawing fresh uniforms, the
  uniforms equal to eager draws from the same generator state, calls with fresh tensors (clones, and other
  logits) replaying the same graph and deciding for their own inputs, and torch's count of syncs per call;
- timing: baseline (transformers' algorithm on torch), eager kernels and graphed kernels through
  `verify(...).host()` as bench-verify times them: median wall µs of --iters calls after --warmup, GPU µs
  from CUDA events (eager: around the kernel launches; graphed: around the copy-in and the replay, so the
  input copies, draws and readback's copy count as GPU time), host µs = call − GPU. The graphed kernels are
  timed twice: with the same tensors every call, and with fresh tensors every call as the decoding engine
  passes them (clones made before each call, outside the timed region; the previous call's clones are kept
  alive so that no call sees the previous one's addresses): `graphed_fresh_*`, `verify_*_fresh`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
GOAL = dict(V=151_936, gamma=5, B=1, dtype="fp32", mode="exact")
TIMED = [(1, "fp32", "exact"), (1, "fp32", "sigmoid"), (8, "fp32", "exact"), (1, "bf16", "exact"),
         (8, "bf16", "exact")]  # (B, dtype, mode) at V = --vocab, γ = --gamma
CHECKED = [  # (mode, B, γ, V, dtype, settings)
    ("exact", 1, 5, 151_936, "fp32", {}),
    ("exact", 8, 5, 151_936, "bf16", {}),
    ("sigmoid", 8, 5, 151_936, "fp32", dict(sigmoid_alpha=-8.0, sigmoid_beta=8.0)),
    ("sigmoid", 1, 3, 51_865, "bf16", dict(sigmoid_alpha=-8.0, sigmoid_beta=8.0)),
    ("exact", 3, 2, 51_865, "fp16", dict(topk=50, top_p=0.9)),
    ("exact", 2, 1, 7, "fp32", dict(lenience=0.7)),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--iters", type=int, default=300, help="timed calls per row (median)")
    p.add_argument("--warmup", type=int, default=30, help="untimed calls before each timing")
    p.add_argument("--vocab", type=int, default=GOAL["V"])
    p.add_argument("--gamma", type=int, default=GOAL["gamma"])
    return p.parse_args(argv)


def _median_us(fn, warmup: int, iters: int, setup=None) -> float:
    """Median wall µs of fn() (fn(setup()) where setup is given: setup runs outside the timed region)."""
    for _ in range(warmup):
        fn() if setup is None else fn(setup())
    samples = []
    for _ in range(iters):
        args = None if setup is None else setup()
        t0 = time.perf_counter()
        fn() if setup is None else fn(args)
        samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def _fresh(*tensors):
    """A setup for `_median_us`: clones of the tensors on each call, the previous call's clones kept alive
    (so that the caching allocator cannot hand their addresses to the next call's clones)."""
    import torch

    held = []

    def setup():
        clones = tuple(t.clone() for t in tensors)
        held[:] = held[-len(tensors):] + list(clones)
        torch.cuda.current_stream().synchronize()  # the clones are done before the clock starts
        return clones

    return setup


def _median_gpu_us(run, warmup: int, iters: int) -> float:
    """Median µs between the (start, end) CUDA events that run((start, end)) records."""
    import torch

    samples = []
    for i in range(warmup + iters):
        events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        run(events)
        events[1].synchronize()
        if i >= warmup:
            samples.append(events[0].elapsed_time(events[1]) * 1e3)
    return statistics.median(samples)


def _inputs(B: int, gamma: int, V: int, dtype: str, seed: int):
    """Random logits, drafts drawn from the draft: (tokens [B, γ], draft [B, γ, V], target [B, γ+1, V])."""
    import torch

    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    g = torch.Generator(device="cuda").manual_seed(seed)
    target = 2 * torch.randn(B, gamma + 1, V, device="cuda", generator=g)
    draft = target[:, :gamma] + torch.randn(B, gamma, V, device="cuda", generator=g)
    tokens = torch.multinomial(torch.softmax(draft.reshape(-1, V), -1), 1, generator=g).reshape(B, gamma)
    return tokens, draft.to(dt), target.to(dt)


def machine(kernels) -> dict:
    import torch

    info = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "python": sys.version.split()[0]}
    try:
        import cupy

        info["cupy"] = cupy.__version__
    except Exception as exc:  # recorded, and the kernels then report themselves unavailable
        info["cupy"] = f"not importable: {exc}"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, sms=props.multi_processor_count)
    info["kernels_available"] = kernels.available()
    info["kernels_unavailable_reason"] = kernels.unavailable_reason()
    return info


def _syncs(fn) -> int:
    """Synchronizing CUDA operations torch's sync debug mode reports while fn runs."""
    import warnings

    import torch

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("called a synchronizing CUDA operation" in str(w.message) for w in caught)


def correctness(kernels) -> list[dict]:
    """Per case: graphed outputs equal to `launch` with the graph's uniforms, over 3 replays."""
    import torch

    from specviz.config import SamplingConfig
    from specviz.verify import verify

    rows = []
    for i, (mode, B, gamma, V, dtype, settings) in enumerate(CHECKED):
        row = dict(mode=mode, B=B, gamma=gamma, V=V, dtype=dtype, settings=settings)
        try:
            tokens, draft, target = _inputs(B, gamma, V, dtype, seed=100 + i)
            gen = torch.Generator(device="cuda").manual_seed(i)
            t0 = time.perf_counter()
            kernels.launch_sampled(mode, tokens, draft, target, gen, graphs_on=True, **settings)
            row["first_call_ms"] = (time.perf_counter() - t0) * 1e3  # warm-up and capture
            graphs_after_capture = len(kernels.launcher._graph_cache.keys())
            equal, graphed, fresh, same_draws, previous = True, True, True, True, None
            for _ in range(3):
                before = gen.get_state()
                done = kernels.launch_sampled(mode, tokens, draft, target, gen, graphs_on=True, **settings)
                graphed &= done.graphed
                outputs = {k: v.clone() for k, v in done.outputs.items()}
                u, u_res = outputs["uniforms"], done.u_res.clone()
                twin = torch.Generator(device="cuda")
                twin.set_state(before)
                same_draws &= (torch.equal(u, torch.rand((B, gamma), generator=twin, device="cuda"))
                               and torch.equal(u_res, torch.rand((B,), generator=twin, device="cuda")))
                eager = kernels.launch(mode, tokens, draft, target, u, u_res, **settings)
                equal &= all(torch.equal(outputs[k], eager.outputs[k]) for k in outputs) and done.host == eager.host
                fresh &= previous is None or not torch.equal(u, previous)
                previous = u
            # fresh tensors (clones, then other logits of the layout) replay the same graph, deciding for their own
            fresh_equal = True
            for seed in (None, 200 + i):
                args = (tuple(t.clone() for t in (tokens, draft, target)) if seed is None
                        else _inputs(B, gamma, V, dtype, seed=seed))
                done = kernels.launch_sampled(mode, *args, gen, graphs_on=True, **settings)
                graphed &= done.graphed
                outputs = {k: v.clone() for k, v in done.outputs.items()}
                eager = kernels.launch(mode, *args, outputs["uniforms"], done.u_res.clone(), **settings)
                fresh_equal &= all(torch.equal(outputs[k], eager.outputs[k]) for k in outputs) and (
                    done.host == eager.host)
            row.update(graphed=graphed, equal_to_eager=equal, fresh_uniforms=fresh,
                       uniforms_equal_eager_draws=same_draws, fresh_tensors_equal_to_eager=fresh_equal,
                       fresh_tensors_same_graph=len(kernels.launcher._graph_cache.keys()) == graphs_after_capture)
            sampling = SamplingConfig(temperature=1.0)
            verify(mode, tokens, draft, target, sampling, gen, backend="cuda")  # the plan verify() keys
            row["syncs_per_call"] = _syncs(lambda: verify(mode, tokens, draft, target, sampling, gen,
                                                          backend="cuda").host())
        except Exception:
            row["error"] = traceback.format_exc(limit=6)
        rows.append(row)
    return rows


def timing(kernels, args: argparse.Namespace) -> list[dict]:
    """Baseline, eager kernels and graphed kernels per (B, dtype, mode) at V = --vocab, γ = --gamma."""
    import torch

    from specviz.config import SamplingConfig
    from specviz.verify import kernel_args, verify

    sampling = SamplingConfig(temperature=1.0)
    V, gamma, warmup, iters = args.vocab, args.gamma, args.warmup, args.iters
    rows = []
    for B, dtype, mode in TIMED:
        row = dict(V=V, gamma=gamma, B=B, dtype=dtype, mode=mode)
        try:
            tokens, draft, target = _inputs(B, gamma, V, dtype, seed=7)
            gen = torch.Generator(device="cuda").manual_seed(0)

            def call(mode=mode, backend="cuda"):
                verify(mode, tokens, draft, target, sampling, gen, backend=backend).host()

            row["baseline_us"] = _median_us(lambda: call("baseline", "torch"), warmup, iters)
            opts = dict(scale=1.0, topk=0, top_p=1.0, lenience=1.0, sigmoid_alpha=-1e4, sigmoid_beta=1e4)
            kernels.set_graphs_enabled(False)
            try:
                row["eager_call_us"] = _median_us(call, warmup, iters)
            finally:
                kernels.set_graphs_enabled(True)
            _, _, u, u_res, _ = kernel_args(mode, tokens, draft, target, sampling, gen)
            row["eager_gpu_us"] = _median_gpu_us(
                lambda ev: kernels.launch(mode, tokens, draft, target, u, u_res, check=False, events=ev, **opts),
                warmup, iters)
            row["graphed_call_us"] = _median_us(call, warmup, iters)

            def fresh_call(args, mode=mode):
                verify(mode, *args, sampling, gen, backend="cuda").host()

            row["graphed_fresh_call_us"] = _median_us(fresh_call, warmup, iters, setup=_fresh(tokens, draft, target))
            row["graphed_gpu_us"] = _median_gpu_us(
                lambda ev: kernels.launch_sampled(mode, tokens, draft, target, gen, graphs_on=True, events=ev, **opts),
                warmup, iters)
            row["graphed_fresh_gpu_us"] = row["graphed_gpu_us"]  # the same copy-in and replay either way
            for path in ("eager", "graphed", "graphed_fresh"):
                row[f"{path}_host_us"] = row[f"{path}_call_us"] - row[f"{path}_gpu_us"]
                row[f"{path}_x_baseline"] = row["baseline_us"] / row[f"{path}_call_us"]
        except Exception:
            row["error"] = traceback.format_exc(limit=6)
        rows.append(row)
    return rows


def _goal_row(rows: list[dict], args: argparse.Namespace) -> dict | None:
    for r in rows:
        if (r["V"], r["gamma"], r["B"], r["dtype"], r["mode"]) == (args.vocab, args.gamma, 1, "fp32", "exact"):
            return r
    return None


def _table(report: dict) -> str:
    lines = [f"{report['machine'].get('gpu', '?')}; torch {report['machine'].get('torch')}, "
             f"cupy {report['machine'].get('cupy')}"]
    for r in report.get("correctness", []):
        status = r.get("error", "").strip().splitlines()[-1:] or [
            f"graphed={r.get('graphed')} equal={r.get('equal_to_eager')} fresh={r.get('fresh_uniforms')} "
            f"same_draws={r.get('uniforms_equal_eager_draws')} "
            f"fresh_tensors={r.get('fresh_tensors_equal_to_eager')} same_graph={r.get('fresh_tensors_same_graph')} "
            f"syncs={r.get('syncs_per_call')} "
            f"first={r.get('first_call_ms', 0):.1f} ms"]
        lines.append(f"check {r['mode']:7s} B={r['B']} γ={r['gamma']} V={r['V']} {r['dtype']} {r['settings']}: "
                     f"{status[0]}")
    lines.append(f"{'mode':7s} {'B':>2s} {'dtype':5s} {'base µs':>8s} | {'eager':>7s} {'GPU':>6s} {'host':>6s} "
                 f"{'×base':>6s} | {'graphed':>7s} {'GPU':>6s} {'host':>6s} {'×base':>6s} | {'fresh':>7s} {'host':>6s} "
                 f"{'×base':>6s}")
    for r in report.get("timing", []):
        if "error" in r:
            lines.append(f"{r['mode']:7s} {r['B']:2d} {r['dtype']:5s} error: {r['error'].strip().splitlines()[-1]}")
            continue
        lines.append(f"{r['mode']:7s} {r['B']:2d} {r['dtype']:5s} {r['baseline_us']:8.1f} | "
                     f"{r['eager_call_us']:7.1f} {r['eager_gpu_us']:6.1f} {r['eager_host_us']:6.1f} "
                     f"{r['eager_x_baseline']:6.2f} | {r['graphed_call_us']:7.1f} {r['graphed_gpu_us']:6.1f} "
                     f"{r['graphed_host_us']:6.1f} {r['graphed_x_baseline']:6.2f} | {r['graphed_fresh_call_us']:7.1f} "
                     f"{r['graphed_fresh_host_us']:6.1f} {r['graphed_fresh_x_baseline']:6.2f}")
    for name in ("verify_x_baseline", "verify_host_us", "verify_x_baseline_fresh", "verify_host_us_fresh",
                 "eager_x_baseline", "eager_host_us"):
        if name in report:
            lines.append(f"{name}: {report[name]:.2f}")
    for part, text in report["errors"].items():
        lines.append(f"error in {part}: {text.strip().splitlines()[-1]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report: dict = {"command": " ".join(["python3", *sys.argv]) if argv is None else " ".join(argv),
                    "machine": {}, "errors": {}}
    try:
        # run as a script, kernels/cuda/ heads sys.path: its modules (build, plan, spec...) must not shadow others
        sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != HERE]
        from specviz.verify import project_kernels

        kernels = project_kernels()
        report["machine"] = machine(kernels)
        if not report["machine"]["kernels_available"]:
            raise RuntimeError(f"the kernels cannot run: {report['machine']['kernels_unavailable_reason']}")
    except Exception:
        report["errors"]["machine"] = traceback.format_exc(limit=6)
        kernels = None
    if kernels is not None:
        for part, run in (("correctness", lambda: correctness(kernels)), ("timing", lambda: timing(kernels, args))):
            t0 = time.perf_counter()
            try:
                report[part] = run()
            except Exception:
                report["errors"][part] = traceback.format_exc(limit=6)
            report[f"{part}_s"] = time.perf_counter() - t0
        goal = _goal_row(report.get("timing", []), args)
        if goal is not None and "error" not in goal:
            report.update(verify_x_baseline=goal["graphed_x_baseline"], verify_host_us=goal["graphed_host_us"],
                          verify_gpu_us=goal["graphed_gpu_us"],
                          verify_x_baseline_fresh=goal["graphed_fresh_x_baseline"],
                          verify_host_us_fresh=goal["graphed_fresh_host_us"], eager_x_baseline=goal["eager_x_baseline"],
                          eager_host_us=goal["eager_host_us"], eager_gpu_us=goal["eager_gpu_us"],
                          goal_met=goal["graphed_host_us"] <= 40 and goal["graphed_x_baseline"] >= 5)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))
    print(_table(report), flush=True)
    failed = [r for r in report.get("correctness", []) + report.get("timing", []) if "error" in r] + [
        r for r in report.get("correctness", []) if not all(r.get(k) for k in (
            "graphed", "equal_to_eager", "fresh_uniforms", "fresh_tensors_equal_to_eager", "fresh_tensors_same_graph"))]
    return 1 if report["errors"] or failed else 0


if __name__ == "__main__":
    sys.exit(main())
