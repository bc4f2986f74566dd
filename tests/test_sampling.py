"""`specviz.sampling.draw`: the one sampler of draft tokens, target-only tokens and plain steps, tested as the
verifiers are: chi-square goodness of fit at stated power, fixed seeds, on both of its paths (the C++ inverse
CDF for fp32 CPU rows, the float64 running sum in torch for everything else)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import test_verify_statistics as st  # tests/ is on sys.path under pytest's default import mode
from specviz import native, sampling
from specviz.config import SamplingConfig

ALPHA = 1e-3 / 12  # family-wise 1e-3 over the cases below
PATHS = ["native", "torch"]


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    if request.param == "native":
        if not native.available():
            pytest.skip("the CPU kernels do not build here")
    else:
        monkeypatch.setattr(sampling, "_native_rows", lambda rows: False)
    return request.param


def _counts(logits: torch.Tensor, cfg: SamplingConfig, n: int, seed: int) -> np.ndarray:
    """n draws from one row of logits [V], in batches of identical rows (expanded, not copied) of at most
    2^22 logits (the torch path makes [rows, V] temporaries)."""
    g = torch.Generator().manual_seed(seed)
    chunk = max(1, (1 << 22) // logits.shape[-1])
    tokens = torch.cat([sampling.draw(logits.expand(min(chunk, n - done), -1), cfg, g) for done in range(0, n, chunk)])
    return torch.bincount(tokens, minlength=logits.shape[-1]).numpy()


CASES = [
    ("V=32, T=0.8", 32, SamplingConfig(temperature=0.8)),
    ("V=32, T=1.3, top-k 9", 32, SamplingConfig(temperature=1.3, top_k=9)),
    ("V=500, T=0.7, top-p 0.8", 500, SamplingConfig(temperature=0.7, top_p=0.8)),
    ("V=2, T=1", 2, SamplingConfig(temperature=1.0)),
]


@pytest.mark.parametrize("label, vocab, cfg", CASES, ids=[c[0] for c in CASES])
def test_draws_follow_the_standardized_distribution(path, label, vocab, cfg):
    """N sized to detect TV ≥ 0.01 with power 0.99; masked tokens (top-k, top-p) must never be drawn."""
    logits = 2.5 * torch.randn(vocab, generator=torch.Generator().manual_seed(vocab))
    p = st.probs_of(logits, cfg)
    n = st.samples_to_detect_tv(st.FULL_TV, st.support_dof(p), ALPHA, st.POWER)
    counts = _counts(logits, cfg, n, seed=3)
    assert counts[p == 0].sum() == 0, f"{label}: drew a token of probability 0"
    failure = st.gof_failure(counts, p, ALPHA)
    assert failure is None, f"{path} {label}: {failure}"


def test_large_vocabulary_heavy_tokens_and_tail(path):
    """V = 151,936 with 40 heavy tokens at the edges and in the middle and a tail bin: the inverse CDF must
    place each heavy token's interval right (chunk edges of the C++ scan included)."""
    vocab = 151_936
    rng = np.random.default_rng(0)
    heavy = st.heavy_tokens(vocab, rng)
    probs = st.spread_probs(vocab, heavy, 0.6, rng)
    logits = torch.from_numpy(np.log(probs)).float()
    p = st.probs_of(logits, SamplingConfig(temperature=1.0))
    n = 20_000
    counts = _counts(logits, SamplingConfig(temperature=1.0), n, seed=5)
    failure = st.gof_failure(*st.tail_binned(counts, p, heavy), ALPHA)
    note = f"N = {n} detects TV ≥ {st.detectable_tv(n, len(heavy), ALPHA, st.POWER):.3f} on the binned partition"
    assert failure is None, f"{path}: {failure} ({note})"


def test_rows_of_a_batch_are_drawn_from_their_own_logits(path):
    """A batch of different rows: each row's draws follow its own distribution (no row reads another's)."""
    vocab, per_row = 16, 60_000
    logits = 2.0 * torch.randn(3, vocab, generator=torch.Generator().manual_seed(9))
    logits[1, :8] = float("-inf")
    batch = logits.repeat_interleave(per_row, dim=0)  # [3·n, V]
    tokens = sampling.draw(batch, SamplingConfig(temperature=1.0), torch.Generator().manual_seed(2)).reshape(3, per_row)
    for r in range(3):
        p = st.probs_of(logits[r], SamplingConfig(temperature=1.0))
        counts = torch.bincount(tokens[r], minlength=vocab).numpy()
        assert st.gof_failure(counts, p, ALPHA) is None, (path, r)
    assert bool((tokens[1] >= 8).all())


def test_greedy_is_the_argmax_and_draws_no_random_number():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(7)
    state = g.get_state()
    assert torch.equal(sampling.draw(logits, SamplingConfig(temperature=0.0), g), logits.argmax(dim=-1))
    assert torch.equal(g.get_state(), state)


