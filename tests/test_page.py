"""The page's orchestration without a browser: stopping a run, the target-only reference, comparison
rounds, restoring settings from a trace, and the words the page writes about a run."""

from __future__ import annotations

import json
import threading
import time

import pytest

from specviz.page import actions as page, sessions
from specviz.figures import report
from specviz.runs.compare import compare, noise, source_runner
from specviz.config import SamplingConfig, SpecConfig
from specviz.runs.decode import run
from specviz.runs.settings import Settings
from specviz.runs.tasks import SUMMARIZE, TRANSCRIBE
from specviz.traces.json_format import loads_trace

from conftest import decode, prompts_source

SAMPLED = SamplingConfig(temperature=0.8)


class _Models:
    """A ModelCache stand-in that hands out the tiny pair for any name."""

    def __init__(self, pair):
        self.pair = pair

    def text(self, draft, target, progress):
        return self.pair


def test_stop_ends_the_run_after_the_current_iteration(tiny_pair, prompt_ids):
    source = prompts_source(tiny_pair, [prompt_ids])
    cfg = SpecConfig(sampling=SAMPLED, max_new_tokens=200, gamma_policy="constant", gamma_init=2)
    stop = sessions.StopFlag()
    seen = []
    for trace, done, reading, _ in page._streamed(source, cfg, {}, stop):
        if reading is None and not done:  # the first frame of the decoding, drawn at its first iteration
            seen.append(len(trace.steps))
            stop.stop("test")
    assert done and trace.meta["stopped"] is True and seen and seen[0] >= 1
    assert len(trace.steps) <= seen[0] + 1 and trace.new_tokens < 200  # at most the iteration in flight finishes
    loads_trace(json.dumps(trace.to_dict()))  # the partial trace is a valid, exportable trace


DRAWING_S = 0.03


def test_a_streamed_run_streams_text_on_a_budget_and_ends_with_the_whole_run(tiny_pair, prompt_ids):
    """Frames come when no newer iteration waits, at least MIN_TEXT_GAP_S apart (and TEXT_WAIT times a frame's own
    time); the trace grows frame to frame and the last one is the whole run. Before them, one frame per model says
    it has read the input."""
    source = prompts_source(tiny_pair, [prompt_ids])
    # long enough for three frames MIN_TEXT_GAP_S apart with room to spare: 120 tokens took 0.8 s on a quiet 2-core
    # host once each draw stopped copying and re-reading its logits, two frames
    cfg = SpecConfig(sampling=SAMPLED, max_new_tokens=360, gamma_policy="constant", gamma_init=2)
    frames, reading = [], []
    for frame in page._streamed(source, cfg, {}, sessions.StopFlag()):
        if frame.reading is not None:  # the prefill's progress, before any iteration
            assert not frame.trace.steps and not frames
            reading.append((frame.reading.model, frame.reading.read == frame.reading.total))
            continue
        frames.append((time.perf_counter(), len(frame.trace.steps), frame.done))
        if not frame.done:
            time.sleep(DRAWING_S)  # as building the frame would take
    assert reading == [("target", True), ("draft", True)]
    assert frames[-1][2] and not any(done for _, _, done in frames[:-1])
    growing = [frames[i][1] for i in range(len(frames) - 1)]
    assert growing == sorted(growing) and frames[-1][1] == len(frame.trace.steps) > 0
    assert len(frames) >= 3, "the run must be long enough for the gaps between frames to be checked"
    gaps = [b[0] - a[0] for a, b in zip(frames, frames[1:-1])]
    assert all(gap >= max(page.MIN_TEXT_GAP_S, page.TEXT_WAIT * DRAWING_S) for gap in gaps)


HOLD_S = 0.15


