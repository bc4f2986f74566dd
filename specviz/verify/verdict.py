"""What a verification decides: every path's typed `Verdict` (device tensors) and the `VerifyResult` that verify() returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch


class Verdict(NamedTuple):
    """What one verification decided for every row, as device tensors; each path (baseline, tiled, greedy,
    the CUDA kernels) returns one. A NamedTuple: immutable and cheap, and `_asdict()` gives the kernels'
    dict form where the two are compared."""

    n_accepted: torch.Tensor  # LongTensor[B]: drafted tokens kept, a prefix of each row
    next_token: torch.Tensor  # LongTensor[B]: correction on a rejection, bonus when all were kept
    accept_prob: torch.Tensor  # [B, γ]: min(1, p(x) / (l·q(x))) at each drafted token, 0 at padding positions
    uniforms: torch.Tensor  # [B, γ]: the uniform each position was compared with
    p_draft: torch.Tensor  # [B, γ]: target probability of each drafted token, as the mode computes it
    q_draft: torch.Tensor  # [B, γ]: draft probability of each drafted token, as the mode computes it


def accept_probs(ratio: torch.Tensor, drafted: torch.Tensor) -> torch.Tensor:
    """min(1, ratio) where a row drafted (ratio [B, γ], drafted BoolTensor[B, γ]); 0 elsewhere, and where
    ratio is 0/0 (a token neither model can produce)."""
    return torch.where(drafted, ratio.nan_to_num(nan=0.0).clamp(max=1.0), 0.0)


@dataclass(frozen=True)
class VerifyHost:
    """A VerifyResult's fields as Python lists on the host (what the engine records)."""

    n_accepted: list[int]  # [B]
    next_token: list[int]  # [B]
    accept_prob: list[list[float]]  # [B][γ]
    uniforms: list[list[float]]  # [B][γ]
    p_draft: list[list[float]]  # [B][γ]
    q_draft: list[list[float]]  # [B][γ]



@dataclass
class VerifyResult:
    """verify()'s answer: the verdict's tensors, and their host copy, made at most once."""

    n_accepted: torch.Tensor  # LongTensor[B]: drafted tokens kept, a prefix of each row
    next_token: torch.Tensor  # LongTensor[B]: correction on a rejection, bonus when all γ were kept
    accept_prob: torch.Tensor  # [B, γ]: min(1, p(x) / (l·q(x))) at each drafted token
    uniforms: torch.Tensor  # [B, γ]: the uniform each position was compared with
    p_draft: torch.Tensor  # [B, γ]: target probability of each drafted token, as the mode computes it
    q_draft: torch.Tensor  # [B, γ]: draft probability of each drafted token, as the mode computes it
    # The host copy: set by the kernel path from its one readback, else made by the first host() call.
    _host: VerifyHost | None = field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, verdict: Verdict, host: VerifyHost | None = None) -> VerifyResult:
        return cls(n_accepted=verdict.n_accepted, next_token=verdict.next_token, accept_prob=verdict.accept_prob,
                   uniforms=verdict.uniforms, p_draft=verdict.p_draft, q_draft=verdict.q_draft, _host=host)

    def host(self) -> VerifyHost:
        """All fields as Python lists. The kernel path already read them back (no new sync); the torch
        path reads them with one stacked copy the first time, then keeps it."""
        if self._host is None:
            B, gamma = self.accept_prob.shape
            floats = (self.accept_prob, self.uniforms, self.p_draft, self.q_draft)
            # One readback: ids < 2^53 are exact in float64, and so is every float32 value.
            flat = torch.cat([self.n_accepted.reshape(-1).double(), self.next_token.reshape(-1).double(),
                              *(x.reshape(-1).double() for x in floats)]).tolist()

            def per_row(i: int) -> list[list[float]]:  # floats[i] as [B][γ]
                start = 2 * B + i * B * gamma
                return [flat[start + b * gamma:start + (b + 1) * gamma] for b in range(B)]

            self._host = VerifyHost(n_accepted=[int(x) for x in flat[:B]], next_token=[int(x) for x in flat[B:2 * B]],
                                    accept_prob=per_row(0), uniforms=per_row(1), p_draft=per_row(2),
                                    q_draft=per_row(3))
        return self._host

    def emitted(self, draft_tokens: torch.Tensor, row: int = 0) -> list[int]:  # draft_tokens [B, γ]
        """The tokens this verification appends to sequence `row`: kept drafts, then next_token."""
        h = self.host()
        n = h.n_accepted[row]
        return draft_tokens[row, :n].tolist() + [h.next_token[row]]
