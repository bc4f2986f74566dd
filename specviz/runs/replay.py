"""Decoding a trace again exactly: on its own γ schedule (the policy "replay"), with its settings and input.

The cost policy picks γ from this machine's measured call costs, so the same seed and settings can take other
γs on another machine (or in another minute) and so other draws. Every iteration's γ is in the trace; decoded
on that schedule, a seeded run repeats decision for decision wherever the models' logits are the same bits.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from specviz.config import REPLAY, SpecConfig
from specviz.runs.settings import Settings
from specviz.runs.tasks import TASKS
from specviz.text.prompts import InputError
from specviz.traces.json_format import load_trace
from specviz.traces.trace import Trace

def schedule(trace: Trace) -> tuple[int, ...]:
    """γ of each iteration of `trace`, in order (0: a plain target step)."""
    if trace.mode == "target-only" or not trace.steps:
        raise InputError("this trace has no speculative iterations to replay (target-only, or empty)")
    return tuple(step.gamma for step in trace.steps)


def replaying(cfg: SpecConfig, gammas: tuple[int, ...]) -> SpecConfig:
    """`cfg` with γ read from a trace's schedule instead of chosen by a policy."""
    return dataclasses.replace(cfg, gamma_policy=REPLAY, gamma_schedule=tuple(gammas), gamma_init=None)


def schedule_file(path: str | Path) -> tuple[int, ...]:
    """The γ schedule of the trace file at `path` (the CLI's --gamma-schedule), read and checked."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise InputError(f"--gamma-schedule: no such trace file {str(path)!r}")
    return schedule(load_trace(path))


def rerun_request(trace: Trace) -> tuple[Settings, str, tuple[int, ...]]:
    """What the page needs to decode a loaded text trace again exactly: its settings, its article, its γ
    schedule. A speech trace keeps its clip's name, not its audio: refused."""
    article = trace.meta.get("input")
    task = TASKS.get(trace.task)  # None: no task recorded, or one unknown here
    if task is None or task.input_is_file or not isinstance(article, str) or not article.strip():
        raise InputError("only a summary's trace holds its input; for a transcription, load the clip and Run")
    return Settings.from_meta(trace.meta), article, schedule(trace)
