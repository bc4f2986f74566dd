"""Keys and values of prompts a model has already read, so one input is prefilled once.

The page's speculative run and the target-only run that measures its speedup read the same prompt, as do
the rounds of a comparison and a user's runs of one article in several modes: each would prefill it again
(seconds per input on a CPU). A model's keys and values for a prompt depend on the prompt alone (causal
attention; the packed kernels are batch-invariant), so a stored copy is exactly what prefilling would
compute. Entries are tensors that no decoder writes into (decoders copy them into their own caches), kept
for the few most recent prompts per model.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

Layers = tuple[tuple[torch.Tensor, torch.Tensor], ...]  # per layer (keys, values), each [1, heads, n, head_dim]


class PromptCache:
    """Prompt token ids -> a model's per-layer keys and values for them, least recently used dropped first."""

    def __init__(self, capacity: int = 8):
        self.capacity = capacity
        self._entries: OrderedDict[tuple[int, ...], Layers] = OrderedDict()
        # The page serves several sessions from one loaded pair, each decoding in its own thread.
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, prompt: tuple[int, ...]) -> Layers | None:
        with self._lock:
            layers = self._entries.get(prompt)
            if layers is None:
                self.misses += 1
                return None
            self._entries.move_to_end(prompt)
            self.hits += 1
            return layers

    def put(self, prompt: tuple[int, ...], layers: Layers) -> None:
        with self._lock:
            self._entries[prompt] = layers
            self._entries.move_to_end(prompt)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
