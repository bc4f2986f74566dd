"""γ policies: how many tokens the draft proposes next, from what the last iterations showed."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Protocol, Sequence

from specviz import theory
from specviz.config import LOOKUP_THEN_MODEL, REPLAY
from specviz.decoding.acceptance import RunningAcceptance
from specviz.decoding.calibration import MAX_GAMMA
from specviz.decoding.cost import CostModel
from specviz.decoding.expectation import catch_up_s, priced_speedups, speedups
from specviz.decoding.records import LOOKUP, MODEL, Decision


@dataclass(frozen=True)
class Feedback:
    """What one iteration tells a policy."""

    gamma: int  # the policy's γ for this iteration (0: a plain target step, nothing drafted)
    drafted: Sequence[int]  # tokens each sequence drafted (≤ γ: a confidence stop or the token limit ends some early)
    n_accepted: Sequence[int]  # one count per sequence in the batch
    # sequence → min(1, p/q) at its drafted tokens examined (up to the first rejection), in position order
    examined: Mapping[int, Sequence[float]]
    draft_s: float  # time spent drafting (max(drafted) batched draft forwards)
    target_s: float  # time of the one target forward that scored them
    drafters: Mapping[int, str] = field(default_factory=dict)  # sequence → MODEL or LOOKUP (who drafted for it)
    # sequence → prompt lookup's acceptance samples this iteration, whoever drafted (a priced run's; see `of`)
    lookup: Mapping[int, Sequence[float]] = field(default_factory=dict)

    @classmethod
    def of(cls, gamma: int, decisions: Sequence[Decision], *, draft_s: float, target_s: float,
           candidates: Mapping[int, Sequence[int]] | None = None) -> Feedback:
        """What an iteration's decisions (one per sequence, row order) tell a policy; α's samples are each
        decision's examined_accept_probs, the one definition the trace and the figures read too.

        `candidates`: each sequence's prompt-lookup continuation before the iteration (a priced run). Where
        lookup drafted, its samples are its examined drafts; elsewhere, whether each candidate token equals
        the token the iteration emitted there, up to the first that does not: every emitted token is a draw
        from the target's p (exactness), so a one-hot proposal x matches it with probability p(x), its
        acceptance probability. So lookup is priced from every iteration, not only from those it drafted."""
        lookup = {}
        for d in decisions if candidates else ():
            candidate = candidates.get(d.sequence)
            if not candidate:  # lookup's α is priced given a continuation; a row without one teaches nothing
                continue
            if d.drafter == LOOKUP and d.gamma:
                lookup[d.sequence] = d.examined_accept_probs
            else:
                emitted = d.tokens
                hits = next((k for k, (c, e) in enumerate(zip(candidate, emitted)) if c != e),
                            min(len(candidate), len(emitted)))
                lookup[d.sequence] = [1.0] * hits + [0.0] * (hits < min(len(candidate), len(emitted)))
        return cls(gamma=gamma, drafted=[d.gamma for d in decisions], n_accepted=[d.n_accepted for d in decisions],
                   examined={d.sequence: d.examined_accept_probs for d in decisions}, draft_s=draft_s,
                   target_s=target_s, drafters={d.sequence: d.drafter for d in decisions}, lookup=lookup)

    def examined_by(self, drafter: str) -> dict[int, Sequence[float]]:
        if drafter == LOOKUP and self.lookup:
            return dict(self.lookup)
        return {seq: probs for seq, probs in self.examined.items() if self.drafters.get(seq, MODEL) == drafter}

    @property
    def accept_probs(self) -> list[float]:
        """Every examined draft's min(1, p/q), all sequences together."""
        return [a for probs in self.examined.values() for a in probs]


@dataclass(frozen=True)
class Plan:
    """A priced run's next iteration: γ, and who drafts (one of config.PRICED_KINDS; ignored at γ = 0)."""

    gamma: int
    kind: str


