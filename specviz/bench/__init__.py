"""Benchmarks behind docs/benchmarks.md: model steps, drafts, verification and batching. Timings with warm-up
and medians; not tests.

Imports runs/ and everything below it.
"""
