"""`exact` and `sigmoid`: Wagner et al.'s tiled verification, torch path.

Both walk the vocabulary in tiles and never materialize a full-vocabulary output tensor:

- `exact` (§3.2.1): an online max/sum pass over tiles gives each row's log-normalizer, so p(x) and q(x)
  at the drafted tokens come from gathered logits alone; the acceptance ratio follows. For the one
  position per row that needs a new token (the first rejection, or γ for the bonus) a second tiled pass
  sums the residual max(0, p - l·q) per tile; a uniform picks a tile by a scan of those partial sums and
  then a token inside that tile by a scan of its recomputed residual. Exact up to floating point.
- `sigmoid` (§3.2.2): p̂ = σ((z - α)/(β - α)) element-wise in place of softmax, so no normalizer pass at
  all; the same acceptance and residual steps run on p̂ and q̂ (the bonus token samples p̂ normalized).
  Approximate: measure how far it strays.

Temperature scaling is fused into the tile loop; top-k / top-p are applied to the logits first (they
need a full-vocabulary selection anyway). Greedy needs no tiles: p and q are one-hot at their argmax,
which is a reduction, and the residual max(0, p - q) is one-hot at the target's argmax.
"""

from __future__ import annotations

from typing import Callable

import torch

from specviz.config import SamplingConfig
from specviz.sampling import argmax, argmax_is_finite, check_logits, standardize
from specviz.verify import cpu
from specviz.verify.verdict import Verdict, accept_probs

DEFAULT_TILE = 16384
_NEG_INF = float("-inf")


def online_logsumexp(logits: torch.Tensor, scale: float, tile: int) -> torch.Tensor:  # [..., V] -> [...]
    """log Σ exp(scale·z) over the last dim, one read of each logit, tile by tile (fp32 accumulators)."""
    V = logits.shape[-1]
    m = torch.full(logits.shape[:-1], _NEG_INF, device=logits.device)
    s = torch.zeros(logits.shape[:-1], device=logits.device)
    for start in range(0, V, tile):
        z = logits[..., start:start + tile].float() * scale
        m_new = torch.maximum(m, z.amax(dim=-1))
        shift = torch.where(torch.isinf(m_new), 0.0, m_new)  # all -inf so far: nothing to rescale
        s = s * torch.exp(m - shift) + torch.exp(z - shift.unsqueeze(-1)).sum(dim=-1)
        m = m_new
    return m + torch.log(s)


class _Probs:
    """Maps logits to the mode's probabilities, element-wise given per-row statistics."""

    def __init__(self, scale: float, sigmoid: tuple[float, float] | None):
        self.scale = scale
        self.sigmoid = sigmoid

    def row_stats(self, logits: torch.Tensor, tile: int) -> torch.Tensor | None:  # [..., V] -> [...] or None
        return None if self.sigmoid else online_logsumexp(logits, self.scale, tile)

    def __call__(self, z: torch.Tensor, stats: torch.Tensor | None) -> torch.Tensor:  # z [...], stats broadcast to z
        z = z.float() * self.scale
        if self.sigmoid:
            alpha, beta = self.sigmoid
            return torch.sigmoid((z - alpha) / (beta - alpha))
        return torch.exp(z - stats)