def test_decoding_waits_while_the_page_holds_a_frame_and_its_clock_stands_still(tiny_pair, prompt_ids, monkeypatch):
    """The worker hands over one record at a time and waits until the page is done with it: no record is
    produced while the page holds a frame (drawing never shares the cores with decoding), and the time the
    page holds frames is not in the run's decoding time."""
    produced = []  # when the engine produced each record

    def timed_records(*args, **kwargs):
        for event in page_records(*args, **kwargs):
            produced.append(time.perf_counter())
            yield event

    page_records = page.records
    monkeypatch.setattr(page, "records", timed_records)
    source = prompts_source(tiny_pair, [prompt_ids])
    cfg = SpecConfig(sampling=SAMPLED, max_new_tokens=60, gamma_policy="constant", gamma_init=2)
    held = []
    started = time.perf_counter()
    for frame in page._streamed(source, cfg, {}, sessions.StopFlag()):
        if not frame.done:
            start = time.perf_counter()
            time.sleep(HOLD_S)  # as drawing would take
            held.append((start, time.perf_counter()))
    wall = time.perf_counter() - started
    trace = frame.trace
    assert len(held) >= 3 and len(trace.steps) > 0
    assert not [t for t in produced for a, b in held if a < t < b], "the engine produced a record while the page drew"
    holding = sum(b - a for a, b in held)
    # the run's clock left out the held time: what it counts and what the page held add up to at most the wall
    assert trace.total_s + 0.95 * holding < wall, "the page's time with the frames was counted as the run's"


def test_end_to_end_against_a_cached_reference_counts_the_runs_own_reading_of_the_input(tiny_pair, prompt_ids):
    """Target-only timed with the run finds the input in the prompt cache; its end to end counts the run's prefill
    without the draft's reading (the same target reading the same input), not its own ~0 s."""
    models, references = _Models(tiny_pair), page.References()
    settings = Settings(max_new_tokens=8, target="tiny")
    article = "w1 w2 w3 w4 w5 w6 w7 w8"
    *_, last = page.stream_run(models, SUMMARIZE, article, settings, lambda m, f: None, sessions.StopFlag(),
                               with_reference=True)
    spec, reference = last.trace, last.reference
    by_model = spec.meta["prefill_s_by_model"]
    assert set(by_model) == {"target", "draft"} and sum(by_model.values()) <= spec.prefill_s + 1e-9
    assert reference.mode == "target-only" and reference.new_tokens == 8
    assert reference.meta["prompts_reused"] == 1  # it found the input the run had read in the prompt cache
    ref = page.new_reference(references, SUMMARIZE, article, settings, spec, reference)
    assert ref["prefill_timed_in_the_run"] and ref["prefill_s"] == pytest.approx(spec.prefill_s - by_model["draft"])
    decode_s = ref["new_tokens"] / ref["decode_tokens_per_s"]
    assert ref["tokens_per_s"] == pytest.approx(ref["new_tokens"] / (ref["prefill_s"] + decode_s))
    spec.meta["target_only"] = ref
    assert "target-only's counted as this run's without the draft's" in report.summary_markdown(spec)


def test_the_run_and_its_reference_take_turns_and_keep_their_own_clocks(tiny_pair, prompt_ids, monkeypatch):
    """With a reference, target-only starts once the run has read its input and the two alternate (several
    switches over a long run); each trace is what the same settings decode alone, and each clock counts only its
    own decoding (the sum of both runs' times stays within the wall time)."""
    monkeypatch.setattr(page, "TURN_S", 0.02)
    seen = []

    def order(*args, target_only=False, **kwargs):
        for event in page_records(*args, target_only=target_only, **kwargs):
            seen.append("reference" if target_only else "shown")
            yield event

    page_records = page.records
    monkeypatch.setattr(page, "records", order)
    source = prompts_source(tiny_pair, [prompt_ids])
    cfg = SpecConfig(sampling=SAMPLED, max_new_tokens=80, gamma_policy="constant", gamma_init=2)
    started = time.perf_counter()
    *_, last = page._streamed(source, cfg, {}, sessions.StopFlag(), with_reference=True)
    wall = time.perf_counter() - started
    switches = sum(a != b for a, b in zip(seen, seen[1:]))
    assert seen[0] == "shown" and switches >= 4, (switches, seen[:20])
    alone = run(source, cfg, target_only=True)
    assert last.reference.outputs == alone.outputs and last.trace.outputs == run(source, cfg).outputs
    assert last.trace.total_s + last.reference.total_s < wall


