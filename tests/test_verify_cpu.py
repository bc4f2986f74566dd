"""`exact`'s full-vocabulary passes in C++ on the CPU (kernels/cpu/verify_cpu.cpp, specviz/verify/cpu.py).

Exactness itself is tested by tests/test_verify_statistics.py, which runs every suite on these passes
(`exact`) and on the torch path (`exact/torch`). Here: the normalizers against float64, the decisions
against the torch path's (the same except at float32 near-ties, each certified against a float64 inverse
CDF), and the same bits from builds for other instruction sets (AVX2 without AVX-512; SSE2 only).
"""

from __future__ import annotations

import ctypes
import subprocess

import numpy as np
import pytest
import torch

import specviz
from specviz import native
from specviz.config import SamplingConfig
from specviz.paths import KERNELS
from specviz.verify import cpu

pytestmark = pytest.mark.skipif(not native.available(), reason="the CPU kernels do not build here")


def _logits(B: int, rows: int, V: int, seed: int, sparse: bool, spread: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    z = spread * torch.randn(B, rows, V, generator=g)
    if sparse and V > 8:
        z = z.masked_fill(torch.rand(B, rows, V, generator=g) < 0.9, float("-inf"))
        z[..., V // 3] = 1.0  # every row keeps a finite value
    return z


def test_row_lse_matches_float64():
    """Rows with wide ranges, -inf masks, a single finite value, V not a multiple of the 16 lanes."""
    for V in (1, 7, 17, 4096, 151_936):
        for sparse in (False, True):
            z = _logits(3, 4, V, seed=V, sparse=sparse, spread=8.0)
            z[0, 0] = float("-inf")
            z[0, 0, V - 1] = 50.0  # one finite value at the end of a row
            for scale in (1.0, 1.25, 0.1):
                got = cpu.row_lse(z, scale).double()
                want = torch.logsumexp(z.double() * scale, dim=-1)
                assert torch.allclose(got, want, rtol=2e-6, atol=2e-6), (V, sparse, scale, (got - want).abs().max())
    expanded = _logits(1, 3, 1000, seed=1, sparse=False).expand(5, -1, -1)  # stride 0 over the batch
    assert torch.equal(cpu.row_lse(expanded, 1.0), cpu.row_lse(expanded.contiguous(), 1.0))


def _inverse_cdf_ok(dist: np.ndarray, goal: float, token: int, tol: float = 1e-5) -> bool:
    cdf = np.cumsum(dist)
    below = cdf[token - 1] if token > 0 else 0.0
    return dist[token] > 0 and below - tol <= goal <= cdf[token] + tol


def test_exact_on_the_cpu_runs_the_cpp_passes_unless_told_not_to(monkeypatch):
    """verify('exact') on fp32 CPU logits reaches both C++ passes (so the suites that run `exact` test them);
    backend 'torch', sigmoid, and logits the passes cannot read (fp16) stay on torch."""
    calls = []
    for name in ("row_lse", "residual_pick"):
        real = getattr(cpu, name)
        monkeypatch.setattr(cpu, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    target = _logits(2, 4, 300, seed=3, sparse=False)
    draft = target[:, :3] + 0.5
    tokens = torch.zeros(2, 3, dtype=torch.long)
    sampling = SamplingConfig(temperature=0.9)
    specviz.verify("exact", tokens, draft, target, sampling, torch.Generator().manual_seed(0))
    assert calls == ["row_lse", "row_lse", "residual_pick"]
    calls.clear()
    specviz.verify("exact", tokens, draft, target, sampling, torch.Generator().manual_seed(0), backend="torch")
    specviz.verify("sigmoid", tokens, draft, target, sampling, torch.Generator().manual_seed(0))
    specviz.verify("exact", tokens, draft.half(), target.half(), sampling, torch.Generator().manual_seed(0))
    assert calls == []


@pytest.mark.parametrize("V", [7, 1000, 151_936])
def test_decisions_agree_with_the_torch_path(V: int):
    """Same seeds, same uniforms: n_accepted equal wherever u is not within 1e-5 of p/q, next_token equal in
    ≥ 99% of rows, and every native pick at the float64 inverse CDF of its residual (or bonus) distribution."""
    rows = mismatched = 0
    for case in range(12 if V > 1000 else 40):
        B, gamma = (1, 5) if case % 3 == 0 else ((4, 3) if case % 3 == 1 else (2, 1))
        temperature = (0.8, 1.0, 1.3)[case % 3]
        lenience = 0.7 if case % 4 == 0 else 1.0
        sparse = case % 2 == 1
        target = _logits(B, gamma + 1, V, seed=1000 + case, sparse=sparse)
        draft = (target[:, :gamma] + torch.randn(B, gamma, V, generator=torch.Generator().manual_seed(case)))
        sampling = SamplingConfig(temperature=temperature)
        q = torch.softmax(draft / temperature, dim=-1)
        tokens = torch.stack([torch.multinomial(q[b], 1, generator=torch.Generator().manual_seed(case + b)).squeeze(-1)
                              for b in range(B)])
        gen_state = torch.Generator().manual_seed(case)
        native_out = specviz.verify("exact", tokens, draft, target, sampling, torch.Generator().manual_seed(case),
                                    lenience=lenience)
        torch_out = specviz.verify("exact", tokens, draft, target, sampling, torch.Generator().manual_seed(case),
                                   lenience=lenience, backend="torch")
        assert torch.equal(native_out.uniforms, torch_out.uniforms)
        assert torch.allclose(native_out.p_draft, torch_out.p_draft, rtol=1e-5, atol=1e-9)
        ratio = (torch_out.p_draft.double() / (lenience * torch_out.q_draft.double()))
        clear = ((native_out.uniforms.double() - ratio).abs() > 1e-5).all(dim=-1)
        assert torch.equal(native_out.n_accepted[clear], torch_out.n_accepted[clear]), case
        assert torch.equal(torch.rand((B, gamma), generator=gen_state), native_out.uniforms)  # the documented order
        u_res = torch.rand((B,), generator=gen_state).double().numpy()
        p = torch.softmax(target.double() / temperature, dim=-1).numpy()
        qd = torch.softmax(draft.double() / temperature, dim=-1).numpy()
        for b in range(B):
            n = int(native_out.n_accepted[b])
            dist = np.clip(p[b, n] - lenience * qd[b, n], 0, None) if n < gamma else p[b, n]
            if dist.sum() <= 0:
                dist = p[b, n]
            token = int(native_out.next_token[b])
            assert _inverse_cdf_ok(dist, float(u_res[b] * dist.sum()), token), (case, b, token)
            rows += 1
            mismatched += int(token != int(torch_out.next_token[b]))
    assert mismatched <= 0.01 * rows, f"next_token differs from the torch path in {mismatched}/{rows} rows"


def _build(tmp_path, march: str) -> ctypes.CDLL:
    out = tmp_path / f"verify-{march}.so"
    subprocess.run([native._compiler(), "-O3", f"-march={march}", "-fopenmp", "-shared", "-fPIC", "-std=c++17",
                    str(KERNELS / "cpu" / "verify_cpu.cpp"), "-o", str(out)],
                   check=True, capture_output=True, timeout=300)
    lib = ctypes.CDLL(str(out))
    here = native.library()
    for name in ("specviz_row_lse", "specviz_residual_pick"):
        f = getattr(lib, name)
        f.argtypes, f.restype = getattr(here, name).argtypes, None
    return lib


@pytest.mark.parametrize("march", ["haswell", "x86-64"])
def test_same_bits_as_builds_for_other_instruction_sets(tmp_path, march: str, monkeypatch):
    """The 16 lanes do the same IEEE operations whatever registers hold them (AVX-512 here where the CPU has
    it, two AVX2 registers for haswell, four SSE ones for x86-64): normalizers and picks, bit for bit."""
    other = _build(tmp_path, march)
    B, gamma, V = 3, 4, 151_936
    target = _logits(B, gamma + 1, V, seed=5, sparse=False)
    draft = target[:, :gamma] + torch.randn(B, gamma, V, generator=torch.Generator().manual_seed(6))
    n = torch.tensor([0, 2, gamma])
    w = torch.tensor([1.0, 0.7, 0.0])
    u = torch.tensor([0.3, 0.999, 0.5])
    here = (cpu.row_lse(target, 1.25), cpu.row_lse(draft, 1.25))
    picks = cpu.residual_pick(target, draft, n, here[0], here[1], w, u, 1.25)
    monkeypatch.setattr(native, "library", lambda: other)
    there = (cpu.row_lse(target, 1.25), cpu.row_lse(draft, 1.25))
    assert torch.equal(here[0], there[0]) and torch.equal(here[1], there[1])
    assert torch.equal(picks, cpu.residual_pick(target, draft, n, here[0], here[1], w, u, 1.25))
