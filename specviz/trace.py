"""The trace: what happened in every iteration, a summary, and a versioned JSON form.

Only the trace crosses from the engine to the figures and the page; a trace loaded from JSON draws the
same pictures as a live one.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from . import theory

SCHEMA_VERSION = 1

# Outcome of each drafted token, then of the token verification adds.
ACCEPTED, REJECTED, DISCARDED = "accepted", "rejected", "discarded"  # discarded: drafted after a rejection
RESAMPLED, BONUS = "resampled", "bonus"


class TraceFormatError(ValueError):
    """A trace file that this version of specviz cannot read; the message says what is wrong."""


@dataclass
class IterationRecord:
    index: int
    gamma: int
    draft_ids: list[int]
    draft_text: list[str]
    q: list[float]  # draft probability of each drafted token
    p: list[float]  # target probability of each drafted token
    accept_prob: list[float]  # min(1, p / (l·q))
    uniform: list[float]  # the uniform each drafted token was compared with
    outcome: list[str]  # ACCEPTED / REJECTED / DISCARDED per drafted token
    n_accepted: int
    next_id: int
    next_text: str
    next_kind: str  # RESAMPLED or BONUS
    emitted: int  # tokens appended to the output (fewer than n_accepted + 1 at EOS or the token limit)
    draft_s: float
    target_s: float
    verify_s: float
    window: int = 0  # speech: which 30 s audio window this iteration decoded


@dataclass
class Trace:
    meta: dict[str, Any]  # mode, sampling, γ policy, models, device, dtype, prompt, ...
    prompt_ids: list[int]
    output_ids: list[int]
    output_text: str
    iterations: list[IterationRecord] = field(default_factory=list)
    prefill_s: float = 0.0
    total_s: float = 0.0  # wall time of the whole decode, prefill included
    schema_version: int = SCHEMA_VERSION

    # ---- summary -------------------------------------------------------------------------------
    @property
    def new_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    @property
    def target_forward_passes(self) -> int:
        """Target forwards, the prefill included (target-only: one per generated token)."""
        if self.meta.get("mode") == "target-only":
            return self.new_tokens
        return len(self.iterations) + 1

    def alpha_estimate(self) -> float | None:
        """Mean of min(1, p/q) over the drafted tokens verification examined (up to the first rejection).

        Each is the chance that its context accepts a draft sample, so the mean estimates α = 1 - D_LK
        (Leviathan §3) as seen along the decoded text; tokens drafted after a rejection are left out
        because their contexts never occur in the output.
        """
        probs = [a for it in self.iterations for a, o in zip(it.accept_prob, it.outcome) if o != DISCARDED]
        return sum(probs) / len(probs) if probs else None

    def acceptance_rate(self) -> float | None:
        drafted = sum(it.gamma for it in self.iterations)
        return sum(it.n_accepted for it in self.iterations) / drafted if drafted else None

    def summary(self) -> dict[str, Any]:
        its = self.iterations
        alpha = self.alpha_estimate()
        out: dict[str, Any] = {
            "mode": self.meta.get("mode"),
            "new_tokens": self.new_tokens,
            "total_s": self.total_s,
            "tokens_per_s": self.tokens_per_s,
            "target_forward_passes": self.target_forward_passes,
        }
        if its:
            out.update(
                iterations=len(its),
                alpha=alpha,
                acceptance_rate=self.acceptance_rate(),
                tokens_per_iteration=sum(it.n_accepted + 1 for it in its) / len(its),
                predicted_tokens_per_iteration=sum(theory.expected_tokens(alpha, it.gamma) for it in its) / len(its),
                mean_gamma=sum(it.gamma for it in its) / len(its),
                draft_s=sum(it.draft_s for it in its),
                target_s=sum(it.target_s for it in its),
                verify_s=sum(it.verify_s for it in its),
                median_verify_ms=1e3 * statistics.median(it.verify_s for it in its),
            )
        return out

    # ---- JSON ----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["summary"] = self.summary()  # for readers of the file; recomputed, never trusted, on load
        return d

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), ensure_ascii=False, allow_nan=False))

    @classmethod
    def from_dict(cls, d: Any) -> "Trace":
        if not isinstance(d, dict):
            raise TraceFormatError("not a specviz trace: the top level must be a JSON object")
        version = d.get("schema_version")
        if not isinstance(version, int) or isinstance(version, bool):
            raise TraceFormatError("not a specviz trace: no integer schema_version")
        if version > SCHEMA_VERSION:
            raise TraceFormatError(
                f"trace schema_version {version} is newer than this specviz reads ({SCHEMA_VERSION}); upgrade specviz"
            )
        if version < 1:
            raise TraceFormatError(f"unknown trace schema_version {version}")
        top = _typed(d, cls, "trace", skip={"iterations", "summary"})
        its = d.get("iterations", [])
        if not isinstance(its, list):
            raise TraceFormatError("malformed trace: 'iterations' must be a list")
        top["iterations"] = [IterationRecord(**_typed(it, IterationRecord, f"iteration {i}")) for i, it in enumerate(its)]
        for i, it in enumerate(top["iterations"]):
            lengths = {len(getattr(it, k)) for k in ("draft_ids", "draft_text", "q", "p", "accept_prob", "uniform", "outcome")}
            if lengths != {it.gamma}:
                raise TraceFormatError(f"malformed trace: iteration {i} has per-token lists that do not all have γ = {it.gamma} entries")
        return cls(**top)

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        try:
            text = Path(path).read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise TraceFormatError(f"{Path(path).name} is not a text file, so not a specviz trace") from e
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise TraceFormatError(f"{Path(path).name} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from e
        return cls.from_dict(data)


_JSON_TYPES = {"int": (int,), "float": (int, float), "str": (str,), "list[int]": (list,), "list[str]": (list,),
               "list[float]": (list,), "dict[str, Any]": (dict,)}
_ELEMENT_TYPES = {"list[int]": (int,), "list[str]": (str,), "list[float]": (int, float)}


def _typed(d: Any, cls: type, where: str, skip: set[str] = frozenset()) -> dict[str, Any]:
    """Check that d has every field of dataclass cls with a JSON value of the right type."""
    if not isinstance(d, dict):
        raise TraceFormatError(f"malformed trace: {where} must be a JSON object")
    out = {}
    for f in fields(cls):
        if f.name in skip:
            continue
        if f.name not in d:
            raise TraceFormatError(f"malformed trace: {where} is missing '{f.name}'")
        value = d[f.name]
        kind = str(f.type)
        ok = isinstance(value, _JSON_TYPES[kind]) and not isinstance(value, bool)
        if ok and kind in _ELEMENT_TYPES:
            ok = all(isinstance(v, _ELEMENT_TYPES[kind]) and not isinstance(v, bool) for v in value)
        if ok and kind == "float":
            ok = math.isfinite(value)
        if not ok:
            raise TraceFormatError(f"malformed trace: '{f.name}' in {where} should be {kind}, got {type(value).__name__}")
        out[f.name] = value
    return out
