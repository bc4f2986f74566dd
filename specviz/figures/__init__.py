"""Figures: what a trace looks like. Plotly figures, the coloured token view, the why-panel, the run summary
(`report`). Built from a trace alone; nothing here calls a model.

Imports runs/ (compare rows), traces/, decoding.records and the top-level modules.
"""