def test_a_closed_stream_stops_its_worker(tiny_pair, prompt_ids):
    """Gradio dropping the generator (a closed tab) must not leave the decoding thread running."""
    source = prompts_source(tiny_pair, [prompt_ids])
    cfg = SpecConfig(sampling=SAMPLED, max_new_tokens=200, gamma_policy="constant", gamma_init=2)
    stop = sessions.StopFlag()
    before = threading.active_count()
    stream = page._streamed(source, cfg, {}, stop)
    next(stream)
    stream.close()
    assert stop.is_set() and "stopped reading" in stop.reason
    deadline = time.time() + 30
    while threading.active_count() > before and time.time() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= before


def test_stops_table_is_per_session():
    stops = sessions.Stops()
    a, b = stops.start("a"), stops.start("b")
    assert stops.stop("a", "Stop pressed") and a.is_set() and a.reason == "Stop pressed" and not b.is_set()
    stops.end("b", b)
    assert not stops.stop("b", "late") and not b.is_set()
    newer = stops.start("a")
    stops.end("a", a)  # an old run ending does not remove the session's newer run
    assert stops.stop("a", "again") and newer.is_set()


def test_reference_is_measured_once_and_reused(tiny_pair):
    models, references = _Models(tiny_pair), page.References()
    settings = Settings(max_new_tokens=8, target="tiny")
    article = "w1 w2 w3 w4 w5 w6"
    *_, last = page.stream_run(models, SUMMARIZE, article, settings, lambda m, f: None, sessions.StopFlag(),
                               with_reference=True)
    assert page.known_reference(references, SUMMARIZE, article, settings, last.trace) is None
    first = page.new_reference(references, SUMMARIZE, article, settings, last.trace, last.reference)
    again = page.known_reference(references, SUMMARIZE, article, settings, last.trace)
    assert not first["reused"] and again["reused"] and first["decode_tokens_per_s"] == again["decode_tokens_per_s"]
    assert first["new_tokens"] == 8
    other = page.References.key(SUMMARIZE, article, Settings(max_new_tokens=8, target="tiny", seed=1))
    assert other != page.References.key(SUMMARIZE, article, settings)  # another seed is another reference
    draft_only = Settings(max_new_tokens=8, target="tiny", mode="sigmoid", draft_kind="lookup")
    assert page.References.key(SUMMARIZE, article, draft_only) == page.References.key(SUMMARIZE, article, settings)


def test_measured_speedup_is_labelled_as_measured(tiny_pair, prompt_ids):
    source = prompts_source(tiny_pair, [prompt_ids])
    cfg = SpecConfig(sampling=SAMPLED, max_new_tokens=12)
    trace = run(source, cfg)
    assert "Speedup not measured" in report.summary_markdown(trace)
    reference = run(source, cfg, target_only=True)
    trace.meta["target_only"] = report.reference_meta(reference, reused=False, measured_at=time.time())
    speedup = report.measured_speedup(trace)
    assert speedup.decode == pytest.approx(trace.decode_tokens_per_s / reference.decode_tokens_per_s)
    assert speedup.end_to_end == pytest.approx(trace.tokens_per_s / reference.tokens_per_s)
    text = report.summary_markdown(trace)
    assert f"Measured: {speedup.decode:.2f}×" in text and f"{speedup.end_to_end:.2f}× end to end" in text
    assert f"decoding {trace.decode_s:.2f} s" in text


def test_compare_rounds_report_spread(tiny_pair, prompt_ids):
    source = prompts_source(tiny_pair, [prompt_ids])
    rows, traces = compare(source_runner(source), SpecConfig(sampling=SAMPLED, max_new_tokens=8), repeat=3)
    assert [r.name for r in rows] == ["target-only", "baseline", "exact", "sigmoid"]
    for r in rows:
        assert len(r.tokens_per_s_runs) == 3
        assert r.speedup_end_to_end_min <= r.speedup_end_to_end <= r.speedup_end_to_end_max
    assert rows[0].speedup_end_to_end_min == rows[0].speedup_end_to_end_max == rows[0].speedup_decode == 1.0
    assert noise(rows) >= 0
    note = report.compare_note(3, 0.4, "sampling")
    assert "3 interleaved rounds" in note and "noisy" in note


