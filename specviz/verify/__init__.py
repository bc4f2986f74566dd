"""Verification: one public function, three modes.

    result = specviz.verify("exact", draft_tokens, draft_logits, target_logits, sampling=..., generator=g)

Shapes: draft_tokens LongTensor[B, γ], draft_logits [B, γ, V], target_logits [B, γ+1, V] (raw model
logits; the sampling settings are applied here, identically to both models). Per row the result says how
many drafted tokens were accepted and which token comes next: the correction sampled from the residual
on a rejection, the bonus token from the target's last position when all γ were accepted.

Ragged batches: `draft_lengths` (γ_b per row, 1 ≤ γ_b ≤ γ) lets rows draft fewer tokens than γ (the
draft-confidence stop ends rows at different points). Row b then uses draft positions [0, γ_b) and target
positions [0, γ_b]; whatever lies beyond is padding that is never read into a decision, and the bonus of
a row that kept all γ_b drafts comes from target position γ_b. Omitted, every row drafted γ.

Random numbers are drawn from `generator` in a fixed order: one uniform per drafted position (a [B, γ]
tensor), then the residual draw. `baseline` draws the residual with torch.multinomial, as transformers
does, so that both make identical decisions from identically seeded generators.

The engine holds a batch's facts in one `VerifyMetadata` and calls `verify_batch`; `verify` builds that
object from its keywords. The torch paths are `baseline` and `tiled`; the CUDA kernels (kernels/cuda/, loaded by
`cuda`) take over exact and sigmoid on CUDA tensors, and on the CPU exact's two full-vocabulary passes run in
C++ (`cpu`, kernels/cpu/verify_cpu.cpp) unless the backend is 'torch'. Imports config, sampling, paths and native only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from specviz.config import MODES, SamplingConfig, SpecConfig
from specviz.sampling import check_logits
from specviz.verify.baseline import verify_baseline
from specviz.verify.cuda import (BACKENDS, KernelArgs, KernelSampling, kernel_args, kernel_sampling, kernels_active,
                                 project_kernels, use_kernels, verify_kernels)
from specviz.verify.tiled import DEFAULT_TILE, verify_tiled
from specviz.verify.verdict import Verdict, VerifyHost, VerifyResult

__all__ = ["VerifyHost", "VerifyResult", "VerifyMetadata", "Verdict", "verify", "verify_batch", "MODES", "BACKENDS",
           "kernels_active", "kernel_args", "kernel_sampling", "KernelArgs", "KernelSampling", "project_kernels"]


@dataclass(frozen=True)
class VerifyMetadata:
    """One verification call's facts besides its tensors, in one object (the idea of vLLM's
    SpecDecodeMetadata): the rule that decides, how both models' logits are standardized, how far each
    row drafted, and where it runs."""

    mode: str  # 'baseline' (transformers' algorithm), 'exact' (Wagner et al. §3.2.1) or 'sigmoid' (§3.2.2)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    draft_lengths: tuple[int, ...] | None = None  # γ_b per row (1 ≤ γ_b ≤ γ); None: every row drafted γ
    lenience: float = 1.0  # l in (0, 1] multiplies q before the comparison (Leviathan et al. A.5); 1 is exact
    sigmoid_alpha: float = -1e4  # sigmoid mode: p̂ = σ((z − α) / (β − α))
    sigmoid_beta: float = 1e4
    backend: str = "auto"  # see verify()
    tile_size: int = DEFAULT_TILE  # vocabulary columns per tile on the torch path of exact and sigmoid

    @classmethod
    def for_run(cls, cfg: SpecConfig, draft_lengths: Sequence[int]) -> VerifyMetadata:
        """A run's verification settings for a batch whose rows drafted draft_lengths tokens."""
        return cls(mode=cfg.mode, sampling=cfg.sampling, draft_lengths=tuple(draft_lengths), lenience=cfg.lenience,
                   sigmoid_alpha=cfg.sigmoid_alpha, sigmoid_beta=cfg.sigmoid_beta, backend=cfg.verify_backend)

    @property
    def sigmoid(self) -> tuple[float, float] | None:
        """(α, β) in sigmoid mode; None otherwise."""
        return (self.sigmoid_alpha, self.sigmoid_beta) if self.mode == "sigmoid" else None

    def ragged(self, gamma: int) -> bool:
        """Whether some row drafted fewer than γ tokens."""
        return self.draft_lengths is not None and min(self.draft_lengths) < gamma


def _check_metadata(meta: VerifyMetadata) -> None:
    if meta.mode not in MODES:
        raise ValueError(f"unknown verification mode {meta.mode!r}; choose one of {', '.join(MODES)}")
    if not 0 < meta.lenience <= 1:
        raise ValueError(f"lenience must be in (0, 1], got {meta.lenience}")
    if meta.backend not in BACKENDS:
        raise ValueError(f"unknown verification backend {meta.backend!r}; choose one of {', '.join(BACKENDS)}")


def _check_shapes(draft_tokens: torch.Tensor, draft_logits: torch.Tensor, target_logits: torch.Tensor,
                  draft_lengths: Sequence[int] | None) -> None:
    """Shapes, dtypes and draft_lengths: no device work."""
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
    if draft_lengths is not None:
        if len(draft_lengths) != B or any(not 1 <= int(n) <= gamma for n in draft_lengths):
            raise ValueError(f"draft_lengths must hold B={B} counts in [1, γ={gamma}], got {list(draft_lengths)}")


