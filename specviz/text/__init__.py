"""The text task: articles as sequences of the shared driver (a causal LM over slotted caches), prompts and
their refusals.

Imports models/, decoding/ and the top-level modules.
"""
