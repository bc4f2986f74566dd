"""Traces: records gathered into a `Trace`, its versioned JSON (written atomically, read as untrusted input),
and what a trace predicts about its own speed (`prediction`).

Imports decoding/ (for the records and the cost table) and the top-level modules; a trace never calls a model.
"""
