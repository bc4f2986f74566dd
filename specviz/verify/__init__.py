"""Verification: one public function, three modes.

    result = specviz.verify("exact", draft_tokens, draft_logits, target_logits, sampling=..., generator=g)

Shapes: draft_tokens LongTensor[B, γ], draft_logits [B, γ, V], target_logits [B, γ+1, V] (raw model
logits; the sampling settings are applied here, identically to both models). Per row the result says how
many drafted tokens were accepted and which token comes next: the correction sampled from the residual
on a rejection, the bonus token from the target's last position when all γ were accepted.

Random numbers are drawn from `generator` in a fixed order: one uniform per drafted position (a [B, γ]
tensor), then the residual draw. `baseline` draws the residual with torch.multinomial, as transformers
does, so that both make identical decisions from identically seeded generators.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import MODES, SamplingConfig
from ..sampling import check_logits
from .baseline import verify_baseline
from .tiled import DEFAULT_TILE, verify_tiled

__all__ = ["VerifyResult", "verify", "MODES", "BACKENDS", "kernels_active"]


@dataclass
class VerifyResult:
    n_accepted: torch.Tensor  # LongTensor[B]: drafted tokens kept, a prefix of each row
    next_token: torch.Tensor  # LongTensor[B]: correction on a rejection, bonus when all γ were kept
    accept_prob: torch.Tensor  # [B, γ]: min(1, p(x) / (l·q(x))) at each drafted token
    uniforms: torch.Tensor  # [B, γ]: the uniform each position was compared with
    p_draft: torch.Tensor  # [B, γ]: target probability of each drafted token, as the mode computes it
    q_draft: torch.Tensor  # [B, γ]: draft probability of each drafted token, as the mode computes it

    def emitted(self, draft_tokens: torch.Tensor, row: int = 0) -> list[int]:
        """The tokens this verification appends to sequence `row`: kept drafts, then next_token."""
        n = int(self.n_accepted[row])
        return draft_tokens[row, :n].tolist() + [int(self.next_token[row])]


def _check_shapes(draft_tokens: torch.Tensor, draft_logits: torch.Tensor, target_logits: torch.Tensor) -> None:
    if draft_tokens.dim() != 2 or draft_tokens.dtype != torch.long:
        raise ValueError(f"draft_tokens must be a LongTensor [B, γ], got {draft_tokens.dtype} {tuple(draft_tokens.shape)}")
    B, gamma = draft_tokens.shape
    if gamma < 1:
        raise ValueError("need at least one drafted token (γ >= 1)")
    if draft_logits.dim() != 3 or draft_logits.shape[:2] != (B, gamma):
        raise ValueError(f"draft_logits must be [B={B}, γ={gamma}, V], got {tuple(draft_logits.shape)}")
    if target_logits.dim() != 3 or target_logits.shape[:2] != (B, gamma + 1):
        raise ValueError(f"target_logits must be [B={B}, γ+1={gamma + 1}, V], got {tuple(target_logits.shape)}")
    if draft_logits.shape[-1] != target_logits.shape[-1]:
        raise ValueError(
            f"draft and target vocabularies differ: {draft_logits.shape[-1]} vs {target_logits.shape[-1]} columns"
        )
    V = target_logits.shape[-1]
    if bool((draft_tokens < 0).any()) or bool((draft_tokens >= V).any()):
        raise ValueError(f"draft_tokens must lie in [0, {V})")


def verify(
    mode: str,
    draft_tokens: torch.Tensor,
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    sampling: SamplingConfig = SamplingConfig(),
    generator: torch.Generator | None = None,
    *,
    lenience: float = 1.0,
    sigmoid_alpha: float = -1e4,
    sigmoid_beta: float = 1e4,
    tile_size: int = DEFAULT_TILE,
    backend: str = "auto",
) -> VerifyResult:
    """Decide which drafted tokens to keep and sample the next token; see the module docstring.

    mode: 'baseline' (transformers' algorithm), 'exact' (Wagner et al. §3.2.1 tiled pass) or 'sigmoid'
    (Wagner et al. §3.2.2, approximate). lenience l in (0, 1] multiplies q before the comparison
    (Leviathan et al. A.5); 1 keeps the output distribution exact. backend: 'auto' runs `exact` and
    `sigmoid` on CUDA tensors with the CuPy kernels in kernels/ when they work (same random numbers, same
    decisions up to floating-point near-ties), 'torch' forces the torch path, 'cuda' requires the kernels.
    """
    if mode not in MODES:
        raise ValueError(f"unknown verification mode {mode!r}; choose one of {', '.join(MODES)}")
    if not 0 < lenience <= 1:
        raise ValueError(f"lenience must be in (0, 1], got {lenience}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown verification backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    _check_shapes(draft_tokens, draft_logits, target_logits)
    if _use_kernels(mode, sampling, target_logits, backend):
        return VerifyResult(**_verify_kernels(mode, draft_tokens, draft_logits, target_logits, sampling, generator,
                                              lenience, sigmoid_alpha, sigmoid_beta))
    check_logits(draft_logits, "draft")
    check_logits(target_logits, "target")
    if mode == "baseline":
        fields = verify_baseline(draft_tokens, draft_logits, target_logits, sampling, generator, lenience)
    else:
        fields = verify_tiled(
            draft_tokens, draft_logits, target_logits, sampling, generator,
            lenience=lenience, sigmoid=(sigmoid_alpha, sigmoid_beta) if mode == "sigmoid" else None,
            tile=tile_size,
        )
    return VerifyResult(**fields)


BACKENDS = ("auto", "torch", "cuda")


def kernels_active() -> bool:
    """True when the CuPy verification kernels can run here (a CUDA device, CuPy, a working compiler)."""
    try:
        import kernels
    except ImportError:
        return False
    return kernels.available()


def _use_kernels(mode: str, sampling: SamplingConfig, target_logits: torch.Tensor, backend: str) -> bool:
    # greedy needs only argmaxes, which torch does well on any device; baseline is transformers' algorithm
    wanted = mode != "baseline" and not sampling.greedy and target_logits.is_cuda
    if backend == "cuda":
        if not wanted:
            raise ValueError("the CUDA kernels verify exact/sigmoid on CUDA tensors with sampling (not greedy)")
        if not kernels_active():
            import kernels

            raise RuntimeError(f"the CUDA verification kernels cannot run: {kernels.unavailable_reason()}")
        return True
    return backend == "auto" and wanted and kernels_active()


def _verify_kernels(mode, draft_tokens, draft_logits, target_logits, sampling, generator, lenience, alpha, beta) -> dict:
    import kernels

    from ..sampling import standardize

    B, gamma = draft_tokens.shape
    # the same draws, in the same order, as the torch path: the decisions then agree
    u = torch.rand((B, gamma), generator=generator, device=target_logits.device)
    u_res = torch.rand((B,), generator=generator, device=target_logits.device)
    if sampling.temperature_only:
        scale = 1.0 / sampling.temperature
    else:
        draft_logits, target_logits, scale = standardize(draft_logits, sampling), standardize(target_logits, sampling), 1.0
    return kernels.verify_cuda(mode, draft_tokens, draft_logits, target_logits, u, u_res, scale=scale,
                               lenience=lenience, sigmoid_alpha=alpha, sigmoid_beta=beta)
