"""Statistical tests of `specviz.verify`: the emitted tokens must follow the target distribution.

The property under test (Leviathan et al., Theorem 3.1): if the drafted token x is drawn from
q = softmax(standardized draft logits) and verified with γ = 1, the first emitted token (x when it is
kept, next_token otherwise) is distributed exactly as p = softmax(standardized target logits).

Every check is a Pearson chi-square goodness-of-fit test with fixed seeds, so the outcome is
deterministic. Sample sizes come from `samples_to_detect_tv`: the chi-square statistic under an
alternative r = p + δ is (asymptotically) noncentral chi-square with λ = N·Σδ_i²/p_i, and by
Cauchy–Schwarz Σδ_i²/p_i ≥ (Σ|δ_i|)² = 4·TV², so λ ≥ 4·N·TV² whatever the shape of the error. Power
for a fixed λ falls as the degrees of freedom grow, so computing N with dof = |support(p)| - 1 (an
upper bound on the dof left after pooling sparse categories) is conservative. One caveat holds for
every power statement below: tokens whose expected count is below 5 are pooled into one bin, so the
guarantee is about the TV distance measured on the pooled partition; an error that only moves mass
among those rare tokens is invisible. Tokens with p = 0 are not binned: a single sample on one fails.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from scipy.optimize import brentq
from scipy.stats import binom, chi2, ncx2

import specviz
from specviz import SamplingConfig, VerifyResult
from specviz.sampling import standardize
from specviz.verify.tiled import DEFAULT_TILE

FAMILY_ALPHA = 1e-3  # family-wise false-alarm rate of each test function, split Bonferroni-style
POWER = 0.99
FULL_TV = 0.01  # the TV error the dedicated (full-power) cases must detect
BATTERY_TV = 0.025  # the TV error the 200-pair battery detects (full power for 200 pairs is too slow on CPU)
N_BATTERY_PAIRS = 200
ELEMENT_BUDGET = 1 << 23  # per-call cap on rows × columns × positions, to bound memory
T1 = SamplingConfig(temperature=1.0)
# `exact` runs its full-vocabulary passes in C++ on the CPU (specviz.verify.cpu); "exact/torch" is the same
# mode forced onto the torch path (backend 'torch'), so both implementations pass every suite below.
EXACT_TORCH = "exact/torch"
TILED_MODES = ["baseline", "exact", EXACT_TORCH]


def verify_as(mode: str, *args, **kwargs) -> VerifyResult:
    """specviz.verify, where EXACT_TORCH means `exact` on backend 'torch'."""
    if mode == EXACT_TORCH:
        return specviz.verify("exact", *args, backend="torch", **kwargs)
    return specviz.verify(mode, *args, **kwargs)


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    """These tests run many small tensor ops: with two OpenMP threads on a 2-core machine that is busy
    with anything else they ran 5-20x slower than with one thread, which is as fast when idle."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# ----------------------------------------------------------------------------------------------------
# Sample sizes and goodness of fit
# ----------------------------------------------------------------------------------------------------


def _noncentrality_for_power(dof: int, alpha: float, power: float) -> float:
    """The λ at which the level-alpha chi-square test with `dof` degrees of freedom has the given power."""
    critical = chi2.isf(alpha, dof)
    return brentq(lambda lam: ncx2.sf(critical, dof, lam) - power, 1e-9, 1e7)


def samples_to_detect_tv(tv: float, dof: int, alpha: float, power: float) -> int:
    """Samples N so that a level-alpha chi-square test rejects every alternative at TV ≥ tv with prob ≥ power.

    Uses the worst case λ = 4·N·tv² (Cauchy–Schwarz: Σδ_i²/p_i ≥ (Σ|δ_i|)² = 4·TV²).
    """
    return math.ceil(_noncentrality_for_power(max(dof, 1), alpha, power) / (4 * tv * tv))


def detectable_tv(n: int, dof: int, alpha: float, power: float) -> float:
    """The smallest TV that n samples detect with the given power: the inverse of samples_to_detect_tv."""
    return math.sqrt(_noncentrality_for_power(max(dof, 1), alpha, power) / (4 * n))


def support_dof(probs: np.ndarray) -> int:
    return max(int((probs > 0).sum()) - 1, 1)


