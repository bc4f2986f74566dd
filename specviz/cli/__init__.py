"""The command line, `specviz ...` (or `python -m specviz`): generate, transcribe, compare, eval and the
benchmarks, with progress bars.

Imports every package below it except the page.
"""


def __getattr__(name: str) -> object:  # the names of the old specviz/cli.py (specviz._moved)
    from specviz._moved import forward

    return forward(__name__, name)
