"""The page's trace shelf: traces held once per server within a memory budget, the least recently used
written to disk and read back whole, the oldest files pruned; shared by many handler threads."""

from __future__ import annotations

import threading

import pytest

from specviz.config import SamplingConfig, SpecConfig
from specviz.page.shelf import Ticket, TraceShelf, json_size

from conftest import decode


@pytest.fixture(scope="module")
def traces(tiny_pair, prompt_ids) -> list:
    """Six real traces of different seeds (sampled, so each decodes differently)."""
    return [decode(tiny_pair, [prompt_ids], SpecConfig(max_new_tokens=6, seed=seed,
                                                             sampling=SamplingConfig(temperature=1.0)))
            for seed in range(6)]


def test_within_budget_every_trace_stays_in_memory(traces, tmp_path):
    shelf = TraceShelf(tmp_path, memory_bytes=10**9)
    tickets = [shelf.put(t, json_size(t)) for t in traces]
    assert all(shelf.get(k) is t for k, t in zip(tickets, traces))
    assert not list(tmp_path.glob("*.json"))  # nothing written while memory holds it all


def test_beyond_budget_the_least_recently_used_go_to_disk_and_come_back_whole(traces, tmp_path):
    size = json_size(traces[0])
    shelf = TraceShelf(tmp_path, memory_bytes=int(2.5 * size))  # room for two
    tickets = [shelf.put(t, json_size(t)) for t in traces]
    assert shelf.held_bytes() <= 2.5 * size
    assert len(list(tmp_path.glob("*.json"))) == len(traces) - 2
    shelf.get(tickets[-2])  # touched: now the most recently used of the two in memory
    shelf.put(traces[0], json_size(traces[0]))  # so the last one is the one written out
    assert (tmp_path / f"{tickets[-1].key}.json").exists()
    for ticket, trace in zip(tickets, traces):  # each read back equals what was put, as the page would use it
        assert shelf.get(ticket).to_dict() == trace.to_dict()
        assert shelf.held_bytes() <= 2.5 * size


def test_a_trace_still_growing_is_written_as_its_latest_version(traces, tmp_path):
    shelf = TraceShelf(tmp_path, memory_bytes=1)  # nothing but the one just touched stays in memory
    live = traces[1]
    ticket = shelf.put(traces[0], 0)
    assert shelf.put(live, 0, ticket) == ticket  # the run's next update: a new version behind the same ticket
    shelf.put(traces[2], 10)  # pushes it out
    assert shelf.get(ticket).to_dict() == live.to_dict()


def test_only_the_newest_files_are_kept_and_an_older_ticket_says_gone(traces, tmp_path):
    shelf = TraceShelf(tmp_path, memory_bytes=1, kept=2)
    tickets = [shelf.put(t, json_size(t)) for t in traces]
    assert len(list(tmp_path.glob("*.json"))) <= 2
    assert shelf.get(tickets[0]) is None  # pruned: gone, said by the page (handlers.GONE)
    assert shelf.get(tickets[-1]).to_dict() == traces[-1].to_dict()
    assert shelf.get(None) is None and shelf.get(Ticket("f" * 32)) is None


def test_a_trace_larger_than_the_budget_is_never_held_but_always_there(traces, tmp_path):
    shelf = TraceShelf(tmp_path, memory_bytes=json_size(traces[0]) // 2)
    ticket = shelf.put(traces[0], json_size(traces[0]))
    assert shelf.held_bytes() == 0 and (tmp_path / f"{ticket.key}.json").exists()
    for _ in range(2):  # each look reads it back and lets it go again
        assert shelf.get(ticket).to_dict() == traces[0].to_dict() and shelf.held_bytes() == 0


def test_the_files_stay_within_their_byte_budget(traces, tmp_path):
    size = json_size(traces[0])
    shelf = TraceShelf(tmp_path, memory_bytes=1, kept=100, disk_bytes=int(3.5 * size))
    tickets = [shelf.put(t, json_size(t)) for t in traces]
    assert sum(p.stat().st_size for p in tmp_path.glob("*.json")) <= 3.5 * size
    assert shelf.get(tickets[0]) is None and shelf.get(tickets[-1]) is not None


def test_a_damaged_file_is_gone_not_a_crash(traces, tmp_path):
    shelf = TraceShelf(tmp_path, memory_bytes=1)
    ticket = shelf.put(traces[0], 10)
    shelf.put(traces[1], 10)
    (tmp_path / f"{ticket.key}.json").write_text('{"schema_version": 3, "steps": "cut sh')
    assert shelf.get(ticket) is None


def test_many_threads_each_get_their_own_trace(traces, tmp_path):
    """8 sessions' threads put and look at once with room for two: every look returns its own trace."""
    shelf = TraceShelf(tmp_path, memory_bytes=2 * json_size(traces[0]))
    wrong: list = []

    def session(i: int) -> None:
        mine = traces[i % len(traces)]
        ticket = shelf.put(mine, json_size(mine))
        for _ in range(20):
            seen = shelf.get(ticket)
            if seen is None or seen.outputs != mine.outputs:
                wrong.append((i, seen))

    threads = [threading.Thread(target=session, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong and shelf.held_bytes() <= 2 * json_size(traces[0]) + max(json_size(t) for t in traces)


def test_a_trace_put_with_its_export_is_linked_not_written_again(traces, tmp_path):
    export = tmp_path / "export.json"
    traces[0].save(export)
    shelf = TraceShelf(tmp_path / "shelf", memory_bytes=1)  # dropped from memory at once
    ticket = shelf.put(traces[0], export.stat().st_size, file=export)
    kept = tmp_path / "shelf" / f"{ticket.key}.json"
    assert kept.stat().st_ino == export.stat().st_ino  # the export's bytes, no second serialization
    export.unlink()  # the export folder pruned: the shelf's link still holds it
    assert shelf.get(ticket).to_dict() == traces[0].to_dict()
    gone = tmp_path / "gone.json"  # an export pruned before the trace left memory: written instead
    ticket = shelf.put(traces[1], 10, file=gone)
    assert shelf.get(ticket).to_dict() == traces[1].to_dict()
