"""The command line, `specviz ...` (or `python -m specviz`): generate, transcribe, compare, eval and the
benchmarks, with progress bars.

Imports every package below it except the page.
"""
