"""What each γ is expected to buy on the measured costs (Leviathan et al. §3 with a measured cost curve in place
of their flat one): expected speedups, the best γ and the break-even α.

Leviathan's speedup E[tokens] / (γc + 1) assumes a target call costs the same whatever the number of
tokens it scores. On a CPU it does not, so the expected speedup of γ for a batch of B rows is

    Σ_rows E_r[tokens | γ] · T_plain(B) / B  /  (γ · T_draft(B) + T_target(B, γ + 1) + T_verify + T_other)

with T_plain(B) = T_target(B, 1) plus drawing the token: one step of target-only decoding, and γ = 0 a
plain target step (speedup 1 by definition). The costs are a CostModel (specviz.decoding.cost); E_r comes
from the acceptance by draft position (specviz.theory.expected_tokens_by_position), not from one α.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

from specviz.decoding.calibration import MAX_GAMMA
from specviz.decoding.cost import CostModel
from specviz.theory import expected_tokens_by_gamma, token_variance_by_gamma


def expected_speedup(costs: CostModel, batch: int, gamma: int, alphas_by_row: Sequence[Sequence[float]]) -> float:
    """Tokens per second with γ over target-only's, for a batch of len(alphas_by_row) rows."""
    return speedups(costs, batch, alphas_by_row, gamma)[gamma]


def speedups(costs: CostModel, batch: int, alphas_by_row: Sequence[Sequence[float]],
             max_gamma: int = MAX_GAMMA) -> list[float]:
    """expected_speedup for every γ in 0..max_gamma (index γ), reading the costs once: the cost-aware policy
    decides every iteration, and on a 20 ms Whisper step the naive loop cost a few percent."""
    plain, draft = costs.plain_s(batch), costs.draft_s(batch)
    fixed = costs.verify_s() + costs.other_s()
    target = costs.target_curve(batch, max_gamma + 1)
    tokens = [0.0] * (max_gamma + 1)
    for alphas in alphas_by_row:
        for g, expected in enumerate(expected_tokens_by_gamma(alphas, max_gamma)):
            tokens[g] += expected
    return [1.0] + [tokens[g] * plain / (batch * (g * draft + target[g] + fixed)) for g in range(1, max_gamma + 1)]


def best_gamma(costs: CostModel, batch: int, alphas_by_row: Sequence[Sequence[float]],
               max_gamma: int = MAX_GAMMA) -> tuple[int, float]:
    """The γ in 0..max_gamma with the highest expected speedup (ties: the smaller γ), and that speedup."""
    table = speedups(costs, batch, alphas_by_row, max_gamma)
    gamma = max(range(max_gamma + 1), key=lambda g: (table[g], -g))
    return gamma, table[gamma]


def break_even_alpha(costs: CostModel, batch: int, gamma: int) -> float | None:
    """The α (the same at every position) at which γ neither gains nor loses; None when even α = 1 loses."""
    if gamma == 0 or expected_speedup(costs, batch, gamma, [[1.0]] * batch) < 1.0:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        if expected_speedup(costs, batch, gamma, [[mid]] * batch) < 1.0:
            lo = mid
        else:
            hi = mid
    return hi


@functools.lru_cache(maxsize=64)
def expected_max_of_normals(n: int) -> float:
    """E[max of n independent standard normal variables] (0 for one; 1.03 for four, 1.42 for eight), by the
    trapezoid rule over ±8: ∫ x · n φ(x) Φ(x)^(n-1) dx."""
    if n <= 1:
        return 0.0
    step, total = 0.01, 0.0
    for i in range(-800, 801):
        x = i * step
        density = math.exp(-x * x / 2) / math.sqrt(2 * math.pi)
        total += x * n * density * (0.5 * (1 + math.erf(x / math.sqrt(2)))) ** (n - 1) * step
    return total


def batch_tokens(rows: Sequence[tuple[float, float]], remaining: Sequence[int] = ()) -> float:
    """What an iteration's rows, each (expected tokens, their variance), are worth to a batch that ends with its
    slowest row, in tokens over the rows: their sum for one row or where `remaining` (the tokens each row may
    still emit) is not known.

    Rows that draft move on by random amounts, so after n iterations the slowest trails the mean by about
    c_B · σ · √n tokens (c_B: the expected maximum of B standard normals; σ² the rows' mean variance), which the
    batch then pays in iterations of a few rows (a batch of 4 on the CPU: 2-4 of them, ~5% of a 64-token run; at
    break even, the margin). Spread over the n ≈ remaining / (tokens a row an iteration) iterations left, that
    comes off each iteration: c_B · σ / √n a row, small early in a run and large near its end. (Pricing only the
    rows with the most left, which end the batch, was tried: it stepped plainly where lookup paid on average,
    since which row trails changes from one iteration to the next.)"""
    total = sum(e for e, _ in rows)
    batch = len(rows)
    if batch <= 1 or len(remaining) != batch or total <= 0:
        return total
    per_row = total / batch
    variance = sum(v for _, v in rows) / batch
    left = max(1.0, max(remaining) / per_row)
    return batch * (per_row - expected_max_of_normals(batch) * math.sqrt(variance / left))


