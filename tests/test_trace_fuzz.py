"""Fuzzing the trace loader: thousands of mutated traces (fixed seed) are either refused with a
TraceFormatError that names the problem, or loaded, drawn (every figure, the summary, the token view)
and exported again. Nothing else may happen: no other exception, no markup from the file in the HTML."""

from __future__ import annotations

import copy
import json
import random
from html.parser import HTMLParser

import pytest

from specviz.page import actions as page
from specviz.figures import report
from specviz.config import SamplingConfig, SpecConfig
from specviz.figures.token_view import token_html
from specviz.traces.trace import TraceFormatError
from specviz.traces.json_format import loads_trace
from specviz.figures.why_panel import why_html

from conftest import decode
from test_trace import V1_TRACE

N_MUTANTS = 2_000
SCRIPT = ['"><img src=x onerror=alert(1)>', '" onmouseover="alert(1)', "<script>alert(1)</script>",
          "javascript:alert(1)", "</span><b onclick=alert(1)>"]
# numbers json.dumps cannot write (they are put into the text in place of these markers): 5,000 digits, a
# float literal that parses as infinity
TEXT_NUMBERS = {"__HUGE_INT__": "1" * 5000, "__OVERFLOW__": "1e309", "__NEG_OVERFLOW__": "-1e309"}
HOSTILE = [None, True, False, -1, 0, 1, 7, 10**29, 2**60, -2**40, 1e308, -1e-9, 0.5, 1.5, "", "x", "accepted",
           "\ud800", [], {}, [1, 2, 3], [0.1] * 3, ["a"], {"a": 1}, float("nan"), float("inf"), *SCRIPT,
           5e-324, 1e-300, *TEXT_NUMBERS]


class _Markup(HTMLParser):
    """Collects every tag and attribute name in a piece of HTML."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: set[str] = set()
        self.attributes: set[str] = set()

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        self.attributes.update(name for name, _ in attrs)


def injected(markup: str, tags: set[str], attributes: set[str]) -> set[str]:
    """Tags or attributes in the HTML beyond the ones the page itself writes."""
    parser = _Markup()
    parser.feed(markup)
    return (parser.tags - tags) | (parser.attributes - attributes)


def _nested(depth: int):
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


def _paths(node, prefix=()):
    """Every (container path, key) in a JSON tree, down to the schema's own depth."""
    out = []
    if len(prefix) > 8:
        return out
    if isinstance(node, dict):
        items = node.items()
    elif isinstance(node, list):
        items = enumerate(node)
    else:
        return out
    for key, child in items:
        out.append((prefix, key))
        out.extend(_paths(child, prefix + (key,)))
    return out


def _at(root, path):
    for key in path:
        root = root[key]
    return root


def mutate(base: dict, rng: random.Random) -> str:
    """One mutant as JSON text: edits to the tree (1-3 of them), or damage to the text itself."""
    data = copy.deepcopy(base)
    for _ in range(rng.choice((1, 1, 2, 3))):
        paths = _paths(data)
        if not paths:
            break
        parent_path, key = rng.choice(paths)
        parent = _at(data, parent_path)
        kind = rng.random()
        if kind < 0.25:  # drop a field or an element
            del parent[key]
        elif kind < 0.55:  # a value of another type or range, or markup
            parent[key] = copy.deepcopy(rng.choice(HOSTILE))
        elif kind < 0.65:  # deep nesting (text nested deeper than Python's JSON parser goes: test_trace.py)
            parent[key] = _nested(rng.choice((40, 200, 600)))
            break
        elif kind < 0.8 and isinstance(parent[key], list) and parent[key]:  # a list of another length
            if rng.random() < 0.5:
                parent[key].pop()
            else:
                parent[key].append(copy.deepcopy(parent[key][-1]))
        elif kind < 0.7 and isinstance(parent[key], dict):  # null in every slot of one object
            for k in parent[key]:
                parent[key][k] = None
        elif isinstance(parent[key], str):  # markup inside a string the page shows
            parent[key] = rng.choice(SCRIPT)
        else:  # a nearby number
            value = parent[key]
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                parent[key] = value + rng.choice((-1, 1, -0.5, 1000))
    text = json.dumps(data, allow_nan=True)
    for marker, number in TEXT_NUMBERS.items():
        text = text.replace(f'"{marker}"', number)
    if rng.random() < 0.08:  # damage the text: cut it, or change one character
        cut = rng.randrange(len(text))
        text = text[:cut] if rng.random() < 0.5 else text[:cut] + rng.choice('{}[]",:0x\\') + text[cut + 1:]
    return text


