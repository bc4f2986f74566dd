"""Standardized sampling (Leviathan et al. §2.2): logits -> the distribution both models sample from.

`standardize` returns logits whose softmax *is* the standardized distribution (masked entries are -inf),
so draft sampling, the target-only reference and every verification mode share one definition.
"""

from __future__ import annotations

import torch

from specviz import native
from specviz.config import SamplingConfig


class InvalidLogitsError(ValueError):
    """Logits that cannot define a distribution: NaN, +inf, or a row with no finite entry."""


def check_logits(logits: torch.Tensor, name: str) -> None:
    """Raise InvalidLogitsError naming the tensor and the first bad row; one reduction over the vocabulary."""
    row_max = logits.amax(dim=-1)
    bad = ~torch.isfinite(row_max)  # NaN propagates through amax; +inf and all -inf rows are not finite
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        row = logits[idx]
        if bool(torch.isnan(row).any()):
            what = "NaN"
        elif bool(torch.isposinf(row).any()):
            what = "+inf"
        else:
            what = "only -inf (no token has any probability)"
        raise InvalidLogitsError(f"{name} logits contain {what} at index {list(idx)}; the model output is unusable")


def standardize(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Apply greedy / temperature / top-k / top-p along the last dim; returns float32 logits."""
    z = logits.float()
    if cfg.greedy:
        out = torch.full_like(z, float("-inf"))
        return out.scatter_(-1, argmax(z).unsqueeze(-1), 0.0)
    if cfg.temperature != 1.0:
        z = z / cfg.temperature
    if cfg.top_k and cfg.top_k < z.shape[-1]:
        kth = torch.topk(z, cfg.top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_z, order = torch.sort(z, dim=-1, descending=True)
        cum = sorted_z.softmax(dim=-1).cumsum(dim=-1)
        # drop a token when the mass strictly before it already reaches top_p; the first token always stays
        drop_sorted = (cum - sorted_z.softmax(dim=-1)) >= cfg.top_p
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        z = z.masked_fill(drop, float("-inf"))
    return z


def sample(std_logits: torch.Tensor, generator: torch.Generator | None, greedy: bool) -> torch.Tensor:
    """Draw one token per row from softmax(std_logits) at the inverse CDF of one uniform per row (never a
    token of probability 0); argmax when greedy (no random number used).

    Not torch.multinomial: on the CPU it draws an exponential per token, 3 ms a row at V = 151,936 (a sampled
    draft paid it for every drafted token, target-only decoding for every token). fp32 CPU rows go to C++
    (specviz.native: masses summed in fp64 per chunk, ~0.25 ms; the token -1 for a row without a finite
    normalizer: NaN, +inf, nothing finite); others to a float64 running sum in torch."""
    if greedy:
        return argmax(std_logits)
    V = std_logits.shape[-1]
    rows = std_logits.reshape(-1, V)  # [R, V]
    if _native_rows(rows):
        return _sample_native(rows, generator, 1.0).reshape(std_logits.shape[:-1])
    u = torch.rand((rows.shape[0],), generator=generator, device=rows.device)  # [R]
    probs = rows.softmax(dim=-1)
    cdf = probs.double().cumsum(dim=-1)
    picked = torch.searchsorted(cdf, u.double().unsqueeze(-1) * cdf[:, -1:], right=True).squeeze(-1)  # cdf > goal
    over = picked >= V
    # u·total rounded up to the total: the last token with probability > 0. On a GPU always computed (one more
    # pass) rather than asking the device whether any row needs it, which would wait for the GPU each draw.
    if rows.is_cuda or bool(over.any()):
        positions = torch.arange(V, device=rows.device)
        picked = torch.where(over, torch.where(probs > 0, positions, 0).amax(dim=-1), picked)
    return picked.reshape(std_logits.shape[:-1])


def draw_checked(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None, name: str
                 ) -> list[int]:
    """draw's tokens as a list, logits [R, V] checked as check_logits does. On a GPU in one readback: the tokens
    and each row's finiteness come back together (each readback waits for the device). A sampled draw in C++
    marks a row it cannot normalize (token -1) instead of drawing from it, so its logits are read once more only
    then (a pass of 0.03 ms over a 4-row draw's 151,936 logits a row, in cache); a greedy draw checks the value
    at its argmax (argmax_is_finite); elsewhere the check comes first."""
    if not logits.is_cuda:
        if cfg.greedy:
            tokens = argmax(logits)  # [R]
            if not bool(argmax_is_finite(logits, tokens).all()):
                check_logits(logits, name)  # raises, naming the row
            return tokens.tolist()
        if not _native_rows(logits):
            check_logits(logits, name)
            return draw(logits, cfg, generator).tolist()
        tokens = draw(logits, cfg, generator).tolist()
        if min(tokens) < 0:
            check_logits(logits, name)  # raises, naming the row
            row = tokens.index(-1)  # finite logits whose scaled values overflow (a temperature near 0)
            raise InvalidLogitsError(f"{name} logits at row {row} overflow at temperature {cfg.temperature}")
        return tokens
    bad = ~torch.isfinite(logits.amax(dim=-1))  # [R]
    x = draw(logits, cfg, generator)  # [R]
    both = torch.cat([x.long(), bad.long()]).tolist()
    if any(both[len(both) // 2:]):
        check_logits(logits, name)  # raises, naming the row
    return both[: len(both) // 2]


def _native_rows(rows: torch.Tensor) -> bool:  # rows [R, V]
    return rows.device.type == "cpu" and rows.dtype == torch.float32 and rows.stride(-1) == 1 and native.available()


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax over the last dimension: a row's first largest value, NaN counting as largest. fp32 CPU rows go
    to C++ (specviz.native), a tenth of torch's time (~0.6 ns a logit there: 32 µs a Whisper row, ~95 µs a
    Qwen row), which greedy decoding pays for every scored position, draft and target."""
    V = logits.shape[-1]
    rows = logits.reshape(-1, V)  # [R, V]
    if not rows.shape[0] or not _native_rows(rows):
        return logits.argmax(dim=-1)
    index = torch.empty((rows.shape[0],), dtype=torch.long)
    native.library().specviz_row_argmax(rows.data_ptr(), rows.shape[0], V, rows.stride(0), index.data_ptr(),
                                        torch.get_num_threads())
    return index.reshape(logits.shape[:-1])


def argmax_is_finite(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Whether each row of logits [..., V] is usable, read from its argmax index [...] alone: argmax takes a row's
    first NaN as its largest value, then +inf; a row of only -inf has its maximum -inf. So a row holds NaN, +inf,
    or nothing finite exactly when the value at its argmax is not finite: what check_logits learns from a pass
    over the vocabulary (15-31 µs for 1-4 rows of 151,936 logits in cache, against 7 µs). Returns BoolTensor[...]."""
    return torch.isfinite(logits.gather(-1, index.unsqueeze(-1)).squeeze(-1))


def _sample_native(rows: torch.Tensor, generator: torch.Generator | None, scale: float) -> torch.Tensor:
    """sample's C++ path: a token of softmax(scale · rows) per row (rows [R, V] fp32, V contiguous) -> [R]."""
    u = torch.rand((rows.shape[0],), generator=generator)  # [R]
    picked = torch.empty((rows.shape[0],), dtype=torch.long)
    native.library().specviz_sample_rows(rows.data_ptr(), rows.shape[0], rows.shape[1], rows.stride(0), scale,
                                         u.data_ptr(), picked.data_ptr(), torch.get_num_threads())
    return picked


def draw(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> torch.Tensor:
    """Sample from the standardized distribution of raw logits (argmax when greedy, without standardizing). At a
    temperature alone, fp32 CPU rows are drawn at scale 1/T in C++, as exact verification scales them: the draw
    and the acceptance ratio read the same scaled logits z · (1/T) and the same normalizer (verify.cpu.row_lse),
    where z / T computed first could differ in the last bit; and no scaled copy of the logits is made."""
    if cfg.greedy:
        return argmax(logits)
    rows = logits.reshape(-1, logits.shape[-1])  # [R, V]
    if cfg.temperature_only and _native_rows(rows):
        return _sample_native(rows, generator, 1.0 / cfg.temperature).reshape(logits.shape[:-1])
    return sample(standardize(logits, cfg), generator, greedy=False)