def catch_up_s(costs: CostModel, batch: int, tokens: float) -> float:
    """The draft model's first forward when it reads `tokens` a row it did not draft (after prompt lookup or plain
    steps), in one forward: a draft step scaled as the target's calls scale with the tokens they read, the curve
    extended past its calibrated points (a catch-up may read more tokens than any γ scores). Measured: after lookup
    iterations of ~6 tokens the model's next draft took 113-130 ms against 16 ms for one step; after 24 plain steps
    of a batch of 4, 249 ms."""
    one, many = costs.target_points(batch, (1, max(1, round(tokens))))
    return costs.draft_s(batch) * many / one


def priced_speedups(costs: CostModel, batch: int, model_alphas: Sequence[Sequence[float]],
                    lookup_alphas: Sequence[Sequence[float]], lookups: Sequence[int],
                    max_gamma: int = MAX_GAMMA, with_model: bool = True,
                    remaining: Sequence[int] = ()) -> dict[tuple[str, int], float]:
    """The expected speedup of every (who drafts, γ) a priced run can choose, per row r of the batch its α by
    position for each drafter and lookups[r], the length of its prompt-lookup continuation (0: none):

    - ("model", γ): every row drafts γ with the model: γ draft forwards, the target scores γ + 1 per row.
    - ("lookup", γ): rows with a continuation propose min(lookups[r], γ) of it, the others whatever a shorter
      match gives (priced as no gain, at γ wide); the target scores the widest proposal + 1, and the draft
      model later reads the tokens it did not draft (where the model's drafts pay).
    - ("lookup+model", γ): continuations where there are, the model's γ elsewhere (only when both occur).

    `with_model` False: the draft model sits out for good (the cost policy's `_model_stays_out`): lookup plans
    only, with no catch-up to pay later.

    `remaining` (a batch: the tokens each row may still emit; empty: not known) prices the batch's end, which comes
    with its slowest row (`batch_tokens`).

    A plain target step is 1 by definition; the formula is `speedups`'s with the draft's cost where it runs."""
    plain, draft = costs.plain_s(batch), costs.draft_s(batch)
    fixed = costs.verify_s() + costs.other_s()
    target = costs.target_curve(batch, max_gamma + 1)  # index g: scoring g + 1 tokens per row
    by_model = [expected_tokens_by_gamma(a, max_gamma) for a in model_alphas]
    by_lookup = [expected_tokens_by_gamma(a, max_gamma) for a in lookup_alphas]
    spread_model = [token_variance_by_gamma(e) for e in by_model]
    spread_lookup = [token_variance_by_gamma(e) for e in by_lookup]
    found = [r for r, n in enumerate(lookups) if n > 0]
    missing = [r for r, n in enumerate(lookups) if n == 0]
    table: dict[tuple[str, int], float] = {}

    def speedup(rows: list[tuple[float, float]], seconds: float) -> float:  # rows: (expected tokens, variance)
        return batch_tokens(rows, remaining) * plain / (batch * seconds)

    for g in range(1, max_gamma + 1):
        table[("model", g)] = speedup([(e[g], v[g]) for e, v in zip(by_model, spread_model)],
                                      g * draft + target[g] + fixed)
    # The model catches up on the tokens it did not draft at its next draft (catch_up_s): only where its drafts
    # pay at all; otherwise it will not draft again.
    model_pays = with_model and max(table.values()) > 1.0

    def catch_up(tokens: float) -> float:
        return catch_up_s(costs, batch, tokens) if model_pays else 0.0

    for g in range(1, max_gamma + 1):
        if not found:
            break
        looked_up = {r: (by_lookup[r][min(lookups[r], g)], spread_lookup[r][min(lookups[r], g)]) for r in found}
        widest = max(e for e, _ in looked_up.values())  # what the model's catch-up reads
        if g <= max(lookups[r] for r in found):  # a longer γ proposes nothing more
            # rows without a continuation of lookup_ngram tokens may still match a shorter one: up to γ
            width = g if missing else max(min(lookups[r], g) for r in found)
            rows = [looked_up.get(r, (1.0, 0.0)) for r in range(len(lookups))]
            table[("lookup", g)] = speedup(rows, catch_up(widest) + target[width] + fixed)
        if missing and with_model:
            rows = [looked_up.get(r, (by_model[r][g], spread_model[r][g])) for r in range(len(lookups))]
            table[("lookup+model", g)] = speedup(rows, g * draft + catch_up(widest) + target[g] + fixed)
    return table if with_model else {plan: speedup for plan, speedup in table.items() if plan[0] == "lookup"}
