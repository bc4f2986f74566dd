"""Tests of the CUDA verification kernels: kernels/verify.cu and its CuPy wrapper kernels/__init__.py.

Everywhere (no GPU needed):
- every .cu file compiles (nvcc for sm_90 with warnings as errors; else CuPy's NVRTC), and with NVRTC too
  where CuPy is installed (the path `available()` takes at run time);
- `import kernels` works without CuPy, and `available()` is False without a GPU, without raising;
- the planner sizes grids to fill the GPU and handles chunk sizes that do not divide V;
- the kernels themselves run on the CPU under a small fiber-based CUDA emulator (built with g++ from the
  source below): they must decide as `verify_tiled` does on small cases of every kind, leave their state
  zeroed, raise the documented errors, and every __syncthreads / warp primitive must be reached by the
  whole block / warp at the same source line (the emulator fails the run otherwise).

On a GPU (marker `gpu`, skipped without CUDA; needs CuPy):
- agreement with `specviz.verify.tiled.verify_tiled` on the same CUDA tensors and uniforms, for
  V ∈ {7, 51865, 151936, 256000}, B ∈ {1, 8}, γ ∈ {1, 5, 20}, fp32/fp16/bf16, exact and sigmoid;
- the first emitted token follows p (chi-square at the sample size that detects TV 1%);
- NaN / +inf / all -inf logits and out-of-range drafted tokens raise errors naming the row;
- determinism, state reuse across shapes, expanded inputs, side streams, check=False / host=True.

Rounding. The kernels compute every probability with torch's own fp32 operations, so p(x), q(x) and the
ratios agree to the normalizer's last bits, but sums run in another order. A decision can therefore differ
where the torch path itself is within float32 noise of a boundary: a uniform within ~1e-6 of a ratio, or a
residual draw whose goal u·total lies within ~1e-6 of a token's CDF edge. With V = 151,936-256,000 and
every token live, tokens carry ~1e-6 of the mass each, so such draws are not rare: a CPU model of both
summation orders disagrees on ~0.5% of those rows (and the torch path's fp32 result disagrees with a
float64 computation on ~0.3%). Every disagreement must therefore be *certified* as a near-tie in float64
(`near_tie_token`, tolerance 1e-5 of probability mass, the tolerance tests/test_verify_statistics.py uses
for the same reason), and agreement must reach 99.9% of rows where logits have a sparse support (rounding
can then only matter for ~1e-4 of rows) and 99% where all V tokens are live.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from specviz.verify import project_kernels

kernels = project_kernels()  # the project's own kernels/ (a PyPI package is also named `kernels`)
from specviz.config import SamplingConfig
from specviz.sampling import InvalidLogitsError, standardize
from specviz.verify.tiled import verify_tiled

REPO = Path(__file__).resolve().parents[1]
TIE_TOLERANCE = 1e-5  # probability mass (relative to the residual's total) within which a draw is a near-tie
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
                       sigmoid=(alpha, beta) if mode == "sigmoid" else None)
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


def near_tie_token(mode, zp_row, zq_row, n, gamma, scale, lenience, alpha, beta, u_res, tokens) -> bool:
    """True when every token in `tokens` is within TIE_TOLERANCE of the goal u_res·total on the float64 CDF of
    the residual the row samples (max(0, p_n - w·q_n), w = l on a rejection, 0 for the bonus; p_n alone when
    that residual is empty): the row is a near-tie, and float32 rounding may decide it either way."""
    p = _probs64(mode, zp_row, scale, alpha, beta)
    q = _probs64(mode, zq_row, scale, alpha, beta)
    w = lenience if n < gamma else 0.0
    r = torch.clamp(p - w * q, min=0)
    if float(r.sum()) <= 1e-9 * float(p.sum()):
        r = p
    cdf = torch.cumsum(r, 0) / r.sum()
    goal = float(u_res)
    for t in tokens:
        lo = float(cdf[t - 1]) if t > 0 else 0.0
        hi = float(cdf[t])
        if max(lo - goal, goal - hi, 0.0) > TIE_TOLERANCE:
            return False
    return True


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
        if tok_k[b] != tok_t[b]:
            mismatches += 1
            n, qn = n_k[b], min(n_k[b], gamma - 1)
            if not near_tie_token(mode, tl[b, n], dl[b, qn], n, gamma, scale, lenience, alpha, beta,
                                  u_res[b], (tok_k[b], tok_t[b])):
                problems.append(f"row {b}: next_token {tok_k[b]} vs torch {tok_t[b]} (n={n}): not a near-tie")
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


@pytest.mark.skipif(not _nvrtc_available(), reason="CuPy (with NVRTC) is not installed")
def test_cuda_sources_compile_with_nvrtc():
    """NVRTC has no implicit CUDA headers: this is the compile `available()` does at run time."""
    kernels.nvrtc_check()


def test_compile_check_reports_compiler_errors(tmp_path, monkeypatch):
    if _nvcc() is None:
        pytest.skip("nvcc is not available")
    broken = tmp_path / "broken.cu"
    broken.write_text("extern \"C\" __global__ void k(float* x) { x[0] = undefined_name; }\n")
    monkeypatch.setattr(kernels, "source_files", lambda: [broken])
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


def test_prepare_grids_and_buffers():
    """The device-agnostic half of verify_cuda on CPU tensors: grids, chunking, input validation."""
    tokens, dl, tl, u, ur = _cpu_case(B=3, gamma=4, V=1000)
    state = torch.zeros(kernels.state_size(3, 4), dtype=torch.int32)
    prep = kernels._prepare("exact", tokens, dl, tl, u, ur, scale=1.0, lenience=1.0, sigmoid_alpha=-1e4,
                            sigmoid_beta=1e4, state=state, sms=132, stats_chunk=300, residual_chunk=333)
    (n1, g1, a1), (n2, g2, a2) = prep.launches
    assert (n1, g1) == ("sv_exact_stats_f32", (4, 9, 3))  # ceil(1000/300) chunks × (2γ+1) rows × B
    assert (n2, g2) == ("sv_exact_resample_f32", (4, 3, 1))  # ceil(1000/333) chunks × B
    assert len(a1) == 11 and len(a2) == 23
    prep = kernels._prepare("sigmoid", tokens, dl.half(), tl.half(), u, ur, scale=1.0, lenience=1.0,
                            sigmoid_alpha=-1.0, sigmoid_beta=1.0, state=state, sms=132, residual_chunk=999)
    ((name, grid, args),) = prep.launches
    assert (name, grid, len(args)) == ("sv_sigmoid_f16", (2, 9, 3), 22)
    bad = dict(scale=1.0, lenience=1.0, sigmoid_alpha=-1e4, sigmoid_beta=1e4, state=state, sms=132)
    with pytest.raises(ValueError, match="γ <="):
        kernels._prepare("exact", torch.zeros(1, 300, dtype=torch.long), torch.zeros(1, 300, 5),
                         torch.zeros(1, 301, 5), torch.zeros(1, 300), torch.zeros(1), **bad)
    with pytest.raises(ValueError, match="lenience"):
        kernels._prepare("exact", tokens, dl, tl, u, ur, **{**bad, "lenience": 0.0})
    with pytest.raises(ValueError, match="unknown CUDA verification mode"):
        kernels._prepare("baseline", tokens, dl, tl, u, ur, **bad)
    with pytest.raises(ValueError, match="target_logits must be"):
        kernels._prepare("exact", tokens, dl, tl[:, :3], u, ur, **bad)


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
inline void __threadfence() {}
inline int atomicMin(int* p, int v) { int o = *p; if (v < o) *p = v; return o; }
inline int atomicMax(int* p, int v) { int o = *p; if (v > o) *p = v; return o; }
inline int atomicOr(int* p, int v) { int o = *p; *p = o | v; return o; }
inline unsigned atomicAdd(unsigned* p, unsigned v) { unsigned o = *p; *p = o + v; return o; }
inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
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
  ENTRY(sv_exact_stats_f32) ENTRY(sv_exact_resample_f32) ENTRY(sv_sigmoid_f32)
  ENTRY(sv_exact_stats_f16) ENTRY(sv_exact_resample_f16) ENTRY(sv_sigmoid_f16)
  ENTRY(sv_exact_stats_bf16) ENTRY(sv_exact_resample_bf16) ENTRY(sv_sigmoid_bf16)
  snprintf(err, errlen, "unknown kernel %s", cname);
  return 1;
}
"""


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    """The kernels compiled for the CPU emulator (g++), as a ctypes library."""
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("g++ is not available to build the CPU emulator")
    d = tmp_path_factory.mktemp("cuda_emulator")
    (d / "emu.h").write_text(EMULATOR_H)
    (d / "main.cpp").write_text(EMULATOR_MAIN.replace("@SOURCE@", str(kernels.source_files()[0])))
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
            stats_chunk=None, residual_chunk=None, sms=132, seed=0):
    """verify_cuda's steps with the launches run by the emulator on CPU tensors."""
    B, gamma = tokens.shape
    state = torch.zeros(kernels.state_size(B, gamma) + 7, dtype=torch.int32)
    prep = kernels._prepare(mode, tokens, dl, tl, u, u_res, scale=scale, lenience=lenience, sigmoid_alpha=alpha,
                            sigmoid_beta=beta, state=state, sms=sms, stats_chunk=stats_chunk,
                            residual_chunk=residual_chunk)
    for name, grid, args in prep.launches:
        arrays = [np.asarray(a) for a in args]
        bufs = [ctypes.create_string_buffer(a.tobytes(), a.nbytes) for a in arrays]
        ptrs = (ctypes.c_void_p * len(bufs))(*[ctypes.addressof(b) for b in bufs])
        sizes = (ctypes.c_int * len(bufs))(*[a.nbytes for a in arrays])
        err = ctypes.create_string_buffer(1024)
        rc = so.emu_launch(name.encode(), *grid, kernels.THREADS, ptrs, sizes, len(bufs), seed, err, 1024)
        assert rc == 0, f"{name} {grid}: {err.value.decode()}"
    assert bool((state == 0).all()), "the kernels must leave their ticket counters and error words at zero"
    views = kernels._views(prep.buffer, B, gamma)
    kernels.raise_for_errors(views.pop("errors"), prep.vocab)
    return views


