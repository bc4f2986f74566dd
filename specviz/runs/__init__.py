"""Runs: what the CLI and the page share to turn a setting into a trace. The settings declaration (`settings`),
one run (`run`), and every mode side by side (`compare`).

Imports text/, speech/, traces/, decoding/, models/ and the top-level modules; never figures, the page or the
CLI.
"""
