"""One verification call's launch, described without its data: `LaunchSpec`, the plan cache's key."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .sources import MAX_GAMMA, MAX_GRID_YZ, MAX_TOPK, MODES


@dataclass(frozen=True)
class LaunchSpec:
    """Everything a call's launch plan depends on: the layout of its tensors and its settings.

    Built once per call by `of` and handed on (launch → plan._prepare → plan._cached_plan → plan._plan). Two
    calls with equal specs launch the same grids with the same arguments but for the data pointers, so the
    spec is the key of the plan cache. Frozen: a key must not change once stored.

    Settings (the fields with defaults, which `launch` and `verify_cuda` take as keywords):
    scale multiplies the logits as the kernels read them (1/T, or `topk_scale(T)` with top-k / top-p);
    topk (1..MAX_TOPK; 0 = off) and top_p ((0, 1]; 1 = off) filter each row inside the kernels as
    `standardize` does; lenience l in (0, 1] multiplies q before the comparison; sigmoid_alpha < sigmoid_beta:
    sigmoid mode's p̂ = σ((z − α) / (β − α)); stats_chunk / residual_chunk: columns per block (None: sized to
    fill `sms` multiprocessors; tests set them).
    """

    mode: str  # 'exact' or 'sigmoid'
    batch: int  # B
    gamma: int  # γ, drafted tokens per row
    vocab: int  # V
    draft_dtype: torch.dtype  # of draft_logits
    target_dtype: torch.dtype  # of target_logits
    draft_strides: tuple[int, ...]  # of draft_logits [B, γ, V], in elements
    target_strides: tuple[int, ...]  # of target_logits [B, γ+1, V], in elements
    sms: int  # multiprocessors to fill (chunk sizes)
    scale: float = 1.0
    lenience: float = 1.0
    sigmoid_alpha: float = -1e4
    sigmoid_beta: float = 1e4
    topk: int = 0
    top_p: float = 1.0
    stats_chunk: int | None = None
    residual_chunk: int | None = None

    @classmethod
    def of(cls, mode: str, draft_tokens: torch.Tensor, draft_logits: torch.Tensor, target_logits: torch.Tensor,
           u: torch.Tensor, u_res: torch.Tensor, *, sms: int, **settings: float | None) -> LaunchSpec:
        """The launch of these tensors (draft_tokens LongTensor[B, γ], draft_logits [B, γ, V], target_logits
        [B, γ+1, V], u [B, γ], u_res [B]) with these settings (the fields with defaults).

        Checks the shapes against each other on every call (one comparison); `validate` checks the rest once
        per plan. Raises ValueError on a mismatch, TypeError on an unknown setting.
        """
        if draft_tokens.dim() != 2 or draft_tokens.dtype != torch.long:
            raise ValueError(f"draft_tokens must be a LongTensor [B, γ], got {draft_tokens.dtype} "
                             f"{tuple(draft_tokens.shape)}")
        B, gamma = draft_tokens.shape
        V = target_logits.shape[-1] if target_logits.dim() == 3 else -1
        shapes = (draft_logits.shape, target_logits.shape, u.shape, u_res.shape)
        if shapes != ((B, gamma, V), (B, gamma + 1, V), (B, gamma), (B,)):
            raise ValueError(_shape_mismatch(B, gamma, *shapes))
        return cls(mode, B, gamma, V, draft_logits.dtype, target_logits.dtype, draft_logits.stride(),
                   target_logits.stride(), sms, **settings)

    def validate(self) -> None:
        """Raise ValueError for what the kernels cannot run (once per plan: everything checked is in the key)."""
        B, gamma = self.batch, self.gamma
        if self.mode not in MODES:
            raise ValueError(f"unknown CUDA verification mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if B < 1 or gamma < 1:
            raise ValueError(f"need B >= 1 and γ >= 1, got B={B}, γ={gamma}")
        if gamma > MAX_GAMMA:
            raise ValueError(f"the CUDA kernels support γ <= {MAX_GAMMA}, got {gamma}")
        if B > MAX_GRID_YZ:
            raise ValueError(f"the CUDA kernels support B <= {MAX_GRID_YZ}, got {B}")
        if self.vocab < 1:
            raise ValueError("the vocabulary is empty")
        if not 0 < self.lenience <= 1:
            raise ValueError(f"lenience must be in (0, 1], got {self.lenience}")
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"scale must be a positive finite number, got {self.scale}")
        if self.mode == "sigmoid" and not self.sigmoid_alpha < self.sigmoid_beta:
            raise ValueError("sigmoid α must be smaller than β")
        if self.topk and not 0 < self.topk <= MAX_TOPK:
            raise ValueError(f"in-kernel top-k needs 1 <= k <= {MAX_TOPK}, got k={self.topk}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")


def _shape_mismatch(B: int, gamma: int, draft: torch.Size, target: torch.Size, u: torch.Size,
                    u_res: torch.Size) -> str:
    """What is wrong with the shapes of draft_logits, target_logits, u and u_res, given draft_tokens [B, γ]."""
    if len(draft) != 3 or tuple(draft[:2]) != (B, gamma):
        return f"draft_logits must be [B={B}, γ={gamma}, V], got {tuple(draft)}"
    if len(target) != 3 or tuple(target[:2]) != (B, gamma + 1):
        return f"target_logits must be [B={B}, γ+1={gamma + 1}, V], got {tuple(target)}"
    if draft[-1] != target[-1]:
        return f"draft and target vocabularies differ: {draft[-1]} vs {target[-1]}"
    return f"u must be [B, γ] = [{B}, {gamma}] and u_res [B] = [{B}], got {tuple(u)}, {tuple(u_res)}"