class Policy(Protocol):
    """Chooses γ for the next iteration and learns from each one's feedback."""

    name: str

    def current(self) -> int:
        """γ for the next iteration (0: a plain target step)."""
        ...

    def plan(self, sequences: Sequence[int], lookups: Sequence[int], *, lag: int = 0,
             remaining: Sequence[int] = ()) -> Plan:
        """A priced run's next iteration, for the live rows' sequences and the lengths of their prompt-lookup
        continuations (0: none); `lag`: the most tokens a row's draft model has not read yet (it reads them before
        it drafts again); `remaining`: the tokens each row may still emit (empty: not known). Only the cost policy
        prices who drafts; the others keep lookup else model."""
        ...

    def update(self, fb: Feedback) -> None:
        ...


def _any_accepted_all(fb: Feedback) -> bool:
    """Some sequence kept every token it drafted."""
    return any(n == d for n, d in zip(fb.n_accepted, fb.drafted))


class _Held:
    """A policy whose next γ is the one it holds: its update sets it (or leaves it)."""

    def __init__(self, gamma: int = 5):
        self.gamma = gamma

    def current(self) -> int:
        return self.gamma

    def plan(self, sequences: Sequence[int], lookups: Sequence[int], *, lag: int = 0,
             remaining: Sequence[int] = ()) -> Plan:
        return Plan(self.current(), LOOKUP_THEN_MODEL)


class Constant(_Held):
    name = "constant"

    def update(self, fb: Feedback) -> None:
        pass


class HFHeuristic(_Held):
    """transformers' 'heuristic' schedule: +2 when every drafted token was accepted, else -1 (minimum 1)."""

    name = "hf"

    def update(self, fb: Feedback) -> None:
        if _any_accepted_all(fb):
            self.gamma += 2
        else:
            self.gamma = max(1, self.gamma - 1)


class BASS(_Held):
    """BASS Algorithm 1 (Qian et al.): grow when any sequence accepted all, shrink faster on repeated misses."""

    name = "bass"

    def __init__(self, gamma: int = 7, incre: int = 2, mod: int = 10, limit: int = 32):
        super().__init__(gamma)
        self.incre, self.mod, self.limit = incre, mod, limit
        self.streak = 0  # s in the paper: 1 after a step that decreased

    def update(self, fb: Feedback) -> None:
        best = max(fb.n_accepted)
        if _any_accepted_all(fb):
            self.gamma = min(self.gamma + self.incre, self.limit)
            self.streak = 0
        else:
            self.gamma = self.gamma - math.ceil(self.gamma / self.mod) - self.streak
            self.gamma = max(1, best, self.gamma)
            self.streak = 1


class Optimal(_Held):
    """Leviathan §3.5: the γ maximizing (1 - α^{γ+1}) / ((1 - α)(γc + 1)) from running estimates.

    α is the running mean of min(1, p/q) over examined drafted tokens (estimates 1 - D_LK); c is the
    draft's time per token over the target's time per forward, both summed over all iterations so far.
    """

    name = "optimal"

    def __init__(self, gamma: int = 5, max_gamma: int = 32):
        super().__init__(gamma)
        self.max_gamma = max_gamma
        self.prob_sum = 0.0
        self.prob_count = 0
        self.draft_s = 0.0
        self.draft_tokens = 0
        self.target_s = 0.0
        self.target_calls = 0

    @property
    def alpha(self) -> float:
        return self.prob_sum / self.prob_count if self.prob_count else 0.0

    @property
    def c(self) -> float:
        if not self.draft_tokens or not self.target_s:
            return 0.0
        return (self.draft_s / self.draft_tokens) / (self.target_s / self.target_calls)

    def update(self, fb: Feedback) -> None:
        self.prob_sum += sum(fb.accept_probs)
        self.prob_count += len(fb.accept_probs)
        self.draft_s += fb.draft_s
        self.draft_tokens += max(fb.drafted)  # draft forwards: the batch drafts its rows together
        self.target_s += fb.target_s
        self.target_calls += 1
        alpha = min(max(self.alpha, 0.0), 0.999)  # α → 1 would make every γ look free
        self.gamma = theory.optimal_gamma(alpha, self.c, self.max_gamma)