def _scan_pick(weights: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # weights [B, K], target [B] -> [B]
    """Index of the entry whose cumulative-weight interval holds `target`, never a zero-weight entry."""
    cum = weights.cumsum(dim=-1)
    idx = torch.searchsorted(cum, target.unsqueeze(-1), right=True).squeeze(-1)
    positions = torch.arange(weights.shape[-1], device=weights.device)
    last_positive = torch.where(weights > 0, positions, 0).amax(dim=-1)
    return torch.minimum(idx, last_positive)  # target at the very top (rounding) keeps the last live entry


def _sample_residual(
    target_logits: torch.Tensor,  # [B, γ+1, V]
    draft_logits: torch.Tensor,  # [B, γ, V]
    n: torch.Tensor,  # LongTensor[B]: the position that needs a new token
    probs: _Probs,
    p_stats: torch.Tensor | None,  # [B, γ+1] log-normalizers of the target (None in sigmoid mode)
    q_stats: torch.Tensor | None,  # [B, γ] log-normalizers of the draft (None in sigmoid mode)
    q_weight: torch.Tensor,  # [B]: l on a rejection, 0 for the bonus draw
    u: torch.Tensor,  # [B]: the residual uniforms
    tile: int,
) -> torch.Tensor:  # LongTensor[B]
    """Sample max(0, p - w·q) at position n of each row (w = 0 gives the bonus draw from p)."""
    B, gamma, V = draft_logits.shape
    rows = torch.arange(B, device=n.device)
    qn = n.clamp(max=gamma - 1)
    ps = p_stats[rows, n].unsqueeze(-1) if p_stats is not None else None
    qs = q_stats[rows, qn].unsqueeze(-1) if q_stats is not None else None
    w = q_weight.unsqueeze(-1)

    def residual(zp: torch.Tensor, zq: torch.Tensor) -> torch.Tensor:
        return torch.clamp(probs(zp, ps) - w * probs(zq, qs), min=0)

    def tile_masses() -> torch.Tensor:  # [B, K] partial sums, the only per-tile output
        return torch.stack(
            [residual(target_logits[rows, n, s:s + tile], draft_logits[rows, qn, s:s + tile]).sum(-1)
             for s in range(0, V, tile)],
            dim=-1,
        )

    tile_mass = tile_masses()
    total = tile_mass.sum(dim=-1)
    if bool((total <= 0).any()):
        # A rejection with no residual mass can only come from rounding (p ≈ q): sample p there instead.
        w = torch.where((total > 0).unsqueeze(-1), w, 0.0)
        tile_mass = tile_masses()
        total = tile_mass.sum(dim=-1)
    goal = u * total
    k = _scan_pick(tile_mass, goal)
    before = torch.where(k > 0, tile_mass.cumsum(-1).gather(-1, (k - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1), 0.0)

    # Recompute only the chosen tile of each row and scan inside it.
    cols = k.unsqueeze(-1) * tile + torch.arange(tile, device=k.device)
    inside = cols < V
    cols = cols.clamp(max=V - 1)
    zp = target_logits[rows.unsqueeze(-1), n.unsqueeze(-1), cols]
    zq = draft_logits[rows.unsqueeze(-1), qn.unsqueeze(-1), cols]
    local = torch.where(inside, residual(zp, zq), 0.0)
    j = _scan_pick(local, goal - before)
    return cols.gather(-1, j.unsqueeze(-1)).squeeze(-1)


def verify_tiled(draft_tokens: torch.Tensor, draft_logits: torch.Tensor, target_logits: torch.Tensor,
                 lengths: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None, *,
                 lenience: float, sigmoid: tuple[float, float] | None, tile: int = DEFAULT_TILE,
                 native: bool = False, checked: bool = True) -> Verdict:
    """`exact` (sigmoid None) or `sigmoid` (its (α, β)) on the torch path; see the module docstring. Shapes and
    lengths as verify_baseline's (specviz.verify.baseline). native: `exact`'s two full-vocabulary passes (the
    normalizers, the residual draw) in C++ where fp32 CPU logits allow it (specviz.verify.cpu); `tile` then
    does not apply. checked: whether the caller has checked both logits (sampling.check_logits); if not, this
    does, on the native path from the normalizers it needs anyway (a bad row's is not finite: a 4-row γ-1
    verification spends 0.08 + 0.14 ms less reading the logits once more)."""
    if tile < 1:
        raise ValueError("tile size must be >= 1")
    tile = min(tile, target_logits.shape[-1])  # per-row scratch is [B, tile]: never wider than the vocabulary
    B, gamma = draft_tokens.shape
    drafted = torch.arange(gamma, device=draft_tokens.device) < lengths.unsqueeze(-1)  # [B, γ]
    given = draft_logits, target_logits

    def check() -> None:
        check_logits(given[0], "draft")
        check_logits(given[1], "target")

    if sampling.greedy:
        return _verify_greedy(draft_tokens, draft_logits, target_logits, drafted, lengths, generator, lenience,
                              None if checked else check)
    if sampling.temperature_only:
        scale = 1.0 / sampling.temperature
    else:
        draft_logits, target_logits, scale = standardize(draft_logits, sampling), standardize(target_logits, sampling), 1.0
    probs = _Probs(scale, sigmoid)
    native = native and sigmoid is None and cpu.applies(draft_logits, target_logits)
    if native:
        p_stats, q_stats = cpu.row_lse(target_logits, scale), cpu.row_lse(draft_logits, scale)
        if not checked and not bool(torch.isfinite(p_stats).all() and torch.isfinite(q_stats).all()):
            check()  # names the first bad row (a finite row overflowing its scale passes, as it would have)
    else:
        if not checked:
            check()
        p_stats, q_stats = probs.row_stats(target_logits, tile), probs.row_stats(draft_logits, tile)

    idx = draft_tokens.unsqueeze(-1)
    p_x = probs(target_logits[:, :gamma].gather(-1, idx).squeeze(-1), None if p_stats is None else p_stats[:, :gamma])
    q_x = probs(draft_logits.gather(-1, idx).squeeze(-1), q_stats)
    ratio = p_x / (lenience * q_x)

    u = torch.rand((B, gamma), generator=generator, device=ratio.device, dtype=ratio.dtype)
    accepted = (u <= ratio) & drafted  # NaN (0/0) compares False: a token neither model can produce is rejected
    n = accepted.long().cumprod(dim=-1).sum(dim=-1)

    u_res = torch.rand((B,), generator=generator, device=ratio.device, dtype=ratio.dtype)
    q_weight = torch.where(n < lengths, lenience, 0.0)
    if native:
        t = cpu.residual_pick(target_logits, draft_logits, n, p_stats, q_stats, q_weight, u_res, scale)
    else:
        t = _sample_residual(target_logits, draft_logits, n, probs, p_stats, q_stats, q_weight, u_res, tile)
    return Verdict(n_accepted=n, next_token=t, accept_prob=accept_probs(ratio, drafted), uniforms=u, p_draft=p_x,
                   q_draft=q_x)


def _verify_greedy(
    draft_tokens: torch.Tensor,  # LongTensor[B, γ]
    draft_logits: torch.Tensor,  # [B, γ, V]
    target_logits: torch.Tensor,  # [B, γ+1, V]
    drafted: torch.Tensor,  # BoolTensor[B, γ]: position < the row's draft length
    lengths: torch.Tensor,  # LongTensor[B]
    generator: torch.Generator | None,
    lenience: float,
    check: Callable[[], None] | None = None,
) -> Verdict:
    """Temperature 0: both distributions are one-hot, so only argmaxes are needed (same for both modes). check:
    where the caller has not checked the logits, what names a bad row; called only where a value at an argmax
    is not finite, which is where a row is bad (sampling.argmax_is_finite)."""
    B, gamma = draft_tokens.shape
    p_arg = argmax(target_logits)  # [B, γ+1]
    q_arg = argmax(draft_logits)  # [B, γ]
    if check is not None and not bool(argmax_is_finite(draft_logits, q_arg).all()
                                      and argmax_is_finite(target_logits, p_arg).all()):
        check()
    p_x = (draft_tokens == p_arg[:, :gamma]).float()
    q_x = (draft_tokens == q_arg).float()
    ratio = p_x / (lenience * q_x)
    # Draw the same random numbers as the sampled path so traces stay comparable across settings.
    u = torch.rand((B, gamma), generator=generator, device=ratio.device)
    torch.rand((B,), generator=generator, device=ratio.device)
    n = ((u <= ratio) & drafted).long().cumprod(dim=-1).sum(dim=-1)
    t = p_arg.gather(-1, n.unsqueeze(-1)).squeeze(-1)  # n ≤ the row's length: the bonus sits right after its drafts
    return Verdict(n_accepted=n, next_token=t, accept_prob=accept_probs(ratio, drafted), uniforms=u, p_draft=p_x,
                   q_draft=q_x)
