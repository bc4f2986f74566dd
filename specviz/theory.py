"""Leviathan et al. §3: what speculative decoding should buy for a given α, γ and cost ratio c."""

from __future__ import annotations

from typing import Sequence


def expected_tokens(alpha: float, gamma: int) -> float:
    """Expected tokens per iteration for one α at every position, (1 - α^{γ+1}) / (1 - α) (Leviathan eq. 1);
    γ + 1 when α = 1. The closed form of expected_tokens_by_position([α], γ), kept closed: the `optimal`
    policy's γ rests on it."""
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def expected_tokens_by_gamma(alphas: Sequence[float], max_gamma: int) -> list[float]:
    """expected_tokens_by_position(alphas, γ) for every γ in 0..max_gamma (index γ), in one pass: the cost-aware
    policy prices every γ each iteration."""
    out = [1.0]
    total = reach = 1.0
    for k in range(max_gamma):
        a = alphas[min(k, len(alphas) - 1)] if alphas else 0.0
        reach *= min(max(a, 0.0), 1.0)
        total += reach
        out.append(total)
    return out


def token_variance_by_gamma(expected: Sequence[float]) -> list[float]:
    """The variance of the tokens an iteration appends, for every γ (index γ), from expected_tokens_by_gamma's list
    (whose steps are P(tokens ≥ m) = Π_{j<m-1} α_j, so α is walked once): E[tokens²] = Σ_m (2m - 1) P(tokens ≥ m)."""
    out = [0.0]
    square = 1.0
    for g in range(1, len(expected)):
        square += (2 * g + 1) * (expected[g] - expected[g - 1])
        out.append(max(0.0, square - expected[g] * expected[g]))
    return out


def expected_tokens_by_position(alphas: Sequence[float], gamma: int) -> float:
    """Expected tokens an iteration appends when the draft at position k passes with probability alphas[k]
    given that every earlier one passed: Σ_{k=0..γ} Π_{j<k} α_j (the last α repeats beyond the list; none: 0).
    With one α this is expected_tokens(α, γ)."""
    return expected_tokens_by_gamma(alphas, gamma)[gamma]


def walltime_factor(alpha: float, gamma: int, c: float) -> float:
    """Expected speedup over target-only, E / (γc + 1) (Leviathan Theorem 3.8)."""
    return expected_tokens(alpha, gamma) / (gamma * c + 1.0)


def optimal_gamma(alpha: float, c: float, max_gamma: int = 32) -> int:
    """The γ in 1..max_gamma that maximizes the walltime factor (Leviathan §3.5)."""
    return max(range(1, max_gamma + 1), key=lambda g: walltime_factor(alpha, g, c))
