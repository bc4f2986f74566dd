"""Standardized sampling (Leviathan et al. §2.2): logits -> the distribution both models sample from.

`standardize` returns logits whose softmax *is* the standardized distribution (masked entries are -inf),
so draft sampling, the target-only reference and every verification mode share one definition.
"""

from __future__ import annotations

import torch

from specviz.config import SamplingConfig


class InvalidLogitsError(ValueError):
    """Logits that cannot define a distribution: NaN, +inf, or a row with no finite entry."""


def check_logits(logits: torch.Tensor, name: str) -> None:
    """Raise InvalidLogitsError naming the tensor and the first bad row; one reduction over the vocabulary."""
    row_max = logits.amax(dim=-1)
    bad = ~torch.isfinite(row_max)  # NaN propagates through amax; +inf and all -inf rows are not finite
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        row = logits[idx]
        if bool(torch.isnan(row).any()):
            what = "NaN"
        elif bool(torch.isposinf(row).any()):
            what = "+inf"
        else:
            what = "only -inf (no token has any probability)"
        raise InvalidLogitsError(f"{name} logits contain {what} at index {list(idx)}; the model output is unusable")


def standardize(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Apply greedy / temperature / top-k / top-p along the last dim; returns float32 logits."""
    z = logits.float()
    if cfg.greedy:
        out = torch.full_like(z, float("-inf"))
        return out.scatter_(-1, z.argmax(dim=-1, keepdim=True), 0.0)
    if cfg.temperature != 1.0:
        z = z / cfg.temperature
    if cfg.top_k and cfg.top_k < z.shape[-1]:
        kth = torch.topk(z, cfg.top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_z, order = torch.sort(z, dim=-1, descending=True)
        cum = sorted_z.softmax(dim=-1).cumsum(dim=-1)
        # drop a token when the mass strictly before it already reaches top_p; the first token always stays
        drop_sorted = (cum - sorted_z.softmax(dim=-1)) >= cfg.top_p
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        z = z.masked_fill(drop, float("-inf"))
    return z


def sample(std_logits: torch.Tensor, generator: torch.Generator | None, greedy: bool) -> torch.Tensor:
    """Draw one token per row from softmax(std_logits); argmax when greedy (no random number used)."""
    if greedy:
        return std_logits.argmax(dim=-1)
    probs = std_logits.softmax(dim=-1)
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def draw(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> torch.Tensor:
    """Sample from the standardized distribution of raw logits (argmax when greedy, without standardizing)."""
    if cfg.greedy:
        return logits.argmax(dim=-1)
    return sample(standardize(logits, cfg), generator, greedy=False)