class CostAware:
    """Each iteration, the γ with the highest expected tokens per second (specviz.decoding.expectation): the
    measured cost of every call (the target's by the tokens it scores, the draft's step, verification) against
    the expected tokens from α by draft position, per sequence of the batch. γ = 0, a plain target step, when
    no γ is expected to beat it. The first γ comes from the calibrated costs and the prior α.

    Plain steps teach it nothing about the draft, so while it steps plainly it drafts now and then (a
    probe), so that a draft that got better on an easier stretch of text is found again. A probe costs
    what its iteration is expected to lose against a plain step plus the draft's catching up on the tokens
    it missed; probes are spaced so that they take about EXPLORE_SHARE of the plain steps' time (every
    2 to 64 plain steps): often where drafting nearly pays and the draft has little to catch up on, at most
    PROBE_MAX apart after a long plain run (its catching up grows faster than the share: `probe_after`).

    In a priced run (`plan`) a draft model that sat out (after plain steps or lookup) comes back only where its
    plans save more over the rest of the run than its catching up costs (`_model_stays_out`), and a batch's
    iterations are priced less the tail they leave (the batch ends with its slowest row:
    expectation.batch_tokens).

    The other way round, drafting iterations never measure the plain step that every γ is weighed against: its
    price is the calibration's, scaled by the run's level, and that misses when the cost curve's shape drifts
    (a one-token step bound by memory, a 3-token call partly by arithmetic: 1.08× one at a calibration, 1.34×
    an hour later on the 2-core EPYC; docs/history.md). So where the choice is close (the best plan expected
    below PLAIN_PROBE_BELOW) and the run has not timed PLAIN_TRUST plain steps of its own, every PLAIN_PROBE_EVERY-th
    iteration is a plain step: at most PLAIN_PROBES per run (batch sizes change as rows finish: each size's plain
    price then follows the level of the one measured), each losing under half a step where drafting pays.

    A plan priced on the prior α (no draft examined yet) is a guess, so its γ is at most PRIOR_MAX_GAMMA, and it
    drafts even where the capped γ alone is not expected to pay (it is how α gets learned): a long first draft at
    a wrong α costs several steps (speech at the prior 0.8 drafted γ = 6, mostly rejected: ~3% of a 61-token
    clip), a short one at a right α under one iteration. Not shorter: a first γ of 1 teaches α at one position
    only, and the γs priced from it then swing (7, then 4 on news_water: 7% slower than starting at 3)."""

    name = "cost"
    EXPLORE_SHARE = 0.03
    PROBE_MIN, PROBE_MAX = 2, 64
    PLAIN_PROBE_EVERY = 8
    PLAIN_PROBE_BELOW = 1.5
    PLAIN_PROBES = 4
    PRIOR_MAX_GAMMA = 3

    def __init__(self, gamma: int | None = None, costs: CostModel | None = None, max_gamma: int = MAX_GAMMA):
        # costs: the run's measurements, written by the driver after each iteration and read here, in the
        # driver's thread. gamma: the first γ; None decides it from the costs (4 without any).
        self.gamma, self.costs, self.max_gamma = gamma, costs, max_gamma
        self.acceptance = RunningAcceptance()  # every draft, whoever drafted it: what `current` prices γ with
        # A priced run's, by who drafted. Lookup's hears from every iteration (Feedback.of); the model's only
        # when it drafts, and it fades while the model sits out, so that it is tried again.
        self.by_drafter = {MODEL: RunningAcceptance(), LOOKUP: RunningAcceptance()}
        self.plain_run = 0  # plain steps since the last iteration that drafted
        self.drafting_run = 0  # iterations that drafted since the last plain step
        self.plain_probes = 0  # plain steps taken to price plain steps, this run
        # rows whose next γ `current` decides (a priced run asks `plan` instead: 0.2 ms an iteration not spent)
        self.decide_for: list | None = None

    def current(self) -> int:
        if self.decide_for is not None:  # the last iteration's rows: decided here, once, where the γ is asked for
            self.gamma, self.decide_for = self._decide(self.decide_for), None
        if self.gamma is None:
            ready = self.costs is not None and self.costs.ready
            batch = min(b for b, _ in self.costs.curve) if ready and self.costs.curve else 1
            self.gamma = self._decide([None] * batch) if ready else 4
        return self.gamma

    def update(self, fb: Feedback) -> None:
        if any(fb.examined.values()):
            self.acceptance.add(fb.examined)
        else:  # a plain step: α fades back towards the prior, as a drafter's that sits out does (probe_after)
            self.acceptance.fade()
        for drafter, acceptance in self.by_drafter.items():
            if any((examined := fb.examined_by(drafter)).values()):
                acceptance.add(examined)
            else:
                acceptance.fade()
        self.plain_run = self.plain_run + 1 if fb.gamma == 0 else 0
        self.drafting_run = 0 if fb.gamma == 0 else self.drafting_run + 1
        if self.costs is not None and self.costs.ready:
            rows = sorted(fb.examined) or [None]
            self.decide_for = rows if len(rows) > 1 else [None]

    def _decide(self, rows: list) -> int:
        batch = len(rows)
        alphas = [self.acceptance.alphas(seq, self.max_gamma) for seq in rows]
        table = speedups(self.costs, batch, alphas, self.max_gamma)
        gamma = max(range(self.max_gamma + 1), key=lambda g: (table[g], -g))
        if gamma > self.PRIOR_MAX_GAMMA and self._on_prior():
            gamma = max(range(1, self.PRIOR_MAX_GAMMA + 1), key=lambda g: (table[g], -g))
        if gamma > 0:
            return 0 if self._plain_probe_due(batch, table[gamma]) else gamma
        probe = max(range(1, self.max_gamma + 1), key=lambda g: (table[g], -g))
        return probe if self.plain_run >= self.probe_after(batch, probe, table[probe]) else 0

    def plan(self, sequences: Sequence[int], lookups: Sequence[int], *, lag: int = 0,
             remaining: Sequence[int] = ()) -> Plan:
        """The (who drafts, γ) with the highest expected tokens per second (expectation.priced_speedups), a
        plain step where none beats it, and a probe of the best one now and then as `current` does. A draft
        model `lag` tokens behind drafts again only where that pays for its catching up (`_model_stays_out`)."""
        if self.costs is None or not self.costs.ready:
            return Plan(self.current(), LOOKUP_THEN_MODEL)
        keys = list(sequences) if len(sequences) > 1 else [None]
        alphas = ([self.by_drafter[MODEL].alphas(seq, self.max_gamma) for seq in keys],
                  [self.by_drafter[LOOKUP].alphas(seq, self.max_gamma) for seq in keys])
        table = priced_speedups(self.costs, len(keys), *alphas, lookups, self.max_gamma, remaining=remaining)
        if self._model_stays_out(len(keys), table, lag, remaining):
            table = priced_speedups(self.costs, len(keys), *alphas, lookups, self.max_gamma, with_model=False,
                                    remaining=remaining)
            if not table:
                return Plan(0, "")
        (kind, gamma), best = max(table.items(), key=lambda item: (item[1], -item[0][1]))
        if gamma > self.PRIOR_MAX_GAMMA and self._on_prior():
            kind, gamma = max((plan for plan in table if 0 < plan[1] <= self.PRIOR_MAX_GAMMA),
                              key=lambda plan: (table[plan], -plan[1]))
            return Plan(gamma, kind)
        if best > 1.0 and self._plain_probe_due(len(keys), best):
            return Plan(0, "")
        behind = lag if kind != LOOKUP else 1  # lookup reads nothing (1: no reading beyond a step's own)
        if best > 1.0 or self.plain_run >= self.probe_after(len(keys), gamma, best, behind):
            return Plan(gamma, kind)
        return Plan(0, "")

    def _model_stays_out(self, batch: int, table: dict[tuple[str, int], float], lag: int,
                         remaining: Sequence[int]) -> bool:
        """Whether a draft model `lag` tokens behind should keep sitting out: before it drafts it reads what it
        missed (one forward over `lag` tokens a row: after 24 plain steps of a batch of 4, 249 ms, 4 plain steps),
        which pays only if its plans then save more than that over the rest of the run (`remaining` tokens at
        most a row, as plain steps) against the best plan without it. Unknown `remaining`: no limit."""
        if lag <= 2 or not remaining:  # 1-2 tokens: what every draft's first forward reads anyway
            return False
        with_model = max((s for (kind, _), s in table.items() if kind != LOOKUP), default=0.0)
        without = max([1.0] + [s for (kind, _), s in table.items() if kind == LOOKUP])
        if with_model <= without:
            return False  # not chosen unless as a probe, which probe_after prices with the catch-up
        extra = catch_up_s(self.costs, batch, lag) - self.costs.draft_s(batch)
        saved = max(remaining) * self.costs.plain_s(batch) * (1 / without - 1 / with_model)
        return saved < extra

    def _on_prior(self) -> bool:
        """Whether no draft has been examined yet in this run (α is the prior's; see the class's text)."""
        return not self.acceptance.stats and not any(a.stats for a in self.by_drafter.values())

    def _plain_probe_due(self, batch: int, best: float) -> bool:
        """Whether this iteration should be a plain step that prices plain steps (see the class's text)."""
        due = (best < self.PLAIN_PROBE_BELOW and self.drafting_run >= self.PLAIN_PROBE_EVERY
               and self.plain_probes < self.PLAIN_PROBES and self.costs.plain_calls(batch) < self.costs.PLAIN_TRUST)
        self.plain_probes += due  # asked once per iteration (by `plan`, or by `current` where a run asks for γ alone)
        return due

    def probe_after(self, batch: int, gamma: int, speedup: float, lag: int | None = None) -> int:
        """Plain steps between probes: a probe's expected loss, in plain steps, over EXPLORE_SHARE. A probe
        at γ takes iteration_s(γ), its first draft forward reading the `lag` tokens the draft missed (catch_up_s;
        by default one per plain step since it last drafted) instead of one, where plain steps would have made the
        same tokens in speedup · iteration_s(γ). The reading grows with the plain run (on the text pair by ~0.05
        of a plain step a step, more than EXPLORE_SHARE), so after a long plain run probes come PROBE_MAX apart:
        that is what they cost here; a draft that got better is found again as its α fades back to the prior."""
        lag = self.plain_run + 1 if lag is None else lag
        plain = self.costs.plain_s(batch)
        steps = self.costs.iteration_s(batch, gamma) / plain
        reading = catch_up_s(self.costs, batch, max(1, lag)) - self.costs.draft_s(batch)
        loss = steps * (1 - speedup) + reading / plain
        return min(self.PROBE_MAX, max(self.PROBE_MIN, math.ceil(loss / self.EXPLORE_SHARE)))


