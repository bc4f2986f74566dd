"""Batch-invariant attention for the CPU target (kernels/cpu/attention_cpu.cpp), plugged into transformers.

Contract: a position's attention output depends on its query and the keys and values it may see, never on
how many other positions or sequences share the call; each row walks exactly its visible keys in order.
With the packed linear layers (also batch-invariant) the whole CPU forward gives a position the same bits
in a prefill, a verification call of γ + 1 positions, a ragged batch, or alone. torch's SDPA does not
(~1e-6 between call shapes), which 8-bit activations can turn into a different code, so packed models use
this one. Registered once with transformers under NAME, with a mask function that always builds the
explicit boolean mask (SDPA's may be skipped for plain causal calls).
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from specviz.models import cpu_kernels

NAME = "specviz_cpu"
_registered = False
_lock = threading.Lock()  # registration happens once, from whichever thread loads a model first


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
               **kwargs) -> tuple[torch.Tensor, None]:
    """query [B, H, L, D], key/value [B, Hkv, S, D], attention_mask [B, 1, L, S] bool (True: attend)
    -> ([B, L, H, D], None), transformers' attention-function contract."""
    if dropout:
        raise ValueError("the specviz CPU attention is for inference only (dropout 0)")
    B, H, L, D = query.shape
    S = key.shape[2]
    if attention_mask is None and not getattr(module, "is_causal", True):  # cross-attention: every key
        sees = torch.ones(B, L, S, dtype=torch.bool)
    elif attention_mask is None:  # never from our mask function; a plain causal call over a fresh sequence
        sees = torch.ones(L, S, dtype=torch.bool).tril(S - L).expand(B, L, S)
    else:
        sees = attention_mask[:, 0] if attention_mask.dtype == torch.bool else attention_mask[:, 0] == 0
    scale = scaling if scaling is not None else D ** -0.5
    # keys and values go as they are: a KV cache's views are read in place (cpu_kernels.attention checks layouts)
    out = cpu_kernels.attention(query.float().contiguous(), key.float(), value.float(),
                                sees.to(torch.uint8).contiguous(), float(scale))
    return out.to(query.dtype), None


def _explicit_mask(*args, **kwargs):
    """SDPA's boolean mask [B, 1, L, S], never skipped in favour of an is_causal flag."""
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def register() -> str:
    """Make NAME an attention implementation transformers knows; returns NAME."""
    global _registered
    with _lock:
        if not _registered:
            from transformers import AttentionInterface
            from transformers.masking_utils import AttentionMaskInterface

            AttentionInterface.register(NAME, _attention)
            AttentionMaskInterface.register(NAME, _explicit_mask)
            _registered = True
    return NAME


def use(model: nn.Module) -> bool:
    """Switch `model` (CPU, fp32) to the batch-invariant attention where the kernels have it; whether it did."""
    if not cpu_kernels.has_attention():
        return False
    model.set_attn_implementation(register())
    return True
