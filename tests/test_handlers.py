"""The page's handlers, called as plain functions (no browser, no Gradio server): named inputs in, named
updates out, only for components the event lists as outputs."""

from __future__ import annotations

import json

import gradio as gr

from specviz.page import app
from specviz.page import handlers, actions as page, sessions
from specviz.runs import settings
from specviz.config import SpecConfig
from specviz.runs.decode import run
from specviz.page.shelf import Ticket, TraceShelf
from specviz.runs.settings import TEXT, Settings
from specviz.text.source import article_source
from specviz.evaluation.results import load_results
from specviz.traces.trace import Trace

from conftest import decode


def _server(pair, shelf: TraceShelf | None = None, tmp=None,
            limits: sessions.VisitorLimits = sessions.VisitorLimits()) -> handlers.Server:
    return handlers.Server(sessions.ModelCache(loader=lambda draft, target, progress: pair), sessions.Stops(),
                           page.References(), shelf or TraceShelf(page.EXPORT_DIR.parent / "specviz-test-shelf", 10**8),
                           limits)


def _values(**overrides) -> dict:
    values = {"task": TEXT, "article": "w5 w9 w13 w2 w7 w5 w9 w13 w4", "audio": None, "reference_summary": "",
              "reference_transcript": "", "measure": False, **Settings().to_dict()}
    values.update(overrides)
    return values


def _caller(session: str = "s1") -> tuple[handlers.Caller, list]:
    messages: list = []
    return handlers.Caller(session, lambda message, fraction: messages.append(message)), messages


def test_run_streams_named_updates_and_ends_with_the_trace(tiny_pair):
    caller, _ = _caller()
    server = _server(tiny_pair)
    updates = list(handlers.run(server, _values(decoding="greedy", max_new_tokens=8, measure=True), caller))
    for u in updates:
        assert set(u) <= set(app.SHOWN), set(u) - set(app.SHOWN)
    final = updates[-1]
    assert "speedup measured" in final["status"]
    # the session's state holds a ticket, the same one through the whole stream; the trace is on the shelf
    tickets = {u["trace"] for u in updates if "trace" in u}
    assert len(tickets) == 1 and isinstance(final["trace"], Ticket)
    trace = server.traces.get(final["trace"])
    assert isinstance(trace, Trace) and trace.meta["target_only"]["reused"] is False
    # the page's run is the engine's run: the same greedy output as the same settings decoded without the page
    cfg = Settings(decoding="greedy", max_new_tokens=8).spec(TEXT)
    direct = run(article_source(tiny_pair, [("article", _values()["article"])], cfg), cfg)
    assert trace.new_tokens > 0 and trace.outputs == direct.outputs and trace.meta["config"] == cfg.to_dict()
    assert isinstance(final["gamma_plot"], gr.Plot) and final["batch_plot"].visible is False
    exported = json.loads(open(final["export"].value["path"], encoding="utf-8").read())
    assert exported["meta"]["page_settings"]["decoding"] == "greedy"


def test_run_says_how_far_each_model_has_read_the_input_before_the_first_iteration(tiny_pair):
    fractions: list = []
    caller = handlers.Caller("s1", lambda message, fraction: fractions.append((message, fraction)))
    statuses = [str(u["status"]) for u in handlers.run(_server(tiny_pair), _values(max_new_tokens=8), caller)
                if "status" in u]
    first_iteration = next(i for i, s in enumerate(statuses) if "Decoding…" in s or "Done" in s)
    reading = [s for s in statuses[:first_iteration] if "Prefill: the target" in s or "Prefill: the draft" in s]
    assert [("target" in s, "draft" in s) for s in reading] == [(True, False), (False, True)]
    assert all("has read the input" in s for s in reading)  # a tiny fp32 pair reads each prompt in one forward
    assert [f for m, f in fractions if m.startswith("Prefill")] == [1.0, 1.0]


def test_run_shows_a_bad_setting_or_input_in_the_status_and_frees_the_session(tiny_pair):
    server = _server(tiny_pair)
    caller, _ = _caller("s2")
    for values in (_values(article="   "), _values(temperature=99.0), _values(sequences=9)):
        updates = list(handlers.run(server, values, caller))
        assert set(updates[-1]) == {"status"} and "⚠" in updates[-1]["status"]
        assert handlers.stop(server, {}, caller) == {}  # no run left registered for the session


