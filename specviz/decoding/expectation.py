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

from typing import Sequence

from specviz.decoding.calibration import MAX_GAMMA
from specviz.decoding.cost import CostModel
from specviz.theory import expected_tokens_by_gamma


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


def catch_up_s(draft_s: float, target: Sequence[float], tokens: float) -> float:
    """The draft model reading `tokens` it did not draft (after prompt lookup drafted), in one forward: a draft
    step scaled as the target's calls scale with the tokens they read (target[k]: scoring k + 1 tokens).
    Measured: after lookup iterations of ~6 tokens the model's next draft took 113-130 ms against 16 ms for one
    step."""
    n = min(len(target), max(1, round(tokens)))
    return draft_s * target[n - 1] / target[0]


def priced_speedups(costs: CostModel, batch: int, model_alphas: Sequence[Sequence[float]],
                    lookup_alphas: Sequence[Sequence[float]], lookups: Sequence[int],
                    max_gamma: int = MAX_GAMMA, with_model: bool = True) -> dict[tuple[str, int], float]:
    """The expected speedup of every (who drafts, γ) a priced run can choose, per row r of the batch its α by
    position for each drafter and lookups[r], the length of its prompt-lookup continuation (0: none):

    - ("model", γ): every row drafts γ with the model: γ draft forwards, the target scores γ + 1 per row.
    - ("lookup", γ): rows with a continuation propose min(lookups[r], γ) of it, the others whatever a shorter
      match gives (priced as no gain, at γ wide); the target scores the widest proposal + 1, and the draft
      model later reads the tokens it did not draft (where the model's drafts pay).
    - ("lookup+model", γ): continuations where there are, the model's γ elsewhere (only when both occur).

    `with_model` False: the draft model sits out for good (the cost policy's `_model_stays_out`): lookup plans
    only, with no catch-up to pay later.

    A plain target step is 1 by definition; the formula is `speedups`'s with the draft's cost where it runs."""
    plain, draft = costs.plain_s(batch), costs.draft_s(batch)
    fixed = costs.verify_s() + costs.other_s()
    target = costs.target_curve(batch, max_gamma + 1)  # index g: scoring g + 1 tokens per row
    by_model = [expected_tokens_by_gamma(a, max_gamma) for a in model_alphas]
    by_lookup = [expected_tokens_by_gamma(a, max_gamma) for a in lookup_alphas]
    found = [r for r, n in enumerate(lookups) if n > 0]
    missing = [r for r, n in enumerate(lookups) if n == 0]
    table: dict[tuple[str, int], float] = {}

    def speedup(tokens: float, seconds: float) -> float:
        return tokens * plain / (batch * seconds)

    for g in range(1, max_gamma + 1):
        table[("model", g)] = speedup(sum(e[g] for e in by_model), g * draft + target[g] + fixed)
    # The model catches up on the tokens it did not draft at its next draft (catch_up_s): only where its drafts
    # pay at all; otherwise it will not draft again.
    model_pays = with_model and max(table.values()) > 1.0

    def catch_up(tokens: float) -> float:
        return catch_up_s(draft, target, tokens) if model_pays else 0.0

    for g in range(1, max_gamma + 1):
        if not found:
            break
        lookup_tokens = sum(by_lookup[r][min(lookups[r], g)] for r in found)
        widest = max(by_lookup[r][min(lookups[r], g)] for r in found)  # what the model's catch-up reads
        if g <= max(lookups[r] for r in found):  # a longer γ proposes nothing more
            # rows without a continuation of lookup_ngram tokens may still match a shorter one: up to γ
            width = g if missing else max(min(lookups[r], g) for r in found)
            table[("lookup", g)] = speedup(lookup_tokens + len(missing), catch_up(widest) + target[width] + fixed)
        if missing and with_model:
            modelled = sum(by_model[r][g] for r in missing)
            table[("lookup+model", g)] = speedup(lookup_tokens + modelled,
                                                 g * draft + catch_up(widest) + target[g] + fixed)
    return table if with_model else {plan: speedup for plan, speedup in table.items() if plan[0] == "lookup"}
