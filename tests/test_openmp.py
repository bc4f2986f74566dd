"""A thread that computed hands its OpenMP team back (specviz.openmp), so a decoding thread is not slowed by it."""

import os
import threading

import pytest
import torch

from specviz import openmp
from specviz.page import sessions


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _parallel_op() -> None:
    torch.randn(1 << 22).exp_()  # large enough for torch to open a parallel region


needs_a_team = pytest.mark.skipif(torch.get_num_threads() < 2 or not os.path.isdir("/proc/self/task")
                                  or openmp._runtime() is None,
                                  reason="needs two or more torch threads, /proc and libgomp with OpenMP 5.0's pause")


def _in_thread(work) -> list[int]:
    """Run `work` in a fresh thread that reports the process's thread counts it asked for."""
    counts: list[int] = []
    thread = threading.Thread(target=lambda: work(counts))
    thread.start()
    thread.join()
    return counts


@needs_a_team
def test_a_threads_team_is_freed_and_rebuilt_on_demand():
    def work(counts):
        counts.append(_threads())
        _parallel_op()
        counts.append(_threads())  # this thread's team: torch's threads less this one
        assert openmp.release_team()
        counts.append(_threads())
        _parallel_op()  # a later region builds it again
        counts.append(_threads())
        openmp.release_team()

    before, with_team, released, again = _in_thread(work)
    assert with_team == before + torch.get_num_threads() - 1
    assert released == before and again == with_team


@needs_a_team
def test_the_page_gives_back_the_team_of_a_thread_that_loaded_models():
    """ModelCache loads in a handler's thread that outlives the load; its team must not stay behind."""
    cache = sessions.ModelCache(loader=lambda draft, target, progress: _parallel_op() or "pair")

    def work(counts):
        counts.append(_threads())
        assert cache.text("draft", "target", lambda *a: None) == "pair"
        counts.append(_threads())

    before, after = _in_thread(work)
    assert after == before


def test_release_is_harmless_where_no_team_exists():
    openmp.release_team()
    # a second call finds nothing to free and still succeeds wherever the runtime can pause
    assert openmp.release_team() is (openmp._runtime() is not None)
