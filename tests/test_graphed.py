"""Steps over static buffers (specviz/models/graphed.py) against transformers' forward on tiny models: the same
logits up to rounding through prefill, ragged feeds, rollback, row selection, the prompt merge, the prompt cache
and growth past the headroom; workspaces reused from one decoder to the next. On a GPU (marker `gpu`): a graph's
replay gives the eager forward's bits, and graphs are captured once per shape and reused by the next decoder."""

from __future__ import annotations

import pytest
import torch

from specviz.models import fused, fused_linear, graphed
from specviz.models.prompt_cache import PromptCache
from specviz.text.source import CausalLMDecoder

from conftest import VOCAB, tiny_qwen

TOL = dict(rtol=1e-4, atol=1e-4)  # fp32: a fused projection and another attention kernel, same arithmetic


def _tokens(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(0, VOCAB - 1, (n,), generator=g).tolist()


def _models(device: str = "cpu", dtype=torch.float32, mode: str = "eager"):
    """(reference, static) tiny Qwen2 models with the same weights: transformers' forward, and this module's."""
    ref = tiny_qwen(5).to(device, dtype)
    ref.set_attn_implementation("sdpa")
    static = tiny_qwen(5).to(device, dtype)
    graphed.attach(static, mode)
    assert static.graphed_forward is not None
    return ref, static


def _close(a: torch.Tensor, b: torch.Tensor, tol=TOL) -> None:
    assert a.shape == b.shape
    assert torch.allclose(a.float(), b.float(), **tol), (a.float() - b.float()).abs().max()


def _same_state(new: CausalLMDecoder, old: CausalLMDecoder, tol=TOL) -> None:
    assert torch.equal(new.valid, old.valid) and new.slots == old.slots
    assert new.cache.get_seq_length() == old.cache.get_seq_length() == new.valid.shape[1]
    w, L, B = new.cache.workspace, new.valid.shape[1], new.batch
    for i, layer in enumerate(old.cache.layers):
        # holes may differ (the static forward also writes padding slots' keys), valid slots may not
        mask = new.valid[:, None, :, None]
        _close(w.keys[i][:B, :, :L] * mask, layer.keys * mask, tol)
        _close(w.values[i][:B, :, :L] * mask, layer.values * mask, tol)


@torch.inference_mode()
def _drive(new: CausalLMDecoder, old: CausalLMDecoder, prompts: list[list[int]], seed: int, steps: int = 10,
           tol=TOL) -> None:
    """The same prefill, ragged feeds, rollbacks and a row selection on both; logits must agree."""
    g = torch.Generator().manual_seed(seed)
    new.prefill(prompts)
    old.prefill(prompts)
    _same_state(new, old, tol)
    for step in range(steps):
        feeds = [_tokens(g, int(torch.randint(0, 6, (1,), generator=g))) for _ in range(new.batch)]
        if not any(feeds):
            feeds[0] = [5]
        keep = max(len(f) for f in feeds)
        a, b = new.forward(feeds, keep), old.forward(feeds, keep)
        for r, f in enumerate(feeds):  # padding columns' logits are never read
            if f:
                _close(a[r, keep - len(f):], b[r, keep - len(f):], tol)
        fed = [new.fed(r) - int(torch.randint(0, len(f) + 1, (1,), generator=g)) for r, f in enumerate(feeds)]
        new.rollback(fed)
        old.rollback(fed)
        _same_state(new, old, tol)
        if step == 4 and new.batch > 1:  # the first row leaves, the last one is copied
            rows = list(range(1, new.batch)) + [new.batch - 1]
            new.select(rows)
            old.select(rows)
            _same_state(new, old, tol)


def test_supports_qwen_and_refuses_other_layers():
    model = tiny_qwen(1)
    assert graphed.supports(model)
    model.model.layers[0].mlp.up_proj = torch.nn.Identity()
    assert not graphed.supports(model)
    assert graphed.attach(model, "eager").graphed_forward is None
    assert graphed.attach(tiny_qwen(1), "transformers").graphed_forward is None


def test_bad_mode_is_refused(monkeypatch):
    monkeypatch.setenv("SPECVIZ_GPU_STEPS", "fast")
    with pytest.raises(ValueError, match="SPECVIZ_GPU_STEPS"):
        graphed.gpu_steps()


def test_fused_projections_keep_the_modules_weights_as_views():
    model = tiny_qwen(2)
    before = [p.clone() for p in model.parameters()]
    graphed.attach(model, "eager")
    for a, b in zip(before, model.parameters(), strict=True):
        assert torch.equal(a, b)
    layer, fused = model.model.layers[0], model.graphed_forward.layers[0]
    assert layer.self_attn.q_proj.weight.data_ptr() == fused.qkv_weight.data_ptr()
    assert layer.mlp.up_proj.weight.data_ptr() > fused.gate_up_weight.data_ptr()


def test_one_row_matches_transformers():
    ref, static = _models()
    g = torch.Generator().manual_seed(1)
    _drive(CausalLMDecoder(static, VOCAB, 1), CausalLMDecoder(ref, VOCAB, 1), [_tokens(g, 17)], seed=2)


def test_ragged_batch_and_prompt_merge_match_transformers():
    ref, static = _models()
    g = torch.Generator().manual_seed(3)
    prompts = [_tokens(g, n) for n in (12, 5, 21)]
    _drive(CausalLMDecoder(static, VOCAB, 3), CausalLMDecoder(ref, VOCAB, 3), prompts, seed=4)


@pytest.mark.parametrize("attention", ["sdpa", "triton"])
def test_other_attention_paths_match_transformers(monkeypatch, attention):
    """The other attention paths, kept for measurement beside the two matrix products: torch's fused kernel, and
    'triton' (here on the references: no GPU; its kernels run under the interpreter in another test)."""
    monkeypatch.setenv("SPECVIZ_STEP_ATTENTION", attention)
    ref, static = _models()
    assert static.graphed_forward.attention == attention
    g = torch.Generator().manual_seed(31)
    _drive(CausalLMDecoder(static, VOCAB, 2), CausalLMDecoder(ref, VOCAB, 2), [_tokens(g, 7), _tokens(g, 12)],
           seed=32, steps=5)
    monkeypatch.setenv("SPECVIZ_STEP_ATTENTION", "flash")
    with pytest.raises(ValueError, match="attention"):
        graphed.attach(tiny_qwen(1), "eager")


def test_prompt_cache_and_shared_prefill_match_transformers():
    """Identical prompts share one prefill (rows copied up to the batch); the second round reads the prompts
    from the prompt cache, whose entries are exactly each prompt's slots."""
    ref, static = _models()
    g = torch.Generator().manual_seed(5)
    a, b = _tokens(g, 9), _tokens(g, 14)
    new_prompts, old_prompts = PromptCache(), PromptCache()
    for _ in range(2):
        _drive(CausalLMDecoder(static, VOCAB, 3, prompt_cache=new_prompts),
               CausalLMDecoder(ref, VOCAB, 3, prompt_cache=old_prompts), [a, b, a], seed=6, steps=6)
    assert new_prompts.hits == old_prompts.hits == 2
    for keys, _ in new_prompts.get(tuple(a)):
        assert keys.shape[-2] == len(a)
    # N samples of one prompt: one prefill, copied into every row
    _drive(CausalLMDecoder(static, VOCAB, 4), CausalLMDecoder(ref, VOCAB, 4), [a] * 4, seed=7, steps=4)


def test_growth_past_the_headroom(monkeypatch):
    """A run that outlasts its workspace moves to one of twice the capacity; nothing changes in the logits."""
    monkeypatch.setattr(graphed, "HEADROOM", 4)
    monkeypatch.setattr(graphed, "ALIGN", 8)
    ref, static = _models()
    g = torch.Generator().manual_seed(7)
    new = CausalLMDecoder(static, VOCAB, 2)
    _drive(new, CausalLMDecoder(ref, VOCAB, 2), [_tokens(g, 3), _tokens(g, 8)], seed=8, steps=12)
    assert new.cache.workspace.capacity > graphed.capacity_for(8)


@torch.inference_mode()
def test_workspaces_are_reused_and_cleared():
    """A decoder's workspace goes back to the pool when its cache is dropped and the next decoder of the same
    shape gets it (so graphs captured over it are reused), zeroed: a NaN a previous run left in a masked slot
    must not reach the next run's logits (0 · NaN through the mask)."""
    ref, static = _models()
    g = torch.Generator().manual_seed(9)
    prompt = _tokens(g, 10)
    first = CausalLMDecoder(static, VOCAB, 1)
    first.prefill([prompt])
    first.forward([[3, 4]], 2)
    workspace = first.cache.workspace
    for t in workspace.keys:
        t[:, :, -1] = float("nan")  # a slot the next run masks
    del first
    second = CausalLMDecoder(static, VOCAB, 1)
    second.prefill([prompt])
    assert second.cache.workspace is workspace
    old = CausalLMDecoder(ref, VOCAB, 1)
    old.prefill([prompt])
    _close(second.forward([[3, 4]], 2), old.forward([[3, 4]], 2))
    other = CausalLMDecoder(static, VOCAB, 1)  # a second live decoder gets a workspace of its own
    other.prefill([prompt])
    assert other.cache.workspace is not workspace


class _StandIn:
    """A CUDA graph's stand-in on the CPU: `replay` runs the captured function again into the same output tensor,
    reading the static inputs as a graph would. Drives the capture bookkeeping (keys, static inputs, reuse)."""

    def __init__(self, run, out):
        self.run, self.out, self.replays = run, out, 0

    def replay(self) -> None:
        self.out.copy_(self.run())
        self.replays += 1


def _stand_in_capture(log: list):
    def capture(run, device, pool):
        run()  # the warm-up run before a capture
        graph = _StandIn(run, run())
        log.append(graph)
        return graph, graph.out
    return capture


@torch.inference_mode()
def test_graph_bookkeeping_with_a_stand_in_for_cuda_graphs():
    """Through the graph path with a stand-in capture: every replay reads the call's own inputs (copied into the
    static ones), the logits match transformers' through ragged feeds, rollbacks and a row selection, a step
    shape is captured once, and the next decoder of the same shape replays the first one's graphs."""
    ref, static = _models()
    log: list[_StandIn] = []
    static.graphed_forward = graphed.GraphedForward(static, capture=_stand_in_capture(log))
    g = torch.Generator().manual_seed(41)
    prompts = [_tokens(g, 40), _tokens(g, 36)]  # wider than MAX_GRAPH_WIDTH: read eagerly
    new = CausalLMDecoder(static, VOCAB, 2)
    _drive(new, CausalLMDecoder(ref, VOCAB, 2), prompts, seed=42, steps=10)
    shapes = set(new.cache.workspace.graphs)
    assert len(log) == len(shapes) and sum(x.replays for x in log) > len(log)  # replayed, not recaptured
    workspace, captured = new.cache.workspace, len(log)
    del new
    again = CausalLMDecoder(static, VOCAB, 2)
    again.prefill(prompts)
    B, W, keep, _ = next(k for k in shapes if k[0] == 2)
    again.forward([[5] * W, [6] * W], keep)
    assert again.cache.workspace is workspace and len(log) == captured


def test_decoding_through_static_steps_matches_transformers(tiny_pair, prompt_ids):
    """The driver end to end, greedy, on the pair with static steps: the same tokens as transformers' forward."""
    from dataclasses import replace

    from specviz.config import SpecConfig
    from conftest import decode

    cfg = SpecConfig(max_new_tokens=24, gamma_policy="constant", gamma_init=4)
    want = decode(tiny_pair, [prompt_ids], cfg)
    target = tiny_qwen(0)
    draft = type(target)(target.config).float().eval()
    draft.load_state_dict(tiny_pair.draft.state_dict())
    graphed.attach(target, "eager")
    graphed.attach(draft, "eager")
    pair = replace(tiny_pair, draft=draft, target=target)
    got = decode(pair, [prompt_ids], cfg)
    assert [s.output_ids for s in got.sequences] == [s.output_ids for s in want.sequences]
    assert len(want.sequences[0].output_ids) == 24


def _fused_checks() -> None:
    """Run by test_fused_kernels_under_the_interpreter in a process where Triton interprets kernels on the CPU."""
    cpu = torch.device("cpu")
    for dtype in (torch.float32, torch.bfloat16):  # odd shapes: hidden 96, intermediate 80, 6 heads over 2
        assert fused._self_check(cpu, dtype, 96, 80, 6, 2, 16, 1e-6) is None
        assert fused._attend_check(cpu, dtype, 96, 80, 6, 2, 16, 1e-6) is None
    # the projections' kernel, every case, against the cuBLAS composition; 16 × 32 and 32 × 32 walk K in several
    # steps, 32 × 32 with 32 outputs a program (the last of 80 partly masked; checked here instead of in a whole
    # step: ~17 s interpreted)
    for config in (*fused_linear.CANDIDATES, fused_linear.Config(16, 32), fused_linear.Config(32, 32)):
        assert fused_linear.check(cpu, torch.float32, config) is None
    for config in fused_linear.CANDIDATES:  # bf16 on the shipped tiles only (16 × 32 interpreted: ~6 s more)
        # bf16 looser: the interpreter rounds fp32 to bf16 toward zero (a GPU rounds to nearest: 2e-2 there)
        assert fused_linear.check(cpu, torch.bfloat16, config, tol=dict(rtol=5e-2, atol=5e-2)) is None
    for attention in ("matmul", "triton"):  # triton: attention split over the keys in two kernels too
        ref, static = _models()
        static.graphed_forward.ops, static.graphed_forward.attention = fused.Ops(True), attention
        g = torch.Generator().manual_seed(21)
        _drive(CausalLMDecoder(static, VOCAB, 2), CausalLMDecoder(ref, VOCAB, 2), [_tokens(g, 9), _tokens(g, 4)],
               seed=22, steps=5)
    # a whole step with every projection on the kernel (each shipped config), against transformers; ragged feeds
    # and rollbacks (the row selection is the attention drives' above: interpreted, a step costs ~3 s)
    for config in fused_linear.CANDIDATES:
        ref, static = _models()
        static.graphed_forward.ops = fused.Ops(True, linear=dict.fromkeys(fused_linear.STAGES, config))
        g = torch.Generator().manual_seed(23)
        _drive(CausalLMDecoder(static, VOCAB, 2), CausalLMDecoder(ref, VOCAB, 2), [_tokens(g, 9), _tokens(g, 4)],
               seed=24, steps=3)
    # a whole step with more rows than the kernel holds (a 3-row prefill of 9 tokens): those calls on cuBLAS
    ref, static = _models()
    static.graphed_forward.ops = fused.Ops(True, linear=dict.fromkeys(fused_linear.STAGES, fused_linear.CANDIDATES[0]))
    g = torch.Generator().manual_seed(25)
    _drive(CausalLMDecoder(static, VOCAB, 3), CausalLMDecoder(ref, VOCAB, 3), [_tokens(g, 9) for _ in range(3)],
           seed=26, steps=1)
    # the choice: cuBLAS unless the kernel is MARGIN faster (timings in the order choose asks for them: per stage
    # cuBLAS, then each candidate), every stage's calls run
    ran, times = [], iter([100.0, 98.0, 100.0, 90.0, 100.0, 120.0, 100.0, 100.0])

    def timer(calls):
        for c in calls:
            c()
        ran.append(len(calls))
        return next(times)
    layers = static.graphed_forward.layers
    choice = fused_linear.choose(layers, torch.float32, fused.add_rms_norm_triton, fused.silu_mul_triton, timer)
    assert [s for s, c in choice.configs.items() if c is not None] == ["o"], choice
    assert ran == [len(layers)] * 8 and choice.timings["o"] == {"cublas": 100.0, "16x256": 90.0}
    try:  # a kernel that is off is caught, in its output and in its residual
        right_linear = fused_linear.norm_linear_triton
        fused_linear.norm_linear_triton = lambda *a: (lambda r: (r[0], r[1] * 1.05))(right_linear(*a))
        assert "differs from the reference" in fused_linear.check(cpu, torch.float32, fused_linear.CANDIDATES[0])
        fused_linear.norm_linear_triton = lambda *a: (lambda r: (r[0] * 1.001, r[1]))(right_linear(*a))
        assert "residual" in fused_linear.check(cpu, torch.float32, fused_linear.CANDIDATES[0],
                                                cases=((False, True, False),))
    finally:
        fused_linear.norm_linear_triton = right_linear
    for bad in (lambda: fused_linear.linear_triton(torch.ones(2, 96), torch.ones(96, 80).t(), None,
                                                  fused_linear.CANDIDATES[0]),
                lambda: fused_linear._launch(torch.ones(1, 96), torch.ones(1, 96), None, 0.0, torch.ones(80, 96),
                                             None, False, fused_linear.CANDIDATES[0])):
        try:
            bad()
            raise AssertionError("a call the kernel cannot do was launched")
        except ValueError:
            pass
    right = fused.silu_mul_triton
    fused.silu_mul_triton = lambda gu: right(gu) * 1.05  # a kernel that is off is caught
    assert "silu_mul differs" in fused._self_check(cpu, torch.float32, 96, 80, 6, 2, 16, 1e-6)
    fused.silu_mul_triton = right
    fused.attend_triton = lambda *a: fused.attend_ref(*a) * 1.05
    assert "attend differs" in fused._attend_check(cpu, torch.float32, 96, 80, 6, 2, 16, 1e-6)
    ops = fused.Ops(True, "", False, "attend differs")  # what choose() makes of a failing attention alone
    assert ops.silu_mul is right and ops.attend is fused.attend_ref
    print("fused checks passed")


def test_fused_kernels_under_the_interpreter():
    """The Triton kernels, interpreted on the CPU, against the torch operations they replace, and a whole step on
    them against transformers' forward (fp32). In a subprocess: Triton must be imported with TRITON_INTERPRET set."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(tests.parent), str(tests), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", "import test_graphed; test_graphed._fused_checks()"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "fused checks passed" in done.stdout, done.stderr[-3000:]


def test_the_cpu_steps_use_the_references():
    assert not graphed.attach(tiny_qwen(1), "eager").graphed_forward.ops.fused


# ---- on a GPU ---------------------------------------------------------------------------------------------

def _cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


@pytest.mark.gpu
def test_graph_replays_give_the_eager_bits_on_gpu():
    """bf16 on the GPU: decoding through graphs gives exactly the eager static forward's logits (same kernels,
    same shapes) through ragged feeds, rollbacks and a row selection; in fp32, transformers' up to rounding."""
    _cuda()
    g = torch.Generator().manual_seed(11)
    prompts = [_tokens(g, n) for n in (12, 5, 21)]
    _, eager = _models("cuda", torch.bfloat16, "eager")
    _, replayed = _models("cuda", torch.bfloat16, "graphs")
    assert replayed.graphed_forward.ops.fused, replayed.graphed_forward.ops.why  # Triton is on the GPU image
    _drive(CausalLMDecoder(replayed, VOCAB, 3), CausalLMDecoder(eager, VOCAB, 3), prompts, seed=12,
           tol=dict(rtol=0, atol=0))
    # against transformers in fp32: in bf16, rounding once (the fused kernels) against rounding per operation
    # moved logits of these large-weight tiny models by more than any fixed tolerance would separate from a bug
    ref, replayed = _models("cuda", torch.float32, "graphs")
    _drive(CausalLMDecoder(replayed, VOCAB, 3), CausalLMDecoder(ref, VOCAB, 3), prompts, seed=12,
           tol=dict(rtol=1e-3, atol=1e-3))