def _check_token_range(draft_tokens: torch.Tensor, vocab: int) -> None:  # draft_tokens LongTensor[B, γ]
    """Drafted ids in [0, V): one reduction and one host sync (the kernels check this in their error slot)."""
    if bool(((draft_tokens < 0) | (draft_tokens >= vocab)).any()):
        raise ValueError(f"draft_tokens must lie in [0, {vocab})")


def _lengths(draft_lengths: Sequence[int] | None, draft_tokens: torch.Tensor) -> torch.Tensor:
    """γ_b per row as LongTensor[B] on the tokens' device (γ everywhere when not given); draft_tokens [B, γ]."""
    B, gamma = draft_tokens.shape
    if draft_lengths is None:
        return torch.full((B,), gamma, dtype=torch.long, device=draft_tokens.device)
    return torch.tensor([int(n) for n in draft_lengths], dtype=torch.long, device=draft_tokens.device)


def verify(
    mode: str,
    draft_tokens: torch.Tensor,  # LongTensor[B, γ]
    draft_logits: torch.Tensor,  # [B, γ, V]
    target_logits: torch.Tensor,  # [B, γ+1, V]
    sampling: SamplingConfig = SamplingConfig(),
    generator: torch.Generator | None = None,
    *,
    lenience: float = 1.0,
    sigmoid_alpha: float = -1e4,
    sigmoid_beta: float = 1e4,
    tile_size: int = DEFAULT_TILE,
    backend: str = "auto",
    draft_lengths: Sequence[int] | None = None,
) -> VerifyResult:
    """Decide which drafted tokens to keep and sample the next token; see the module docstring.

    mode: 'baseline' (transformers' algorithm), 'exact' (Wagner et al. §3.2.1 tiled pass) or 'sigmoid'
    (Wagner et al. §3.2.2, approximate). lenience l in (0, 1] multiplies q before the comparison
    (Leviathan et al. A.5); 1 keeps the output distribution exact. backend: 'auto' runs `exact` and
    `sigmoid` on CUDA tensors with the CuPy kernels in kernels/cuda/ when they work, and `exact`'s two
    full-vocabulary passes on fp32 CPU tensors in C++ (specviz.verify.cpu; both with the same random numbers
    and the same decisions up to floating-point near-ties); 'torch' runs everything in torch; 'cuda' requires
    the kernels for exact and sigmoid (baseline, transformers' algorithm, has no kernel and runs on torch
    under any backend).
    draft_lengths: drafted tokens per row when rows drafted fewer than γ (see the module docstring); ragged
    rows verify on the torch path, which the kernels do not yet take.

    On the kernel path a call launches the two uniform draws and the kernels and reads back once (the
    result's `host()` is that copy); input problems (bad logits, drafted ids outside [0, V)) are raised
    from that readback. The kernels apply temperature, top-k and top-p themselves in both modes (see
    `kernel_sampling`); only top_k above their MAX_TOPK standardizes the logits with torch first.
    """
    meta = VerifyMetadata(mode=mode, sampling=sampling, lenience=lenience, sigmoid_alpha=sigmoid_alpha,
                          sigmoid_beta=sigmoid_beta, tile_size=tile_size, backend=backend,
                          draft_lengths=None if draft_lengths is None else tuple(draft_lengths))
    return verify_batch(meta, draft_tokens, draft_logits, target_logits, generator)


def verify_batch(
    meta: VerifyMetadata,
    draft_tokens: torch.Tensor,  # LongTensor[B, γ]
    draft_logits: torch.Tensor,  # [B, γ, V]
    target_logits: torch.Tensor,  # [B, γ+1, V]
    generator: torch.Generator | None = None,
) -> VerifyResult:
    """`verify` with the call's facts in one object."""
    _check_metadata(meta)
    _check_shapes(draft_tokens, draft_logits, target_logits, meta.draft_lengths)
    ragged = meta.ragged(draft_tokens.shape[1])
    if ragged and meta.backend == "cuda" and meta.mode != "baseline":
        raise ValueError("the CUDA kernels verify rows of equal length; ragged draft_lengths need backend 'auto' or 'torch'")
    if use_kernels(meta.mode, meta.sampling, target_logits, "torch" if ragged and meta.backend == "auto" else meta.backend):
        # No device checks here: the kernels flag bad logits and out-of-range tokens in their one readback.
        return verify_kernels(meta.mode, draft_tokens, draft_logits, target_logits, meta.sampling, generator,
                               meta.lenience, meta.sigmoid_alpha, meta.sigmoid_beta)
    _check_token_range(draft_tokens, target_logits.shape[-1])
    return VerifyResult.of(_verify_torch(meta, draft_tokens, draft_logits, target_logits, generator))


def _verify_torch(meta: VerifyMetadata, draft_tokens: torch.Tensor, draft_logits: torch.Tensor,
                  target_logits: torch.Tensor, generator: torch.Generator | None) -> Verdict:
    """The torch path of every mode (draft_tokens [B, γ], draft_logits [B, γ, V], target_logits [B, γ+1, V]), the
    logits checked on the way (InvalidLogitsError names the tensor and its first bad row)."""
    lengths = _lengths(meta.draft_lengths, draft_tokens)  # [B]
    if meta.mode == "baseline":
        check_logits(draft_logits, "draft")
        check_logits(target_logits, "target")
        return verify_baseline(draft_tokens, draft_logits, target_logits, lengths, meta.sampling, generator,
                               meta.lenience)
    return verify_tiled(draft_tokens, draft_logits, target_logits, lengths, meta.sampling, generator,
                        lenience=meta.lenience, sigmoid=meta.sigmoid, tile=meta.tile_size,
                        native=meta.backend == "auto", checked=False)
