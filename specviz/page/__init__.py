"""The Gradio page without its layout: what a run, a comparison, an upload and an export do (`actions`), the
event handlers app.py wires (`handlers`), what browser sessions share (`sessions`) and the traces they hold
(`shelf`).

Imports every package below it; app.py is its only user. The CLI never imports it.
"""


def __getattr__(name: str) -> object:  # the names of the old specviz/page.py (specviz._moved)
    from specviz._moved import forward

    return forward(__name__, name)