@pytest.mark.gpu
@torch.inference_mode()
def test_graphs_are_captured_once_per_shape_on_gpu():
    _cuda()
    _, static = _models("cuda", torch.bfloat16, "graphs")
    g = torch.Generator().manual_seed(13)
    prompt = _tokens(g, 40)  # read eagerly: wider than MAX_GRAPH_WIDTH
    first = None
    for run in range(2):
        d = CausalLMDecoder(static, VOCAB, 1)
        d.prefill([prompt])
        for _ in range(3):
            d.forward([[1]], 1)
            d.forward([[1, 2, 3]], 3)
        workspace = d.cache.workspace
        assert set(workspace.graphs) == {(1, 1, 1, id(static.lm_head)), (1, 3, 3, id(static.lm_head))}
        first = first if first is not None else workspace.graphs
        assert workspace.graphs is first  # the second decoder replays the first one's graphs
        del d


@pytest.mark.gpu
@torch.inference_mode()
def test_projection_kernel_on_gpu():
    """fused_linear's kernel on the GPU, every config and dtype, at a real model's widths: it agrees with the
    cuBLAS composition within the dtype's rounding and a row's bits do not depend on the other rows; choosing
    times every stage's options and records them."""
    _cuda()
    for config in fused_linear.CANDIDATES:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            assert fused_linear.check(torch.device("cuda"), dtype, config, hidden=896, out=1152) is None, (config, dtype)
    _, static = _models("cuda", torch.bfloat16, "graphs")
    ops = static.graphed_forward.ops
    names = {"cublas", *(f"{c.block_n}x{c.block_k}" for c in fused_linear.CANDIDATES)}
    assert {s: set(t) for s, t in ops.linear_timings.items()} == dict.fromkeys(fused_linear.STAGES, names), \
        ops.linear_why
    assert all(t > 0 for times in ops.linear_timings.values() for t in times.values())
    # every projection on the kernel, graphed, against transformers' forward (fp32: rounding apart, the same)
    g = torch.Generator().manual_seed(31)
    prompts = [_tokens(g, n) for n in (12, 5, 21)]
    ref, forced = _models("cuda", torch.float32, "graphs")
    forced.graphed_forward.ops = fused.Ops(True, linear=dict.fromkeys(fused_linear.STAGES, fused_linear.CANDIDATES[0]))
    _drive(CausalLMDecoder(forced, VOCAB, 3), CausalLMDecoder(ref, VOCAB, 3), prompts, seed=32,
           tol=dict(rtol=1e-3, atol=1e-3))