def test_argmax_is_torchs_on_ties_nan_infinities_and_strided_rows(path):
    """The greedy token on both paths is torch.argmax's: the first of tied maxima, the first NaN (torch counts NaN
    as largest), index 0 for a row of -inf only; rows of a larger tensor read in place; vocabularies of both pairs."""
    g = torch.Generator().manual_seed(3)
    cases = [torch.randn(1, 51865, generator=g), torch.randn(2, 5, 151936, generator=g),
             torch.randint(0, 3, (64, 1000), generator=g).float(), torch.randn(3, 6, 2000, generator=g)[:, 1:5],
             torch.randn(5, 17, generator=g)]
    odd = torch.randn(6, 1000, generator=g)
    odd[1, 500] = odd[1, 700] = odd[4, 3] = float("nan")
    odd[2] = float("-inf")
    odd[3, 999] = float("inf")
    odd[5, :9], odd[5, 9:] = -1.0, 0.0  # a plateau: 991 tied maxima from index 9 (one of them -0.0, equal to 0.0)
    odd[5, 400] = -0.0
    for x in [*cases, odd]:
        assert torch.equal(sampling.argmax(x), x.argmax(dim=-1)), x.shape
    assert sampling.argmax(odd).tolist() == [int(odd[0].argmax()), 500, 0, 999, 3, 9]


@pytest.mark.parametrize("cfg", [SamplingConfig(temperature=0.8), SamplingConfig(temperature=0.8, top_k=20),
                                 SamplingConfig(temperature=0)], ids=["temperature", "top-k", "greedy"])
def test_draw_checked_on_the_cpu_draws_as_draw_and_names_a_bad_row(cfg):
    """The CPU's sampled draw checks its rows from the normalizers it computes (a bad row's token -1), greedy
    from the value at its argmax: the same tokens as draw from the same generator state, and each kind of bad
    row named."""
    from specviz.sampling import InvalidLogitsError, draw, draw_checked

    z = torch.randn(4, 1000, generator=torch.Generator().manual_seed(2))
    want = draw(z, cfg, torch.Generator().manual_seed(3)).tolist()
    assert draw_checked(z, cfg, torch.Generator().manual_seed(3), "draft") == want
    for value, what, row in [(float("nan"), "NaN", 2), (float("inf"), r"\+inf", 1), (float("-inf"), "only -inf", 3)]:
        bad = z.clone()
        if value == float("-inf"):
            bad[row] = value
        else:
            bad[row, 7] = value
        with pytest.raises(InvalidLogitsError, match=rf"draft logits contain {what}.* at index \[{row}\]"):
            draw_checked(bad, cfg, torch.Generator().manual_seed(3), "draft")
    if not cfg.greedy:  # finite logits that overflow once divided by a tiny temperature
        huge = z.clone()
        huge[1, 3] = 3e38
        with pytest.raises(InvalidLogitsError, match=r"draft logits at row 1 overflow"):
            draw_checked(huge, SamplingConfig(temperature=0.01), torch.Generator().manual_seed(3), "draft")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["native", "torch"])
def test_a_rows_argmax_value_says_whether_the_row_is_usable(dtype):
    """argmax_is_finite against check_logits' definition (no NaN, no +inf, something finite), on the C++ argmax
    (fp32) and torch's (fp64), with the bad value before, at and after the row's finite maximum."""
    from specviz.sampling import argmax, argmax_is_finite

    g = torch.Generator().manual_seed(4)
    rows = []
    for place in (0, 50, 999):
        for value in (float("nan"), float("inf")):
            row = torch.randn(1000, generator=g, dtype=dtype)
            row[place] = value
            rows.append(row)
    masked = torch.full((1000,), float("-inf"), dtype=dtype)
    partly = masked.clone()
    partly[999] = -1e30  # one finite value among -inf: usable
    both = torch.randn(1000, generator=g, dtype=dtype)
    both[10], both[20] = float("inf"), float("nan")
    rows += [masked, partly, both, torch.randn(1000, generator=g, dtype=dtype)]
    z = torch.stack(rows)
    usable = [bool(torch.isfinite(r).any()) and not bool(torch.isnan(r).any() or torch.isposinf(r).any()) for r in z]
    assert argmax_is_finite(z, argmax(z)).tolist() == usable == [False] * 6 + [False, True, False, True]


@pytest.mark.gpu
def test_draw_checked_reads_tokens_and_finiteness_back_once_on_gpu():
    """On a GPU the draw and the logits check share one readback: the same tokens as draw from the same
    generator state, and a NaN / all -inf row still raises naming it."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from specviz.sampling import InvalidLogitsError, draw, draw_checked

    cfg = SamplingConfig(temperature=0.8)
    z = torch.randn(4, 1000, device="cuda")
    want = draw(z, cfg, torch.Generator(device="cuda").manual_seed(3)).tolist()
    assert draw_checked(z, cfg, torch.Generator(device="cuda").manual_seed(3), "draft") == want
    z[2, 7] = float("nan")
    with pytest.raises(InvalidLogitsError, match=r"draft logits contain NaN at index \[2\]"):
        draw_checked(z, cfg, torch.Generator(device="cuda").manual_seed(3), "draft")