def test_stop_reaches_only_its_own_session(tiny_pair):
    server = _server(tiny_pair)
    caller, _ = _caller("mine")
    going = handlers.run(server, _values(max_new_tokens=200, gamma_policy="constant", gamma_init=2), caller)
    next(going)
    next(going)  # the stream is started: the run is registered
    other, _ = _caller("theirs")
    assert handlers.stop(server, {}, other) == {}
    assert "Stopping" in handlers.stop(server, {}, caller)["status"]
    final = list(going)[-1]
    assert server.traces.get(final["trace"]).meta["stopped"] is True and final["status"].count("Stopped") == 1


def test_compare_fills_the_compare_tab(tiny_pair):
    caller, messages = _caller()
    server = _server(tiny_pair)
    updates = list(handlers.compare(server, _values(rounds=1, with_hf=False, max_new_tokens=6, decoding="greedy"),
                                    caller))
    for u in updates:
        assert set(u) <= set(app.COMPARE_OUTPUTS)
    final = updates[-1]
    assert list(final["compare_table"]["run"]) == ["target-only", "baseline", "exact", "sigmoid"]
    assert set(final["compare_state"]) == {"target-only", "baseline", "exact", "sigmoid"}
    assert any("running exact" in m for m in messages)
    opened = handlers.open_compared(server, {"compare_state": final["compare_state"], "compare_pick": "sigmoid"})
    assert set(opened) <= set(app.RESTORED) and opened["mode"] == "sigmoid"


def test_upload_restores_the_settings_or_says_why_not(tiny_pair, prompt_ids, tmp_path):
    trace = decode(tiny_pair, [prompt_ids], SpecConfig(mode="baseline", max_new_tokens=6, seed=4))
    good = tmp_path / "good.json"
    trace.save(good)
    server = _server(tiny_pair)
    opened = handlers.upload(server, {"trace_upload": str(good)})
    assert set(opened) <= set(app.RESTORED)
    assert set(settings.page_names()) <= set(opened)
    assert (opened["mode"], opened["seed"], opened["decoding"]) == ("baseline", 4, "greedy")
    assert server.traces.get(opened["trace"]).outputs == trace.outputs
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": 3, "steps": "many"}')
    refused = handlers.upload(server, {"trace_upload": str(bad)})
    assert set(refused) == {"status"} and "TraceFormatError" in refused["status"]
    assert handlers.upload(server, {"trace_upload": None}) == {}


def test_replay_and_why_take_malformed_input_quietly(tiny_pair, prompt_ids, tmp_path):
    server = _server(tiny_pair, TraceShelf(tmp_path / "shelf", 10**8))
    ticket = server.traces.put(decode(tiny_pair, [prompt_ids], SpecConfig(max_new_tokens=6)), 1)
    assert handlers.replay(server, {"trace": None, "replay": 3}) == {}
    assert set(handlers.replay(server, {"trace": ticket, "replay": 1})) == set(app.VIEW)
    for picked in ("", "x,y,z", "1,2", None):
        assert handlers.why(server, {"trace": ticket, "why_select": picked}) == {}
    assert "sv-why" in handlers.why(server, {"trace": ticket, "why_select": "0,0,0,123"})["why_panel"]
    assert handlers.why(server, {"trace": None, "why_select": "0,0,0,1"}) == {}
    # a ticket whose trace the shelf no longer keeps: said in the status line, nothing else changes
    gone = Ticket("0" * 32)
    assert set(handlers.replay(server, {"trace": gone, "replay": 1})) == {"status"}
    assert "no longer held" in handlers.why(server, {"trace": gone, "why_select": "0,0,0,1"})["status"]


def test_buttons_and_samples_update_only_their_outputs():
    assert set(handlers.busy({})) == {"status", *app.BUTTONS}
    assert set(handlers.idle({})) == set(app.BUTTONS)
    assert handlers.idle({})["stop_button"].interactive is False
    assert set(handlers.sample_audio({})) == {"audio", "reference_transcript"}
    assert handlers.sample_text({})["article"].strip()