def binned(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> tuple[np.ndarray, np.ndarray]:
    """Observed and expected counts over p's support; tokens expecting < min_expected samples are pooled.

    The pool is its own bin when it expects enough samples, otherwise it joins the largest bin.
    """
    expected = counts.sum() * probs
    support = probs > 0
    big = support & (expected >= min_expected)
    small = support & ~big
    obs, exp = counts[big].astype(np.float64), expected[big]
    if small.any():
        pooled_obs, pooled_exp = counts[small].sum(), expected[small].sum()
        if pooled_exp >= min_expected or obs.size == 0:
            obs, exp = np.append(obs, pooled_obs), np.append(exp, pooled_exp)
        else:
            largest = int(np.argmax(exp))
            obs[largest] += pooled_obs
            exp[largest] += pooled_exp
    return obs, exp


def empirical_tv(counts: np.ndarray, probs: np.ndarray) -> float:
    return 0.5 * float(np.abs(counts / counts.sum() - probs).sum())


def gof_failure(counts: np.ndarray, probs: np.ndarray, alpha: float) -> str | None:
    """None when counts are consistent with probs at level alpha, else a description of the misfit."""
    off_support = (probs == 0) & (counts > 0)
    if off_support.any():
        tokens = np.nonzero(off_support)[0]
        return f"{int(counts[tokens].sum())} samples on tokens with p = 0, e.g. {tokens[:8].tolist()}"
    obs, exp = binned(counts, probs)
    if obs.size < 2:
        return None  # a single bin: the support check above is the whole test
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = obs.size - 1
    pvalue = float(chi2.sf(stat, dof))
    if pvalue >= alpha:
        return None
    return (
        f"chi2 = {stat:.1f} on {dof} dof, p-value {pvalue:.2e} < alpha {alpha:.1e}, "
        f"empirical TV {empirical_tv(counts, probs):.4f} at N = {int(counts.sum())}"
    )


# ----------------------------------------------------------------------------------------------------
# Running verify on N copies of one (draft, target) pair
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pair:
    label: str
    draft_logits: torch.Tensor  # [γ, V]
    target_logits: torch.Tensor  # [γ + 1, V]
    sampling: SamplingConfig = T1

    @property
    def vocab(self) -> int:
        return self.target_logits.shape[-1]


@dataclass
class Outcome:
    draft_tokens: torch.Tensor  # [N, γ]
    n_accepted: torch.Tensor  # [N]
    next_token: torch.Tensor  # [N]
    accept_prob: torch.Tensor  # [N, γ]
    uniforms: torch.Tensor  # [N, γ]
    residual_uniforms: torch.Tensor | None  # [N], replayed from the generator (tiled modes only)

    @property
    def first_token(self) -> torch.Tensor:
        return torch.where(self.n_accepted >= 1, self.draft_tokens[:, 0], self.next_token)


def probs_of(logits: torch.Tensor, sampling: SamplingConfig) -> np.ndarray:
    """The standardized distribution, in float64, that verify's output must follow."""
    return standardize(logits, sampling).double().softmax(dim=-1).numpy()


def draw_drafts(pair: Pair, n: int, gen: torch.Generator) -> torch.Tensor:
    """n rows of drafted tokens, position j drawn independently from the standardized q_j."""
    q = standardize(pair.draft_logits, pair.sampling).softmax(dim=-1)
    columns = [torch.multinomial(q_j, n, replacement=True, generator=gen) for q_j in q]
    return torch.stack(columns, dim=1)


def run_copies(
    mode: str,
    pair: Pair,
    n: int,
    seed: int,
    *,
    replay_residual_uniform: bool = False,
    chunk_rows: int | None = None,
    **verify_kwargs,
) -> Outcome:
    """verify() on n copies of `pair` with drafts drawn from q, chunked to bound memory.

    The logits are broadcast with expand(): verify reads them without copying the batch dimension.
    Chunks consume one generator in turn, so runs compare row for row only with equal chunk_rows.
    """
    draft_gen = torch.Generator().manual_seed(seed)
    verify_gen = torch.Generator().manual_seed(seed + 1)
    drafts = draw_drafts(pair, n, draft_gen)
    gamma, vocab = pair.draft_logits.shape
    # Tiled modes allocate [rows, tile] even when the tile is wider than V, so budget for the wider one.
    width = max(vocab, verify_kwargs.get("tile_size", DEFAULT_TILE) if mode != "baseline" else vocab)
    chunk = chunk_rows or max(1, ELEMENT_BUDGET // (width * (gamma + 1)))
    parts: list[tuple[VerifyResult, torch.Tensor | None]] = []
    for start in range(0, n, chunk):
        rows = drafts[start:start + chunk]
        b = rows.shape[0]
        state = verify_gen.get_state()
        result = verify_as(
            mode, rows, pair.draft_logits.expand(b, -1, -1), pair.target_logits.expand(b, -1, -1),
            sampling=pair.sampling, generator=verify_gen, **verify_kwargs,
        )
        parts.append((result, _replay_residual_uniform(state, result) if replay_residual_uniform else None))
    return Outcome(
        draft_tokens=drafts,
        n_accepted=torch.cat([r.n_accepted for r, _ in parts]),
        next_token=torch.cat([r.next_token for r, _ in parts]),
        accept_prob=torch.cat([r.accept_prob for r, _ in parts]),
        uniforms=torch.cat([r.uniforms for r, _ in parts]),
        residual_uniforms=torch.cat([u for _, u in parts]) if replay_residual_uniform else None,
    )


def _replay_residual_uniform(state: torch.Tensor, result: VerifyResult) -> torch.Tensor:
    """The residual draw's uniform, from the documented order: [B, γ] position uniforms, then [B]."""
    replay = torch.Generator()
    replay.set_state(state)
    b, gamma = result.uniforms.shape
    assert torch.equal(torch.rand((b, gamma), generator=replay), result.uniforms), "uniform draw order changed"
    return torch.rand((b,), generator=replay)


def first_token_counts(mode: str, pair: Pair, n: int, seed: int, **verify_kwargs) -> np.ndarray:
    out = run_copies(mode, pair, n, seed, **verify_kwargs)
    return torch.bincount(out.first_token, minlength=pair.vocab).numpy()


def tile_kwargs(mode: str, vocab: int) -> dict:
    # Small vocabularies: one tile of width V (the default 16384-wide tile costs [B, 16384] memory).
    return {} if mode == "baseline" else {"tile_size": vocab}


# ----------------------------------------------------------------------------------------------------
# The pairs
# ----------------------------------------------------------------------------------------------------

NEG_INF = float("-inf")


def _logits(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def _masked(values: torch.Tensor, keep: list[int]) -> torch.Tensor:
    out = torch.full_like(values, NEG_INF)
    out[keep] = values[keep]
    return out


def edge_pairs() -> list[Pair]:
    g = torch.Generator().manual_seed(1234)
    r = lambda v, scale=1.5: scale * torch.randn(v, generator=g)  # noqa: E731
    same = r(8)
    return [
        Pair("p_equals_q", same[None], torch.stack([same, r(8)])),
        Pair("disjoint_supports", _masked(r(10), [5, 6, 7, 8, 9])[None],
             torch.stack([_masked(r(10), [0, 1, 2, 3, 4]), r(10)])),
        Pair("q_zero_where_p_positive", _masked(r(12), list(range(4, 12)))[None],
             torch.stack([r(12) + torch.tensor([3.0] * 4 + [0.0] * 8), r(12)])),
        Pair("one_hot_p", r(6)[None], torch.stack([_masked(r(6), [2]), r(6)])),
        Pair("one_hot_q", _masked(r(9), [4])[None], torch.stack([r(9), r(9)])),
        Pair("vocab_2", _logits([2.0, -0.2]), _logits([-0.4, 0.45], [0.0, 0.0])),
        # Flat enough that ~17 tokens survive top-k 20 / top-p 0.9, fewer than half of them in both supports.
        Pair("tempered_top_k_top_p", r(50, 0.6)[None], torch.stack([r(50, 0.6), r(50, 0.6)]),
             SamplingConfig(temperature=0.7, top_k=20, top_p=0.9)),
        Pair("temperature_0.7_only", r(24, 2.0)[None], torch.stack([r(24, 2.0), r(24)]),
             SamplingConfig(temperature=0.7)),
        Pair("random_v32", r(32, 2.0)[None], torch.stack([r(32, 2.0), r(32)])),
    ]


def random_pair(seed: int) -> Pair:
    """A pair with V in [2, 64] (log-uniform), peaked or flat logits, related or unrelated draft."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    vocab = max(2, round(2 ** rng.uniform(1, 6)))
    target = rng.choice([0.1, 0.5, 1.0, 2.0, 4.0, 8.0]) * torch.randn(vocab, generator=g)
    relation = rng.choice(["independent", "noisy_copy", "permuted"])
    if relation == "independent":
        draft = rng.choice([0.1, 0.5, 1.0, 2.0, 4.0, 8.0]) * torch.randn(vocab, generator=g)
    elif relation == "noisy_copy":
        draft = target + rng.choice([0.1, 0.5, 2.0]) * torch.randn(vocab, generator=g)
    else:
        draft = target[torch.randperm(vocab, generator=g)]
    target, draft = (_mask_some(x, rng) if vocab > 2 and rng.random() < 0.15 else x for x in (target, draft))
    top_k = rng.choice([0, 0, 0, rng.randint(1, vocab)])
    sampling = SamplingConfig(temperature=rng.choice([1.0, 1.0, 0.7, 1.5]), top_k=top_k,
                              top_p=rng.choice([1.0, 1.0, 0.8]))
    bonus = torch.randn(vocab, generator=g)
    return Pair(f"random_{seed}_V{vocab}_{relation}", draft[None], torch.stack([target, bonus]), sampling)


def _mask_some(x: torch.Tensor, rng: random.Random) -> torch.Tensor:
    keep = rng.sample(range(x.numel()), rng.randint(1, x.numel() - 1))
    return _masked(x, keep)


# ----------------------------------------------------------------------------------------------------
# 1. Exactness: the first emitted token follows p
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", TILED_MODES)
def test_first_token_battery(mode: str) -> None:
    """200 random pairs plus the edge cases, each at the N that detects TV ≥ 0.025 with power ≥ 0.99.

    Level per pair: 1e-3 / (number of pairs), Bonferroni over the battery. Full power for a 1% TV error
    (about 100k-290k samples per pair) is too slow here; `test_first_token_full_power` has it for the
    edge cases and one random pair.
    """
    pairs = [random_pair(seed) for seed in range(N_BATTERY_PAIRS)] + edge_pairs()
    alpha = FAMILY_ALPHA / len(pairs)
    failures = []
    for i, pair in enumerate(pairs):
        p = probs_of(pair.target_logits[0], pair.sampling)
        n = samples_to_detect_tv(BATTERY_TV, support_dof(p), alpha, POWER)
        counts = first_token_counts(mode, pair, n, seed=10_000 + 7 * i, **tile_kwargs(mode, pair.vocab))
        failure = gof_failure(counts, p, alpha)
        if failure:
            failures.append(f"{pair.label} ({pair.sampling}): {failure}")
    assert not failures, (
        f"{mode}: {len(failures)}/{len(pairs)} pairs fail (each test sized to detect TV ≥ {BATTERY_TV} "
        f"with power {POWER}):\n" + "\n".join(failures)
    )


@pytest.mark.parametrize("mode", TILED_MODES)
@pytest.mark.parametrize("pair", edge_pairs(), ids=lambda pair: pair.label)
def test_first_token_full_power(mode: str, pair: Pair) -> None:
    """Edge cases at the N that detects TV ≥ 0.01 with power ≥ 0.99 at level 1e-3 / 18 (9 pairs × 2 modes).

    Cases: p == q, disjoint supports, q(x) = 0 where p(x) > 0, one-hot p, one-hot q, V = 2,
    temperature 0.7 with top-k 20 and top-p 0.9 (drafts drawn from the standardized q), temperature 0.7
    alone (exact fuses it into the tile loop instead of standardizing), a random V = 32.
    """
    alpha = FAMILY_ALPHA / (2 * len(edge_pairs()))
    p = probs_of(pair.target_logits[0], pair.sampling)
    n = samples_to_detect_tv(FULL_TV, support_dof(p), alpha, POWER)
    counts = first_token_counts(mode, pair, n, seed=777, **tile_kwargs(mode, pair.vocab))
    failure = gof_failure(counts, p, alpha)
    assert failure is None, f"{mode} {pair.label}: {failure} (N sized to detect TV ≥ {FULL_TV}, power {POWER})"


def bonus_pairs() -> list[Pair]:
    g = torch.Generator().manual_seed(99)
    q = 2.0 * torch.randn(16, generator=g)
    return [
        Pair("bonus_random", q[None], torch.stack([q, 2.0 * torch.randn(16, generator=g)])),
        Pair("bonus_masked", q[None], torch.stack([q, _masked(torch.randn(16, generator=g), [0, 7, 15])])),
    ]


@pytest.mark.parametrize("mode", TILED_MODES)
@pytest.mark.parametrize("pair", bonus_pairs(), ids=lambda pair: pair.label)
def test_bonus_token_follows_last_position(mode: str, pair: Pair) -> None:
    """γ = 1 with p_0 == q, so every draft is kept: next_token (the bonus) must follow p_1.

    N detects TV ≥ 0.01 in the bonus distribution with power ≥ 0.99 at level 1e-3 / 4.
    """
    alpha = FAMILY_ALPHA / 4
    p1 = probs_of(pair.target_logits[1], pair.sampling)
    n = samples_to_detect_tv(FULL_TV, support_dof(p1), alpha, POWER)
    out = run_copies(mode, pair, n, seed=4242, **tile_kwargs(mode, pair.vocab))
    assert bool((out.n_accepted == 1).all()), "p == q at position 0, so every draft must be accepted"
    counts = torch.bincount(out.next_token, minlength=pair.vocab).numpy()
    failure = gof_failure(counts, p1, alpha)
    assert failure is None, f"{mode} {pair.label} bonus token: {failure}"


# ----------------------------------------------------------------------------------------------------
# 2. Large vocabularies
# ----------------------------------------------------------------------------------------------------

LARGE_VOCABS = (32000, 151936)
LARGE_TILE = 7919  # prime: divides neither vocabulary, so the last tile is ragged
LARGE_SAMPLES = {32000: 3000, 151936: 800}  # a few seconds per case on 2 CPU cores


def heavy_tokens(vocab: int, rng: np.random.Generator, count: int = 40) -> np.ndarray:
    """`count` distinct indices across the range: the ends, the middle, tile boundaries, the rest random."""
    fixed = {0, 1, vocab // 2 - 1, vocab // 2, vocab - 2, vocab - 1}
    fixed |= {k * LARGE_TILE + d for k in (1, 2) for d in (-1, 0)}
    picks = set(fixed)
    while len(picks) < count:
        picks.add(int(rng.integers(0, vocab)))
    return np.array(sorted(picks))


def spread_probs(vocab: int, heavy: np.ndarray, heavy_mass: float, rng: np.random.Generator) -> np.ndarray:
    """Mass heavy_mass over the heavy tokens (random weights), the rest evenly over every other token."""
    probs = np.full(vocab, (1 - heavy_mass) / (vocab - heavy.size))
    probs[heavy] = heavy_mass * rng.dirichlet(np.ones(heavy.size))
    return probs


def large_pair(vocab: int) -> tuple[Pair, np.ndarray]:
    """p: 95% over 40 spread-out tokens, 5% tail. q: 97% over 20 of them plus 20 others, 3% tail."""
    rng = np.random.default_rng(vocab)
    p_heavy = heavy_tokens(vocab, rng)
    q_heavy = np.unique(np.concatenate([p_heavy[::2], heavy_tokens(vocab, rng, 20) + 2]) % vocab)
    p = spread_probs(vocab, p_heavy, 0.95, rng)
    q = spread_probs(vocab, q_heavy, 0.97, rng)
    to_logits = lambda probs: torch.from_numpy(np.log(probs)).float()  # noqa: E731
    return Pair(f"V{vocab}", to_logits(q)[None], torch.stack([to_logits(p), to_logits(p)])), p_heavy


def tail_binned(counts: np.ndarray, probs: np.ndarray, heavy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Heavy tokens as their own categories, everything else as one tail category."""
    tail = np.ones(counts.size, dtype=bool)
    tail[heavy] = False
    return (np.append(counts[heavy], counts[tail].sum()), np.append(probs[heavy], probs[tail].sum()))


@functools.lru_cache(maxsize=None)
def large_outcome(mode: str, vocab: int) -> Outcome:
    """One run per (mode, V), shared by the chi-square and the per-sample test: each sample costs O(V)."""
    pair, _ = large_pair(vocab)
    kwargs = {"tile_size": LARGE_TILE, "replay_residual_uniform": True} if mode != "baseline" else {}
    return run_copies(mode, pair, LARGE_SAMPLES[vocab], seed=31337, **kwargs)


@pytest.mark.parametrize("vocab", LARGE_VOCABS)
@pytest.mark.parametrize("mode", TILED_MODES)
def test_first_token_large_vocab(mode: str, vocab: int) -> None:
    """V = 32000 / 151936, p spread over 40 tokens (index 0, V/2, V-1, tile edges, ...) plus a tail bin;
    exact runs with tile 7919, which divides neither V.

    Every sample costs O(V), so N is small: 3000 samples (V = 32000) detect TV ≥ 0.083 and 800 samples
    (V = 151936) detect TV ≥ 0.16, power 0.99 at level 1e-3 / 4 on the 41 categories. That catches
    gross tile or indexing errors only; `test_exact_large_vocab_follows_inverse_cdf` checks each exact
    sample individually.
    """
    alpha = FAMILY_ALPHA / 4
    pair, heavy = large_pair(vocab)
    p = probs_of(pair.target_logits[0], pair.sampling)
    out = large_outcome(mode, vocab)
    counts = torch.bincount(out.first_token, minlength=vocab).numpy()
    failure = gof_failure(*tail_binned(counts, p, heavy), alpha)
    n = out.n_accepted.numel()
    power_note = f"N = {n} detects TV ≥ {detectable_tv(n, heavy.size, alpha, POWER):.2f}"
    assert failure is None, f"{mode} V={vocab}: {failure} ({power_note})"


@pytest.mark.parametrize("vocab", LARGE_VOCABS)
@pytest.mark.parametrize("mode", ["exact", EXACT_TORCH])
def test_exact_large_vocab_follows_inverse_cdf(mode: str, vocab: int) -> None:
    """Per-sample check of `exact` at large V (C++ passes, and the torch path with tile 7919): with the uniforms replayed from the generator
    (position uniforms, then the residual uniform, the order the verify docstring documents), each
    decision must be u ≤ p(x)/q(x), and each next_token must be the inverse CDF of the float64 residual
    max(0, p - q) (or of p_1 for the bonus) at u·total, up to 1e-5 of probability mass (float32 sums).
    """
    pair, _ = large_pair(vocab)
    p0, p1 = (probs_of(pair.target_logits[j], T1) for j in (0, 1))
    q = probs_of(pair.draft_logits[0], T1)
    out = large_outcome(mode, vocab)
    x = out.draft_tokens[:, 0].numpy()
    u = out.uniforms[:, 0].double().numpy()
    ratio = p0[x] / q[x]
    clear = np.abs(u - ratio) > 1e-5
    n = out.n_accepted.numpy()
    assert np.array_equal(n[clear], (u <= ratio)[clear].astype(n.dtype)), "decisions differ from u ≤ p/q"
    assert 0 < n.sum() < n.size, "the pair should give both acceptances and rejections"

    tol = 1e-5
    goal_u = out.residual_uniforms.double().numpy()
    token = out.next_token.numpy()
    bad = []
    for accepted, dist in ((0, np.clip(p0 - q, 0, None)), (1, p1)):
        rows = n == accepted
        cdf = np.cumsum(dist)
        goal = goal_u[rows] * cdf[-1]
        t = token[rows]
        below = np.where(t > 0, cdf[np.maximum(t - 1, 0)], 0.0)
        ok = (below - tol <= goal) & (goal <= cdf[t] + tol) & (dist[t] > 0)
        bad += [(accepted, int(tk), float(gl)) for tk, gl in zip(t[~ok], goal[~ok])]
    assert not bad, f"next_token not at the inverse CDF (n_accepted, token, goal): {bad[:10]}"


# ----------------------------------------------------------------------------------------------------
# 3. Exact mode: the tile size must not change anything
# ----------------------------------------------------------------------------------------------------


def tile_pair() -> Pair:
    g = torch.Generator().manual_seed(5)
    vocab = 37
    target = 2.0 * torch.randn(3 + 1, vocab, generator=g)
    draft = target[:3] + 0.8 * torch.randn(3, vocab, generator=g)
    # Masked runs at the start, middle and end leave whole tiles at -inf for the small tile sizes.
    target[:, [0, 1, 2, 20, 21, 36]] = NEG_INF
    draft[:, [0, 1, 2, 3, 4, 5, 6, 14, 35]] = NEG_INF
    return Pair("tiles_V37_gamma3_masked", draft, target)


@pytest.mark.parametrize("tile", [1, 3, 7, 64, DEFAULT_TILE])
def test_exact_tile_size_does_not_change_decisions(tile: int) -> None:
    """γ = 3, V = 37 (prime, so tiles 3 and 7 leave a ragged last tile; 64 and the default are wider
    than V), with -inf runs that make whole tiles empty. Under the same generator seed, decisions must
    equal those with tile = V: n_accepted in every row, next_token in ≥ 99.9% of rows (room for float
    near-ties). The first token must also pass the chi-square against p_0. Tiles ≤ 64 use N rows sized
    to detect TV ≥ 0.01 with power 0.99 at level 1e-3 / 5; the default 16384-wide tile costs
    [rows, 16384] memory and time per call, so it runs 6000 rows, which detect TV ≥ 0.056.
    """
    pair = tile_pair()
    p0 = probs_of(pair.target_logits[0], T1)
    alpha = FAMILY_ALPHA / 5
    n = 6000 if tile == DEFAULT_TILE else samples_to_detect_tv(FULL_TV, support_dof(p0), alpha, POWER)
    chunk = max(1, ELEMENT_BUDGET // (max(tile, pair.vocab) * 4))
    # tiles are the torch path's (the C++ passes have none)
    reference = run_copies(EXACT_TORCH, pair, n, seed=8, tile_size=pair.vocab, chunk_rows=chunk)
    out = run_copies(EXACT_TORCH, pair, n, seed=8, tile_size=tile, chunk_rows=chunk)
    assert torch.equal(out.uniforms, reference.uniforms)
    assert torch.equal(out.n_accepted, reference.n_accepted), f"tile {tile} changes accept decisions"
    agreement = (out.next_token == reference.next_token).double().mean().item()
    assert agreement >= 0.999, f"tile {tile}: next_token agrees with tile = V in only {agreement:.4%} of rows"
    assert 0 < int(out.n_accepted.sum()) and bool((out.n_accepted < 3).any())
    counts = torch.bincount(out.first_token, minlength=pair.vocab).numpy()
    failure = gof_failure(counts, p0, alpha)
    power_note = f"N = {n} detects TV ≥ {detectable_tv(n, support_dof(p0), alpha, POWER):.3f}"
    assert failure is None, f"tile {tile}: {failure} ({power_note})"


# ----------------------------------------------------------------------------------------------------
# 4. Sigmoid: an approximation, measured
# ----------------------------------------------------------------------------------------------------


def realistic_pair(seed: int, vocab: int = 512) -> Pair:
    """LM-like logits (sd 3, a few boosted tokens); the draft is the target plus noise of sd 0.6."""
    g = torch.Generator().manual_seed(seed)
    target = 3.0 * torch.randn(vocab, generator=g)
    target[torch.randperm(vocab, generator=g)[:5]] += 6.0
    draft = target + 0.6 * torch.randn(vocab, generator=g)
    return Pair(f"realistic_{seed}", draft[None], torch.stack([target, target]))


def test_sigmoid_distance_from_target_is_measured() -> None:
    """TV(first emitted token, p) for sigmoid at (α, β) = (-1e4, 1e4) and (-10, 10), 4 pairs, N = 8000.

    Reported with `pytest -s`. Asserted: TVs lie in [0, 1]; the exact mode at the same N sits at the
    sampling-noise level (TV of N draws straight from p, same seed scheme); sigmoid at ∓1e4 is far above
    it (more than 3× the noise and 0.05), i.e. the approximation is measurably not exact. For (-1e4, 1e4)
    every σ((z - α)/(β - α)) is ≈ 0.62, so p̂ ≈ q̂ and nearly every draft is kept: the output is ≈ q.
    """
    n = 8000
    rows = []
    for seed in range(4):
        pair = realistic_pair(seed)
        p = probs_of(pair.target_logits[0], T1)
        q = probs_of(pair.draft_logits[0], T1)
        direct = torch.multinomial(torch.from_numpy(p), n, replacement=True,
                                   generator=torch.Generator().manual_seed(seed))
        measured = {"noise": empirical_tv(torch.bincount(direct, minlength=pair.vocab).numpy(), p)}
        runs = {"exact": ("exact", {}), "sigmoid±1e4": ("sigmoid", {}),
                "sigmoid±10": ("sigmoid", {"sigmoid_alpha": -10.0, "sigmoid_beta": 10.0})}
        for name, (mode, extra) in runs.items():
            counts = first_token_counts(mode, pair, n, seed=100 + seed, tile_size=pair.vocab, **extra)
            measured[name] = empirical_tv(counts, p)
        measured["TV(p,q)"] = 0.5 * float(np.abs(p - q).sum())
        rows.append(measured)
    print("\nsigmoid TV from p (first emitted token, N = %d, V = 512, temperature 1)" % n)
    for seed, measured in enumerate(rows):
        print(f"  pair {seed}: " + "  ".join(f"{k} {v:.4f}" for k, v in measured.items()))
    mean = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
    print("  mean:   " + "  ".join(f"{k} {v:.4f}" for k, v in mean.items()))
    for measured in rows:
        assert all(0.0 <= v <= 1.0 for v in measured.values())
    assert mean["exact"] < 2 * mean["noise"], f"exact mode should sit at the noise level: {mean}"
    assert mean["sigmoid±1e4"] > max(3 * mean["noise"], 0.05), f"sigmoid ±1e4 looks exact: {mean}"


def test_sigmoid_greedy_matches_exact() -> None:
    """Temperature 0: sigmoid and exact must make identical decisions, and those must be greedy ones."""
    g = torch.Generator().manual_seed(3)
    b, gamma, vocab = 4000, 4, 50
    target = torch.randn(b, gamma + 1, vocab, generator=g)
    draft = target[:, :gamma] + 0.7 * torch.randn(b, gamma, vocab, generator=g)
    drafted = draft.argmax(-1)
    swap = torch.rand(b, gamma, generator=g) < 0.1
    drafted = torch.where(swap, torch.randint(0, vocab, (b, gamma), generator=g), drafted)
    greedy = SamplingConfig(temperature=0.0)
    results = {
        mode: specviz.verify(mode, drafted, draft, target, sampling=greedy,
                             generator=torch.Generator().manual_seed(11), tile_size=vocab)
        for mode in ("exact", "sigmoid")
    }
    assert torch.equal(results["exact"].n_accepted, results["sigmoid"].n_accepted)
    assert torch.equal(results["exact"].next_token, results["sigmoid"].next_token)
    # q is one-hot, but a draft that is the target's argmax is still kept (p/q = 1/0 = inf ≥ u):
    # greedy speculative decoding must reproduce the target's argmax sequence, nothing else.
    target_arg = target.argmax(-1)
    expected_n = (drafted == target_arg[:, :gamma]).long().cumprod(-1).sum(-1)
    assert torch.equal(results["exact"].n_accepted, expected_n)
    assert torch.equal(results["exact"].next_token, target_arg.gather(-1, expected_n[:, None]).squeeze(-1))


# ----------------------------------------------------------------------------------------------------
# 5. Lenience
# ----------------------------------------------------------------------------------------------------


def lenient_output_probs(p: np.ndarray, q: np.ndarray, lenience: float) -> np.ndarray:
    """The first-token law under lenience l: min(q, p/l) + P(reject)·max(0, p - l·q)/Z, which is ≤ p/l."""
    residual = np.clip(p - lenience * q, 0, None)
    reject = float(np.clip(q - p / lenience, 0, None).sum())
    return np.minimum(q, p / lenience) + reject * residual / residual.sum()


@pytest.mark.parametrize("lenience", [0.5, 0.8])
@pytest.mark.parametrize("mode", TILED_MODES)
def test_lenience(mode: str, lenience: float) -> None:
    """accept_prob == min(1, p/(l·q)) at every drafted token; the first token follows the lenient law
    (chi-square, N detects TV ≥ 0.01 with power 0.99 at level 1e-3 / 8) and no token's count exceeds the
    one-sided binomial bound for p(x)/l at level 1e-3 / (8·V).
    """
    g = torch.Generator().manual_seed(17)
    vocab = 16
    pair = Pair("lenience", 1.5 * torch.randn(1, vocab, generator=g), 1.5 * torch.randn(2, vocab, generator=g))
    p = probs_of(pair.target_logits[0], T1)
    q = probs_of(pair.draft_logits[0], T1)
    expected = lenient_output_probs(p, q, lenience)
    alpha = FAMILY_ALPHA / 8
    n = samples_to_detect_tv(FULL_TV, vocab - 1, alpha, POWER)
    out = run_copies(mode, pair, n, seed=23, lenience=lenience, **tile_kwargs(mode, vocab))

    x = out.draft_tokens[:, 0].numpy()
    analytic = np.minimum(1.0, p[x] / (lenience * q[x]))
    np.testing.assert_allclose(out.accept_prob[:, 0].double().numpy(), analytic, rtol=1e-5, atol=1e-7)

    counts = torch.bincount(out.first_token, minlength=vocab).numpy()
    failure = gof_failure(counts, expected, alpha)
    assert failure is None, f"{mode} l={lenience}: first token does not follow the lenient law: {failure}"
    bound = binom.isf(alpha / vocab, n, np.minimum(1.0, p / lenience))
    assert (counts <= bound).all(), f"{mode} l={lenience}: counts {counts} exceed N·p/l bound {bound}"


# ----------------------------------------------------------------------------------------------------
# 6. baseline == transformers' _speculative_sampling, decision for decision
# ----------------------------------------------------------------------------------------------------


def hf_case(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(candidate_input_ids [1, prompt + γ], draft logits [1, γ, V], target logits [1, γ + 1, V], prompt)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    gamma = rng.randint(1, 8)
    vocab = max(2, round(2 ** rng.uniform(1, math.log2(1000))))
    scale = rng.choice([0.3, 1.0, 3.0])
    draft = scale * torch.randn(1, gamma, vocab, generator=g)
    if rng.random() < 0.5:  # close target, so long accepted runs happen
        target = torch.cat([draft, scale * torch.randn(1, 1, vocab, generator=g)], dim=1)
        target = target + rng.choice([0.05, 0.3]) * torch.randn(1, gamma + 1, vocab, generator=g)
    else:
        target = scale * torch.randn(1, gamma + 1, vocab, generator=g)
    if seed % 2 == 0:
        drafted = torch.multinomial(draft[0].softmax(-1), 1, generator=g).T
    else:
        drafted = torch.randint(0, vocab, (1, gamma), generator=g)
    prompt = rng.randint(1, 5)
    prompt_ids = torch.randint(0, vocab, (1, prompt), generator=g)
    return torch.cat([prompt_ids, drafted], dim=1), draft, target, prompt


def test_baseline_matches_transformers() -> None:
    """300 cases (γ 1..8, V 2..1000, half with drafts from q, half random): identical n_accepted and
    emitted tokens from transformers (global RNG seeded s) and baseline (generator seeded s)."""
    speculative_sampling = pytest.importorskip("transformers.generation.utils")._speculative_sampling
    seen_n = {"none": 0, "some": 0, "all": 0}
    mismatches = []
    for seed in range(300):
        candidate_ids, draft, target, prompt = hf_case(seed)
        gamma = draft.shape[1]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            hf_tokens, hf_n = speculative_sampling(candidate_ids, draft, gamma, target)
        drafted = candidate_ids[:, prompt:]
        ours = specviz.verify("baseline", drafted, draft, target, sampling=T1,
                              generator=torch.Generator().manual_seed(seed))
        n = int(ours.n_accepted[0])
        theirs = hf_tokens[0].tolist()
        if n != int(hf_n) or ours.emitted(drafted) != theirs:
            mismatches.append((seed, gamma, draft.shape[-1], int(hf_n), theirs, n, ours.emitted(drafted)))
        seen_n["none" if n == 0 else "all" if n == gamma else "some"] += 1
    assert not mismatches, f"(seed, γ, V, hf n, hf tokens, our n, our tokens): {mismatches[:5]}"
    assert min(seen_n.values()) >= 20, f"cases should cover all accept patterns: {seen_n}"


# ----------------------------------------------------------------------------------------------------
# Ragged batches: rows that drafted fewer tokens than γ (draft_lengths)
# ----------------------------------------------------------------------------------------------------

RAGGED_GAMMA = 3


def ragged_pair() -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position logits independent of context (so position j of the output must follow p_j):
    draft [γ, V] and target [γ+1, V], V = 16, every position a different distribution."""
    g = torch.Generator().manual_seed(2024)
    return 1.5 * torch.randn(RAGGED_GAMMA, 16, generator=g), 1.5 * torch.randn(RAGGED_GAMMA + 1, 16, generator=g)


def ragged_batch(draft: torch.Tensor, target: torch.Tensor, lengths: list[int], seed: int):
    """Rows drafting lengths[r] tokens from q; everything beyond a row's length is garbage that verify
    must never read into a decision (random tokens and logits, different in every row)."""
    g = torch.Generator().manual_seed(seed)
    n, (gamma, vocab) = len(lengths), draft.shape
    q = draft.softmax(-1)
    tokens = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=g) for j in range(gamma)], dim=1)
    draft_logits = draft.expand(n, -1, -1).clone()
    target_logits = target.expand(n, -1, -1).clone()
    length = torch.tensor(lengths)
    pad_draft = torch.arange(gamma) >= length[:, None]  # [n, γ]
    pad_target = torch.arange(gamma + 1) > length[:, None]  # [n, γ+1]: position L is the row's bonus
    tokens = torch.where(pad_draft, torch.randint(0, vocab, (n, gamma), generator=g), tokens)
    draft_logits[pad_draft] = 5 * torch.randn(int(pad_draft.sum()), vocab, generator=g)
    target_logits[pad_target] = 5 * torch.randn(int(pad_target.sum()), vocab, generator=g)
    return tokens, draft_logits, target_logits


@pytest.mark.parametrize("mode", TILED_MODES)
def test_ragged_rows_stay_exact(mode: str) -> None:
    """Rows of one batch draft 1, 2 or 3 tokens. For a row of length L the token at output position j ≤ L
    (emitted when the first j drafts were kept) must follow p_j; position L is the bonus from target
    position L, not γ. Each of the 6 (L, j) checks detects TV ≥ 0.02 with power 0.99 at level 1e-3 / 6."""
    draft, target = ragged_pair()
    alpha = FAMILY_ALPHA / 6
    p = target.double().softmax(-1).numpy()
    per_length = samples_to_detect_tv(0.02, 15, alpha, POWER) * 4  # position L is reached by ~α^L of the rows
    lengths = [1 + (i % RAGGED_GAMMA) for i in range(per_length * RAGGED_GAMMA)]
    tokens, d_logits, t_logits = ragged_batch(draft, target, lengths, seed=5)
    result = verify_as(mode, tokens, d_logits, t_logits, sampling=T1, generator=torch.Generator().manual_seed(6),
                            draft_lengths=lengths, **tile_kwargs(mode, 16))
    n, nxt = result.n_accepted, result.next_token
    length = torch.tensor(lengths)
    assert bool((n <= length).all()), "a row kept more drafts than it drafted"
    for L in range(1, RAGGED_GAMMA + 1):
        rows = length == L
        for j in range(L + 1):
            reached = rows & (n >= j)  # rows whose output has a token at position j
            if j == L:
                token = nxt[reached]  # every draft kept: the bonus
            else:
                token = torch.where(n[reached] > j, tokens[reached, j], nxt[reached])  # kept draft, or the correction
            counts = torch.bincount(token, minlength=16).numpy()
            assert counts.sum() > 200, (L, j, int(counts.sum()))
            failure = gof_failure(counts, p[j], alpha)
            assert failure is None, f"{mode}, rows of length {L}, output position {j}: {failure}"


@pytest.mark.parametrize("mode", TILED_MODES)
def test_a_row_does_not_depend_on_the_other_rows(mode: str) -> None:
    """Same generator seed, same B and γ: changing every other row (its logits, tokens, length) leaves
    row 0's decision and next token unchanged."""
    draft, target = ragged_pair()
    for trial in range(20):
        base = ragged_batch(draft, target, [2, 3, 1, 3], seed=100 + trial)
        other = ragged_batch(draft, target, [2, 1, 3, 2], seed=900 + trial)
        mixed = tuple(torch.cat([b[:1], o[1:]]) for b, o in zip(base, other))
        a = verify_as(mode, *base, sampling=T1, generator=torch.Generator().manual_seed(trial),
                           draft_lengths=[2, 3, 1, 3], **tile_kwargs(mode, 16))
        b = verify_as(mode, *mixed, sampling=T1, generator=torch.Generator().manual_seed(trial),
                           draft_lengths=[2, 1, 3, 2], **tile_kwargs(mode, 16))
        assert int(a.n_accepted[0]) == int(b.n_accepted[0]) and int(a.next_token[0]) == int(b.next_token[0]), trial


def test_draft_lengths_are_checked() -> None:
    draft, target = ragged_pair()
    tokens, d_logits, t_logits = ragged_batch(draft, target, [1, 3], seed=1)
    for bad in ([0, 3], [1, 4], [1]):
        with pytest.raises(ValueError, match="draft_lengths"):
            specviz.verify("exact", tokens, d_logits, t_logits, sampling=T1, draft_lengths=bad)


@pytest.mark.parametrize("mode", ["baseline", "exact", "sigmoid"])
def test_metadata_call_decides_as_the_keyword_call(mode: str) -> None:
    """verify_batch with a run's VerifyMetadata (what the engine calls) and verify with the same settings as
    keywords make bit-identical decisions from identically seeded generators, ragged rows included."""
    from specviz.config import SpecConfig
    from specviz.verify import VerifyMetadata, verify_batch

    draft, target = ragged_pair()
    lengths = [2, 3, 1, 3]
    tokens, d_logits, t_logits = ragged_batch(draft, target, lengths, seed=3)
    cfg = SpecConfig(mode=mode, sampling=SamplingConfig(temperature=0.9, top_k=12), lenience=0.8,
                     sigmoid_alpha=-6.0, sigmoid_beta=6.0)
    meta = VerifyMetadata.for_run(cfg, lengths)
    assert meta.sigmoid == ((-6.0, 6.0) if mode == "sigmoid" else None) and meta.ragged(3)
    a = verify_batch(meta, tokens, d_logits, t_logits, torch.Generator().manual_seed(5)).host()
    b = specviz.verify(mode, tokens, d_logits, t_logits, cfg.sampling, torch.Generator().manual_seed(5),
                       lenience=0.8, sigmoid_alpha=-6.0, sigmoid_beta=6.0, draft_lengths=lengths).host()
    assert a == b
