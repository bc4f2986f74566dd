"""The fp16-weight kernel (kernels/cpu/half_matmul_cpu.cpp, specviz.models.half_linear): the same products as fp32
up to summation order, every row the same bits in any call and on every build. Whisper's decoder on it transcribes
as the fp32 decoder does (tests/test_asr.py)."""

import copy
import ctypes
import subprocess

import pytest
import torch
from torch import nn

from specviz.models import cpu_kernels
from specviz.models.half_linear import HalfLinear, halve_linears
from specviz.native import _compiler

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="the CPU kernels do not build here")

SOURCE = next(p for p in cpu_kernels.SOURCES if p.name == "half_matmul_cpu.cpp")

SHAPES = [(37, 64, True), (512, 512, True), (2048, 512, False), (512, 2048, True), (5, 8, False)]  # N, K, bias


def fp16_linear(n: int, k: int, bias: bool, seed: int) -> nn.Linear:
    """An fp32 linear layer whose weights are fp16 values (as Whisper's are)."""
    torch.manual_seed(seed)
    linear = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(linear.weight.half().float())
    return linear


@pytest.mark.parametrize("n, k, bias", SHAPES)
def test_matches_fp64_within_fp32_rounding(n, k, bias):
    linear = fp16_linear(n, k, bias, seed=n + k)
    half = HalfLinear.from_linear(linear)
    assert half is not None and half.weight.dtype == torch.float16
    x = torch.randn(9, k) * 3
    exact = x.double() @ linear.weight.double().T + (linear.bias.double() if bias else 0)
    got = half(x).double()
    # fp32 sums of k products: relative to the size of the terms, a few ulps times sqrt(k)
    scale = (x.double().abs() @ linear.weight.double().abs().T).clamp_min(1e-30)
    assert ((got - exact).abs() / scale).max() < 4e-7 * k ** 0.5
    assert torch.allclose(half(x), linear(x), rtol=1e-5, atol=1e-5)  # and torch's own fp32 linear


@pytest.mark.parametrize("n, k, bias", SHAPES)
def test_a_row_gets_the_same_bits_in_any_call(n, k, bias):
    """Alone or among 1 … 13 rows (every tile shape and remainder, 4-row and 2-row builds alike)."""
    half = HalfLinear.from_linear(fp16_linear(n, k, bias, seed=1))
    x = torch.randn(13, k)
    alone = torch.cat([half(x[r:r + 1]) for r in range(13)])
    for m in range(1, 14):
        assert torch.equal(half(x[:m]), alone[:m]), f"a row differs when scored among {m} rows"
    assert torch.equal(half(x[5:12]), alone[5:12])  # rows need not start a tile
    assert torch.equal(half(x.reshape(13, 1, k)).reshape(13, n), alone)  # leading dimensions as nn.Linear's


@pytest.mark.parametrize("n, k, bias", [(37, 64, True), (512, 512, True), (70, 2048, False)])
def test_many_rows_widen_the_weights_once_and_keep_the_bits(n, k, bias):
    """Calls of 64 rows or more (Whisper's 1,500 encoder frames) go by blocks of widened weights: every row the
    bits of its one-row call, whatever the remainder of rows (6-row tiles) and of columns (blocks of 32, tiles of 4)."""
    half = HalfLinear.from_linear(fp16_linear(n, k, bias, seed=8))
    x = torch.randn(131, k)
    alone = torch.cat([half(x[r:r + 1]) for r in range(131)])
    for m in (64, 65, 70, 131):
        assert torch.equal(half(x[:m]), alone[:m]), f"{m} rows"


def test_from_linear_refuses_what_would_change_the_layer():
    linear = fp16_linear(16, 64, True, seed=2)
    assert HalfLinear.from_linear(linear) is not None
    off = copy.deepcopy(linear)
    with torch.no_grad():
        off.weight[3, 5] += 1e-4  # no longer an fp16 value
    assert HalfLinear.from_linear(off) is None
    assert HalfLinear.from_linear(fp16_linear(16, 60, True, seed=2)) is None  # K not a multiple of 8
    assert HalfLinear.from_linear(copy.deepcopy(linear).double()) is None


def test_halving_a_module_keeps_its_outputs_and_survives_dtype_casts():
    """Module.float() converts floating buffers: the fp16 weight is held as int16 bits so it is not converted."""
    model = nn.Sequential(fp16_linear(64, 32, True, seed=3), nn.GELU(), fp16_linear(16, 64, False, seed=4))
    x = torch.randn(5, 32)
    before = model(x)
    assert halve_linears(model) == 2
    assert all(isinstance(m, HalfLinear) for m in (model[0], model[2]))
    after = model(x)
    assert torch.allclose(after, before, rtol=1e-5, atol=1e-6)
    model.float()
    assert model[0].weight.dtype == torch.float16 and torch.equal(model(x), after)


