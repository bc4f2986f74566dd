"""Hugging Face ZeroGPU: where the `spaces` package imports and the page decodes on CUDA, the handlers that run
models (Run, Compare, Evaluate, rerun) hold a GPU through `spaces.GPU` while they run; elsewhere they are the
plain functions, and nothing changes.

On ZeroGPU a decorated call runs in a forked worker process and what it yields is pickled back to the page's
process; what the call leaves in memory there (the loaded pair, the traces it shelved) is not seen by the
page's later calls. Nothing here changes that: it only asks for the GPU.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch

# How long each handler may hold the GPU (spaces.GPU's `duration`, in seconds): a Run streams up to the page's
# tokens and times target-only beside it; a Compare decodes every mode in rounds; an evaluation many cells.
SECONDS = {"run": 120, "rerun": 120, "compare": 300, "evaluate": 300}


def decorator(device: str | torch.device | None) -> Callable[..., Any] | None:
    """spaces.GPU where `spaces` imports and `device` (None: CUDA when present) is a CUDA device, else None."""
    where = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if where.type != "cuda":
        return None
    try:
        import spaces
    except ImportError:
        return None
    return spaces.GPU


def on_gpu(handler: Callable[..., Any], name: str, gpu: Callable[..., Any] | None) -> Callable[..., Any]:
    """`handler` held on the GPU by `gpu` (decorator()'s answer) for up to SECONDS[name]; without one, the handler
    itself. A generator handler stays a generator function, as the page's wiring tells streamed handlers apart
    by that (whatever the decorator returns)."""
    if gpu is None:
        return handler
    held = gpu(duration=SECONDS[name])(handler)
    if inspect.isgeneratorfunction(handler):
        def streamed(*args: Any, **kwargs: Any):
            yield from held(*args, **kwargs)
        wrapped = streamed
    else:
        def wrapped(*args: Any, **kwargs: Any):
            return held(*args, **kwargs)
    functools.update_wrapper(wrapped, handler)
    wrapped.__wrapped__ = held  # the decorated function (update_wrapper pointed at the plain handler)
    return wrapped
