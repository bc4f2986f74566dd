"""Figures: what a trace looks like. Plotly figures, the coloured token view, the why-panel, the run summary
(`report`). Built from a trace alone; nothing here calls a model.

Imports runs/ (compare rows), traces/, decoding.records and the top-level modules.
"""


def __getattr__(name: str) -> object:  # the names of the old specviz/figures.py (specviz._moved)
    from specviz._moved import forward

    return forward(__name__, name)
