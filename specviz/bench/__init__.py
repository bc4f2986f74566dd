"""Benchmarks behind docs/benchmarks.md: model steps, drafts, verification and batching. Timings with warm-up
and medians; not tests.

Imports runs/ and everything below it.
"""


def __getattr__(name: str) -> object:  # the names of the old specviz/bench.py (specviz._moved)
    from specviz._moved import forward

    return forward(__name__, name)
