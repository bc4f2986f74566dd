"""Evaluation: `specviz eval`. Data sets in (manifest, JSONL, `datasets`, parquet), a grid of settings, cells run
serially or on Ray, results as JSONL, Table 1 and Table 2, and their figures. Outputs are scored by their task
(runs.tasks).

Imports figures/, runs/ and everything below them; never the page or the CLI.
"""