@pytest.mark.parametrize("march", ["haswell", "x86-64"])
def test_other_builds_compute_the_same_bits(tmp_path, march):
    """AVX2 with 2-row tiles (haswell) and the portable scalar path (x86-64: no F16C) against this machine's
    build, few rows and many (widened blocks): the same fp32 operations per output, so the same bits; a trace's
    target does not depend on the CPU."""
    lib_path = tmp_path / f"half-{march}.so"
    subprocess.run([_compiler(), "-O3", f"-march={march}", "-fopenmp", "-shared", "-fPIC", "-std=c++17",
                    str(SOURCE), "-o", str(lib_path)], check=True, capture_output=True, timeout=300)
    # (the source includes vector_math.h beside it)
    lib = ctypes.CDLL(str(lib_path))
    lib.specviz_f16_matmul.argtypes = cpu_kernels.library().specviz_f16_matmul.argtypes
    for n, k, bias in SHAPES:
        half = HalfLinear.from_linear(fp16_linear(n, k, bias, seed=5))
        for m in (1, 2, 3, 5, 8, 67):
            x = torch.randn(m, k)
            theirs = torch.empty(m, n)
            lib.specviz_f16_matmul(x.data_ptr(), m, k, half.bits.data_ptr(), n, cpu_kernels.address(half.bias),
                                   theirs.data_ptr(), 2)
            assert torch.equal(half(x), theirs), f"{march}: {n} × {k}, {m} rows"


def test_subnormal_and_special_weights_widen_exactly(tmp_path):
    """The portable path widens fp16 by hand: subnormals, zeros of both signs, the largest value, the least normal."""
    specials = torch.tensor([6e-8, -6e-8, 3e-5, 0.0, -0.0, 65504.0, -65504.0, 1.0, 2.0 ** -14, -2.5],
                            dtype=torch.float16)
    w = specials.repeat(8).reshape(10, 8).float()  # K = 8
    linear = nn.Linear(8, 10, bias=False)
    with torch.no_grad():
        linear.weight.copy_(w)
    half = HalfLinear.from_linear(linear)
    lib_path = tmp_path / "half-portable.so"
    subprocess.run([_compiler(), "-O3", "-march=x86-64", "-fopenmp", "-shared", "-fPIC", "-std=c++17",
                    str(SOURCE), "-o", str(lib_path)], check=True, capture_output=True, timeout=300)
    lib = ctypes.CDLL(str(lib_path))
    lib.specviz_f16_matmul.argtypes = cpu_kernels.library().specviz_f16_matmul.argtypes
    x = torch.zeros(1, 8)
    for j in range(8):  # one-hot inputs read single weights back
        x.zero_()
        x[0, j] = 1.0
        theirs = torch.empty(1, 10)
        lib.specviz_f16_matmul(x.data_ptr(), 1, 8, half.bits.data_ptr(), 10, None, theirs.data_ptr(), 1)
        assert torch.equal(theirs[0], w[:, j]) and torch.equal(half(x)[0], w[:, j])


def test_bad_calls_are_refused_before_the_kernel_reads_anything():
    with pytest.raises(ValueError, match="multiple of 8"):
        HalfLinear(torch.zeros(4, 12), None)
    half = HalfLinear.from_linear(fp16_linear(8, 16, True, seed=6))
    with pytest.raises(ValueError, match="f16_matmul"):
        cpu_kernels.f16_matmul(torch.zeros(2, 16).t().contiguous().t(), half.bits, None)  # not contiguous
    with pytest.raises(ValueError, match="f16_matmul"):
        cpu_kernels.f16_matmul(torch.zeros(2, 24), half.bits, None)  # K mismatch
    with pytest.raises(ValueError, match="f16_matmul"):
        cpu_kernels.f16_matmul(torch.zeros(2, 16), half.bits, torch.zeros(3))  # bias of another width


def test_a_reduced_head_keeps_the_fp16_rows_it_selects():
    """The draft's reduced head (decoding.drafts.SubsetHead) over an fp16 head: the selected rows' logits are the
    full head's bits, -inf elsewhere."""
    from specviz.decoding.drafts import SubsetHead

    head = HalfLinear.from_linear(fp16_linear(40, 32, False, seed=7))
    ids = torch.tensor([0, 1, 2, 5, 17, 39])
    sub = SubsetHead(head, ids, 40)
    assert isinstance(sub.linear, HalfLinear) and sub.size == 6
    x = torch.randn(2, 3, 32)
    got, full = sub(x), head(x)
    assert torch.equal(got[..., ids], full[..., ids])
    rest = torch.ones(40, dtype=torch.bool)
    rest[ids] = False
    assert torch.isneginf(got[..., rest]).all()


def test_gelu_rows_get_the_same_bits_in_any_call():
    """The lean Whisper decoder's GELU: a row alone or among many (past the size torch splits over threads)."""
    from specviz.speech.lean_decoder import _gelu

    x = torch.randn(40, 2048)
    alone = torch.cat([_gelu(x[r:r + 1]) for r in range(40)])
    assert torch.equal(_gelu(x), alone) and torch.equal(_gelu(x[3:29]), alone[3:29])
    assert torch.allclose(alone, torch.nn.functional.gelu(x))
    odd = torch.randn(9, 100)  # rows no multiple of two vectors go one by one
    assert torch.equal(_gelu(odd), torch.cat([_gelu(odd[r:r + 1]) for r in range(9)]))
