"""Exact verification's two full-vocabulary passes in C++ on the CPU (kernels/cpu/verify_cpu.cpp), behind
`verify_tiled`: each row's log-normalizer, and the residual draw at the position that needs a new token.

The algorithm and the random numbers are the torch path's (Wagner et al.'s tiled pass); only the sums run
in another order, so decisions agree with the torch path except at floating-point near-ties (tested). Used
for fp32 CPU logits whose last dimension is contiguous, where the library builds; else the torch path runs.
"""

from __future__ import annotations

import torch

from specviz import native


def applies(*logits: torch.Tensor) -> bool:
    """Whether these logits ([..., V] each) can go to the C++ passes as they are (and the library loads here)."""
    return native.available() and all(z.device.type == "cpu" and z.dtype == torch.float32 and z.dim() == 3
                               and z.stride(-1) == 1 for z in logits)


def row_lse(logits: torch.Tensor, scale: float) -> torch.Tensor:  # [B, R, V] -> [B, R]
    """log Σ exp(scale·z) over the last dimension of every row; NaN for a row holding a NaN, +inf for one holding
    +inf, -inf for one without a finite value (the caller checks the logits from these)."""
    B, R, V = logits.shape
    out = torch.empty((B, R), dtype=torch.float32)
    native.library().specviz_row_lse(logits.data_ptr(), B, R, V, logits.stride(0), logits.stride(1), scale,
                                     out.data_ptr(), torch.get_num_threads())
    return out


def residual_pick(
    target_logits: torch.Tensor,  # [B, γ+1, V]
    draft_logits: torch.Tensor,  # [B, γ, V]
    n: torch.Tensor,  # LongTensor[B]: the position that needs a new token
    p_stats: torch.Tensor,  # [B, γ+1] the target's log-normalizers
    q_stats: torch.Tensor,  # [B, γ] the draft's
    q_weight: torch.Tensor,  # [B]: l on a rejection, 0 for the bonus draw
    u: torch.Tensor,  # [B]: the residual uniforms
    scale: float,
) -> torch.Tensor:  # LongTensor[B]
    """A token from max(0, p - w·q) at position n of each row (from p where that has no mass)."""
    B, gamma, V = draft_logits.shape
    token = torch.empty((B,), dtype=torch.long)
    n, p_stats, q_stats = n.contiguous(), p_stats.contiguous(), q_stats.contiguous()
    w, u = q_weight.float().contiguous(), u.float().contiguous()
    native.library().specviz_residual_pick(
        target_logits.data_ptr(), target_logits.stride(0), target_logits.stride(1),
        draft_logits.data_ptr(), draft_logits.stride(0), draft_logits.stride(1), B, gamma, V,
        n.data_ptr(), p_stats.data_ptr(), q_stats.data_ptr(), w.data_ptr(), u.data_ptr(), scale, token.data_ptr(),
        torch.get_num_threads())
    return token