class Replay:
    """γ read from a recorded schedule, one entry per iteration (specviz.runs.replay): a trace decoded again
    takes the γs its run took, whatever chose them, so its draws and decisions repeat. Past the schedule's
    end (a longer run than the trace's) it holds the last γ."""

    name = REPLAY

    def __init__(self, schedule: Sequence[int], drafters: Sequence[str] = ()):
        if not schedule:
            raise ValueError("the replay policy needs a γ schedule")
        self.schedule, self.drafters, self.index = tuple(schedule), tuple(drafters), 0

    def current(self) -> int:
        return self.schedule[min(self.index, len(self.schedule) - 1)]

    def plan(self, sequences: Sequence[int], lookups: Sequence[int], *, lag: int = 0,
             remaining: Sequence[int] = ()) -> Plan:
        kind = self.drafters[min(self.index, len(self.drafters) - 1)] if self.drafters else LOOKUP_THEN_MODEL
        return Plan(self.current(), kind)

    def update(self, fb: Feedback) -> None:
        self.index += 1


_POLICIES = {"constant": Constant, "hf": HFHeuristic, "bass": BASS, "optimal": Optimal, "cost": CostAware}


# The default γ policy, for one sequence and for batches: the cost-aware policy measured better than hf and bass
# on every text row of docs/benchmarks.md and never slower, because it also stops drafting where drafting cannot
# pay. Its γ follows this machine's measured time, so a seeded sampled run repeats elsewhere only on its own
# schedule: every trace records it, and the replay policy decodes on it (specviz.runs.replay).
DEFAULT_POLICY = "cost"


def make_policy(name: str, initial: int | None = None, costs: CostModel | None = None,
                schedule: Sequence[int] = (), drafters: Sequence[str] = ()) -> Policy:
    """A fresh policy; `initial` overrides its starting γ (hf/constant/optimal: 5, bass: 7, cost: from the
    calibrated costs); the cost-aware policy reads the run's measured costs; replay reads `schedule` (and a
    priced run's `drafters`)."""
    if name == REPLAY:
        return Replay(schedule, drafters)
    cls = _POLICIES[name]
    kwargs = {"costs": costs} if cls is CostAware else {}
    return cls(**kwargs) if initial is None else cls(initial, **kwargs)
