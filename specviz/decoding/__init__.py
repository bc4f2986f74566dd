"""Decoding: the one driver (`engine`), its slotted KV caches (`decoder`), who drafts (`proposers`, `drafts`),
how many (`gamma`, with the measured cost model: `cost`, `expectation`, `acceptance`, `calibration`), and what
it yields (`records`, `explain`).

Imports models/, verify/ and the top-level modules; never traces, tasks, the page or the CLI. Everything it
produces leaves as immutable records.
"""
