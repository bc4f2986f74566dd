"""The allocator setting the entry points make (specviz.memory.reuse_freed_memory): a decoding step's
full-vocabulary temporaries reuse freed pages instead of faulting in fresh ones."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

# In a fresh interpreter: the why-panel's work for a batch of 4 at V = 151,936 (specviz.decoding.explain, ~20
# full-vocabulary temporaries an iteration, as a decoding step makes), and the minor page faults an iteration took:
# the median of 10, so a one-off (a thread's first stack, a lazily built table) does not stand for every step.
# "on": the entry points' setting. "mapped", the control: glibc's starting mmap threshold (128 KiB) held, so every
# such block is mapped afresh, as glibc's defaults often do. Not the defaults themselves: their threshold moves
# with the history of frees, and six fresh processes measured medians of 0 to 5,310 faults an iteration.
_PROBE = """
import ctypes, ctypes.util, json, resource, statistics, sys, torch
from specviz import memory
if sys.argv[1] == "on":
    took = memory.reuse_freed_memory()
else:
    took = bool(ctypes.CDLL(ctypes.util.find_library("c")).mallopt(-3, 128 * 1024))  # M_MMAP_THRESHOLD, fixed
from specviz.config import SamplingConfig
from specviz.decoding.explain import examine
torch.manual_seed(0)
V = 151936
draft_logits, target_logits = torch.randn(4, 1, V), torch.randn(4, 2, V)
def iteration():
    examine([[1]] * 4, [1, 0, 1, 1], draft_logits, target_logits, SamplingConfig(temperature=0.8), lenience=1.0,
            sigmoid=None, top=20, decode=str)
for _ in range(3):
    iteration()
faults = []
for _ in range(10):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    iteration()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"took": took, "faults": statistics.median(faults), "each": faults}))
"""


def _faults(setting: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE, setting], capture_output=True, text=True, timeout=120,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_freed_blocks_are_reused_not_faulted_in_again():
    mapped, tuned = _faults("mapped"), _faults("on")
    row = 151936 * 4 // 4096  # pages of one full-vocabulary row
    assert tuned["took"] is True and mapped["took"] is True
    assert mapped["faults"] > 5 * row  # every block mapped afresh: 7,128 an iteration measured (~48 rows' pages)
    assert tuned["faults"] < row, (mapped, tuned)  # with it: 0–1 (a one-off iteration once took ~1,800)


def test_the_entry_points_make_the_setting():
    import inspect

    from specviz.cli import commands
    from specviz.page import app

    for main in (commands.main, app.main):
        assert "memory.reuse_freed_memory()" in inspect.getsource(main)
