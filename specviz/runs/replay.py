"""Decoding a trace again exactly: on its own γ schedule (the policy "replay"), with its settings and input.
A priced run's choice of who drafts follows measured time too, and is replayed with it.

The cost policy picks γ from this machine's measured call costs, so the same seed and settings can take other
γs on another machine (or in another minute) and so other draws. Every iteration's γ is in the trace; decoded
on that schedule, a seeded run repeats decision for decision wherever the models' logits are the same bits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from specviz.config import DRAFT_KINDS, PRICED, REPLAY, SpecConfig
from specviz.decoding.records import drafted_by
from specviz.runs.settings import Settings
from specviz.runs.tasks import TASKS
from specviz.text.prompts import InputError
from specviz.traces.json_format import load_trace
from specviz.traces.trace import Trace

@dataclass(frozen=True)
class Schedule:
    """What a run chose that followed measured time: γ of each iteration, and who drafted at each (a priced
    run's: one of config.PRICED_KINDS, "" at a plain step; empty for every other kind)."""

    gammas: tuple[int, ...]
    drafters: tuple[str, ...] = ()
    draft_kind: str | None = None  # the trace's own (a default may have changed since it ran); None: keep cfg's

    def __len__(self) -> int:
        return len(self.gammas)


def schedule(trace: Trace) -> Schedule:
    """γ of each iteration of `trace`, in order (0: a plain target step), and who drafted where it was priced."""
    if trace.mode == "target-only" or not trace.steps:
        raise InputError("this trace has no speculative iterations to replay (target-only, or empty)")
    gammas = tuple(step.gamma for step in trace.steps)
    kind = trace.config.get("draft_kind")
    kind = kind if kind in DRAFT_KINDS else None
    if kind != PRICED:
        return Schedule(gammas, draft_kind=kind)
    by_step: dict[int, list] = {}
    for d in trace.decisions():
        by_step.setdefault(d.step, []).append(d)
    # The plan each iteration ran on, from who drafted its rows. Replayed, each gives the same proposals: the
    # plans a priced run picks among differ only where rows did or did not find a continuation, which is recorded.
    return Schedule(gammas, tuple(drafted_by(by_step.get(step.index, [])) if step.gamma else ""
                                  for step in trace.steps), PRICED)


def replaying(cfg: SpecConfig, plan: Schedule) -> SpecConfig:
    """`cfg` with γ (and a priced run's drafters) read from a trace's schedule instead of chosen, and the
    trace's own draft kind."""
    return dataclasses.replace(cfg, gamma_policy=REPLAY, gamma_schedule=plan.gammas, gamma_init=None,
                               drafter_schedule=plan.drafters, draft_kind=plan.draft_kind or cfg.draft_kind)


def schedule_file(path: str | Path) -> Schedule:
    """The schedule of the trace file at `path` (the CLI's --gamma-schedule), read and checked."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise InputError(f"--gamma-schedule: no such trace file {str(path)!r}")
    return schedule(load_trace(path))


def rerun_request(trace: Trace) -> tuple[Settings, str, Schedule]:
    """What the page needs to decode a loaded text trace again exactly: its settings, its article, its
    schedule. A speech trace keeps its clip's name, not its audio: refused."""
    article = trace.meta.get("input")
    task = TASKS.get(trace.task)  # None: no task recorded, or one unknown here
    if task is None or task.input_is_file or not isinstance(article, str) or not article.strip():
        raise InputError("only a summary's trace holds its input; for a transcription, load the clip and Run")
    return Settings.from_meta(trace.meta), article, schedule(trace)