@pytest.fixture(scope="module")
def bases(tiny_pair, batch_prompts) -> list[dict]:
    cfg = SpecConfig(mode="exact", sampling=SamplingConfig(temperature=1.0), max_new_tokens=8, seed=1)
    batched = decode(tiny_pair, batch_prompts[:2], cfg, meta={"input": "article", "wer": 0.1, "rouge1": 0.5}).to_dict()
    # measured times differ run to run; fixed ones make every run of the fuzzer try the very same files
    for k, step in enumerate(batched["steps"]):
        step.update(draft_s=0.01, target_s=0.05, verify_s=0.001, end_s=0.1 * (k + 1))
    for seq in batched["sequences"]:
        seq["finished_s"] = 0.1 * len(batched["steps"])
    batched.update(prefill_s=0.5, total_s=0.1 * len(batched["steps"]) + 0.5)
    v2 = copy.deepcopy(batched)  # what a version-2 writer produced: no why-panel data, no explain_s
    for s in v2["sequences"]:
        for d in s["decisions"]:
            d.pop("why", None)
    for step in v2["steps"]:
        step.pop("explain_s", None)
    v2["schema_version"] = 2
    return [batched, copy.deepcopy(V1_TRACE), v2]


def test_trace_fuzz(bases, capsys):
    rng = random.Random(20261122)
    counts = {v: {"tried": 0, "refused": 0, "loaded": 0, "crashed": 0} for v in (1, 2, 3)}
    crashes, injections = [], []
    for i in range(N_MUTANTS):
        base = bases[i % len(bases)]
        tally = counts[base["schema_version"]]
        text = mutate(base, rng)
        tally["tried"] += 1
        try:
            trace = loads_trace(text)
        except TraceFormatError as e:
            tally["refused"] += 1
            assert str(e) and "float, got float" not in str(e)
            continue
        except Exception as e:  # noqa: BLE001: anything else is the bug this test looks for
            crashes.append((i, "load", repr(e)[:200]))
            tally["crashed"] += 1
            continue
        tally["loaded"] += 1
        try:
            drawn = page.figures(trace, upto=1 if i % 8 == 0 else None) if i % 4 == 0 else {
                "tokens": token_html(trace), "summary": report.summary_markdown(trace),
                "warning": report.sigmoid_warning(trace)}
            d = trace.decisions()[i % len(trace.decisions())] if trace.decisions() else None
            why = "".join(why_html(trace, d.step, d.sequence, k) for k in range(d.gamma + 1)) if d else ""
            json.dumps(trace.to_dict(), ensure_ascii=False, allow_nan=False).encode("utf-8")
        except Exception as e:  # noqa: BLE001
            crashes.append((i, "draw/export", repr(e)[:200]))
            tally["crashed"] += 1
            continue
        extra = (injected(drawn["tokens"], {"div", "span"}, {"class", "title", "data-step", "data-seq", "data-pos"})
                 | injected(drawn["summary"], {"div"}, {"class"}) | injected(drawn["warning"], {"div", "b"}, {"class", "role"})
                 | injected(why, {"div", "span", "br", "b"}, {"class", "style", "title"}))
        if extra:
            injections.append((i, sorted(extra)))
    with capsys.disabled():
        for version, c in counts.items():
            print(f"\ntrace fuzz, schema v{version}: {c['tried']} tried, {c['refused']} refused, {c['loaded']} loaded, "
                  f"{c['crashed']} crashed", end="")
        print(f"; {len(injections)} injections")
    assert not crashes, crashes[:5]
    assert not injections, injections[:5]
    for version, c in counts.items():  # both paths were exercised for every schema version
        assert c["loaded"] > 60 and c["refused"] > 60, (version, c)