def _emulated_case(label, mode="exact", B=2, gamma=3, V=7, dtype=torch.float32, sampling=SamplingConfig(temperature=1.0),
                   lenience=1.0, alpha=-1e4, beta=1e4, spread=2.0, noise=1.0, shift=0.0, live=None, expand=False,
                   seed=0, **chunks):
    return pytest.param(dict(mode=mode, B=B, gamma=gamma, V=V, dtype=dtype, sampling=sampling, lenience=lenience,
                             alpha=alpha, beta=beta, spread=spread, noise=noise, shift=shift, live=live,
                             expand=expand, seed=seed, chunks=chunks), id=label)


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
    _emulated_case("exact-sparse-support", V=3000, live=20, stats_chunk=1024, residual_chunk=1024),
    _emulated_case("exact-expanded-batch", B=4, V=900, expand=True, stats_chunk=256, residual_chunk=300),
    _emulated_case("sigmoid-empty-residual", mode="sigmoid", B=3, V=300, alpha=-1.0, beta=1.0, spread=0.5, noise=0.0,
                   shift=6.0, residual_chunk=100),
    _emulated_case("sigmoid-default-alpha-beta", mode="sigmoid", V=500, residual_chunk=200),
]


def _make_logits(c, device="cpu"):
    g = torch.Generator(device=device).manual_seed(c["seed"])
    B, gamma, V = c["B"], c["gamma"], c["V"]
    rows = 1 if c["expand"] else B
    tl = c["spread"] * torch.randn(rows, gamma + 1, V, generator=g, device=device)
    dl = tl[:, :gamma] + c["noise"] * torch.randn(rows, gamma, V, generator=g, device=device) + c["shift"]
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
    near-tie), same p(x), q(x), ratios. Blocks run in shuffled order, so any block may be the last."""
    c = case
    tokens, dl, tl = _make_logits(c)
    sampling = c["sampling"]
    ref, u, u_res = torch_path(c["mode"], tokens, dl, tl, sampling, c["lenience"], c["alpha"], c["beta"], seed=c["seed"] + 1)
    dk, tk, scale = kernel_inputs(sampling, dl, tl)
    chunks = dict(c["chunks"])
    sms = chunks.pop("sms", 132)
    out = emulate(emulator, c["mode"], tokens, dk, tk, u, u_res, scale=scale, lenience=c["lenience"], alpha=c["alpha"],
                  beta=c["beta"], sms=sms, seed=c["seed"], **chunks)
    _, compared, problems = compare_rows(c["mode"], out, ref, tokens, dk, tk, u, u_res, scale, c["lenience"],
                                                  c["alpha"], c["beta"])
    assert not problems, problems
    assert compared == tokens.shape[0], "n_accepted differs (near-ties only)"
    if c["noise"] == 0.0 and c["shift"] > 0:  # q̂ > p̂ everywhere: the rejections have an empty residual
        assert bool((out["n_accepted"] < c["gamma"]).any()), "the case should contain rejections"


def test_emulated_errors(emulator):
    """NaN / +inf / all -inf rows and out-of-range drafted tokens raise, naming tensor and row, in both modes."""
    for mode in ("exact", "sigmoid"):
        for dtype in (torch.float32, torch.bfloat16):
            tokens, dl, tl, u, ur = _cpu_case(B=3, gamma=2, V=300, seed=3)
            dl, tl = dl.to(dtype), tl.to(dtype)
            run = functools.partial(emulate, emulator, mode, u=u, u_res=ur, alpha=-5.0, beta=5.0,
                                    stats_chunk=128, residual_chunk=128)
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
    if not kernels.available():
        pytest.skip(f"CUDA kernels unavailable: {kernels.unavailable_reason()}")


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


def _first_tokens_gpu(pair, n: int, seed: int, chunk_rows: int = 1 << 15) -> np.ndarray:
    """verify_cuda on n copies of the pair (logits expanded, not copied), drafts drawn from q on the GPU."""
    dl, tl, scale = kernel_inputs(pair.sampling, pair.draft_logits.cuda(), pair.target_logits.cuda())
    gamma, V = dl.shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.softmax(standardize(pair.draft_logits.cuda(), pair.sampling), dim=-1)
    counts = torch.zeros(V, dtype=torch.long, device="cuda")
    done = 0
    while done < n:
        b = min(chunk_rows, n - done)
        tokens = torch.stack([torch.multinomial(q[j], b, replacement=True, generator=g) for j in range(gamma)], dim=1)
        u = torch.rand((b, gamma), generator=g, device="cuda")
        u_res = torch.rand((b,), generator=g, device="cuda")
        out = kernels.verify_cuda("exact", tokens, dl.expand(b, -1, -1), tl.expand(b, -1, -1), u, u_res, scale=scale)
        first = torch.where(out["n_accepted"] >= 1, tokens[:, 0], out["next_token"])
        counts += torch.bincount(first, minlength=V)
        done += b
    return counts.cpu().numpy()


@pytest.mark.gpu
def test_first_token_follows_target_on_gpu():
    """Leviathan et al. Thm 3.1 on the kernel: with drafts from q, the first emitted token follows p. Edge
    pairs of tests/test_verify_statistics.py plus its V = 151,936 pair (40 heavy tokens spread over the
    vocabulary, so chunk edges matter, and a tail bin), each at the N that detects TV ≥ 0.01 with power
    0.99 at level 1e-3 / (number of pairs)."""
    _require_kernels()
    st = _stats_module()
    pairs = st.edge_pairs()
    large, heavy = st.large_pair(151936)
    alpha = st.FAMILY_ALPHA / (len(pairs) + 1)
    failures = []
    for i, pair in enumerate(pairs):
        p = st.probs_of(pair.target_logits[0], pair.sampling)
        n = st.samples_to_detect_tv(st.FULL_TV, st.support_dof(p), alpha, st.POWER)
        failure = st.gof_failure(_first_tokens_gpu(pair, n, seed=500 + i), p, alpha)
        if failure:
            failures.append(f"{pair.label}: {failure}")
    p = st.probs_of(large.target_logits[0], large.sampling)
    n = st.samples_to_detect_tv(st.FULL_TV, heavy.size, alpha, st.POWER)
    failure = st.gof_failure(*st.tail_binned(_first_tokens_gpu(large, n, seed=999), p, heavy), alpha)
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