def test_evaluate_runs_a_small_sweep_and_stop_ends_it(tiny_pair, tmp_path, monkeypatch):
    monkeypatch.setattr(page, "EXPORT_DIR", tmp_path / "downloads")
    server = _server(tiny_pair)
    caller, messages = _caller("eval")
    values = {**_values(decoding="greedy", max_new_tokens=200), "eval_data": "text", "eval_examples": 1}
    updates = list(handlers.evaluate(server, values, caller))
    for u in updates:
        assert set(u) <= {*app.EVAL_SHOWN, "eval_download"}
    final = updates[-1]
    assert "Done: 4 of 4 runs (0 failed)" in final["status"], final["status"]
    assert "| exact · γ auto | 0 | 1 | " in final["eval_table1"]
    assert "| -10000 (default) | 10000 (default) | auto | 0 | 1 |" in final["eval_table2"]
    assert final["eval_tradeoff_plot"].visible and any("run 4 of 4" in m for m in messages)
    results = load_results(final["eval_download"].value["path"])
    assert all(r["new_tokens"] <= handlers.PAGE_SWEEP_TOKENS for r in results.cells)  # the page's cap
    # Stop pressed before the first cell: nothing runs, the session is freed
    stopping = handlers.evaluate(server, {**values, "eval_examples": 2}, caller)
    next(stopping)
    handlers.stop(server, {}, caller)
    assert "Stopped: 0 of 8 runs" in list(stopping)[-1]["status"]
    assert handlers.stop(server, {}, caller) == {}


def test_evaluate_refuses_a_big_sweep_and_a_bad_results_file(tiny_pair, tmp_path):
    caller, _ = _caller()
    values = {**_values(), "eval_data": "text", "eval_examples": 9}
    assert "1 to 4 examples" in list(handlers.evaluate(_server(tiny_pair), values, caller))[-1]["status"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"kind": "sweep"}\n{"kind": "cell", "key": 3}\n{"kind": "sweep"}\n')
    refused = handlers.evaluate_upload({"eval_upload": str(bad)})
    assert set(refused) == {"status", "eval_upload"} and "line 2" in refused["status"]
    assert handlers.evaluate_upload({"eval_upload": None}) == {}


def test_a_shared_page_caps_what_one_visitor_holds_before_any_model_loads(tiny_pair):
    loads = []

    def loader(draft, target, progress):
        loads.append(target)
        return tiny_pair

    server = handlers.Server(sessions.ModelCache(loader=loader), sessions.Stops(), page.References(),
                             TraceShelf(page.EXPORT_DIR.parent / "specviz-test-shelf", 10**8), sessions.SHARED_LIMITS)
    limits = sessions.SHARED_LIMITS
    refused = [
        list(handlers.run(server, _values(max_new_tokens=limits.max_new_tokens + 1), _caller()[0]))[-1],
        list(handlers.run(server, _values(sequences=limits.sequences + 1), _caller()[0]))[-1],
        list(handlers.compare(server, {**_values(max_new_tokens=limits.compare_tokens + 1), "rounds": 1,
                                       "with_hf": False}, _caller()[0]))[-1],
        list(handlers.compare(server, {**_values(max_new_tokens=8), "rounds": limits.compare_rounds + 1,
                                       "with_hf": False}, _caller()[0]))[-1],
        list(handlers.evaluate(server, {**_values(), "eval_data": "text",
                                        "eval_examples": limits.eval_examples + 1}, _caller()[0]))[-1],
    ]
    for update in refused:
        assert set(update) == {"status"} and "this page is shared" in update["status"], update
    assert not loads  # refused before anything loaded
    # within the limits the same server runs
    final = list(handlers.run(server, _values(decoding="greedy", max_new_tokens=8), _caller()[0]))[-1]
    assert final["status"].count("Done") == 1 and "error" not in final["status"]


def test_a_local_page_caps_nothing():
    assert not sessions.VisitorLimits().shared and sessions.SHARED_LIMITS.shared
    assert not app.shared_by_strangers("127.0.0.1") and app.shared_by_strangers("0.0.0.0")


def test_rerun_decodes_the_loaded_trace_again_exactly(tiny_pair):
    caller, _ = _caller()
    server = _server(tiny_pair)
    first = list(handlers.run(server, _values(decoding="sample", temperature=0.8, max_new_tokens=8, seed=5), caller))[-1]
    original = server.traces.get(first["trace"])
    updates = list(handlers.rerun(server, {"trace": first["trace"]}, caller))
    assert all(set(u) <= set(app.SHOWN) for u in updates)
    assert "token for token" in updates[-1]["status"], updates[-1]["status"]
    again = server.traces.get([u["trace"] for u in updates if "trace" in u][-1])
    assert again.config["gamma_policy"] == "replay" and again.outputs == original.outputs
    assert [s.gamma for s in again.steps] == [s.gamma for s in original.steps]
    nothing = list(handlers.rerun(server, {"trace": None}, caller))
    assert "Load a trace first" in nothing[-1]["status"]


PLOTS = {f"{name}_plot" for name in handlers.PLOTS}


