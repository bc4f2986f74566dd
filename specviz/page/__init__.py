"""The Gradio page without its layout: what a run, a comparison, an upload and an export do (`actions`), the
event handlers app.py wires (`handlers`), what browser sessions share (`sessions`) and the traces they hold
(`shelf`).

Imports every package below it; app.py is its only user. The CLI never imports it.
"""
