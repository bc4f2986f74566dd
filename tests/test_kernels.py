"""Tests of the CUDA verification kernels: kernels/cuda/verify.cu and its CuPy wrapper (the kernels/cuda/ package).

What the CPU emulation (below; built with g++, no GPU) checks, and what it cannot:
- It runs the real verify.cu source on CPU tensors, one block at a time in a shuffled order, each CUDA
  thread a fiber. It checks: the decisions against `verify_tiled` (same n, same next token or a certified
  near-tie, same p(x), q(x), ratios); barrier uniformity (every __syncthreads / __syncthreads_or reached
  by all threads of the block at the same source line, none after an exit); warp primitives reached by
  all 32 lanes at the same line; that any block can be the last one of its row (shuffled order, the
  ticket logic); that the kernels leave their state zeroed; the argument lists against the kernels'
  parameter sizes; the documented errors; in-kernel top-k and top-p (both modes) against `standardize`,
  ties included (top-p keeps every token tied with a row's boundary value: `topp_ties_kept`), through the
  decisions and directly through each row's threshold and normalizer.
- It cannot check: blocks running concurrently (it runs them one after another, so races between blocks,
  the atomic tickets under contention and the __threadfence / volatile memory ordering are not
  exercised); CUDA's own expf / logf (the emulator uses the host libm, so bitwise agreement with torch's
  CUDA exp is untested); timing, occupancy, register use; CuPy's argument packing and NVRTC itself.
  Those need the GPU tests.

Everywhere (no GPU needed), besides the emulation:
- every .cu file compiles (nvcc for sm_90 with warnings as errors; else CuPy's NVRTC), and with NVRTC too
  where CuPy is installed (the path `available()` takes at run time);
- the package loads from this repository's kernels/cuda/ as `specviz_kernels` (never a PyPI `kernels`), imports
  without CuPy, and `available()` is False without a GPU, without raising;
- the planner sizes grids to fill the GPU, handles chunk sizes that do not divide V, and caches one plan
  per (shapes, dtypes, strides, settings), patching only pointers;
- the caches (plans, state buffers, stream handles, compiled functions) hand every thread the same entry
  when threads race on one key;
- `VerifyResult.host()` on the torch path, and the token-range check that the kernel path leaves to the
  kernels.

On a GPU (marker `gpu`; skipped only where torch sees no CUDA device; where it does, missing CuPy or an
NVRTC failure FAILS these tests, so a green GPU run means the kernels ran; install requirements-gpu.txt):
- agreement with `specviz.verify.tiled.verify_tiled` on the same CUDA tensors and uniforms, for
  V ∈ {7, 51865, 151936, 256000}, B ∈ {1, 8}, γ ∈ {1, 5, 20}, fp32/fp16/bf16, exact and sigmoid, and
  in-kernel top-k and top-p against `standardize` (top-p: both modes, several temperatures, with top-k,
  top_p from 1e-3 to 0.999), top-p bitwise deterministic;
- every kernel pick against a float64 inverse-CDF pick from the same uniform (`pick_is_certified`);
- the first emitted token follows p (chi-square at the sample size that detects TV 1%);
- NaN / +inf / all -inf logits and out-of-range drafted tokens raise errors naming the row;
- determinism, state reuse across shapes, expanded inputs, side streams, check=False / host=True;
- stress: hundreds of back-to-back launches with varying B, γ, V and chunk counts without a sync in
  between, and a producer on a side stream; `verify()` makes no sync torch can see besides its readback.

Rounding. The kernels compute every probability with torch's fp32 operations, so p(x), q(x) and the
ratios agree to the normalizer's last bits, but sums run in another order. A decision can therefore differ
where the torch path itself is within float32 noise of a boundary: a uniform within ~1e-6 of a ratio, or a
residual draw whose goal u·total lies within float32 noise of a token's CDF edge. Each kernel pick is
compared with the float64 inverse-CDF pick from the same uniform: they must be the same token, or the
goal must lie within `pick_tolerance` of the kernel token's float64 interval: a quarter of that token's
own mass, but never less than PICK_FLOOR = 1e-6 of the total (about 8 ulps of a float32 CDF value near
1; a CPU model of the kernels' float32 summation order at V = 151,936 puts the largest CDF error at
2.5e-7, so the floor leaves a 4x margin, uncalibrated on hardware; much less than the 1e-5 of mass the
earlier check allowed, which exceeds most tokens' mass at V = 151,936). Torch-vs-kernel next-token mismatches are certified the same
way for both picks, and agreement must reach 99.9% of rows where logits have a sparse support and 99%
where all V tokens are live.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import functools
import gc
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from specviz.verify import project_kernels

kernels = project_kernels()  # the project's own kernels/cuda/ (a PyPI package is also named `kernels`)
from specviz.config import SamplingConfig
from specviz.sampling import InvalidLogitsError, standardize
from specviz.verify import kernel_sampling
from specviz.verify.tiled import verify_tiled

REPO = Path(__file__).resolve().parents[1]
PICK_FLOOR = 1e-6  # of the residual's total: the least distance a float32 pick may miss its float64 interval by
PICK_REL = 0.25  # ... or this fraction of the smaller of the two tokens' masses, where that is more
RATIO_TOLERANCE = 1e-5  # relative distance of a uniform from the ratio within which a decision is a near-tie


# ----------------------------------------------------------------------------------------------------
# Shared helpers
# ----------------------------------------------------------------------------------------------------


def kernel_inputs(sampling: SamplingConfig, draft_logits: torch.Tensor, target_logits: torch.Tensor):
    """What verify_tiled feeds its tiles: raw logits with scale 1/T, or standardized logits with scale 1."""
    if sampling.temperature_only:
        return draft_logits, target_logits, 1.0 / sampling.temperature
    return standardize(draft_logits, sampling), standardize(target_logits, sampling), 1.0


def torch_path(mode, tokens, draft_logits, target_logits, sampling, lenience, alpha, beta, seed):
    """verify_tiled with a fresh generator, and the uniforms it drew, replayed in the documented order."""
    device = target_logits.device
    gen = torch.Generator(device=device).manual_seed(seed)
    state = gen.get_state()
    lengths = torch.full((tokens.shape[0],), tokens.shape[1], dtype=torch.long, device=device)
    ref = verify_tiled(tokens, draft_logits, target_logits, lengths, sampling, gen, lenience=lenience,
                       sigmoid=(alpha, beta) if mode == "sigmoid" else None)._asdict()
    replay = torch.Generator(device=device)
    replay.set_state(state)
    B, gamma = tokens.shape
    u = torch.rand((B, gamma), generator=replay, device=device, dtype=torch.float32)
    u_res = torch.rand((B,), generator=replay, device=device, dtype=torch.float32)
    assert torch.equal(u, ref["uniforms"]), "verify_tiled no longer draws u = rand((B, γ)) first"
    return ref, u, u_res


def _probs64(mode: str, z: torch.Tensor, scale: float, alpha: float, beta: float) -> torch.Tensor:
    z = z.double() * scale
    if mode == "sigmoid":
        return torch.sigmoid((z - alpha) / (beta - alpha))
    return torch.softmax(z, dim=-1)


def residual64(mode, zp_row, zq_row, n, gamma, scale, lenience, alpha, beta) -> torch.Tensor:
    """The float64 residual row n samples: max(0, p_n - w·q_n) (w = l on a rejection, 0 for the bonus), or
    p_n alone when that residual is empty, as tiled.py falls back."""
    p = _probs64(mode, zp_row, scale, alpha, beta)
    q = _probs64(mode, zq_row, scale, alpha, beta)
    w = lenience if n < gamma else 0.0
    r = torch.clamp(p - w * q, min=0)
    if float(r.sum()) <= 1e-9 * float(p.sum()):
        r = p
    return r / r.sum()


def pick64(r: torch.Tensor, u_res: float) -> int:
    """Inverse-CDF pick on a normalized float64 residual r [V]: tiled.py's _scan_pick in float64."""
    cdf = torch.cumsum(r, 0)
    idx = int(torch.searchsorted(cdf, torch.tensor([float(u_res)], dtype=torch.float64, device=r.device), right=True))
    return min(idx, int(torch.nonzero(r > 0).max()))


def pick_tolerance(r: torch.Tensor, a: int, b: int) -> float:
    """How far (in normalized mass) a float32 goal may sit from token a's float64 interval when the float64
    pick is b: a quarter of the smaller token's mass, never below PICK_FLOOR (float32 summation noise)."""
    return max(PICK_REL * min(float(r[a]), float(r[b])), PICK_FLOOR)


def miss_distance(r: torch.Tensor, token: int, u_res: float) -> float:
    """Distance of the goal u_res from token's interval on the float64 CDF of r (0 when inside)."""
    cdf = torch.cumsum(r, 0)
    lo = float(cdf[token - 1]) if token > 0 else 0.0
    hi = float(cdf[token])
    return max(lo - float(u_res), float(u_res) - hi, 0.0)


def pick_is_certified(mode, zp_row, zq_row, n, gamma, scale, lenience, alpha, beta, u_res, token) -> str | None:
    """None when `token` (a float32 pick) is the float64 inverse-CDF pick from the same uniform, or misses it
    by at most pick_tolerance; else a description of the miss."""
    r = residual64(mode, zp_row, zq_row, n, gamma, scale, lenience, alpha, beta)
    ref = pick64(r, u_res)
    if token == ref:
        return None
    if not 0 <= token < r.numel() or float(r[token]) <= 0:
        return f"token {token} has no residual mass (float64 pick {ref})"
    d, tol = miss_distance(r, token, u_res), pick_tolerance(r, token, ref)
    if d <= tol:
        return None
    return (f"token {token} (mass {float(r[token]):.3g}) vs float64 pick {ref} (mass {float(r[ref]):.3g}): the goal "
            f"misses its interval by {d:.3g} > {tol:.3g}")


def near_tie_token(mode, zp_row, zq_row, n, gamma, scale, lenience, alpha, beta, u_res, tokens) -> bool:
    """True when every token in `tokens` is certified against the float64 pick (`pick_is_certified`): the row
    is a near-tie that float32 rounding may decide either way."""
    return all(pick_is_certified(mode, zp_row, zq_row, n, gamma, scale, lenience, alpha, beta, u_res, t) is None
               for t in tokens)


def compare_rows(mode, out, ref, tokens, dl, tl, u, u_res, scale, lenience, alpha, beta):
    """Row-by-row comparison of a kernel result with verify_tiled's. Returns (mismatched next_token rows,
    rows compared, problems): a problem is a difference that is not a certified near-tie."""
    problems = []
    B, gamma = tokens.shape
    for key in ("p_draft", "q_draft", "accept_prob"):
        a, b = out[key].float(), ref[key].float()
        if not torch.allclose(a, b, rtol=1e-5, atol=1e-37, equal_nan=True):
            problems.append(f"{key} differs by up to {float((a - b).abs().nan_to_num().max()):.3g}")
    if not torch.equal(out["uniforms"].to(u.device), u):
        problems.append("uniforms are not the ones passed in")
    n_k = out["n_accepted"].cpu().tolist()
    n_t = ref["n_accepted"].cpu().tolist()
    tok_k = out["next_token"].cpu().tolist()
    tok_t = ref["next_token"].cpu().tolist()
    ratio = (ref["p_draft"] / (lenience * ref["q_draft"])).double().cpu()
    mismatches = compared = 0
    for b in range(B):
        if n_k[b] != n_t[b]:
            j = min(n_k[b], n_t[b])  # the first position decided differently
            r, uj = float(ratio[b, j]), float(u[b, j])
            if not abs(uj - r) <= RATIO_TOLERANCE * max(r, 1e-30):
                problems.append(f"row {b}: n {n_k[b]} vs torch {n_t[b]} (u={uj:.9g}, ratio={r:.9g}: not a near-tie)")
            continue
        compared += 1
        n, qn = n_k[b], min(n_k[b], gamma - 1)
        # every kernel pick against the float64 pick from the same uniform, not only where torch differs
        miss = pick_is_certified(mode, tl[b, n], dl[b, qn], n, gamma, scale, lenience, alpha, beta, u_res[b], tok_k[b])
        if miss:
            problems.append(f"row {b} (n={n}): kernel {miss}")
        if tok_k[b] != tok_t[b]:
            mismatches += 1
            miss = pick_is_certified(mode, tl[b, n], dl[b, qn], n, gamma, scale, lenience, alpha, beta, u_res[b],
                                     tok_t[b])
            if miss:
                problems.append(f"row {b}: next_token {tok_k[b]} vs torch {tok_t[b]} (n={n}): torch {miss}")
    return mismatches, compared, problems


# ----------------------------------------------------------------------------------------------------
# Everywhere: compiling, importing, availability, planning
# ----------------------------------------------------------------------------------------------------


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found is None and Path("/usr/local/cuda/bin/nvcc").exists():
        found = "/usr/local/cuda/bin/nvcc"
    return found


def _nvrtc_available() -> bool:
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
        return True
    except Exception:
        return False


def test_sources_exist():
    assert [p.name for p in kernels.source_files()] == ["verify.cu"]
    text = kernels.source_files()[0].read_text()
    for name in kernels.ENTRY_POINTS:
        suffix = name.rsplit("_", 1)[1]
        assert f"SV_ENTRY_POINTS({suffix}," in text, name


def test_cuda_sources_compile():
    """nvcc (sm_90 cubin, warnings as errors), or NVRTC through CuPy where there is no nvcc."""
    nvcc = _nvcc()
    if nvcc is not None:
        kernels.compile_check(nvcc)
    elif _nvrtc_available():
        kernels.nvrtc_check()
    else:
        pytest.skip("neither nvcc nor CuPy's NVRTC is available on this machine")


def test_cuda_sources_compile_with_nvrtc():
    """NVRTC has no implicit CUDA headers: this is the compile `available()` does at run time. Where torch
    sees a CUDA device, a missing CuPy fails this test instead of skipping it."""
    if not _nvrtc_available():
        if torch.cuda.is_available():
            pytest.fail("a CUDA device is present but CuPy's NVRTC is not importable: pip install -r requirements-gpu.txt")
        pytest.skip("CuPy (with NVRTC) is not installed")
    kernels.nvrtc_check()


def test_compile_check_reports_compiler_errors(tmp_path, monkeypatch):
    if _nvcc() is None:
        pytest.skip("nvcc is not available")
    broken = tmp_path / "broken.cu"
    broken.write_text("extern \"C\" __global__ void k(float* x) { x[0] = undefined_name; }\n")
    monkeypatch.setattr(kernels.build, "source_files", lambda: [broken])
    with pytest.raises(RuntimeError, match="undefined_name"):
        kernels.compile_check(_nvcc())


def test_import_without_cupy():
    """The package imports and reports unavailability when CuPy cannot be imported (even on a GPU machine)."""
    code = (
        "import sys; sys.modules['cupy'] = None; sys.modules['cupy_backends'] = None\n"
        "from specviz.verify import project_kernels; kernels = project_kernels()\n"
        "assert kernels.available() is False, kernels.unavailable_reason()\n"
        "print('reason:', kernels.unavailable_reason())\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "reason: " in proc.stdout and proc.stdout.strip() != "reason:"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_not_available_without_gpu():
    assert kernels.available() is False
    assert kernels.unavailable_reason()
    with pytest.raises(ValueError, match="CUDA tensors"):
        kernels.verify_cuda("exact", torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, 4),
                            torch.zeros(1, 2, 4), torch.zeros(1, 1), torch.zeros(1))