def test_gpu_steps_prediction_and_the_bundled_alphas():
    """The GPU bench's prediction is Leviathan's expected speedup with measured costs (here: a free draft and a
    flat scoring curve give E[tokens] at the largest γ), and it reads α of every bundled article at both
    temperatures from docs/results."""
    from pathlib import Path

    from specviz.bench import gpu_steps
    from specviz.theory import expected_tokens

    speedup, gamma = gpu_steps.predicted_speedup(0.8, 0.0, {1: 1.0, 16: 1.0}, 0.0)
    assert gamma == 15 and speedup == pytest.approx(expected_tokens(0.8, 15))
    speedup, gamma = gpu_steps.predicted_speedup(0.8, 0.9, {1: 1.0, 2: 1.1, 4: 1.3, 16: 2.5}, 0.1)
    assert gamma == 1 and speedup == pytest.approx(1.8 / (0.9 + 1.1 + 0.1))  # t(2) measured, no interpolation
    alphas = gpu_steps.bundled_alphas(Path(__file__).resolve().parents[1] / "docs" / "results")
    assert len(alphas) == 6 and all(0.3 < a < 1.0 for a in alphas.values())


def test_gpu_steps_goals_from_one_modes_costs():
    """Issue 40's step goals from a mode's measured costs: ratios of the right shapes, BASS-8 as 4 draft steps +
    scoring 5 tokens + verification over a batched plain step, predictions filed under the mode; a mode
    without the 7B leaves its goals out."""
    from specviz.bench import gpu_steps

    def rows(one: float, **more: float) -> dict:
        return {"B1W1": {"ms": one}, **{k: {"ms": v} for k, v in more.items()}}

    costs = {"draft": {"m": rows(1.0, B8W1=1.2)},
             "target": {"m": rows(2.0, B1W6=2.2, B8W1=2.4, B8W5=2.6)},
             "target7b": {"m": rows(5.0, B1W6=5.5)}}
    out: dict = {}
    goals = gpu_steps.step_goals(costs, "m", {"B1G5": {"ms": 0.2}, "B8G4": {"ms": 0.3}}, {"a": 0.9}, out)
    assert goals["draft_over_target"] == pytest.approx(0.5) and goals["six_over_one"] == pytest.approx(1.1)
    assert goals["draft_over_target_7b"] == pytest.approx(0.2)
    assert goals["bass8_iteration_over_target_only"] == pytest.approx((4 * 1.2 + 2.6 + 0.3) / 2.4)
    assert set(out) == {"predicted", "predicted_7b"} and set(out["predicted_7b"]) == {"m"}
    assert goals["predicted_speedup_7b"] == out["predicted_7b"]["m"]["a"]["speedup"] > goals["predicted_speedup"]
    del costs["target7b"]
    assert "draft_over_target_7b" not in gpu_steps.step_goals(costs, "m", {}, {"a": 0.9}, {})
