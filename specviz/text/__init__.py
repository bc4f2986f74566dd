"""The text task: articles as sequences of the shared driver (a causal LM over slotted caches), prompts and
their refusals.

Imports models/, decoding/ and the top-level modules.
"""


def __getattr__(name: str) -> object:  # the names of the old specviz/text.py (specviz._moved)
    from specviz._moved import forward

    return forward(__name__, name)
