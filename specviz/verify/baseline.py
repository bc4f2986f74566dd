"""`baseline`: the algorithm of transformers' `_speculative_sampling`, batched.

Full softmax of both logit tensors, gather at the drafted ids, accept while u <= p/q, then
multinomial on the normalized residual (or on p at position γ when everything was accepted). The
operations and the order of random draws follow transformers so that, for B = 1 and the same seeded
generator, both make the same decisions.
"""

from __future__ import annotations

import torch

from specviz.config import SamplingConfig
from specviz.sampling import standardize
from specviz.verify.verdict import Verdict, accept_probs


def verify_baseline(draft_tokens: torch.Tensor, draft_logits: torch.Tensor, target_logits: torch.Tensor,
                    lengths: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None,
                    lenience: float) -> Verdict:
    """transformers' acceptance and residual draw, batched over ragged rows; see the module docstring. Shapes
    as specviz.verify's; lengths LongTensor[B]: drafted tokens per row, 1..γ (positions beyond are padding)."""
    B, gamma = draft_tokens.shape
    q = standardize(draft_logits, sampling).softmax(dim=-1)
    p = standardize(target_logits, sampling).softmax(dim=-1)
    idx = draft_tokens.unsqueeze(-1)
    q_i = q.gather(-1, idx).squeeze(-1)
    p_i = p[:, :gamma].gather(-1, idx).squeeze(-1)
    ratio = p_i / q_i if lenience == 1.0 else p_i / (lenience * q_i)

    r = torch.rand(ratio.shape, generator=generator, device=ratio.device, dtype=ratio.dtype)
    drafted = torch.arange(gamma, device=ratio.device) < lengths.unsqueeze(-1)
    accepted = (r <= ratio) & drafted  # a padded position ends the accepted prefix like a rejection would
    n = ((~accepted).cumsum(dim=-1) < 1).sum(dim=-1)

    rows = torch.arange(B, device=p.device)
    p_n = p[rows, n]
    residual = torch.clamp(p_n - lenience * q[rows, n.clamp(max=gamma - 1)], min=0)
    mass = residual.sum(dim=-1, keepdim=True)
    # A rejection with zero residual mass can only come from rounding (p ≈ q); fall back to p there.
    use_residual = (n < lengths).unsqueeze(-1) & (mass > 0)
    dist = torch.where(use_residual, residual / mass, p_n)
    t = torch.multinomial(dist, num_samples=1, generator=generator).squeeze(-1)

    return Verdict(n_accepted=n, next_token=t, accept_prob=accept_probs(ratio, drafted), uniforms=r, p_draft=p_i,
                   q_draft=q_i)