def test_no_figure_is_drawn_until_the_run_and_its_reference_are_timed(tiny_pair):
    """While the run decodes and while target-only is timed the page sends text only; the figures come in the
    last update, with the measured speedup, which says how it was measured."""
    caller, _ = _caller()
    server = _server(tiny_pair)
    updates = list(handlers.run(server, _values(max_new_tokens=24, measure=True, gamma_policy="constant"), caller))
    assert not any(PLOTS & set(u) for u in updates[:-1])
    assert any("target-only decodes in turns with it" in u.get("status", "") for u in updates[:-1])
    final = updates[-1]
    assert PLOTS <= set(final) and "speedup measured" in final["status"]
    reference = server.traces.get(final["trace"]).meta["target_only"]
    assert reference["other_sessions_running"] is False  # nothing else ran on this server
    assert "in turns with this run" in final["summary"] and "nothing drawn during either" in final["summary"]


def test_a_timing_knows_when_another_sessions_work_overlapped_it():
    activity = sessions.Activity()
    with activity.running("a") as first:
        with activity.running("a") as same_session:  # a session's own outer work is no other load
            pass
        assert not activity.overlapped(same_session)
        with activity.running("b") as other:
            pass
        assert activity.overlapped(first) and activity.overlapped(other)
    with activity.running("a") as alone:
        pass
    assert not activity.overlapped(alone)


def test_an_overlapped_measurement_is_marked_as_such(tiny_pair):
    caller, _ = _caller("s1")
    server = _server(tiny_pair)
    with server.activity.running("s2"):  # another session's run going on the whole time
        updates = list(handlers.run(server, _values(max_new_tokens=8, measure=True), caller))
    final = updates[-1]
    assert server.traces.get(final["trace"]).meta["target_only"]["other_sessions_running"] is True
    assert "another session was working on this server" in final["summary"]


def test_compare_holds_one_gamma_schedule_for_every_mode_unless_told_otherwise(tiny_pair):
    server = _server(tiny_pair)
    values = _values(rounds=1, with_hf=False, max_new_tokens=12, gamma_policy="cost")
    final = list(handlers.compare(server, values, _caller()[0]))[-1]
    assert "every mode on one γ schedule" in final["compare_note"]
    traces = {name: server.traces.get(t) for name, t in final["compare_state"].items()}
    schedules = {name: [s.gamma for s in trace.steps] for name, trace in traces.items() if name != "target-only"}
    assert all(trace.config["gamma_policy"] == "replay" for name, trace in traces.items() if name != "target-only")
    shortest = min(len(g) for g in schedules.values())
    assert len({tuple(g[:shortest]) for g in schedules.values()}) == 1  # the same γ at every shared iteration
    own = list(handlers.compare(server, {**values, "same_schedule": False}, _caller()[0]))[-1]
    assert "each mode chose its own γ" in own["compare_note"]


def test_a_run_waiting_on_another_sessions_load_shows_that_loads_progress(tiny_pair):
    import threading
    import time

    started, release = threading.Event(), threading.Event()

    def slow_loader(draft, target, progress):
        progress("packing the blocks", 0.5)
        started.set()
        release.wait(5)
        return tiny_pair

    models = sessions.ModelCache(loader=slow_loader)
    models.WAIT_POLL_S = 0.02
    first = threading.Thread(target=models.text, args=("default", "default", lambda m, f: None))
    first.start()
    started.wait(5)
    seen = []
    waiter = threading.Thread(target=lambda: seen.append(models.text("default", "default",
                                                                      lambda m, f: seen.append((m, f)))))
    waiter.start()
    time.sleep(0.2)
    release.set()
    first.join(5)
    waiter.join(5)
    assert ("packing the blocks", 0.5) in seen and seen[-1] is tiny_pair


def test_the_task_is_resolved_once_at_the_pages_edge_and_an_unknown_one_is_named(tiny_pair, monkeypatch):
    from specviz.runs import tasks

    looked_up = []
    resolve = tasks.task_of
    monkeypatch.setattr(handlers, "task_of", lambda name: looked_up.append(name) or resolve(name))
    server = _server(tiny_pair)
    list(handlers.run(server, _values(max_new_tokens=4, measure=True), _caller()[0]))
    assert looked_up == [TEXT]  # the run, its reference and its scoring got the Task, not the name again
    final = list(handlers.run(server, _values(task="translate"), _caller()[0]))[-1]
    assert "unknown task" in final["status"] and "summarize" in final["status"]
