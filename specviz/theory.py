"""Leviathan et al. §3: what speculative decoding should buy for a given α, γ and cost ratio c."""

from __future__ import annotations


def expected_tokens(alpha: float, gamma: int) -> float:
    """Expected tokens per iteration, (1 - α^{γ+1}) / (1 - α) (Leviathan eq. 1); γ + 1 when α = 1."""
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def walltime_factor(alpha: float, gamma: int, c: float) -> float:
    """Expected speedup over target-only, E / (γc + 1) (Leviathan Theorem 3.8)."""
    return expected_tokens(alpha, gamma) / (gamma * c + 1.0)


def optimal_gamma(alpha: float, c: float, max_gamma: int = 32) -> int:
    """The γ in 1..max_gamma that maximizes the walltime factor (Leviathan §3.5)."""
    return max(range(1, max_gamma + 1), key=lambda g: walltime_factor(alpha, g, c))