def test_a_compare_row_predicts_round_by_round_as_it_measures(tiny_pair, prompt_ids):
    """The row's prediction pairs round r's run with round r's target-only, as its measured speedup does (the
    median of per-round figures), not the median run with the median reference: the host drifts between rounds
    by more than a prediction's own error."""
    import statistics

    from specviz.runs.compare import _row
    from specviz.traces.prediction import predict

    source = prompts_source(tiny_pair, [prompt_ids])
    runner = source_runner(source)
    cfg = SpecConfig(sampling=SAMPLED, max_new_tokens=12, gamma_policy="constant", gamma_init=3)
    references = [runner(cfg, True) for _ in range(3)]
    runs = [runner(cfg, False) for _ in range(3)]
    row = _row("exact", runs, references)
    by_round = [predict(t, ref.decode_tokens_per_s).speedup for t, ref in zip(runs, references)]
    assert row.predicted_speedup == pytest.approx(statistics.median(by_round))
    assert row.speedup_decode == pytest.approx(statistics.median(
        t.decode_tokens_per_s / ref.decode_tokens_per_s for t, ref in zip(runs, references)))


def test_settings_restore_from_page_and_cli_traces(tiny_pair, prompt_ids):
    settings = Settings(mode="sigmoid", temperature=0.5, sequences=2, max_new_tokens=64, draft_vocab="4096")
    assert Settings.from_meta({"page_settings": settings.to_dict()}) == settings
    hostile = {"page_settings": {"mode": "<img src=x>", "temperature": 99.0, "draft_vocab": "7", "seed": True,
                                 "max_new_tokens": 64, "draft": ""}}
    restored = Settings.from_meta(hostile)
    assert restored == Settings(max_new_tokens=64)
    cli = decode(tiny_pair, [prompt_ids], SpecConfig(mode="baseline", max_new_tokens=24, seed=3))
    from_cli = Settings.from_meta(cli.meta)
    assert (from_cli.mode, from_cli.decoding, from_cli.max_new_tokens, from_cli.seed) == ("baseline", "greedy", 24, 3)


def test_sigmoid_warning_only_when_far(tiny_pair, prompt_ids):
    source = prompts_source(tiny_pair, [prompt_ids])
    far = run(source, SpecConfig(mode="sigmoid", sampling=SAMPLED, max_new_tokens=12))
    assert "far from exact" in report.sigmoid_warning(far)
    assert report.sigmoid_warning(run(source, SpecConfig(sampling=SAMPLED, max_new_tokens=12))) == ""
    # a narrower range brings p̂ closer to p (the measurement follows the setting)
    near = run(source, SpecConfig(mode="sigmoid", sampling=SAMPLED, max_new_tokens=12, sigmoid_alpha=-2,
                                  sigmoid_beta=2))
    gap = near.sigmoid_gap()
    assert gap is not None and gap["mean_tv"] < far.sigmoid_gap()["mean_tv"]


@pytest.mark.parametrize("task, rounds, with_hf, message", [
    (SUMMARIZE, 0, False, "1 to 10 rounds"),
    (SUMMARIZE, 11, False, "1 to 10 rounds"),
    (TRANSCRIBE, 1, True, "text with one sequence"),
])
def test_compare_refuses_bad_settings_with_a_message(tiny_pair, task, rounds, with_hf, message):
    from specviz.text.prompts import InputError

    models = _Models(tiny_pair)
    models.speech = lambda draft, target, progress: pytest.fail("no model may load for a refused comparison")
    with pytest.raises(InputError, match=message):
        page.compare_modes(models, task, "w1 w2 w3", Settings(max_new_tokens=8), lambda m, f: None,
                           lambda name: None, rounds=rounds, with_hf=with_hf)