@pytest.mark.parametrize("vocab", [7, 51865, 151936, 256000])
@pytest.mark.parametrize("batch,gamma", [(1, 1), (1, 5), (8, 20)])
def test_plan_fills_the_gpu(vocab, batch, gamma):
    """Launch 1 spreads over (chunks, 2γ+1 rows, B), not γ blocks; chunks need not divide V."""
    sms = 132
    stats, residual = kernels.plan_chunks("exact", batch, gamma, vocab, sms)
    rows = 2 * gamma + 1
    k1, k2 = -(-vocab // stats), -(-vocab // residual)
    assert 1024 <= residual <= 4096 and 2048 <= stats <= 32768
    if vocab * rows * batch >= 4 * sms * 2048:
        assert k1 * rows * batch >= 2 * sms  # at least ~2 blocks per SM for the bandwidth-bound pass
    if vocab * batch >= sms * 1024:
        assert k2 * batch >= sms
    _, sig = kernels.plan_chunks("sigmoid", batch, gamma, vocab, sms)
    if vocab * rows * batch >= 4 * sms * 1024:
        assert -(-vocab // sig) * rows * batch >= 2 * sms


def _cpu_case(B=2, gamma=3, V=50, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    tl = (2 * torch.randn(B, gamma + 1, V, generator=g)).to(dtype)
    dl = (tl[:, :gamma].float() + torch.randn(B, gamma, V, generator=g)).to(dtype)
    tokens = torch.randint(0, V, (B, gamma), generator=g)
    u = torch.rand(B, gamma, generator=g)
    u_res = torch.rand(B, generator=g)
    return tokens, dl, tl, u, u_res


def _prepare(mode, draft_tokens, draft_logits, target_logits, u, u_res, *, state, sms=132, **settings):
    """plan._prepare of these tensors and settings: the device-agnostic half of `launch`."""
    spec = kernels.LaunchSpec.of(mode, draft_tokens, draft_logits, target_logits, u, u_res, sms=sms, **settings)
    return kernels.plan._prepare(spec, draft_tokens, draft_logits, target_logits, u, u_res, state)


def test_prepare_grids_and_buffers():
    """The device-agnostic half of verify_cuda on CPU tensors: grids, chunking, input validation."""
    tokens, dl, tl, u, ur = _cpu_case(B=3, gamma=4, V=1000)
    state = torch.zeros(kernels.state_size(3, 4), dtype=torch.int32)
    prep = _prepare("exact", tokens, dl, tl, u, ur, scale=1.0, lenience=1.0, sigmoid_alpha=-1e4,
                    sigmoid_beta=1e4, state=state, sms=132, stats_chunk=300, residual_chunk=333)
    (n1, g1, a1), (n2, g2, a2) = prep.launches
    assert (n1, g1) == ("sv_exact_stats_f32", (4, 9, 3))  # ceil(1000/300) chunks × (2γ+1) rows × B
    assert (n2, g2) == ("sv_exact_resample_f32", (4, 3, 1))  # ceil(1000/333) chunks × B
    assert len(a1) == 17 and len(a2) == 25
    assert a1[11] == 0 and a1[12] == np.float32(1.0) and a2[-2] == 0  # no top-k, no top-p, no thresholds
    prep = _prepare("sigmoid", tokens, dl.half(), tl.half(), u, ur, scale=1.0, lenience=1.0,
                    sigmoid_alpha=-1.0, sigmoid_beta=1.0, state=state, sms=132, residual_chunk=999)
    ((name, grid, args),) = prep.launches
    assert (name, grid, len(args)) == ("sv_sigmoid_f16", (2, 9, 3), 23)
    assert args[-1] == 0  # no thresholds
    # top-p: launch 1 gets fp32(top_p) and finds thresholds; launch 2 reads them
    prep = _prepare("exact", tokens, dl, tl, u, ur, scale=1.0, lenience=1.0, sigmoid_alpha=-1e4,
                    sigmoid_beta=1e4, state=state, sms=132, stats_chunk=300, residual_chunk=333, top_p=0.9)
    (n1, _, a1), (_, _, a2) = prep.launches
    assert n1 == "sv_exact_stats_topp_f32"
    assert a1[12] == np.float32(0.9) and a1[12].dtype == np.float32 and a1[15] != 0 and a2[-2] == 1
    prep = _prepare("exact", tokens, dl, tl, u, ur, scale=1.0, lenience=1.0, sigmoid_alpha=-1e4,
                    sigmoid_beta=1e4, state=state, sms=132, stats_chunk=300, residual_chunk=333, topk=7)
    assert prep.launches[0][0] == "sv_exact_stats_topk_f32" and prep.launches[0][2][12] == np.float32(1.0)
    # sigmoid with top-k / top-p: launch 1 of exact for the thresholds, then the sigmoid launch reading them
    prep = _prepare("sigmoid", tokens, dl.half(), tl.half(), u, ur, scale=1.0, lenience=1.0,
                    sigmoid_alpha=-1.0, sigmoid_beta=1.0, state=state, sms=132, stats_chunk=300,
                    residual_chunk=999, topk=5, top_p=0.5)
    (n1, g1, a1), (n2, g2, a2) = prep.launches
    assert (n1, g1, n2, g2) == ("sv_exact_stats_topp_f16", (4, 9, 3), "sv_sigmoid_filtered_f16", (2, 9, 3))
    assert a1[11] == 5 and a1[15] == a2[-1] != 0  # the same rowstat
    bad = dict(scale=1.0, lenience=1.0, sigmoid_alpha=-1e4, sigmoid_beta=1e4, state=state, sms=132)
    with pytest.raises(ValueError, match="γ <="):
        _prepare("exact", torch.zeros(1, 300, dtype=torch.long), torch.zeros(1, 300, 5),
                 torch.zeros(1, 301, 5), torch.zeros(1, 300), torch.zeros(1), **bad)
    with pytest.raises(ValueError, match="lenience"):
        _prepare("exact", tokens, dl, tl, u, ur, **{**bad, "lenience": 0.0})
    with pytest.raises(ValueError, match="unknown CUDA verification mode"):
        _prepare("baseline", tokens, dl, tl, u, ur, **bad)
    with pytest.raises(ValueError, match="target_logits must be"):
        _prepare("exact", tokens, dl, tl[:, :3], u, ur, **bad)
    with pytest.raises(ValueError, match="in-kernel top-k"):
        _prepare("sigmoid", tokens, dl, tl, u, ur, **bad, topk=kernels.MAX_TOPK + 1)
    for top_p in (0.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="top_p must be in"):
            _prepare("exact", tokens, dl, tl, u, ur, **bad, top_p=top_p)


def test_plan_is_cached_and_only_pointers_change():
    """One plan per (shapes, dtypes, strides, settings): a second call with other tensors of the same layout
    reuses it and differs from the first only in the pointer arguments."""
    kernels.plan._plans.clear()
    state = torch.zeros(kernels.state_size(3, 4), dtype=torch.int32)
    opts = dict(scale=1.0, lenience=1.0, sigmoid_alpha=-1e4, sigmoid_beta=1e4, state=state, sms=132)
    a = _cpu_case(B=3, gamma=4, V=1000, seed=1)
    b = _cpu_case(B=3, gamma=4, V=1000, seed=2)
    pa = _prepare("exact", *a, **opts, topk=10)
    plan = next(iter(kernels.plan._plans.values()))
    pb = _prepare("exact", *b, **opts, topk=10)
    assert len(kernels.plan._plans) == 1 and next(iter(kernels.plan._plans.values())) is plan
    for (na, ga, xa), (nb, gb, xb), (_, _, _, slots) in zip(pa.launches, pb.launches, plan.launches):
        assert (na, ga) == (nb, gb)
        pointer_args = {i for i, _, _ in slots}
        for i, (va, vb) in enumerate(zip(xa, xb)):
            if i not in pointer_args:
                assert type(va) is type(vb) and va == vb, (na, i)
        assert xa[0] == a[2].data_ptr() and xb[0] == b[2].data_ptr()  # target logits
    _prepare("exact", *a, **{**opts, "lenience": 0.5}, topk=10)  # another setting: another plan
    _prepare("exact", a[0], a[1], a[2].transpose(0, 1).contiguous().transpose(0, 1), *a[3:], **opts, topk=10)
    _prepare("exact", *a, **opts, topk=10, top_p=0.9)
    assert len(kernels.plan._plans) == 4


def test_launch_spec_is_the_plan_key():
    """LaunchSpec: frozen and hashable; equal for two calls with equal layouts and settings (one plan entry),
    different when a setting (top_p) or a stride changes (another entry)."""
    spec_of = functools.partial(kernels.LaunchSpec.of, "exact", sms=132, scale=0.5, topk=10)
    a = _cpu_case(B=3, gamma=4, V=1000, seed=1)
    b = _cpu_case(B=3, gamma=4, V=1000, seed=2)
    spec = spec_of(*a)
    assert (spec.batch, spec.gamma, spec.vocab, spec.target_strides, spec.target_dtype) == (
        3, 4, 1000, (5000, 1000, 1), torch.float32)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.top_p = 0.5
    assert spec_of(*b) == spec and hash(spec_of(*b)) == hash(spec)
    assert spec_of(*a, top_p=0.9) != spec and spec_of(*a, top_p=0.9) == spec_of(*b, top_p=0.9)
    transposed = a[2].transpose(0, 1).contiguous().transpose(0, 1)
    assert spec_of(a[0], a[1], transposed, *a[3:]) != spec
    with pytest.raises(TypeError):
        spec_of(*a, top_q=0.9)
    with pytest.raises(ValueError, match="u must be"):
        spec_of(*a[:4], a[4][:2])

    kernels.plan._plans.clear()
    plan = kernels.plan._cached_plan(spec)
    assert kernels.plan._cached_plan(spec_of(*b)) is plan and list(kernels.plan._plans) == [spec]
    assert kernels.plan._cached_plan(spec_of(*b, top_p=0.9)) is not plan and len(kernels.plan._plans) == 2


def test_converted_logits_are_read_contiguous():
    """Mixed dtypes go through fp32 and a strided last dimension through a copy: the kernels read contiguous
    copies, and the plan's stride arguments are theirs."""
    tokens, dl, tl, u, ur = _cpu_case(B=2, gamma=3, V=50, seed=3)
    state = torch.zeros(kernels.state_size(2, 3), dtype=torch.int32)
    permuted = tl.transpose(1, 2).contiguous().transpose(1, 2).half()  # fp16, last dimension strided
    strided = torch.zeros(2, 3, 100).index_copy_(2, torch.arange(0, 100, 2), dl)[..., ::2]
    for draft, target in ((dl, permuted), (strided, tl), (dl.bfloat16(), tl.half())):
        prep = _prepare("exact", tokens, draft, target, u, ur, state=state)
        name, _, args = prep.launches[0]
        target_read, draft_read = prep.keep[:2]
        assert name == "sv_exact_stats_f32"
        for read, given in ((target_read, target), (draft_read, draft)):
            assert read.is_contiguous() and torch.equal(read.float(), given.float())
        assert args[0] == target_read.data_ptr() and args[3] == draft_read.data_ptr()
        assert (args[1], args[2], args[4], args[5]) == (4 * 50, 50, 3 * 50, 50)


def test_loads_this_repositorys_kernels_and_never_a_package_named_kernels(tmp_path):
    """project_kernels() loads kernels/cuda/ of this repository as `specviz_kernels`, submodules included, even
    when a package named `kernels` comes first on sys.path and the working directory is elsewhere."""
    decoy = tmp_path / "site" / "kernels"
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text("raise ImportError('the decoy kernels package was imported')\n")
    (decoy / "plan.py").write_text("raise ImportError('the decoy kernels.plan was imported')\n")
    (decoy / "cuda").mkdir()
    (decoy / "cuda" / "__init__.py").write_text("raise ImportError('the decoy kernels.cuda was imported')\n")
    code = (
        "import sys\n"
        "from specviz.verify import project_kernels\n"
        "k = project_kernels()\n"
        "assert project_kernels() is k and k.__name__ == 'specviz_kernels'\n"
        "k.available(); k.plan_chunks('exact', 1, 1, 100, 4)\n"
        "assert not [n for n in sys.modules if n.split('.')[0] == 'kernels'], sys.modules.get('kernels')\n"
        "for name, m in sorted(sys.modules.items()):\n"
        "    if name.split('.')[0] == 'specviz_kernels':\n"
        "        print(name, m.__file__)\n"
    )
    path = os.pathsep.join([str(tmp_path / "site"), str(REPO), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=dict(os.environ, PYTHONPATH=path),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    loaded = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert {"specviz_kernels", "specviz_kernels.plan", "specviz_kernels.launcher"} <= loaded.keys()
    for name, file in loaded.items():
        assert Path(file).parent == REPO / "kernels" / "cuda", (name, file)
    # In this process too: every submodule the package holds comes from kernels/cuda/ here.
    assert kernels.__name__ == "specviz_kernels" and Path(kernels.__file__) == REPO / "kernels" / "cuda" / "__init__.py"
    for sub in ("sources", "build", "plan", "outputs", "launcher"):
        module = getattr(kernels, sub)
        assert module.__name__ == f"specviz_kernels.{sub}" and Path(module.__file__).parent == REPO / "kernels" / "cuda"


def _race(n_threads: int, work) -> list:
    """work(i) in n_threads threads released together; their results, in thread order."""
    barrier = threading.Barrier(n_threads)

    def run(i):
        barrier.wait()
        return work(i)

    with concurrent.futures.ThreadPoolExecutor(n_threads) as pool:
        return list(pool.map(run, range(n_threads)))


def test_plan_cache_is_shared_across_threads(monkeypatch):
    """Threads racing on the same keys all get the one cached plan per key; with a tiny cache that keeps
    starting over, every thread still gets a plan of its own key."""
    plan_module = kernels.plan
    plan_module._plans.clear()
    state = torch.zeros(kernels.state_size(3, 4), dtype=torch.int32)
    opts = dict(scale=1.0, lenience=1.0, sigmoid_alpha=-1e4, sigmoid_beta=1e4, sms=132)
    cases = [_cpu_case(B=3, gamma=4, V=1000, seed=1), _cpu_case(B=2, gamma=3, V=700, seed=2)]

    def plan_of(i):
        return plan_module._cached_plan(kernels.LaunchSpec.of("exact", *cases[i % 2], **opts, topk=10 * (i % 3)))

    def rows_and_batch(plan):  # of launch 1's grid (K1, 2γ+1, B): which case the plan is for
        return plan.launches[0][1][1:]

    plans = _race(12, plan_of)
    assert len(plan_module._plans) == 6
    for i, plan in enumerate(plans):
        assert all(plan is other for j, other in enumerate(plans) if j % 6 == i % 6)
        assert rows_and_batch(plan) == ((9, 3), (7, 2))[i % 2]

    monkeypatch.setattr(plan_module, "_MAX_PLANS", 2)
    for _ in range(5):
        plan_module._plans.clear()
        plans = _race(12, plan_of)
        assert len(plan_module._plans) <= 2
        assert [rows_and_batch(p) for p in plans] == [((9, 3), (7, 2))[i % 2] for i in range(12)]
    prep = _prepare("exact", *cases[0], **opts, state=state, topk=10)
    assert prep.launches[0][2][11] == 10  # a plan built under contention still launches with its settings


def test_state_and_stream_caches_are_shared_across_threads(monkeypatch):
    """The state buffers (CPU tensors stand in) and CuPy stream handles (a fake CuPy) per (device, stream):
    every thread gets a zero state at least as large as it asked for, and one handle per stream."""
    launcher = kernels.launcher
    monkeypatch.setattr(launcher, "_states", {})
    monkeypatch.setattr(launcher, "_streams", {})
    cpu = torch.device("cpu")
    sizes = [100 * (i + 1) for i in range(8)] + [5000] * 4
    states = _race(len(sizes), lambda i: launcher._state(cpu, 7, sizes[i]))
    for size, state in zip(sizes, states):
        assert state.dtype == torch.int32 and state.numel() >= size and not state.any()
    assert launcher._states[(None, 7)].numel() >= 5000

    made = []

    class FakeStream:
        @staticmethod
        def from_external(stream):
            made.append(stream.cuda_stream)
            time.sleep(0.01)  # a slow wrap, to let racing threads meet
            return object()

    fake_cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(Stream=FakeStream))
    streams = [types.SimpleNamespace(device=types.SimpleNamespace(index=0), cuda_stream=i % 3) for i in range(9)]
    handles = _race(9, lambda i: launcher._cupy_stream(fake_cupy, streams[i]))
    assert sorted(made) == [0, 1, 2]
    for i, handle in enumerate(handles):
        assert handle is handles[i % 3]


def test_compile_happens_once_per_device_across_threads(monkeypatch):
    build = kernels.build
    monkeypatch.setattr(build, "_compiled", {})
    calls = []

    def fake_compile(device_index):
        calls.append(device_index)
        time.sleep(0.01)
        return {"device": device_index}

    monkeypatch.setattr(build, "_compile", fake_compile)
    got = _race(8, lambda i: build._functions(i % 2))
    assert sorted(calls) == [0, 1]
    assert all(g is got[i % 2] for i, g in enumerate(got))


def test_host_lists_match_views():
    raw = torch.arange(7 * 2 * 8 + 16 * 2 * 3, dtype=torch.uint8)
    views, lists = kernels.outputs._views(raw, 2, 3), kernels.host_lists(raw.numpy(), 2, 3)
    assert sorted(views) == sorted(lists)
    for k in views:
        assert views[k].tolist() == lists[k], k


def test_sigmoid_and_topk_factors_are_torch_cuda_reciprocals():
    """torch on CUDA turns `t / s` (s a Python float) into t · (1.0f / float(s)): fp32 reciprocal of fp32(s)."""
    for a, b in ((-1e4, 1e4), (-8.0, 8.0), (-3.0, 7.0), (-1e3, 1e3)):
        assert kernels.sigmoid_inv_den(a, b) == np.float32(1) / np.float32(b - a)
        assert kernels.sigmoid_inv_den(a, b).dtype == np.float32
    assert kernels.topk_scale(0.7) == np.float32(1) / np.float32(0.7)
    assert kernels.topk_scale(1.1) != np.float32(1 / 1.1)  # the two roundings differ here: the choice matters


def test_verify_result_host_on_torch_path():
    """host(): one stacked readback on the torch path, equal to the tensors; emitted() uses it."""
    from specviz.verify import VerifyHost, verify

    tokens, dl, tl, _, _ = _cpu_case(B=3, gamma=4, V=300, seed=4)
    for mode in ("baseline", "exact", "sigmoid"):
        res = verify(mode, tokens, dl, tl, SamplingConfig(temperature=0.9), torch.Generator().manual_seed(0),
                     sigmoid_alpha=-5.0, sigmoid_beta=5.0)
        h = res.host()
        assert isinstance(h, VerifyHost) and res.host() is h
        assert h.n_accepted == res.n_accepted.tolist() and h.next_token == res.next_token.tolist()
        for k in ("accept_prob", "uniforms", "p_draft", "q_draft"):
            assert getattr(h, k) == getattr(res, k).float().tolist(), (mode, k)
        n = h.n_accepted[1]
        assert res.emitted(tokens, 1) == tokens[1, :n].tolist() + [h.next_token[1]]


def test_token_range_still_checked_on_torch_path():
    from specviz.verify import verify

    tokens, dl, tl, _, _ = _cpu_case(B=2, gamma=2, V=50)
    for bad in (-1, 50):
        t = tokens.clone()
        t[1, 1] = bad
        with pytest.raises(ValueError, match=r"draft_tokens must lie in \[0, 50\)"):
            verify("exact", t, dl, tl, SamplingConfig(temperature=1.0))


def test_kernel_sampling_routes():
    from specviz.verify import KernelSampling, kernel_sampling

    def route(mode, vocab=100, **kw):
        return tuple(kernel_sampling(mode, SamplingConfig(**kw), vocab))

    assert route("exact", temperature=0.5) == ("scale", 2.0, 0, 1.0)
    how, scale, k, top_p = kernel_sampling("exact", SamplingConfig(temperature=0.7, top_k=20), 100)
    assert (how, k, top_p) == ("filter", 20, 1.0) and np.float32(scale) == kernels.topk_scale(0.7)
    assert route("exact", temperature=1.0, top_k=20) == ("filter", 1.0, 20, 1.0)
    assert route("exact", temperature=1.0, top_k=100) == ("scale", 1.0, 0, 1.0)  # k >= V keeps everything
    assert route("exact", temperature=0.8, top_k=100) == ("scale", float(kernels.topk_scale(0.8)), 0, 1.0)
    # top-p, with or without top-k, in both modes, goes to the kernels
    for mode in ("exact", "sigmoid"):
        assert route(mode, temperature=1.0, top_k=20) == ("filter", 1.0, 20, 1.0)
        assert route(mode, temperature=1.0, top_p=0.9) == ("filter", 1.0, 0, 0.9)
        assert route(mode, temperature=1.3, top_k=7, top_p=0.5) == ("filter", float(kernels.topk_scale(1.3)), 7, 0.5)
        assert route(mode, temperature=1.0, top_k=100, top_p=0.5) == ("filter", 1.0, 0, 0.5)  # k >= V: top-p only
        assert route(mode, temperature=1.0, top_k=kernels.MAX_TOPK, top_p=0.5, vocab=10**6)[:3] == (
            "filter", 1.0, kernels.MAX_TOPK)
        # only k > MAX_TOPK is standardized by torch (with any top-p)
        for top_p in (1.0, 0.9):
            assert route(mode, temperature=1.0, top_k=kernels.MAX_TOPK + 1, top_p=top_p, vocab=10**6) == (
                "standardize", 1.0, 0, 1.0)
    assert isinstance(kernel_sampling("exact", SamplingConfig(temperature=0.5), 100), KernelSampling)


def test_kernel_args():
    """kernel_args hands raw logits and the filters to the kernels and draws u then u_res from the generator;
    only top_k above MAX_TOPK is standardized by torch first."""
    from specviz.verify import kernel_args

    tokens, dl, tl, _, _ = _cpu_case(B=2, gamma=3, V=50, seed=7)
    sampling = SamplingConfig(temperature=0.8, top_k=10, top_p=0.7)
    args = kernel_args("exact", tokens, dl, tl, sampling, torch.Generator().manual_seed(3))
    assert args.draft_logits is dl and args.target_logits is tl
    assert args.options == dict(scale=float(kernels.topk_scale(0.8)), topk=10, top_p=0.7)
    g = torch.Generator().manual_seed(3)
    assert torch.equal(args.u, torch.rand((2, 3), generator=g))
    assert torch.equal(args.u_res, torch.rand((2,), generator=g))
    wide = SamplingConfig(temperature=1.0, top_k=kernels.MAX_TOPK + 1, top_p=0.7)
    tokens, dl, tl, _, _ = _cpu_case(B=1, gamma=2, V=kernels.MAX_TOPK + 50, seed=9)
    args = kernel_args("exact", tokens, dl, tl, wide, None)
    assert torch.equal(args.draft_logits, standardize(dl, wide)) and args.options == dict(scale=1.0, topk=0, top_p=1.0)


def _fake_launched(draft_tokens: torch.Tensor, **extra) -> "kernels.Launched":
    """A Launched of zero outputs (next_token 1) for draft_tokens [B, γ], as a fake launch returns it."""
    B, gamma = draft_tokens.shape
    outputs = dict(n_accepted=torch.zeros(B, dtype=torch.long), next_token=torch.ones(B, dtype=torch.long),
                   **{k: torch.zeros(B, gamma) for k in ("accept_prob", "uniforms", "p_draft", "q_draft")})
    return kernels.Launched(outputs, {k: v.tolist() for k, v in outputs.items()}, **extra)


def test_verify_passes_the_filters_to_the_kernels(monkeypatch):
    """verify's kernel path (entered directly: no GPU here) hands kernel_sampling's settings and the generator
    to launch_sampled, which draws the uniforms itself (graphed where it can), and builds its result from the
    readback; only top_k above MAX_TOPK goes through kernel_args (standardize, uniforms drawn there) and launch."""
    from specviz.verify.cuda import verify_kernels

    tokens, dl, tl, _, _ = _cpu_case(B=2, gamma=3, V=50, seed=8)
    seen = {}

    def fake_sampled(mode, draft_tokens, draft_logits, target_logits, generator, **kw):
        seen.update(kw, via="launch_sampled", mode=mode, draft_logits=draft_logits, generator=generator)
        return _fake_launched(draft_tokens)

    def fake_launch(mode, draft_tokens, draft_logits, target_logits, u, u_res, **kw):
        seen.update(kw, via="launch", mode=mode, draft_logits=draft_logits, u=u)
        return _fake_launched(draft_tokens)

    monkeypatch.setattr(kernels, "launch_sampled", fake_sampled)
    monkeypatch.setattr(kernels, "launch", fake_launch)
    sampling = SamplingConfig(temperature=1.2, top_p=0.8)
    gen = torch.Generator().manual_seed(0)
    res = verify_kernels("sigmoid", tokens, dl, tl, sampling, gen, 0.9, -3.0, 3.0)
    assert seen["via"] == "launch_sampled" and seen["generator"] is gen
    assert seen["mode"] == "sigmoid" and seen["draft_logits"] is dl
    assert (seen["topk"], seen["top_p"], seen["lenience"]) == (0, 0.8, 0.9)
    assert seen["scale"] == float(kernels.topk_scale(1.2))
    assert (seen["sigmoid_alpha"], seen["sigmoid_beta"]) == (-3.0, 3.0)
    assert res.host().next_token == [1, 1]

    wide = SamplingConfig(temperature=1.0, top_k=kernels.MAX_TOPK + 1)
    tokens, dl, tl, _, _ = _cpu_case(B=1, gamma=2, V=kernels.MAX_TOPK + 50, seed=9)
    verify_kernels("exact", tokens, dl, tl, wide, torch.Generator().manual_seed(4), 1.0, -1e4, 1e4)
    assert seen["via"] == "launch" and torch.equal(seen["draft_logits"], standardize(dl, wide))
    assert torch.equal(seen["u"], torch.rand((1, 2), generator=torch.Generator().manual_seed(4)))
    assert (seen["topk"], seen["top_p"], seen["scale"]) == (0, 1.0, 1.0)


def test_graph_cache_keys_and_evicts_least_recently_used():
    """One capture per (layout, instance); a hit captures nothing and counts as a use; beyond `capacity` the
    least recently used graph goes, and a call with its key captures it anew."""
    cache = kernels.GraphCache(capacity=3)
    made = []

    def capture(tag):
        return lambda: made.append(tag) or tag

    assert cache.get("L", 1, capture("a")) == "a"
    assert cache.get("L", 1, capture("never")) == "a"
    assert cache.get("L", 2, capture("b")) == "b"  # same layout, another generator: another graph
    assert cache.get("M", 1, capture("c")) == "c"  # same generator, other layout: another graph
    assert cache.get("L", 1, capture("never")) == "a"  # used again: now the most recent
    assert cache.get("N", 1, capture("d")) == "d"  # evicts ("L", 2), the least recently used
    assert cache.keys() == [("M", 1), ("L", 1), ("N", 1)]
    assert cache.peek("L", 2) is None and cache.peek("M", 1) == "c"  # peek: no capture, no use
    assert cache.keys() == [("M", 1), ("L", 1), ("N", 1)]
    assert cache.get("L", 2, capture("b2")) == "b2"
    assert made == ["a", "b", "c", "d", "b2"] and len(cache.keys()) == 3
    cache.clear()
    assert cache.keys() == [] and cache.get("L", 1, capture("a2")) == "a2"


def test_graph_cache_never_graphed_layouts_and_generators():
    """Every call of a layout hits its graph, however many (no capture budget); a capture that
    returns None (not graphable) makes its layout eager for good (until clear); each generator (by id) gets
    a graph of its own."""
    cache = kernels.GraphCache(capacity=16)
    made = []

    def capture(tag):
        return lambda: made.append(tag) or tag

    assert [cache.get("L", 0, capture(i)) for i in range(100)] == [0] * 100 and made == [0]
    calls = []
    assert cache.get("C", 0, lambda: calls.append(0)) is None
    assert cache.get("C", 1, lambda: calls.append(1)) is None and calls == [0]

    gen, other = torch.Generator(), torch.Generator()
    assert cache.get("L", id(gen), capture("g")) == "g"
    assert cache.get("L", id(gen), capture("never")) == "g"  # the same generator: the same graph
    assert cache.get("L", id(other), capture("o")) == "o"  # another generator: a graph of its own
    cache.clear()
    assert cache.get("L", 5, capture(5)) == 5 and cache.get("C", 0, lambda: "c") == "c"


def test_graph_cache_captures_once_across_threads():
    cache = kernels.GraphCache(capacity=16)
    made = []

    def capture(i):
        def make():
            made.append(i % 3)
            time.sleep(0.01)  # a slow capture, to let racing threads meet
            return object()
        return make

    got = _race(12, lambda i: cache.get("L", i % 3, capture(i)))
    assert sorted(made) == [0, 1, 2]
    assert all(g is got[i % 3] for i, g in enumerate(got))


def test_graph_key_is_the_layout_and_the_generator():
    """graph_key: equal layouts for equal shapes, dtypes, settings, mode, device and stream, whatever the
    tensors' addresses and strides (the graph owns its inputs and copies a call's tensors in); the instance
    is the generator's id (None for None)."""
    key = kernels.graphs.graph_key
    gen, other = torch.Generator(), torch.Generator()
    a = _cpu_case(B=3, gamma=4, V=100, seed=1)
    b = _cpu_case(B=3, gamma=4, V=100, seed=2)  # other tensors, at other addresses
    settings = dict(scale=1.0, topk=0, top_p=1.0)
    layout, instance = key("exact", *a[:3], gen, 7, settings)
    assert instance == id(gen)
    assert key("exact", *b[:3], gen, 7, settings) == (layout, instance)
    assert key("exact", *[t.clone() for t in a[:3]], gen, 7, settings) == (layout, instance)
    transposed = a[2].transpose(0, 1).contiguous().transpose(0, 1)  # same shape, other strides
    assert key("exact", a[0], a[1], transposed, gen, 7, settings) == (layout, instance)
    assert key("exact", *a[:3], other, 7, settings) == (layout, id(other)) and instance != id(other)
    assert key("exact", *a[:3], None, 7, settings) == (layout, None)
    for changed in (key("sigmoid", *a[:3], gen, 7, settings), key("exact", *a[:3], gen, 8, settings),
                    key("exact", *a[:3], gen, 7, dict(settings, top_p=0.9)),
                    key("exact", a[0], a[1].half(), a[2].half(), gen, 7, settings),
                    key("exact", a[0].int(), a[1], a[2], gen, 7, settings),
                    key("exact", *_cpu_case(B=3, gamma=4, V=101)[:3], gen, 7, settings),
                    key("exact", *_cpu_case(B=2, gamma=4, V=100)[:3], gen, 7, settings),
                    key("exact", *_cpu_case(B=3, gamma=5, V=100)[:3], gen, 7, settings)):
        assert changed[0] != layout
    assert len({layout, instance}) == 2  # both hashable: the cache's key


class _FakeStream:
    def synchronize(self):
        pass


def _fake_graphed(B: int, gamma: int, V: int, delay: float = 0.0):
    """A Graphed on the CPU whose `graph` stands in for the capture: its replay writes the static draft tokens
    [:, 0] into n_accepted and [:, 1] into next_token of the pinned bytes, and records what the static inputs
    held when it ran."""
    tokens, dl, tl, u, u_res = _cpu_case(B=B, gamma=gamma, V=V)
    spec = kernels.LaunchSpec.of("exact", tokens, dl, tl, u, u_res, sms=1)
    out_bytes = 7 * B * 8 + 16 * B * gamma
    inputs = kernels.graphs.static_inputs(tokens, dl, tl)
    seen = []

    class Replay:
        def replay(self):
            seen.append(tuple(t.clone() for t in inputs))
            time.sleep(delay)
            pinned[: 16 * B].view(torch.int64).copy_(torch.cat([inputs[0][:, 0], inputs[0][:, 1]]))

    pinned = torch.zeros(out_bytes, dtype=torch.uint8)
    graphed = kernels.graphs.Graphed(Replay(), _FakeStream(), inputs, torch.zeros(8, dtype=torch.int32), u_res,
                                     torch.zeros(out_bytes, dtype=torch.uint8), pinned, spec)
    return graphed, seen


def test_graphed_run_copies_the_call_tensors_in_before_the_replay():
    """Graphed.run (a stand-in graph on the CPU): each call's tensors are copied into the static inputs before
    the replay, whatever their strides; a tensor that is the static one is not copied (its version counter
    does not move); the host lists are read after the replay."""
    B, gamma, V = 3, 4, 50
    graphed, seen = _fake_graphed(B, gamma, V)
    statics = graphed.inputs
    assert all(t.is_contiguous() for t in statics)
    assert [(t.shape, t.dtype) for t in statics] == [((B, gamma), torch.long), ((B, gamma, V), torch.float32),
                                                     ((B, gamma + 1, V), torch.float32)]
    for seed in (1, 2):
        tokens, dl, tl, _, _ = _cpu_case(B=B, gamma=gamma, V=V, seed=seed)
        tl = tl.transpose(0, 1).contiguous().transpose(0, 1)  # non-contiguous: copy_ handles the strides
        host = graphed.run((tokens, dl, tl))
        assert all(torch.equal(x, y) for x, y in zip(seen[-1], (tokens, dl, tl)))
        assert host["n_accepted"] == tokens[:, 0].tolist() and host["next_token"] == tokens[:, 1].tolist()
    versions = [t._version for t in statics]
    statics[0].copy_(_cpu_case(B=B, gamma=gamma, V=V, seed=3)[0])
    tokens = statics[0]
    dl = _cpu_case(B=B, gamma=gamma, V=V, seed=3)[1]
    host = graphed.run((tokens, dl, statics[2]))
    assert [t._version for t in statics] == [versions[0] + 1, versions[1] + 1, versions[2]]  # only dl copied
    assert torch.equal(seen[-1][1], dl) and host["n_accepted"] == tokens[:, 0].tolist()


def test_graphed_run_is_atomic_across_threads():
    """Two threads on one graph (a stand-in replay that sleeps between reading the inputs and writing the
    outputs): each call's host lists come from its own inputs, so copy-in, replay and readback never interleave."""
    B, gamma, V = 2, 3, 20
    graphed, _ = _fake_graphed(B, gamma, V, delay=0.002)
    cases = [_cpu_case(B=B, gamma=gamma, V=V, seed=i)[:3] for i in range(8)]
    got = _race(8, lambda i: [graphed.run(cases[i]) for _ in range(5)])
    for i, hosts in enumerate(got):
        for host in hosts:
            assert host["n_accepted"] == cases[i][0][:, 0].tolist(), i
            assert host["next_token"] == cases[i][0][:, 1].tolist(), i


def test_graphs_switch_routes_launch_sampled(monkeypatch):
    """launch_sampled tries the graph when graphs are on (SPECVIZ_VERIFY_GRAPHS, set_graphs_enabled, or its
    graphs_on argument) and falls back to eager draws (u, then u_res, from the generator) and `launch`."""
    launcher = kernels.launcher
    tokens, dl, tl, _, _ = _cpu_case(B=2, gamma=3, V=50, seed=5)
    assert launcher._launch_graphed("exact", tokens, dl, tl, None, None, {}) is None  # CPU tensors: no graph
    tried, launched = [], []
    graphed = _fake_launched(tokens, graphed=True)
    answer = {"graph": None}

    def fake_graphed(mode, draft_tokens, draft_logits, target_logits, generator, events, settings):
        tried.append(settings)
        return answer["graph"]

    def fake_launch(mode, draft_tokens, draft_logits, target_logits, u, u_res, **kw):
        launched.append((u, u_res))
        return _fake_launched(draft_tokens)

    monkeypatch.setattr(launcher, "_launch_graphed", fake_graphed)
    monkeypatch.setattr(launcher, "launch", fake_launch)
    monkeypatch.setattr(kernels.graphs, "_enabled", True)

    def call(**kw):
        return kernels.launch_sampled("exact", tokens, dl, tl, torch.Generator().manual_seed(3), scale=0.5, **kw)

    done = call()  # graphs on, but none applies: eager, with the documented draws
    ref = torch.Generator().manual_seed(3)
    u, u_res = torch.rand((2, 3), generator=ref), torch.rand((2,), generator=ref)
    assert tried == [dict(scale=0.5)] and len(launched) == 1
    assert torch.equal(launched[0][0], u) and torch.equal(launched[0][1], u_res)
    assert done.u_res is launched[0][1] and not done.graphed
    answer["graph"] = graphed
    assert call() is graphed and len(launched) == 1  # the graph drew; nothing eager
    assert not call(graphs_on=False).graphed and len(tried) == 2 and len(launched) == 2
    kernels.set_graphs_enabled(False)
    assert not kernels.graphs_enabled()
    assert not call().graphed and len(tried) == 2
    assert call(graphs_on=True) is graphed and len(tried) == 3

    code = ("from specviz.verify import project_kernels; k = project_kernels()\n"
            "print(k.graphs_enabled(), k.graphs.ENV)\n")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for value, expected in (("0", "False"), ("1", "True")):
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=dict(env, SPECVIZ_VERIFY_GRAPHS=value),
                              capture_output=True, text=True, timeout=300)
        assert proc.stdout.split() == [expected, "SPECVIZ_VERIFY_GRAPHS"], proc.stdout + proc.stderr


def test_graph_check_script_runs_without_a_gpu(tmp_path):
    """kernels/cuda/graph_check.py parses its arguments, and where the kernels cannot run it still writes its
    JSON (the error recorded) and exits 1 instead of crashing."""
    script = REPO / "kernels" / "cuda" / "graph_check.py"
    spec = importlib.util.spec_from_file_location("graph_check", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = module.parse_args(["--json", "out.json", "--iters", "5"])
    assert (args.json, args.iters, args.vocab, args.gamma) == (Path("out.json"), 5, 151936, 5)
    proc = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "--json" in proc.stdout
    if torch.cuda.is_available():
        return
    out = tmp_path / "check.json"
    proc = subprocess.run([sys.executable, str(script), "--json", str(out)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    report = json.loads(out.read_text())
    assert proc.returncode == 1 and "machine" in report["errors"] and report["machine"]["torch"] == torch.__version__
    assert report["command"].endswith(f"--json {out}")


# ----------------------------------------------------------------------------------------------------
# Everywhere: the kernels on a CPU emulator
# ----------------------------------------------------------------------------------------------------

EMULATOR_H = r"""
// Fiber-based CUDA emulator for tests/test_kernels.py: one OS thread; each CUDA thread of a block is a
// ucontext fiber that runs until it reaches __syncthreads or a warp primitive. Blocks run one at a time,
// in a shuffled order (so any block can be the last one). Fails the launch on: a __syncthreads reached at
// different source lines or after some threads exited; a warp primitive reached by part of a warp or at
// different lines; deadlock.
#pragma once
#include <ucontext.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#define SPECVIZ_EMULATE 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(x)

struct dim3 { unsigned x = 1, y = 1, z = 1; };

namespace emu {
enum { RUN, WAIT_BLOCK, WAIT_WARP, DONE };
enum { K_SYNC, K_OR, K_SHFL, K_BALLOT };
struct Fiber { ucontext_t ctx; int state = RUN, line = 0, kind = 0, src = 0; uint64_t val = 0, res = 0; };
inline dim3 g_tid, g_bid, g_bdim, g_gdim;
inline std::vector<Fiber> g_f;
inline std::vector<std::vector<char>> g_stacks;
inline ucontext_t g_sched;
inline int g_cur = 0;
inline std::string g_error;
inline const std::function<void()>* g_fn;

inline void fail(const std::string& what) {
  if (g_error.empty())
    g_error = what + " (block " + std::to_string(g_bid.x) + "," + std::to_string(g_bid.y) + "," +
              std::to_string(g_bid.z) + ")";
}
inline uint64_t wait(int state, int kind, int line, uint64_t val, int src) {
  Fiber& f = g_f[g_cur];
  f.state = state; f.kind = kind; f.line = line; f.val = val; f.src = src;
  swapcontext(&f.ctx, &g_sched);
  g_tid = dim3{(unsigned)g_cur, 0, 0};
  return g_f[g_cur].res;
}
inline void trampoline() {
  (*g_fn)();
  g_f[g_cur].state = DONE;
  swapcontext(&g_f[g_cur].ctx, &g_sched);
}
template <class T> inline uint64_t bits(T v) { uint64_t b = 0; memcpy(&b, &v, sizeof(T)); return b; }
template <class T> inline T unbits(uint64_t b) { T v; memcpy(&v, &b, sizeof(T)); return v; }
inline void sync(int line) { wait(WAIT_BLOCK, K_SYNC, line, 0, 0); }
inline int sync_or(int p, int line) { return (int)wait(WAIT_BLOCK, K_OR, line, p != 0, 0); }
template <class T> inline T shfl(T v, int src, int line) { return unbits<T>(wait(WAIT_WARP, K_SHFL, line, bits(v), src & 31)); }
inline unsigned ballot(int p, int line) { return (unsigned)wait(WAIT_WARP, K_BALLOT, line, p != 0, 0); }

inline bool run_block(int n) {
  for (int t = 0; t < n; ++t) {
    Fiber& f = g_f[t];
    f.state = RUN;
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = g_stacks[t].data();
    f.ctx.uc_stack.ss_size = g_stacks[t].size();
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, trampoline, 0);
  }
  const int nw = (n + 31) / 32;
  for (;;) {
    bool progressed = false;
    for (int t = 0; t < n; ++t) {
      if (g_f[t].state != RUN) continue;
      g_cur = t;
      g_tid = dim3{(unsigned)t, 0, 0};
      swapcontext(&g_sched, &g_f[t].ctx);
      progressed = true;
    }
    if (!g_error.empty()) return false;
    for (int w = 0; w < nw; ++w) {
      int lo = w * 32, hi = std::min(n, lo + 32), waiting = 0;
      for (int t = lo; t < hi; ++t) waiting += g_f[t].state == WAIT_WARP;
      if (waiting == 0) continue;
      if (waiting != hi - lo) {
        fail("warp primitive not reached by all lanes (line " + std::to_string(g_f[lo].line) + ")");
        return false;
      }
      unsigned mask = 0;
      for (int t = lo; t < hi; ++t) {
        if (g_f[t].line != g_f[lo].line || g_f[t].kind != g_f[lo].kind) {
          fail("divergent warp primitive: lines " + std::to_string(g_f[lo].line) + " and " + std::to_string(g_f[t].line));
          return false;
        }
        if (g_f[t].val) mask |= 1u << (t - lo);
      }
      for (int t = lo; t < hi; ++t) {
        g_f[t].res = g_f[t].kind == K_BALLOT ? mask : g_f[lo + g_f[t].src].val;
        g_f[t].state = RUN;
      }
      progressed = true;
    }
    int at_barrier = 0, done = 0, running = 0, in_warp = 0;
    for (int t = 0; t < n; ++t) {
      at_barrier += g_f[t].state == WAIT_BLOCK;
      done += g_f[t].state == DONE;
      running += g_f[t].state == RUN;
      in_warp += g_f[t].state == WAIT_WARP;
    }
    if (done == n) return true;
    if (at_barrier > 0 && running == 0 && in_warp == 0) {
      if (done > 0) { fail("__syncthreads after some threads exited"); return false; }
      int line = g_f[0].line, kind = g_f[0].kind;
      uint64_t any = 0;
      for (int t = 0; t < n; ++t) {
        if (g_f[t].line != line || g_f[t].kind != kind) {
          fail("divergent __syncthreads: lines " + std::to_string(line) + " and " + std::to_string(g_f[t].line));
          return false;
        }
        any |= g_f[t].val;
      }
      for (int t = 0; t < n; ++t) { g_f[t].res = any; g_f[t].state = RUN; }
      progressed = true;
    }
    if (!progressed) { fail("deadlock"); return false; }
  }
}

inline std::string launch(dim3 grid, int threads, const std::function<void()>& fn, unsigned seed) {
  g_error.clear();
  g_gdim = grid;
  g_bdim = dim3{(unsigned)threads, 1, 1};
  g_fn = &fn;
  g_f.assign(threads, Fiber{});
  if ((int)g_stacks.size() < threads) g_stacks.resize(threads, std::vector<char>(1 << 16));
  std::vector<dim3> blocks;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) blocks.push_back(dim3{x, y, z});
  std::mt19937 rng(seed);
  std::shuffle(blocks.begin(), blocks.end(), rng);
  for (const dim3& b : blocks) {
    g_bid = b;
    if (!run_block(threads)) return g_error;
  }
  return "";
}
}  // namespace emu

#define threadIdx emu::g_tid
#define blockIdx emu::g_bid
#define blockDim emu::g_bdim
#define gridDim emu::g_gdim
#define __syncthreads() emu::sync(__LINE__)
#define __syncthreads_or(p) emu::sync_or((p), __LINE__)
#define __shfl_xor_sync(m, v, o) emu::shfl((v), (int)((threadIdx.x & 31) ^ (o)), __LINE__)
#define __shfl_up_sync(m, v, d) \
  emu::shfl((v), (int)((threadIdx.x & 31) >= (unsigned)(d) ? (threadIdx.x & 31) - (d) : (threadIdx.x & 31)), __LINE__)
#define __shfl_sync(m, v, s) emu::shfl((v), (int)(s), __LINE__)
#define __ballot_sync(m, p) emu::ballot((p) ? 1 : 0, __LINE__)

inline int __ffs(unsigned x) { return x ? __builtin_ctz(x) + 1 : 0; }
inline int __clz(unsigned x) { return x ? __builtin_clz(x) : 32; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline void __threadfence() {}
inline int atomicMin(int* p, int v) { int o = *p; if (v < o) *p = v; return o; }
inline int atomicMax(int* p, int v) { int o = *p; if (v > o) *p = v; return o; }
inline int atomicOr(int* p, int v) { int o = *p; *p = o | v; return o; }
inline unsigned atomicAdd(unsigned* p, unsigned v) { unsigned o = *p; *p = o + v; return o; }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) { auto o = *p; *p = o + v; return o; }
inline int __clzll(long long x) { return x ? __builtin_clzll((unsigned long long)x) : 64; }
inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
inline float __fsub_rn(float a, float b) { volatile float r = a - b; return r; }
inline float __fdiv_rn(float a, float b) { volatile float r = a / b; return r; }
inline float sv_emu_half_to_float(unsigned short h) {
  unsigned sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  if (e == 0x1f) return __uint_as_float(sign | 0x7f800000u | (m << 13));
  if (e == 0) { float f = (float)m * 5.9604644775390625e-8f; return sign ? -f : f; }
  return __uint_as_float(sign | ((e + 112) << 23) | (m << 13));
}
"""

EMULATOR_MAIN = r"""
#include "emu.h"
#include "@SOURCE@"
#include <type_traits>
#include <utility>

template <class... A, size_t... I>
static void call_impl(void (*f)(A...), void** args, std::index_sequence<I...>) {
  f(*reinterpret_cast<std::remove_reference_t<A>*>(args[I])...);
}
template <class... A>
static int run(void (*f)(A...), dim3 grid, int threads, void** args, const int* sizes, int nargs, unsigned seed,
               char* err, int errlen) {
  const size_t expect[] = {sizeof(A)...};
  if (nargs != (int)sizeof...(A)) { snprintf(err, errlen, "kernel takes %zu arguments, got %d", sizeof...(A), nargs); return 1; }
  for (int i = 0; i < nargs; ++i)
    if ((size_t)sizes[i] != expect[i]) { snprintf(err, errlen, "argument %d has %d bytes, the kernel wants %zu", i, sizes[i], expect[i]); return 1; }
  std::string e = emu::launch(grid, threads, [&] { call_impl(f, args, std::index_sequence_for<A...>{}); }, seed);
  if (!e.empty()) { snprintf(err, errlen, "%s", e.c_str()); return 2; }
  return 0;
}
#define ENTRY(N) if (name == #N) return run(N, grid, threads, args, sizes, nargs, seed, err, errlen);
extern "C" int emu_launch(const char* cname, unsigned gx, unsigned gy, unsigned gz, int threads, void** args,
                          const int* sizes, int nargs, unsigned seed, char* err, int errlen) {
  std::string name(cname);
  dim3 grid{gx, gy, gz};
  @ENTRIES@
  snprintf(err, errlen, "unknown kernel %s", cname);
  return 1;
}
"""


def emulator_main(source: Path) -> str:
    """The emulator's main.cpp for a .cu file: every entry point of kernels.ENTRY_POINTS callable by name."""
    entries = " ".join(f"ENTRY({name})" for name in kernels.ENTRY_POINTS)
    return EMULATOR_MAIN.replace("@SOURCE@", str(source)).replace("@ENTRIES@", entries)


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    """The kernels compiled for the CPU emulator (g++), as a ctypes library."""
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("g++ is not available to build the CPU emulator")
    d = tmp_path_factory.mktemp("cuda_emulator")
    (d / "emu.h").write_text(EMULATOR_H)
    (d / "main.cpp").write_text(emulator_main(kernels.source_files()[0]))
    lib = d / "libsvemu.so"
    cmd = [cxx, "-std=c++17", "-O1", "-ffp-contract=off", "-w", "-fPIC", "-shared", "-o", str(lib), str(d / "main.cpp")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 and "ucontext" in proc.stderr:
        pytest.skip(f"the emulator needs <ucontext.h>: {proc.stderr[-500:]}")
    assert proc.returncode == 0, proc.stderr
    so = ctypes.CDLL(str(lib))
    so.emu_launch.argtypes = [ctypes.c_char_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_int,
                              ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int), ctypes.c_int,
                              ctypes.c_uint, ctypes.c_char_p, ctypes.c_int]
    return so


def emulate(so, mode, tokens, dl, tl, u, u_res, *, scale=1.0, lenience=1.0, alpha=-1e4, beta=1e4,
            stats_chunk=None, residual_chunk=None, sms=132, seed=0, topk=0, top_p=1.0, state=None):
    """verify_cuda's steps with the launches run by the emulator on CPU tensors."""
    B, gamma = tokens.shape
    if state is None:
        state = torch.zeros(kernels.state_size(B, gamma) + 7, dtype=torch.int32)
    prep = _prepare(mode, tokens, dl, tl, u, u_res, scale=scale, lenience=lenience, sigmoid_alpha=alpha,
                    sigmoid_beta=beta, state=state, sms=sms, stats_chunk=stats_chunk, residual_chunk=residual_chunk,
                    topk=topk, top_p=top_p)
    for name, grid, args in prep.launches:
        arrays = [np.asarray(a) for a in args]
        bufs = [ctypes.create_string_buffer(a.tobytes(), a.nbytes) for a in arrays]
        ptrs = (ctypes.c_void_p * len(bufs))(*[ctypes.addressof(b) for b in bufs])
        sizes = (ctypes.c_int * len(bufs))(*[a.nbytes for a in arrays])
        err = ctypes.create_string_buffer(1024)
        rc = so.emu_launch(name.encode(), *grid, kernels.THREADS, ptrs, sizes, len(bufs), seed, err, 1024)
        assert rc == 0, f"{name} {grid}: {err.value.decode()}"
    assert bool((state == 0).all()), "the kernels must leave their ticket counters and error words at zero"
    views = kernels.outputs._views(prep.buffer, B, gamma)
    kernels.raise_for_errors(views.pop("errors"), tl.shape[-1])
    name, _, args = prep.launches[0]
    if name.startswith("sv_exact_stats") and int(args[15]):  # top-k / top-p: the rows' (threshold, L)
        at = int(args[15]) - prep.buffer.data_ptr()
        views["rowstat"] = prep.buffer[at: at + B * (2 * gamma + 1) * 8].view(torch.float32).view(B, -1, 2)
    return views


def _emulated_case(label, mode="exact", B=2, gamma=3, V=7, dtype=torch.float32, sampling=SamplingConfig(temperature=1.0),
                   lenience=1.0, alpha=-1e4, beta=1e4, spread=2.0, noise=1.0, shift=0.0, live=None, expand=False,
                   seed=0, ties=False, straddle=False, **chunks):
    """ties: round the logits (few distinct values); straddle: some row's top-p boundary must cut a tie."""
    return pytest.param(dict(mode=mode, B=B, gamma=gamma, V=V, dtype=dtype, sampling=sampling, lenience=lenience,
                             alpha=alpha, beta=beta, spread=spread, noise=noise, shift=shift, live=live,
                             expand=expand, seed=seed, ties=ties, straddle=straddle, chunks=chunks), id=label)


EMULATED_CASES = [
    _emulated_case("exact-V7-chunks3-2", stats_chunk=3, residual_chunk=2),
    _emulated_case("sigmoid-V7-chunk3", mode="sigmoid", alpha=-3.0, beta=3.0, residual_chunk=3),
    _emulated_case("exact-V1", B=3, gamma=1, V=1),
    _emulated_case("sigmoid-V2-fp16", mode="sigmoid", V=2, gamma=2, dtype=torch.float16, alpha=-2.0, beta=2.0),
    _emulated_case("exact-V1000-fp16-T0.7", B=3, gamma=2, V=1000, dtype=torch.float16,
                   sampling=SamplingConfig(temperature=0.7), stats_chunk=300, residual_chunk=333),
    _emulated_case("exact-V2500-bf16-lenience", B=2, gamma=4, V=2500, dtype=torch.bfloat16, lenience=0.6, sms=2),
    _emulated_case("sigmoid-V1777-bf16", mode="sigmoid", gamma=4, V=1777, dtype=torch.bfloat16, alpha=-5.0, beta=5.0,
                   lenience=0.8, residual_chunk=500),
    _emulated_case("exact-gamma8-V300", B=1, gamma=8, V=300, noise=2.0, stats_chunk=128, residual_chunk=100),
    _emulated_case("exact-topk-topp", V=400, sampling=SamplingConfig(temperature=0.8, top_k=40, top_p=0.9),
                   stats_chunk=150, residual_chunk=128),
    _emulated_case("sigmoid-topk", mode="sigmoid", V=400, sampling=SamplingConfig(temperature=1.0, top_k=30),
                   alpha=-4.0, beta=4.0, residual_chunk=128),
    _emulated_case("sigmoid-topk-ties-T1.2", mode="sigmoid", V=600, ties=True, alpha=-4.0, beta=4.0,
                   sampling=SamplingConfig(temperature=1.2, top_k=20), stats_chunk=200, residual_chunk=128),
    _emulated_case("exact-sparse-support", V=3000, live=20, stats_chunk=1024, residual_chunk=1024),
    _emulated_case("exact-expanded-batch", B=4, V=900, expand=True, stats_chunk=256, residual_chunk=300),
    _emulated_case("sigmoid-empty-residual", mode="sigmoid", B=3, V=300, alpha=-1.0, beta=1.0, spread=0.5, noise=0.0,
                   shift=6.0, residual_chunk=100),
    _emulated_case("sigmoid-default-alpha-beta", mode="sigmoid", V=500, residual_chunk=200),
    # top-k inside the kernels (exact mode, no top-p): thresholds by radix select, ties with the k-th kept
    _emulated_case("kernel-topk40-T0.8", V=400, sampling=SamplingConfig(temperature=0.8, top_k=40),
                   stats_chunk=150, residual_chunk=128),
    _emulated_case("kernel-topk1", B=3, gamma=2, V=333, sampling=SamplingConfig(temperature=1.0, top_k=1),
                   stats_chunk=100, residual_chunk=64),
    _emulated_case("kernel-topk-above-chunk", V=300, sampling=SamplingConfig(temperature=1.3, top_k=250),
                   stats_chunk=128, residual_chunk=100),
    _emulated_case("kernel-topk-ties-bf16", B=3, V=700, dtype=torch.bfloat16, ties=True,
                   sampling=SamplingConfig(temperature=1.0, top_k=7), stats_chunk=64, residual_chunk=100),
    _emulated_case("kernel-topk-ties-fp16-T1.1", V=1000, dtype=torch.float16, ties=True,
                   sampling=SamplingConfig(temperature=1.1, top_k=50), stats_chunk=256, residual_chunk=300),
    _emulated_case("kernel-topk-expanded-lenience", B=4, V=900, expand=True, lenience=0.7,
                   sampling=SamplingConfig(temperature=0.9, top_k=30), stats_chunk=256, residual_chunk=300),
    _emulated_case("kernel-topk-sparse", V=2000, live=25, sampling=SamplingConfig(temperature=1.0, top_k=40),
                   stats_chunk=512, residual_chunk=512),
    _emulated_case("kernel-topk-auto-chunks", gamma=5, V=3000, sampling=SamplingConfig(temperature=0.7, top_k=100),
                   sms=2),
    # top-p inside the kernels (both modes; with top-k it ranks the candidate lists, without it the row)
    _emulated_case("kernel-topp0.9", V=400, sampling=SamplingConfig(temperature=1.0, top_p=0.9),
                   stats_chunk=150, residual_chunk=128),
    _emulated_case("kernel-topp0.8-T0.7-bf16", B=3, V=700, dtype=torch.bfloat16,
                   sampling=SamplingConfig(temperature=0.7, top_p=0.8), stats_chunk=256, residual_chunk=300),
    _emulated_case("kernel-topp0.95-T1.3-fp16", V=1000, dtype=torch.float16, seed=1,
                   sampling=SamplingConfig(temperature=1.3, top_p=0.95), stats_chunk=256, residual_chunk=300),
    _emulated_case("kernel-topk-topp-T0.8-fp16", V=800, dtype=torch.float16,
                   sampling=SamplingConfig(temperature=0.8, top_k=60, top_p=0.7), stats_chunk=128, residual_chunk=200),
    _emulated_case("kernel-topk-above-chunk-topp-bf16", V=300, dtype=torch.bfloat16, seed=1,
                   sampling=SamplingConfig(temperature=1.0, top_k=250, top_p=0.9), stats_chunk=128, residual_chunk=100),
    _emulated_case("kernel-topp-ties-bf16", B=3, V=700, dtype=torch.bfloat16, ties=True, straddle=True,
                   sampling=SamplingConfig(temperature=1.0, top_p=0.5), stats_chunk=256, residual_chunk=100),
    _emulated_case("kernel-topk-topp-ties-T1.1", V=1000, ties=True, straddle=True,
                   sampling=SamplingConfig(temperature=1.1, top_k=50, top_p=0.6), stats_chunk=256, residual_chunk=300),
    # top-p reaching the k-th value, which ties across chunks: the chunks' unlisted ties carry mass
    _emulated_case("kernel-topk-topp-ties-extras", V=900, ties=True,
                   sampling=SamplingConfig(temperature=1.0, top_k=5, top_p=0.99), stats_chunk=512, residual_chunk=300),
    _emulated_case("kernel-topp-tiny", V=500, sampling=SamplingConfig(temperature=1.0, top_p=1e-3),
                   stats_chunk=128, residual_chunk=128),
    _emulated_case("kernel-topp-tiny-ties-fp16", V=300, dtype=torch.float16, ties=True, straddle=True,
                   sampling=SamplingConfig(temperature=1.0, top_p=1e-3), stats_chunk=128, residual_chunk=100),
    # top_p = 0.999: the boundary lies among tokens of tiny mass; flat logits keep it off float32 noise
    _emulated_case("kernel-topp0.999", V=1000, spread=0.5, noise=0.5, seed=7,
                   sampling=SamplingConfig(temperature=1.0, top_p=0.999), stats_chunk=256, residual_chunk=300),
    _emulated_case("kernel-topk-topp0.999-T0.9-bf16", V=1500, dtype=torch.bfloat16, seed=6, stats_chunk=512,
                   sampling=SamplingConfig(temperature=0.9, top_k=300, top_p=0.999), residual_chunk=512),
    _emulated_case("kernel-topp-sparse", V=2000, live=25, sampling=SamplingConfig(temperature=1.0, top_p=0.8),
                   stats_chunk=512, residual_chunk=512),
    _emulated_case("kernel-topp-expanded-lenience", B=4, V=900, expand=True, lenience=0.7,
                   sampling=SamplingConfig(temperature=0.9, top_p=0.85), stats_chunk=256, residual_chunk=300),
    _emulated_case("kernel-topp-auto-chunks", gamma=5, V=3000, seed=2,
                   sampling=SamplingConfig(temperature=0.7, top_p=0.9), sms=2),
    _emulated_case("kernel-topp-V1", B=3, gamma=1, V=1, sampling=SamplingConfig(temperature=0.5, top_p=0.5)),
    _emulated_case("sigmoid-kernel-topp", mode="sigmoid", V=400, sampling=SamplingConfig(temperature=1.0, top_p=0.9),
                   alpha=-4.0, beta=4.0, stats_chunk=150, residual_chunk=128),
    _emulated_case("sigmoid-kernel-topk-topp-bf16-T0.8", mode="sigmoid", B=3, V=700, dtype=torch.bfloat16,
                   sampling=SamplingConfig(temperature=0.8, top_k=40, top_p=0.8), alpha=-5.0, beta=5.0, lenience=0.8,
                   stats_chunk=256, residual_chunk=300),
    _emulated_case("sigmoid-kernel-topp-ties-fp16", mode="sigmoid", V=500, dtype=torch.float16, ties=True,
                   straddle=True, sampling=SamplingConfig(temperature=1.0, top_p=0.6), alpha=-3.0, beta=3.0,
                   residual_chunk=200),
]


TOPP_NEAR = 1e-6  # an exclusive mass this close to top_p is a near-tie: float32 sums may put it either side


def _mass_above(z: torch.Tensor) -> torch.Tensor:
    """[..., V] float64: the softmax mass of the values strictly larger than each entry's own (ties share it)."""
    zs, order = torch.sort(z, dim=-1, descending=True)
    ps = torch.softmax(zs.double(), dim=-1)
    excl = torch.cat([torch.zeros_like(ps[..., :1]), ps.cumsum(-1)[..., :-1]], dim=-1)
    starts = torch.ones_like(zs, dtype=torch.bool)
    starts[..., 1:] = zs[..., 1:] != zs[..., :-1]  # -inf == -inf: the masked tail is one tie
    cols = torch.arange(zs.shape[-1], device=z.device).expand_as(zs)
    first = torch.where(starts, cols, 0).cummax(dim=-1).values  # where each entry's tie begins
    return torch.empty_like(excl).scatter_(-1, order, excl.gather(-1, first))


def _before_topp(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    return standardize(logits, SamplingConfig(temperature=sampling.temperature, top_k=sampling.top_k))


def topp_ties_kept(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """`standardize` with the kernels' top-p tie rule: a token goes when the mass strictly above its value
    reaches fp32(top_p), so tokens tied with the boundary value stay or go together (float64 masses)."""
    z = _before_topp(logits, sampling)
    if sampling.top_p == 1.0:
        return z
    return z.masked_fill(_mass_above(z) >= float(kernels.topp_value(sampling.top_p)), float("-inf"))


def topp_margin(logits: torch.Tensor, sampling: SamplingConfig) -> float:
    """The smallest distance of any token's exclusive mass from top_p, over all rows."""
    return float((_mass_above(_before_topp(logits, sampling)) - float(kernels.topp_value(sampling.top_p))).abs().min())


def check_rowstat(rowstat: torch.Tensor, raw: torch.Tensor, std: torch.Tensor, scale: float) -> None:
    """The kernels' per-row (threshold, L) [B, 2γ+1, 2] against the reference's standardized rows std [B, 2γ+1, V]
    (raw: the logits the kernels read, stacked the same way): the kernels keep exactly the finite tokens the
    reference keeps (fp32(x)·scale >= threshold, as sv_prob masks), and L is their log-normalizer."""
    z = raw.float() * np.float32(scale)
    finite = torch.isfinite(z)
    kept = (z >= rowstat[..., :1]) & finite
    bad = (kept != (torch.isfinite(std) & finite)).any(-1).nonzero().tolist()
    assert not bad, f"rows [b, r] whose kept set differs from the reference: {bad}"
    L = torch.logsumexp(std.double(), dim=-1)
    assert torch.allclose(rowstat[..., 1].double(), L, rtol=0, atol=1e-5), (rowstat[..., 1], L)


def reference_inputs(sampling: SamplingConfig, draft_logits: torch.Tensor, target_logits: torch.Tensor):
    """(draft, target, sampling, straddled) for the torch path: the logits and settings themselves, or,
    where tied values straddle some row's top-p boundary (torch's sort then keeps an arbitrary part of the
    tie), the `topp_ties_kept` logits with temperature 1 (already standardized) and straddled = True."""
    pair = (topp_ties_kept(draft_logits, sampling), topp_ties_kept(target_logits, sampling))
    torch_std = (standardize(draft_logits, sampling), standardize(target_logits, sampling))
    if all(torch.equal(torch.isfinite(a), torch.isfinite(b)) for a, b in zip(pair, torch_std)):
        return draft_logits, target_logits, sampling, False
    return pair[0], pair[1], SamplingConfig(temperature=1.0), True


def _make_logits(c, device="cpu"):
    g = torch.Generator(device=device).manual_seed(c["seed"])
    B, gamma, V = c["B"], c["gamma"], c["V"]
    rows = 1 if c["expand"] else B
    tl = c["spread"] * torch.randn(rows, gamma + 1, V, generator=g, device=device)
    dl = tl[:, :gamma] + c["noise"] * torch.randn(rows, gamma, V, generator=g, device=device) + c["shift"]
    if c.get("ties"):  # few distinct values: many columns tie with each row's k-th largest
        tl, dl = tl.round(), dl.round()
    if c["live"]:
        keep = torch.rand(rows, 1, V, generator=g, device=device) < c["live"] / V
        keep[..., 0] = True
        tl, dl = tl.masked_fill(~keep, float("-inf")), dl.masked_fill(~keep, float("-inf"))
    tl, dl = tl.to(c["dtype"]), dl.to(c["dtype"])
    if c["expand"]:
        tl, dl = tl.expand(B, -1, -1), dl.expand(B, -1, -1)
    q = torch.softmax(standardize(dl, c["sampling"]), dim=-1)
    tokens = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(B, gamma)
    return tokens, dl, tl


@pytest.mark.parametrize("case", EMULATED_CASES)
def test_emulated_kernels_match_torch_path(emulator, case):
    """The kernels, run by the CPU emulator, decide as verify_tiled: same n, same next token (or a certified
    near-tie), same p(x), q(x), ratios. Blocks run in shuffled order, so any block may be the last. Top-k and
    top-p run inside the kernels on raw logits; the reference is the torch path, except where tied values
    straddle a row's top-p boundary (the `straddle` cases must have such rows; bf16 logits have them anyway):
    there it is the torch path on `topp_ties_kept` logits."""
    c = case
    tokens, dl, tl = _make_logits(c)
    sampling = c["sampling"]
    ref_dl, ref_tl, ref_sampling, straddled = reference_inputs(sampling, dl, tl)
    if c["straddle"]:
        assert straddled, "the case must have tied values straddling a top-p boundary"
    if sampling.top_p < 1:  # well posed (seeds chosen so): no exclusive mass within float32 noise of top_p
        assert topp_margin(dl, sampling) > TOPP_NEAR and topp_margin(tl, sampling) > TOPP_NEAR
    ref, u, u_res = torch_path(c["mode"], tokens, ref_dl, ref_tl, ref_sampling, c["lenience"], c["alpha"], c["beta"],
                               seed=c["seed"] + 1)
    dk, tk, scale = kernel_inputs(ref_sampling, ref_dl, ref_tl)
    chunks = dict(c["chunks"])
    sms = chunks.pop("sms", 132)
    how, kscale, topk, top_p = kernel_sampling(c["mode"], sampling, tl.shape[-1])
    if how == "filter":  # raw logits in, the kernels mask; the certification below uses standardized logits
        out = emulate(emulator, c["mode"], tokens, dl, tl, u, u_res, scale=kscale, topk=topk, top_p=top_p,
                      lenience=c["lenience"], alpha=c["alpha"], beta=c["beta"], sms=sms, seed=c["seed"], **chunks)
    else:
        out = emulate(emulator, c["mode"], tokens, dk, tk, u, u_res, scale=scale, lenience=c["lenience"],
                      alpha=c["alpha"], beta=c["beta"], sms=sms, seed=c["seed"], **chunks)
    if how == "filter":
        check_rowstat(out.pop("rowstat"), torch.cat([tl, dl], 1), torch.cat([tk, dk], 1), kscale)
    _, compared, problems = compare_rows(c["mode"], out, ref, tokens, dk, tk, u, u_res, scale, c["lenience"],
                                         c["alpha"], c["beta"])
    assert not problems, problems
    assert compared == tokens.shape[0], "n_accepted differs (near-ties only)"
    if c["noise"] == 0.0 and c["shift"] > 0:  # q̂ > p̂ everywhere: the rejections have an empty residual
        assert bool((out["n_accepted"] < c["gamma"]).any()), "the case should contain rejections"


def test_topp_reference_rules():
    """The reference's top-p rule on small hand-made rows: the first token stays however small top_p is,
    a token goes once the mass strictly above it reaches top_p, and tokens tied with the boundary value
    stay together (where torch's sort keeps an arbitrary subset of them)."""
    z = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0], [1.0, 1.0, 1.0, 1.0, 0.0], [0.0, 5.0, float("-inf"), 1.0, 4.0]])
    p = torch.softmax(z.double(), -1)

    def kept(top_p):
        return torch.isfinite(topp_ties_kept(z, SamplingConfig(temperature=1.0, top_p=top_p))).tolist()

    assert kept(1e-6) == [[True, False, False, False, False], [True] * 4 + [False], [False, True, False, False, False]]
    # row 0: the mass above the tie at 2.0 is p(3.0) = 0.52 < 0.65, so both tied tokens stay; torch's sort
    # puts one of them first, and the other, with 0.71 before it, goes
    assert float(p[0, 0]) < 0.65 < float(p[0, 0] + p[0, 2])
    assert kept(0.65)[0] == [True, False, True, True, False]
    assert kept(float(p[0, 0]) * 0.999)[0] == [True, False, False, False, False]  # reached: the tie goes
    assert kept(0.99)[2] == [False, True, False, True, True]
    margin = topp_margin(z[:1], SamplingConfig(temperature=1.0, top_p=0.65))
    assert abs(margin - (float(kernels.topp_value(0.65)) - float(p[0, 0]))) < 1e-12


@pytest.mark.parametrize("filters", [dict(), dict(top_p=0.9), dict(topk=5, top_p=0.9)],
                         ids=["none", "topp", "topk-topp"])
def test_emulated_errors(emulator, filters):
    """NaN / +inf / all -inf rows and out-of-range drafted tokens raise, naming tensor and row, in both modes,
    with and without in-kernel filters (whose threshold search skips such rows)."""
    for mode in ("exact", "sigmoid"):
        for dtype in (torch.float32, torch.bfloat16):
            tokens, dl, tl, u, ur = _cpu_case(B=3, gamma=2, V=300, seed=3)
            dl, tl = dl.to(dtype), tl.to(dtype)
            run = functools.partial(emulate, emulator, mode, u=u, u_res=ur, alpha=-5.0, beta=5.0,
                                    stats_chunk=128, residual_chunk=128, **filters)
            bad = dl.clone()
            bad[1, 1, 177] = float("nan")
            bad[2, 0, 5] = float("inf")
            with pytest.raises(InvalidLogitsError, match=r"draft logits contain NaN at index \[1, 1\]"):
                run(tokens=tokens, dl=bad, tl=tl)
            bad = tl.clone()
            bad[2, 2, 299] = float("inf")
            bad[2, 1, :] = float("-inf")
            with pytest.raises(InvalidLogitsError, match=r"target logits contain only -inf .* at index \[2, 1\]"):
                run(tokens=tokens, dl=dl, tl=bad)
            bad = tl.clone()
            bad[0, 2, 0] = float("inf")
            with pytest.raises(InvalidLogitsError, match=r"target logits contain \+inf at index \[0, 2\]"):
                run(tokens=tokens, dl=dl, tl=bad)
            bad_tokens = tokens.clone()
            bad_tokens[2, 1] = 300
            with pytest.raises(ValueError, match=r"draft_tokens must lie in \[0, 300\): position \[2, 1\]"):
                run(tokens=bad_tokens, dl=dl, tl=tl)


# ----------------------------------------------------------------------------------------------------
# GPU: agreement with the torch path
# ----------------------------------------------------------------------------------------------------

GPU_VOCABS = (7, 51865, 151936, 256000)
GPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
GPU_SEEDS = 14  # × 2 batch sizes (9 rows) × 3 γ × 3 dtypes × 4 V = 4536 rows per mode, half of them sparse
SPARSE_LIVE = 512
SIGMOID = (-8.0, 8.0)  # α, β that make the sigmoid path reject (the paper's ∓1e4 accepts nearly everything)


def _require_kernels():
    """GPU tests run only where torch sees a CUDA device (conftest skips them elsewhere); there, kernels that
    cannot run (no CuPy, NVRTC or driver failure) are a failure: a green GPU run must have launched them."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if not kernels.available():
        pytest.fail(f"a CUDA device is present but the kernels cannot run: {kernels.unavailable_reason()} "
                    "(pip install -r requirements-gpu.txt)")


def _gpu_logits(B, gamma, V, dtype, flavor, seed, spread=2.0, noise=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    tl = spread * torch.randn(B, gamma + 1, V, generator=g, device="cuda")
    dl = tl[:, :gamma] + noise * torch.randn(B, gamma, V, generator=g, device="cuda")
    if flavor == "sparse" and V > SPARSE_LIVE:
        keep = torch.rand(B, 1, V, generator=g, device="cuda") < SPARSE_LIVE / V
        keep[..., V // 2] = True
        tl, dl = tl.masked_fill(~keep, float("-inf")), dl.masked_fill(~keep, float("-inf"))
    tl, dl = tl.to(dtype), dl.to(dtype)
    return tl, dl, g


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["exact", "sigmoid"])
def test_agrees_with_torch_path(mode):
    _require_kernels()
    alpha, beta = SIGMOID
    stats = {"sparse": [0, 0], "dense": [0, 0]}  # [mismatched next_token rows, rows compared]
    problems = []
    case = 0
    for V in GPU_VOCABS:
        for dtype in GPU_DTYPES:
            for B in (1, 8):
                for gamma in (1, 5, 20):
                    for seed in range(GPU_SEEDS):
                        flavor = "sparse" if seed % 2 == 0 else "dense"
                        case += 1
                        temperature = (1.0, 0.8, 1.3)[case % 3]
                        lenience = 0.7 if case % 5 == 0 else 1.0
                        tl, dl, g = _gpu_logits(B, gamma, V, dtype, flavor, seed=10_000 + case)
                        scale = 1.0 / temperature
                        q = torch.softmax(dl.float() * scale, dim=-1)
                        tokens = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(B, gamma)
                        sampling = SamplingConfig(temperature=temperature)
                        ref, u, u_res = torch_path(mode, tokens, dl, tl, sampling, lenience, alpha, beta, seed=case)
                        out = kernels.verify_cuda(mode, tokens, dl, tl, u, u_res, scale=scale, lenience=lenience,
                                                  sigmoid_alpha=alpha, sigmoid_beta=beta)
                        mism, compared, probs = compare_rows(mode, out, ref, tokens, dl, tl, u, u_res, scale,
                                                             lenience, alpha, beta)
                        stats[flavor][0] += mism
                        stats[flavor][1] += compared
                        problems += [f"V={V} {dtype} B={B} γ={gamma} seed={seed} {flavor}: {p}" for p in probs]
    assert not problems, f"{len(problems)} differences that are not near-ties:\n" + "\n".join(problems[:20])
    for flavor, floor in (("sparse", 0.999), ("dense", 0.99)):
        mism, rows = stats[flavor]
        assert rows > 0 and (rows - mism) >= floor * rows, (
            f"{flavor}: next_token agrees in {rows - mism}/{rows} rows, below {floor:.1%} (all were near-ties)"
        )


# ----------------------------------------------------------------------------------------------------
# GPU: exactness, errors, plumbing
# ----------------------------------------------------------------------------------------------------


def _stats_module():
    import test_verify_statistics as st  # tests/ is on sys.path under pytest's default import mode

    return st


def _first_tokens_gpu(pair, n: int, seed: int, chunk_rows: int = 1 << 15, graphed: bool = False) -> np.ndarray:
    """verify_cuda on n copies of the pair (logits expanded, not copied), drafts drawn from q on the GPU.
    graphed: launch_sampled's graph draws the uniforms instead. A graph owns [rows, γ(+1), V] inputs, so its
    chunks hold at most 2^27 logits; the first call of a chunk size copies the expanded logits in, later ones
    pass the graph's own inputs (`graph_inputs`), so that only the drafts are copied (every full chunk
    replays one graph, the last one another)."""
    dl, tl, scale = kernel_inputs(pair.sampling, pair.draft_logits.cuda(), pair.target_logits.cuda())
    gamma, V = dl.shape
    if graphed:
        chunk_rows = max(1, min(chunk_rows, (1 << 27) // ((2 * gamma + 1) * V)))
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.softmax(standardize(pair.draft_logits.cuda(), pair.sampling), dim=-1)
    counts = torch.zeros(V, dtype=torch.long, device="cuda")
    done = 0
    while done < n:
        b = min(chunk_rows, n - done)
        tokens = torch.stack([torch.multinomial(q[j], b, replacement=True, generator=g) for j in range(gamma)], dim=1)
        if graphed:
            dlb, tlb = dl.expand(b, -1, -1), tl.expand(b, -1, -1)
            static = kernels.launcher.graph_inputs("exact", tokens, dlb, tlb, g, scale=scale)
            if static is not None:  # the graph holds these logits already: only the drafts are copied in
                dlb, tlb = static[1], static[2]
            launched = kernels.launch_sampled("exact", tokens, dlb, tlb, g, scale=scale)
            assert launched.graphed
            out = launched.outputs
        else:
            u = torch.rand((b, gamma), generator=g, device="cuda")
            u_res = torch.rand((b,), generator=g, device="cuda")
            out = kernels.verify_cuda("exact", tokens, dl.expand(b, -1, -1), tl.expand(b, -1, -1), u, u_res,
                                      scale=scale)
        first = torch.where(out["n_accepted"] >= 1, tokens[:, 0], out["next_token"])
        counts += torch.bincount(first, minlength=V)
        done += b
    return counts.cpu().numpy()


@pytest.mark.gpu
@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graphed"])
def test_first_token_follows_target_on_gpu(graphed):
    """Leviathan et al. Thm 3.1 on the kernel: with drafts from q, the first emitted token follows p. Edge
    pairs of tests/test_verify_statistics.py plus its V = 151,936 pair (40 heavy tokens spread over the
    vocabulary, so chunk edges matter, and a tail bin), each at the N that detects TV ≥ 0.01 with power
    0.99 at level 1e-3 / (number of pairs). graphed: through launch_sampled's CUDA graphs, whose replays draw
    the uniforms (a replay that reused them would fail the fit)."""
    _require_kernels()
    kernels.launcher._graph_cache.clear()
    st = _stats_module()
    pairs = st.edge_pairs()
    large, heavy = st.large_pair(151936)
    alpha = st.FAMILY_ALPHA / (len(pairs) + 1)
    failures = []
    for i, pair in enumerate(pairs):
        p = st.probs_of(pair.target_logits[0], pair.sampling)
        n = st.samples_to_detect_tv(st.FULL_TV, st.support_dof(p), alpha, st.POWER)
        failure = st.gof_failure(_first_tokens_gpu(pair, n, seed=500 + i, graphed=graphed), p, alpha)
        if failure:
            failures.append(f"{pair.label}: {failure}")
    p = st.probs_of(large.target_logits[0], large.sampling)
    n = st.samples_to_detect_tv(st.FULL_TV, heavy.size, alpha, st.POWER)
    failure = st.gof_failure(*st.tail_binned(_first_tokens_gpu(large, n, seed=999, graphed=graphed), p, heavy),
                             alpha)
    if failure:
        failures.append(f"{large.label}: {failure}")
    assert not failures, "\n".join(failures)


@pytest.mark.gpu
def test_bonus_token_follows_last_position_on_gpu():
    _require_kernels()
    st = _stats_module()
    pairs = st.bonus_pairs()
    alpha = st.FAMILY_ALPHA / len(pairs)
    for i, pair in enumerate(pairs):
        p1 = st.probs_of(pair.target_logits[1], pair.sampling)
        n = st.samples_to_detect_tv(st.FULL_TV, st.support_dof(p1), alpha, st.POWER)
        dl, tl, scale = kernel_inputs(pair.sampling, pair.draft_logits.cuda(), pair.target_logits.cuda())
        g = torch.Generator(device="cuda").manual_seed(77 + i)
        next_tokens = []
        for start in range(0, n, 1 << 15):
            b = min(1 << 15, n - start)
            tokens = torch.multinomial(torch.softmax(dl[0] * scale, -1), b, replacement=True, generator=g)[:, None]
            u = torch.rand((b, 1), generator=g, device="cuda")
            u_res = torch.rand((b,), generator=g, device="cuda")
            out = kernels.verify_cuda("exact", tokens, dl.expand(b, -1, -1), tl.expand(b, -1, -1), u, u_res,
                                      scale=scale)
            assert bool((out["n_accepted"] == 1).all()), "p == q at position 0: every draft is kept"
            next_tokens.append(out["next_token"])
        out = {"next_token": torch.cat(next_tokens)}
        counts = torch.bincount(out["next_token"], minlength=dl.shape[-1]).cpu().numpy()
        failure = st.gof_failure(counts, p1, alpha)
        assert failure is None, f"{pair.label}: {failure}"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["exact", "sigmoid"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_invalid_logits_raise_on_gpu(mode, dtype):
    _require_kernels()
    B, gamma, V = 3, 2, 51865
    tl, dl, g = _gpu_logits(B, gamma, V, dtype, "dense", seed=1)
    tokens = torch.randint(0, V, (B, gamma), generator=g, device="cuda")
    u = torch.rand((B, gamma), generator=g, device="cuda")
    u_res = torch.rand((B,), generator=g, device="cuda")
    run = functools.partial(kernels.verify_cuda, mode, u=u, u_res=u_res, sigmoid_alpha=-8.0, sigmoid_beta=8.0)
    bad = dl.clone()
    bad[1, 1, 40000] = float("nan")
    with pytest.raises(InvalidLogitsError, match=r"draft logits contain NaN at index \[1, 1\]"):
        run(draft_tokens=tokens, draft_logits=bad, target_logits=tl)
    bad = tl.clone()
    bad[2, 0, V - 1] = float("inf")
    with pytest.raises(InvalidLogitsError, match=r"target logits contain \+inf at index \[2, 0\]"):
        run(draft_tokens=tokens, draft_logits=dl, target_logits=bad)
    bad = tl.clone()
    bad[0, 2, :] = float("-inf")
    with pytest.raises(InvalidLogitsError, match=r"target logits contain only -inf .* at index \[0, 2\]"):
        run(draft_tokens=tokens, draft_logits=dl, target_logits=bad)
    bad_tokens = tokens.clone()
    bad_tokens[1, 0] = V
    with pytest.raises(ValueError, match=r"position \[1, 0\]"):
        run(draft_tokens=bad_tokens, draft_logits=dl, target_logits=tl)
    # The state is clean again: a valid call afterwards works and agrees with itself.
    a = run(draft_tokens=tokens, draft_logits=dl, target_logits=tl)
    b = run(draft_tokens=tokens, draft_logits=dl, target_logits=tl)
    assert torch.equal(a["next_token"], b["next_token"]) and torch.equal(a["n_accepted"], b["n_accepted"])


@pytest.mark.gpu
def test_plumbing_on_gpu():
    """Determinism across repeated calls and interleaved shapes (shared ticket counters), expanded and
    strided inputs, explicit chunk sizes that divide nothing, a side stream, check=False and host=True."""
    _require_kernels()
    results = {}
    for mode in ("exact", "sigmoid"):
        for B, gamma, V in ((8, 5, 151936), (1, 20, 7), (3, 1, 51865), (8, 5, 151936)):
            tl, dl, g = _gpu_logits(B, gamma, V, torch.bfloat16, "dense", seed=B * 100 + gamma)
            tokens = torch.multinomial(torch.softmax(dl.float().reshape(-1, V), -1), 1, generator=g).reshape(B, gamma)
            u = torch.rand((B, gamma), generator=g, device="cuda")
            u_res = torch.rand((B,), generator=g, device="cuda")
            out = kernels.verify_cuda(mode, tokens, dl, tl, u, u_res, sigmoid_alpha=-8.0, sigmoid_beta=8.0)
            key = (mode, B, gamma, V)
            if key in results:
                for name in out:
                    assert torch.equal(out[name], results[key][name]), f"{key} {name} not deterministic"
            results[key] = out
            odd = kernels.verify_cuda(mode, tokens, dl, tl, u, u_res, sigmoid_alpha=-8.0, sigmoid_beta=8.0,
                                      stats_chunk=4099, residual_chunk=1777)
            assert torch.equal(odd["n_accepted"], out["n_accepted"])
            for b in (odd["next_token"] != out["next_token"]).nonzero().flatten().tolist():  # near-ties may move
                n = int(out["n_accepted"][b])
                assert near_tie_token(mode, tl[b, n], dl[b, min(n, gamma - 1)], n, gamma, 1.0, 1.0, -8.0, 8.0,
                                      u_res[b], (int(odd["next_token"][b]), int(out["next_token"][b]))), (key, b)

    B, gamma, V = 64, 5, 151936
    tl1, dl1, g = _gpu_logits(1, gamma, V, torch.float16, "dense", seed=5)
    tokens = torch.multinomial(torch.softmax(dl1[0].float(), -1), B, replacement=True, generator=g).T.contiguous()
    u = torch.rand((B, gamma), generator=g, device="cuda")
    u_res = torch.rand((B,), generator=g, device="cuda")
    expanded = kernels.verify_cuda("exact", tokens, dl1.expand(B, -1, -1), tl1.expand(B, -1, -1), u, u_res)
    copied = kernels.verify_cuda("exact", tokens, dl1.expand(B, -1, -1).contiguous(),
                                 tl1.expand(B, -1, -1).contiguous(), u, u_res)
    for name in expanded:
        assert torch.equal(expanded[name], copied[name]), name
    wide = torch.zeros(1, gamma + 1, 2 * V, dtype=torch.float16, device="cuda")
    wide[..., ::2] = tl1
    strided = kernels.verify_cuda("exact", tokens, dl1.expand(B, -1, -1), wide[..., ::2].expand(B, -1, -1), u, u_res)
    assert torch.equal(strided["next_token"], expanded["next_token"])

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = kernels.verify_cuda("exact", tokens, dl1.expand(B, -1, -1), tl1.expand(B, -1, -1), u, u_res)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(on_side["next_token"], expanded["next_token"])

    lazy = kernels.verify_cuda("exact", tokens, dl1.expand(B, -1, -1), tl1.expand(B, -1, -1), u, u_res, check=False)
    assert torch.equal(lazy["next_token"], expanded["next_token"])
    host = kernels.verify_cuda("exact", tokens, dl1.expand(B, -1, -1), tl1.expand(B, -1, -1), u, u_res, host=True)
    assert host["n_accepted"].device.type == "cpu"
    assert torch.equal(host["next_token"], expanded["next_token"].cpu())
    assert sorted(host) == sorted(["n_accepted", "next_token", "accept_prob", "uniforms", "p_draft", "q_draft"])


# ----------------------------------------------------------------------------------------------------
# GPU: top-k inside the kernels, the host path, stress
# ----------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_topk_in_kernel_agrees_with_standardize(dtype):
    """Exact mode with top-k: the kernels mask each row themselves (radix select) and must decide as the torch
    path, which standardizes with torch.topk; p(x), q(x) compared as elsewhere, so a wrong threshold shows."""
    _require_kernels()
    from specviz.verify import kernel_sampling

    problems, rows, mism = [], 0, 0
    for V in (51865, 151936):
        for top_k, temperature in ((1, 1.0), (50, 0.8), (1000, 1.1), (kernels.MAX_TOPK, 1.0)):
            for B, gamma in ((1, 5), (8, 3)):
                seed = V + top_k + B
                tl, dl, g = _gpu_logits(B, gamma, V, dtype, "dense", seed=seed)
                sampling = SamplingConfig(temperature=temperature, top_k=top_k)
                how, scale, k, top_p = kernel_sampling("exact", sampling, V)
                assert (how, k, top_p) == ("filter", top_k, 1.0)
                dk, tk, _ = kernel_inputs(sampling, dl, tl)
                q = torch.softmax(dk, dim=-1)
                tokens = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(B, gamma)
                ref, u, u_res = torch_path("exact", tokens, dl, tl, sampling, 1.0, -1e4, 1e4, seed=seed)
                out = kernels.verify_cuda("exact", tokens, dl, tl, u, u_res, scale=scale, topk=k)
                m, c, probs = compare_rows("exact", out, ref, tokens, dk, tk, u, u_res, 1.0, 1.0, -1e4, 1e4)
                mism, rows = mism + m, rows + c
                problems += [f"V={V} k={top_k} B={B}: {p}" for p in probs]
    assert not problems, "\n".join(problems[:20])
    assert rows > 0 and rows - mism >= 0.99 * rows


def _row_slice(d: dict, b: int) -> dict:
    return {k: v[b:b + 1] for k, v in d.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["exact", "sigmoid"])
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_topp_in_kernel_agrees_with_torch_path(mode, dtype):
    """Top-p inside the kernels (alone and after top-k, several temperatures, top_p from 1e-3 to 0.999, dense
    and sparse rows) against the torch path, which standardizes with a sort. The reference keeps ties with a
    row's boundary value (`reference_inputs`; bf16 rows have many). Compared row by row as elsewhere; a row
    that differs is excused only where some exclusive mass of its logits lies within TOPP_NEAR of top_p (torch's
    float32 cumsum cannot place those), and at most 1% of rows may be excused or differ in next_token."""
    _require_kernels()
    alpha, beta = SIGMOID
    settings = ((1.0, 0, 0.9), (0.7, 0, 0.95), (1.3, 50, 0.8), (0.8, 1000, 0.999), (1.0, 0, 1e-3), (1.1, 1, 0.5))
    problems, rows, mism, excused = [], 0, 0, 0
    case = 0
    for V in (51865, 151936):
        for temperature, top_k, top_p in settings:
            for B, gamma in ((1, 5), (8, 3)):
                case += 1
                flat = top_p > 0.99  # the 0.999 boundary then lies among tokens of ~1/V mass, not ~1e-7
                tl, dl, g = _gpu_logits(B, gamma, V, dtype, "sparse" if case % 3 == 0 else "dense", seed=30_000 + case,
                                        spread=0.5 if flat else 2.0, noise=0.5 if flat else 1.0)
                sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
                how, scale, k, kp = kernel_sampling(mode, sampling, V)
                assert (how, k, kp) == ("filter", top_k, top_p)
                ref_dl, ref_tl, ref_sampling, _ = reference_inputs(sampling, dl, tl)
                dk, tk, _ = kernel_inputs(ref_sampling, ref_dl, ref_tl)
                tokens = torch.multinomial(torch.softmax(dk, -1).reshape(-1, V), 1, generator=g).reshape(B, gamma)
                ref, u, u_res = torch_path(mode, tokens, ref_dl, ref_tl, ref_sampling, 1.0, alpha, beta, seed=case)
                out = kernels.verify_cuda(mode, tokens, dl, tl, u, u_res, scale=scale, topk=k, top_p=kp,
                                          sigmoid_alpha=alpha, sigmoid_beta=beta)
                for b in range(B):
                    m, c, probs = compare_rows(mode, _row_slice(out, b), _row_slice(ref, b), tokens[b:b + 1],
                                               dk[b:b + 1], tk[b:b + 1], u[b:b + 1], u_res[b:b + 1], 1.0, 1.0,
                                               alpha, beta)
                    rows += 1
                    if probs and min(topp_margin(dl[b], sampling), topp_margin(tl[b], sampling)) <= TOPP_NEAR:
                        excused += 1
                        continue
                    mism += m
                    problems += [f"V={V} T={temperature} k={top_k} p={top_p} B={B} row {b}: {p}" for p in probs]
    assert not problems, "\n".join(problems[:20])
    assert rows > 0 and mism + excused <= 0.01 * rows, (mism, excused, rows)


@pytest.mark.gpu
def test_topp_in_kernel_is_deterministic():
    """The top-p threshold sums masses with integer atomics: repeated calls (any block order, any atomic
    order) give bitwise the same outputs, for each dtype's select (fp32 keys of z, 16-bit keys of x) and for
    the candidate select after top-k."""
    _require_kernels()
    B, gamma, V = 8, 5, 151936
    for dtype in GPU_DTYPES:
        tl, dl, g = _gpu_logits(B, gamma, V, dtype, "dense", seed=41)
        tokens = torch.randint(0, V, (B, gamma), generator=g, device="cuda")
        u = torch.rand((B, gamma), generator=g, device="cuda")
        u_res = torch.rand((B,), generator=g, device="cuda")
        for topk in (0, 200):
            first = kernels.verify_cuda("exact", tokens, dl, tl, u, u_res, scale=float(kernels.topk_scale(0.8)),
                                        topk=topk, top_p=0.9)
            for _ in range(5):
                again = kernels.verify_cuda("exact", tokens, dl, tl, u, u_res, scale=float(kernels.topk_scale(0.8)),
                                            topk=topk, top_p=0.9)
                for name in first:
                    assert torch.equal(first[name], again[name]), (dtype, topk, name)


def _syncs_seen(fn) -> list[str]:
    """The synchronizing CUDA operations torch's sync debug mode reports while fn runs, each as
    'file:line: message' (where it was reported, so that a failure names the sync)."""
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # Only the reports of a sync: switching the mode on also warns, that the mode is a prototype.
    return [f"{Path(w.filename).name}:{w.lineno}: {w.message}" for w in caught
            if "called a synchronizing CUDA operation" in str(w.message)]


@pytest.mark.gpu
def test_verify_makes_no_other_sync():
    """verify() on the kernel path: the uniforms, the kernels and one readback. torch's sync debug mode may
    see that readback's wait (at most one sync), nothing else, and host() reads nothing more; the torch
    path, for contrast, syncs several times."""
    _require_kernels()
    from specviz.verify import verify

    B, gamma, V = 4, 5, 151936
    tl, dl, g = _gpu_logits(B, gamma, V, torch.bfloat16, "dense", seed=3)
    tokens = torch.randint(0, V, (B, gamma), generator=g, device="cuda")
    for mode, sampling in (("exact", SamplingConfig(temperature=0.8)),
                           ("exact", SamplingConfig(temperature=0.8, top_k=40)),
                           ("exact", SamplingConfig(temperature=0.8, top_p=0.9)),
                           ("sigmoid", SamplingConfig(temperature=0.8, top_k=40, top_p=0.9))):
        gen = torch.Generator(device="cuda").manual_seed(1)
        verify(mode, tokens, dl, tl, sampling, gen, backend="cuda")  # plans, compiles: outside the count
        out = {}

        def kernel_call():
            out["res"] = verify(mode, tokens, dl, tl, sampling, gen, backend="cuda")
            out["host"] = out["res"].host()

        seen = _syncs_seen(kernel_call)
        assert len(seen) <= 1, (mode, sampling, seen)
        res, h = out["res"], out["host"]
        assert len(_syncs_seen(lambda: verify(mode, tokens, dl, tl, sampling, gen, backend="torch").host())) > 1
        assert h.n_accepted == res.n_accepted.tolist() and h.next_token == res.next_token.tolist()
        assert h.p_draft == res.p_draft.tolist() and h.uniforms == res.uniforms.tolist()
    bad = tokens.clone()
    bad[2, 3] = V
    with pytest.raises(ValueError, match=r"position \[2, 3\]"):
        verify("exact", bad, dl, tl, SamplingConfig(temperature=1.0), backend="cuda")


def _stress_case(rng: np.random.Generator, i: int) -> dict:
    B = int(rng.choice([1, 2, 3, 8, 17, 64]))
    gamma = int(rng.integers(1, 9))
    V = int(rng.choice([7, 1000, 4099, 51865, 151936]))
    tl, dl, g = _gpu_logits(B, gamma, V, GPU_DTYPES[i % 3], "dense" if i % 4 else "sparse", seed=20_000 + i)
    tokens = torch.randint(0, V, (B, gamma), generator=g, device="cuda")
    u = torch.rand((B, gamma), generator=g, device="cuda")
    u_res = torch.rand((B,), generator=g, device="cuda")
    # chunk counts from 1 to V per row (stats_chunk=1 only where the workspace stays small)
    chunks = dict(stats_chunk=int(rng.choice([0, 1 if V <= 4099 else 257, 257, 4096])) or None,
                  residual_chunk=int(rng.choice([0, 1024, 1777, 4096])) or None)
    mode = "exact" if i % 3 else "sigmoid"
    topk = int(rng.choice([0, 0, 5, 300])) if V > 300 and B <= 8 else 0
    top_p = float(rng.choice([1.0, 1.0, 0.9, 0.3]))
    return dict(mode=mode, args=(tokens, dl, tl, u, u_res), kw=dict(sigmoid_alpha=-8.0, sigmoid_beta=8.0, topk=topk,
                                                                      top_p=top_p, **chunks))


@pytest.mark.gpu
def test_stress_back_to_back_launches():
    """200 verifications of varying B, γ, V, dtypes, modes and chunk counts queued without a sync in
    between (check=False), so consecutive grids reuse the per-stream ticket counters while earlier ones may
    still run; each must equal the same call run alone with its readback."""
    _require_kernels()
    rng = np.random.default_rng(0)
    cases = [_stress_case(rng, i) for i in range(200)]
    alone = []
    for c in cases:
        alone.append(kernels.verify_cuda(c["mode"], *c["args"], **c["kw"]))
        torch.cuda.synchronize()
    queued = [kernels.verify_cuda(c["mode"], *c["args"], **c["kw"], check=False) for c in cases]
    torch.cuda.synchronize()
    for i, (a, q) in enumerate(zip(alone, queued)):
        for name in a:
            assert torch.equal(a[name], q[name]), (i, cases[i]["mode"], cases[i]["kw"], name)


@pytest.mark.gpu
def test_stress_producer_on_side_stream():
    """A producer writes the logits on a side stream (behind a long matmul, so they are late); the kernels
    run on the main stream after waiting for it, and also on the side stream itself, back to back; results
    must equal those computed from the finished logits."""
    _require_kernels()
    B, gamma, V = 8, 5, 151936
    tl0, dl0, g = _gpu_logits(B, gamma, V, torch.float16, "dense", seed=11)
    tokens = torch.randint(0, V, (B, gamma), generator=g, device="cuda")
    u = torch.rand((B, gamma), generator=g, device="cuda")
    u_res = torch.rand((B,), generator=g, device="cuda")
    expected = kernels.verify_cuda("exact", tokens, dl0, tl0, u, u_res)
    side = torch.cuda.Stream()
    big = torch.randn(4096, 4096, device="cuda")
    main = torch.cuda.current_stream()
    for rep in range(20):
        tl, dl = torch.empty_like(tl0), torch.empty_like(dl0)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for _ in range(3):
                big = (big @ big).tanh_()  # keeps the side stream busy
            tl.copy_(tl0)
            dl.copy_(dl0)
            on_side = kernels.verify_cuda("exact", tokens, dl, tl, u, u_res, check=False)
        main.wait_stream(side)
        for t in (tl, dl, *on_side.values()):
            t.record_stream(main)
        on_main = kernels.verify_cuda("exact", tokens, dl, tl, u, u_res)
        for name in expected:
            assert torch.equal(on_main[name], expected[name]), (rep, name)
            assert torch.equal(on_side[name], expected[name]), (rep, name)


# ----------------------------------------------------------------------------------------------------
# GPU: one CUDA graph per layout and generator, owning its inputs (kernels/cuda/graphs.py)
# ----------------------------------------------------------------------------------------------------


@pytest.fixture
def graph_cache():
    """launch_sampled's graph cache, empty before and after the test (never-graphed layouts too)."""
    cache = kernels.launcher._graph_cache
    cache.clear()
    yield cache
    cache.clear()


def _graph_inputs(B: int, gamma: int, V: int, dtype: torch.dtype, seed: int):
    """tokens [B, γ] drawn from the draft, draft logits [B, γ, V], target logits [B, γ+1, V] on the GPU."""
    tl, dl, g = _gpu_logits(B, gamma, V, dtype, "dense", seed=seed)
    tokens = torch.multinomial(torch.softmax(dl.float().reshape(-1, V), -1), 1, generator=g).reshape(B, gamma)
    return tokens, dl, tl


GRAPH_CASES = [  # (mode, B, γ, V, dtype, settings)
    ("exact", 1, 5, 151936, torch.float32, {}),
    ("exact", 8, 5, 151936, torch.bfloat16, {}),
    ("sigmoid", 8, 5, 151936, torch.float32, dict(sigmoid_alpha=-8.0, sigmoid_beta=8.0)),
    ("exact", 3, 2, 51865, torch.float16, dict(topk=50, top_p=0.9)),
    ("sigmoid", 1, 3, 51865, torch.bfloat16, dict(sigmoid_alpha=-8.0, sigmoid_beta=8.0, top_p=0.8)),
    ("exact", 2, 1, 7, torch.float32, dict(lenience=0.7)),
]


def _strided_copy(t: torch.Tensor) -> torch.Tensor:
    """t's values in new storage, non-contiguous where B > 1 (batch-major storage of [B, rows, V] seen through a
    transpose). clone, not contiguous(): at B = 1 the transpose is already contiguous and would not be copied."""
    return t.transpose(0, 1).clone(memory_format=torch.contiguous_format).transpose(0, 1)


@pytest.mark.gpu
def test_graphed_call_decides_as_the_eager_kernels(graph_cache):
    """launch_sampled through its graph against `launch` with the uniforms the graph drew: every output
    bitwise equal, and the host lists too, over several replays, which draw fresh uniforms each time. Every
    call passes fresh tensors, as the decoding engine does: the capturing call's, then clones (other
    objects at other addresses), other logits of the layout, and non-contiguous ones; each hits the one
    graph of its layout and decides for its own inputs. With graphs switched off nothing is captured."""
    _require_kernels()
    gens = []
    for i, (mode, B, gamma, V, dtype, settings) in enumerate(GRAPH_CASES):
        first = _graph_inputs(B, gamma, V, dtype, seed=50 + i)
        other = _graph_inputs(B, gamma, V, dtype, seed=150 + i)
        calls = [first, tuple(t.clone() for t in first), other, tuple(t.clone() for t in other),
                 (first[0], _strided_copy(first[1]), _strided_copy(first[2])), first]
        gen = torch.Generator(device="cuda").manual_seed(i)
        gens.append(gen)  # alive: a generator's graphs go once it does
        previous, addresses = None, set()
        for rep, (tokens, dl, tl) in enumerate(calls):
            done = kernels.launch_sampled(mode, tokens, dl, tl, gen, graphs_on=True, **settings)
            assert done.graphed, (mode, B, gamma, V, dtype)
            outputs = {k: v.clone() for k, v in done.outputs.items()}  # the graph's buffer: the next replay writes it
            u, u_res = outputs["uniforms"], done.u_res.clone()
            eager = kernels.launch(mode, tokens, dl, tl, u, u_res, **settings)
            for name in outputs:
                assert torch.equal(outputs[name], eager.outputs[name]), (mode, B, gamma, V, dtype, rep, name)
            assert done.host == eager.host
            assert previous is None or not torch.equal(u, previous), "a replay reused the previous uniforms"
            previous = u
            addresses.add((tokens.data_ptr(), dl.data_ptr(), tl.data_ptr()))
            assert len(graph_cache.keys()) == i + 1, (mode, B, gamma, V, dtype, rep)  # the same graph
        assert len(addresses) == len(calls) - 1  # fresh addresses every call but the last
    assert len(graph_cache.keys()) == len(GRAPH_CASES)
    # with the same uniforms, two sets of inputs of one layout decide for their own (no stale inputs replayed)
    mode, B, gamma, V, dtype, settings = GRAPH_CASES[0]
    first, other = _graph_inputs(B, gamma, V, dtype, seed=50), _graph_inputs(B, gamma, V, dtype, seed=150)
    twin = torch.Generator(device="cuda").manual_seed(123)
    a = kernels.launch_sampled(mode, *first, twin, graphs_on=True, **settings)
    a = {k: v.clone() for k, v in a.outputs.items()}
    twin.manual_seed(123)
    b = kernels.launch_sampled(mode, *other, twin, graphs_on=True, **settings).outputs
    assert torch.equal(a["uniforms"], b["uniforms"]) and not torch.equal(a["p_draft"], b["p_draft"])
    assert len(graph_cache.keys()) == len(GRAPH_CASES) + 1  # the twin generator's graph
    tokens, dl, tl = _graph_inputs(B, gamma, V, dtype, seed=99)
    before = kernels.graphs_enabled()
    kernels.set_graphs_enabled(False)
    try:
        assert not kernels.launch_sampled(mode, tokens, dl, tl, None, **settings).graphed
    finally:
        kernels.set_graphs_enabled(before)
    assert len(graph_cache.keys()) == len(GRAPH_CASES) + 1


@pytest.mark.gpu
def test_graphed_uniforms_continue_the_generator(graph_cache):
    """The graph draws what kernel_args would: u then u_res from the generator's state at the call, and
    leaves the generator where those two eager draws would (the capture itself draws nothing), with fresh
    tensors every call. A second generator gets its own graph of the layout (each draws from its own
    generator)."""
    _require_kernels()
    B, gamma, V = 4, 5, 51865
    tokens, dl, tl = _graph_inputs(B, gamma, V, torch.float32, seed=7)
    gens = [torch.Generator(device="cuda").manual_seed(11), torch.Generator(device="cuda").manual_seed(12)]
    for call in range(8):  # each generator's first call captures, then replays
        gen = gens[call % 2]
        state = gen.get_state()
        done = kernels.launch_sampled("exact", *(t.clone() for t in (tokens, dl, tl)), gen, graphs_on=True)
        assert done.graphed
        twin = torch.Generator(device="cuda")
        twin.set_state(state)
        u = torch.rand((B, gamma), generator=twin, device="cuda")
        u_res = torch.rand((B,), generator=twin, device="cuda")
        assert torch.equal(done.outputs["uniforms"], u) and torch.equal(done.u_res, u_res), call
        assert torch.equal(gen.get_state(), twin.get_state()), call
    assert len(graph_cache.keys()) == 2
    assert sorted(instance for _, instance in graph_cache.keys()) == sorted(id(g) for g in gens)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graphed_invalid_logits_raise_on_gpu(graph_cache, dtype):
    """Through the graph (captured by the first call, then replayed: bad inputs are copied into it like any
    others), bad logits and drafted ids raise naming the row; afterwards the graph's own state is clean and a
    valid call decides as eager."""
    _require_kernels()
    B, gamma, V = 3, 2, 51865
    tokens, dl, tl = _graph_inputs(B, gamma, V, dtype, seed=1)
    gen = torch.Generator(device="cuda").manual_seed(2)
    run = functools.partial(kernels.launch_sampled, "sigmoid", generator=gen, graphs_on=True, sigmoid_alpha=-8.0,
                            sigmoid_beta=8.0)
    bad_draft, bad_target, bad_tokens = dl.clone(), tl.clone(), tokens.clone()
    bad_draft[1, 1, 40000] = float("nan")
    bad_target[2, 0, V - 1] = float("inf")
    bad_tokens[1, 0] = V
    cases = [((tokens, bad_draft, tl), InvalidLogitsError, r"draft logits contain NaN at index \[1, 1\]"),
             ((tokens, dl, bad_target), InvalidLogitsError, r"target logits contain \+inf at index \[2, 0\]"),
             ((bad_tokens, dl, tl), ValueError, r"position \[1, 0\]")]
    for args, error, message in cases:
        for _ in range(2):  # a replay (the first call captures), then another
            with pytest.raises(error, match=message):
                run(*args)
        assert len(graph_cache.keys()) == 1
    for _ in range(2):
        done = run(tokens, dl, tl)
        assert done.graphed
        outputs, u_res = {k: v.clone() for k, v in done.outputs.items()}, done.u_res.clone()
        eager = kernels.launch("sigmoid", tokens, dl, tl, outputs["uniforms"], u_res, sigmoid_alpha=-8.0,
                               sigmoid_beta=8.0)
        assert all(torch.equal(outputs[k], eager.outputs[k]) for k in outputs)


@pytest.mark.gpu
def test_graphed_verify_makes_exactly_one_sync(graph_cache):
    """verify() on the graphed kernel path, after the call that captured: the copy-in, a replay and exactly
    one sync torch can see (the wait for the pinned copy); host() reads nothing more; no new graph; the same
    with fresh tensors (clones made outside the count)."""
    _require_kernels()
    from specviz.verify import verify

    B, gamma, V = 1, 5, 151936
    tokens, dl, tl = _graph_inputs(B, gamma, V, torch.float32, seed=3)
    for sampling in (SamplingConfig(temperature=0.8), SamplingConfig(temperature=0.8, top_k=40, top_p=0.9)):
        gen = torch.Generator(device="cuda").manual_seed(1)
        verify("exact", tokens, dl, tl, sampling, gen, backend="cuda")  # warm-up and capture: outside the count
        graphs_before = graph_cache.keys()
        out = {}

        def kernel_call(args):
            out["res"] = verify("exact", *args, sampling, gen, backend="cuda")
            out["host"] = out["res"].host()

        for args in ((tokens, dl, tl), tuple(t.clone() for t in (tokens, dl, tl))):
            seen = _syncs_seen(lambda: kernel_call(args))
            assert len(seen) == 1, (sampling, seen)
            assert graph_cache.keys() == graphs_before
            assert out["host"].n_accepted == out["res"].n_accepted.tolist()
            assert out["host"].uniforms == out["res"].uniforms.tolist()
