"""The one definition of a measured speedup: a run's rates over target-only's on the same input and settings,
both for decoding alone and end to end, named apart wherever they are shown."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Speedup:
    # decoding tokens/s (prefill excluded) over target-only's: what speculation itself changes
    decode: float
    # tokens/s over the whole wall time (prefill included) over target-only's: what a user waits for
    end_to_end: float


def measured(decode_tokens_per_s: float, tokens_per_s: float, reference_decode_tokens_per_s: float | None,
             reference_tokens_per_s: float | None) -> Speedup | None:
    """None when the reference has no rate to divide by (a reference that decoded nothing, or a trace
    without one)."""
    rates = (decode_tokens_per_s, tokens_per_s, reference_decode_tokens_per_s, reference_tokens_per_s)
    if not all(isinstance(r, (int, float)) and math.isfinite(r) and r > 0 for r in rates[2:]):
        return None
    return Speedup(decode=decode_tokens_per_s / reference_decode_tokens_per_s,
                   end_to_end=tokens_per_s / reference_tokens_per_s)
