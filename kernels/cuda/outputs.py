"""A call's output bytes: typed device views, Python lists of the host copy, and the errors the kernels flagged.

Layout (written by verify.cu, sized by `plan._plan`): int64 n_accepted [B], next_token [B], errors [B, 5], then
float32 accept_prob, p_draft, q_draft, uniforms [B, γ] each.
"""

from __future__ import annotations

import numpy as np
import torch

_ERROR_KIND = {1: "NaN", 2: "+inf", 4: "only -inf (no token has any probability)"}


def _views(raw: torch.Tensor, B: int, gamma: int) -> dict[str, torch.Tensor]:
    """Typed views of the output bytes (device buffer or its host copy)."""
    # split / unbind: one op for several views (each torch op costs the host ~1-2 µs)
    n, t, errors = raw[: 7 * B * 8].view(torch.int64).split([B, B, 5 * B])
    accept_prob, p_draft, q_draft, uniforms = (
        raw[7 * B * 8: 7 * B * 8 + 16 * B * gamma].view(torch.float32).view(4, B, gamma).unbind(0))
    return dict(n_accepted=n, next_token=t, errors=errors.view(B, 5), accept_prob=accept_prob, p_draft=p_draft,
                q_draft=q_draft, uniforms=uniforms)


def host_lists(raw: np.ndarray, B: int, gamma: int) -> dict[str, list]:
    """The output bytes (uint8, host) as Python lists: the same keys as `_views`, [B] or [B][γ] each."""
    i64 = raw[: 7 * B * 8].view(np.int64)
    f32 = raw[7 * B * 8: 7 * B * 8 + 16 * B * gamma].view(np.float32).reshape(4, B, gamma).tolist()
    return dict(
        n_accepted=i64[:B].tolist(),
        next_token=i64[B:2 * B].tolist(),
        errors=i64[2 * B:].reshape(B, 5).tolist(),
        accept_prob=f32[0],
        p_draft=f32[1],
        q_draft=f32[2],
        uniforms=f32[3],
    )


def raise_for_errors(errors, vocab: int) -> None:
    """Raise for the first problem the kernels flagged; errors: host int64 [B, 5] (tensor or nested list;
    see verify.cu sv_finish).

    Order as in `specviz.verify`: drafted tokens out of range, then draft logits, then target logits.
    """
    try:
        from specviz.sampling import InvalidLogitsError
    except Exception:  # used outside the project
        InvalidLogitsError = ValueError  # noqa: N806
    rows = errors.tolist() if hasattr(errors, "tolist") else errors
    for b, row in enumerate(rows):
        if row[4] >= 0:
            raise ValueError(f"draft_tokens must lie in [0, {vocab}): position [{b}, {row[4]}] does not")
    for name, col in (("draft", 0), ("target", 2)):
        for b, row in enumerate(rows):
            if row[col] >= 0:
                bits = row[col + 1]
                what = next((text for bit, text in _ERROR_KIND.items() if bits & bit), f"error bits {bits}")
                raise InvalidLogitsError(
                    f"{name} logits contain {what} at index [{b}, {row[col]}]; the model output is unusable"
                )
