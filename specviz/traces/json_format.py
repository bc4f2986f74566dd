"""Reading untrusted trace JSON: number and nesting limits, typed readers, v1/v2 conversion (the checks: .checks).

A trace may be a shared file, so nothing in it is taken for granted: fields are read with their types checked,
older versions converted, and the result checked for what types cannot say and for derived values (rates,
speedups) that must stay finite. Anything else is refused with a TraceFormatError naming the problem.

Reading is here and not on Trace so that imports go one way: this module builds Traces from specviz.traces.trace.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from specviz.config import MAX_EXPLAIN_TOP
from specviz.decoding.records import (Decision, Examined, StepRecord, TopTokens)
from specviz.traces.checks import MAX_INT, check_consistent, check_derived, json_name
from specviz.traces.trace import SCHEMA_VERSION, SequenceTrace, Trace, TraceFormatError

MAX_TRACE_BYTES = 64 << 20  # a 256-token run of 8 sequences is about 1 MB
MAX_DEPTH = 32  # the schema nests 5 deep; meta holds the run's settings
MAX_FLOAT = 1e12  # seconds, probabilities and counts: anything larger is not a measurement (and sums overflow)
MAX_NUMBER_CHARS = 64  # no number a trace holds needs more characters (an id, a time, a probability)


# ---- entry points ------------------------------------------------------------------------------------


def load_trace(path: str | Path) -> Trace:
    """Read and check a trace file; refused with a TraceFormatError before a byte is parsed if too large."""
    path = Path(path)
    size = path.stat().st_size
    if size > MAX_TRACE_BYTES:
        raise TraceFormatError(f"{path.name} is {size:,} bytes; traces over {MAX_TRACE_BYTES:,} bytes are refused")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise TraceFormatError(f"{path.name} is not a text file, so not a specviz trace") from e
    return loads_trace(text, path.name)


def loads_trace(text: str, name: str = "the trace") -> Trace:
    """Parse and check a trace's JSON text: refused with a TraceFormatError that names what is wrong."""
    try:
        data = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float, parse_int=_bounded_int)
    except json.JSONDecodeError as e:
        raise TraceFormatError(f"{name} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from e
    except TraceFormatError:
        raise
    except ValueError as e:  # the decoder's own limits (e.g. Python's cap on integer digits)
        raise TraceFormatError(f"{name} holds a number JSON cannot hold here ({e})") from e
    except RecursionError:
        raise TraceFormatError(f"{name} nests too deeply to be a specviz trace") from None
    _check_plain_json(data, "trace", 0)
    return trace_from_dict(data)


def trace_from_dict(d: Any) -> Trace:
    """A checked Trace from parsed JSON of any supported schema version."""
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
    trace = _from_v1(d) if version == 1 else _from_v2(d)
    check_consistent(trace)
    check_derived(trace)
    return trace


# ---- parsing: bounded numbers and nesting --------------------------------------------------------------


def _bounded(value: float) -> bool:
    return math.isfinite(value) and abs(value) <= MAX_FLOAT


def _no_constant(name: str):
    raise TraceFormatError(f"malformed trace: {name} is not a number a trace may hold")


def _finite_float(text: str) -> float:
    value = float(text)
    if len(text) > MAX_NUMBER_CHARS or not math.isfinite(value):
        raise TraceFormatError(f"malformed trace: the number {text[:40]}… is not a finite number a trace may hold"
                               if len(text) > 40 else f"malformed trace: {text} is not a finite number a trace may hold")
    return value


def _bounded_int(text: str) -> int:
    if len(text) > MAX_NUMBER_CHARS:
        raise TraceFormatError(f"malformed trace: a number of {len(text):,} digits is not a number a trace may hold")
    return int(text)


def _check_plain_json(value: Any, where: str, depth: int) -> None:
    """Bounded nesting, integers, and strings that can be written back (no lone surrogates)."""
    if depth > MAX_DEPTH:
        raise TraceFormatError(f"malformed trace: {where} nests deeper than {MAX_DEPTH} levels")
    if isinstance(value, dict):
        for key, item in value.items():
            _check_plain_json(key, where, depth + 1)
            _check_plain_json(item, f"{where}.{key[:40]}", depth + 1)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_plain_json(item, f"{where}[{i}]", depth + 1)
    elif isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise TraceFormatError(f"malformed trace: {where} holds a string that is not valid Unicode") from None
    elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
        raise TraceFormatError(f"malformed trace: {where} holds an integer beyond ±2^53")


# ---- typed readers: every field with its JSON type checked ----------------------------------------------

_JSON_TYPES = {"int": (int,), "float": (int, float), "str": (str,), "list[int]": (list,), "list[str]": (list,),
               "list[float]": (list,), "dict[str, Any]": (dict,)}
_ELEMENT_TYPES = {"list[int]": (int,), "list[str]": (str,), "list[float]": (int, float)}
_TYPE_NAMES = {"int": "an integer", "float": "a finite number (|x| ≤ 1e12)", "str": "a string", "list[int]": "a list of integers",
               "list[str]": "a list of strings", "list[float]": "a list of finite numbers (|x| ≤ 1e12)", "dict[str, Any]": "an object"}


def _typed(d: Any, cls: type, where: str, skip: set[str] = frozenset(), optional: set[str] = frozenset()) -> dict[str, Any]:
    """Check that d has every field of dataclass cls with a JSON value of the right type."""
    if not isinstance(d, dict):
        raise TraceFormatError(f"malformed trace: {where} must be a JSON object")
    out = {}
    for f in fields(cls):
        if f.name in skip:
            continue
        if f.name not in d:
            if f.name in optional:
                continue
            raise TraceFormatError(f"malformed trace: {where} is missing '{f.name}'")
        value = d[f.name]
        kind = str(f.type)
        ok = isinstance(value, _JSON_TYPES[kind]) and not isinstance(value, bool)
        if ok and kind in _ELEMENT_TYPES:
            bad = [v for v in value if not isinstance(v, _ELEMENT_TYPES[kind]) or isinstance(v, bool)
                   or (kind == "list[float]" and not _bounded(v))]
            if bad:
                raise TraceFormatError(f"malformed trace: '{f.name}' in {where} should be {_TYPE_NAMES[kind]}, "
                                       f"but holds {json_name(bad[0])}")
        if ok and kind == "float":
            ok = _bounded(value)
        if not ok:
            raise TraceFormatError(f"malformed trace: '{f.name}' in {where} should be {_TYPE_NAMES[kind]}, "
                                   f"got {json_name(value)}")
        out[f.name] = value
    return out


def _list(d: dict, key: str, where: str) -> list:
    value = d.get(key, [])
    if not isinstance(value, list):
        raise TraceFormatError(f"malformed trace: '{key}' in {where} must be a list")
    return value


def _from_v2(d: dict) -> Trace:
    top = _typed(d, Trace, "trace", skip={"sequences", "steps"})
    steps = [StepRecord(**_typed(s, StepRecord, f"step {i}", optional={"explain_s"}))
             for i, s in enumerate(_list(d, "steps", "trace"))]
    sequences = []
    for i, s in enumerate(_list(d, "sequences", "trace")):
        where = f"sequence {i}"
        seq = SequenceTrace(**_typed(s, SequenceTrace, where, skip={"decisions"}))
        seq.decisions = [_decision(x, f"decision {k} of {where}") for k, x in enumerate(_list(s, "decisions", where))]
        sequences.append(seq)
    if not sequences:
        raise TraceFormatError("malformed trace: 'sequences' is empty")
    return Trace(**top, sequences=sequences, steps=steps)


def _decision(x: Any, where: str) -> Decision:
    fields_ = _typed(x, Decision, where, skip={"why"}, optional={"drafter"})
    why = [_examined(e, f"why[{i}] of {where}") for i, e in enumerate(_list(x, "why", where))]
    return Decision(**fields_, why=why)


def _optional_float(d: dict, key: str, where: str) -> float | None:
    value = d.get(key)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= 1:
        raise TraceFormatError(f"malformed trace: '{key}' in {where} should be null or a number in [0, 1]")
    return float(value)


def _examined(e: Any, where: str) -> Examined:
    if not isinstance(e, dict):
        raise TraceFormatError(f"malformed trace: {where} must be a JSON object")
    position = e.get("position")
    if not isinstance(position, int) or isinstance(position, bool):
        raise TraceFormatError(f"malformed trace: 'position' in {where} should be an integer")
    tops = {k: None if e.get(k) is None and k != "p" else _top_tokens(e.get(k), f"{k} of {where}")
            for k in ("p", "q", "drawn_from")}
    return Examined(position=position, **tops, exact_accept_prob=_optional_float(e, "exact_accept_prob", where),
                    sigmoid_tv=_optional_float(e, "sigmoid_tv", where))


def _top_tokens(t: Any, where: str) -> TopTokens:
    top = TopTokens(**_typed(t, TopTokens, where))
    if not len(top.ids) == len(top.texts) == len(top.probs) <= MAX_EXPLAIN_TOP:
        raise TraceFormatError(f"malformed trace: {where} needs ids, texts and probs of one length, at most "
                               f"{MAX_EXPLAIN_TOP}")
    if any(not 0 <= v <= 1 for v in top.probs + [top.rest]) or any(not 0 <= i < MAX_INT for i in top.ids):
        raise TraceFormatError(f"malformed trace: {where} has a probability outside [0, 1] or a negative token id")
    return top


# ---- version 1: one sequence, decisions and timings together ---------------------------------------------


@dataclass
class _V1Iteration:
    """A version-1 iteration: one sequence's decisions and the timings together."""

    index: int
    gamma: int
    draft_ids: list[int]
    draft_text: list[str]
    q: list[float]
    p: list[float]
    accept_prob: list[float]
    uniform: list[float]
    outcome: list[str]
    n_accepted: int
    next_id: int
    next_text: str
    next_kind: str
    emitted: int
    draft_s: float
    target_s: float
    verify_s: float
    window: int = 0


@dataclass
class _V1Top:
    meta: dict[str, Any]
    prompt_ids: list[int]
    output_ids: list[int]
    output_text: str
    prefill_s: float
    total_s: float


def _from_v1(d: dict) -> Trace:
    top = _typed(d, _V1Top, "trace")
    its = [_V1Iteration(**_typed(it, _V1Iteration, f"iteration {i}", optional={"window"}))
           for i, it in enumerate(_list(d, "iterations", "trace"))]
    decisions, steps, end = [], [], top["prefill_s"]
    for k, it in enumerate(its):
        end += it.draft_s + it.target_s + it.verify_s
        steps.append(StepRecord(index=k, gamma=it.gamma, sequences=[0], draft_s=it.draft_s, target_s=it.target_s,
                                verify_s=it.verify_s, end_s=end, real_tokens=0, pad_tokens=0, cache_slots=0,
                                cache_holes=0))
        decisions.append(Decision(step=k, sequence=0, gamma=it.gamma, draft_ids=it.draft_ids, draft_text=it.draft_text,
                                  q=it.q, p=it.p, accept_prob=it.accept_prob, uniform=it.uniform, outcome=it.outcome,
                                  n_accepted=it.n_accepted, next_id=it.next_id, next_text=it.next_text,
                                  next_kind=it.next_kind, emitted=it.emitted))
    meta = top["meta"]
    seq = SequenceTrace(0, str(meta.get("input", "input"))[:80], "input", {}, top["prompt_ids"], top["output_ids"],
                        top["output_text"], decisions, "", top["total_s"])
    return Trace(meta=meta, sequences=[seq], steps=steps, prefill_s=top["prefill_s"], prefill_passes=1,
                 total_s=top["total_s"])
