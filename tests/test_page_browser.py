"""The page in a real browser: Playwright drives Debian's Chromium (headless) against `python app.py`.

Text runs use tiny random models saved to local directories (typed into the page's model fields, the same
path a user with local checkpoints takes); one test runs the embedded pair; speech uses the embedded
Whisper base. A screenshot of each run lands in $SPECVIZ_SCREENSHOTS (default: a pytest temp dir). The README's
gradio_client example runs, as written, against the same server at the end.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from specviz.traces.json_format import load_trace

from conftest import save_tiny_pair

playwright_api = pytest.importorskip("playwright.sync_api")
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
pytestmark = [pytest.mark.browser, pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian chromium not installed")]
ROOT = Path(__file__).resolve().parent.parent
RUN_TIMEOUT_MS = 240_000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> tuple[str, str]:
    return save_tiny_pair(tmp_path_factory.mktemp("page-models"))


@pytest.fixture(scope="module")
def app_log(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("app") / "app.log"


@pytest.fixture(scope="module")
def app_url(app_log, tmp_path_factory):
    port = _free_port()
    log = app_log
    elsewhere = tmp_path_factory.mktemp("cwd")  # started from another directory, as users do
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(ROOT / "app.py"), "--port", str(port)], cwd=elsewhere, stdout=out,
                                stderr=subprocess.STDOUT, env={**os.environ, "GRADIO_ANALYTICS_ENABLED": "False"})
    url = f"http://127.0.0.1:{port}/"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2)
            break
        except OSError:
            if proc.poll() is not None:
                pytest.fail(f"app.py exited: {log.read_text()[-3000:]}")
            time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail(f"app.py did not start: {log.read_text()[-3000:]}")
    yield url
    proc.terminate()
    proc.wait(timeout=20)


@pytest.fixture(scope="module")
def browser():
    with playwright_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync"])
        yield b
        b.close()


@pytest.fixture
def page(browser, app_url):
    context = browser.new_context(viewport={"width": 1400, "height": 1800}, accept_downloads=True)
    pg = context.new_page()
    pg.goto(app_url)
    pg.wait_for_selector("#run-button")
    pg.wait_for_timeout(1000)  # Gradio hydrates after the first paint; typing earlier is lost
    yield pg
    context.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    out = Path(os.environ.get("SPECVIZ_SCREENSHOTS") or tmp_path_factory.mktemp("screenshots"))
    out.mkdir(parents=True, exist_ok=True)
    return out


MORE = "More: sigmoid range, lenience, drafts, models, references"


def _use_models(pg, draft: str, target: str, measure: bool = False) -> None:
    """Type the model paths; the target-only reference is off unless a test is about it (it doubles a run)."""
    if not measure:
        pg.locator("#measure-speedup input").uncheck()
    pg.get_by_text(MORE).click()
    for box, value in (("#draft-model textarea", draft), ("#target-model textarea", target)):
        pg.wait_for_selector(box, state="visible")
        for _ in range(5):  # the accordion's first render can reset a value typed into it
            pg.fill(box, value)
            pg.press(box, "Tab")  # blur: Gradio commits the value
            pg.wait_for_timeout(200)
            if pg.input_value(box) == value:
                break
        assert pg.input_value(box) == value


def _click_and_wait(pg, button: str, pattern: str = "Done|⚠") -> str:
    """Click, then wait for a new status line (they carry the time) that matches pattern."""
    before = _status(pg)
    pg.click(button)
    pg.wait_for_function(
        "([old, pat]) => { const s = document.querySelector('#status .sv-status');"
        " return s && s.innerText !== old && new RegExp(pat).test(s.innerText); }",
        arg=[before, pattern], timeout=RUN_TIMEOUT_MS)
    return _status(pg)


def _status(pg) -> str:
    """The status line's message (without Gradio's progress overlay)."""
    return pg.inner_text("#status .sv-status")


def _run_text(pg, max_new: int = 24) -> str:
    pg.fill("#article-input textarea", "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12")
    pg.locator("#max-new-tokens input[type=number]").fill(str(max_new))
    return _click_and_wait(pg, "#run-button")


def test_summarize_shows_tokens_and_plots_then_switch_mode(page, tiny_dirs, shots):
    _use_models(page, *tiny_dirs)
    status = _run_text(page)
    assert "Done" in status, status
    assert page.locator("#token-view .sv-line").count() >= 2
    assert page.locator("#token-view .sv-tok.sv-accepted, #token-view .sv-tok.sv-bonus").count() > 0
    # a verified draft's tooltip (the cost policy may begin with a plain step, whose token nothing verified)
    drafted = "#token-view .sv-line .sv-tok.sv-accepted, #token-view .sv-line .sv-tok.sv-rejected"
    tip = page.locator(drafted).first.get_attribute("title")
    assert "p(x)=" in tip and "q(x)=" in tip and "uniform=" in tip
    for plot in ("#gamma-plot", "#acceptance-plot", "#timing-plot", "#verify-plot", "#theory-plot"):
        page.wait_for_selector(f"{plot} .js-plotly-plot", timeout=30_000)
    summary = page.inner_text("#run-summary")
    assert "tokens/s decoding" in summary and "prefill" in summary and "Speedup not measured" in summary
    page.screenshot(path=str(shots / "summarize-tiny.png"), full_page=True)

    page.locator("#mode-select input[value=baseline]").check()
    page.fill("#article-input textarea", "w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15")
    status = _click_and_wait(page, "#run-button")
    assert "Done" in status, status
    page.wait_for_function("() => /^baseline ·/m.test(document.querySelector('#run-summary').innerText)",
                           timeout=30_000)


def test_export_and_reload_trace(page, tiny_dirs, tmp_path):
    """The export is named after task, mode and time and pretty-printed; loading it in a new session redraws
    the same view, restores its settings and input, and enables Export again."""
    _use_models(page, *tiny_dirs)
    page.locator("#mode-select input[value=baseline]").check()
    assert "Done" in _run_text(page)
    before = page.inner_html("#token-view .sv-tokens")
    with page.expect_download() as download:
        page.click("#export-button")
    assert re.fullmatch(r"specviz-summarize-baseline-\d{8}-\d{4}\.json", download.value.suggested_filename)
    path = tmp_path / "trace.json"
    download.value.save_as(path)
    assert path.read_text().startswith('{\n  "meta"')
    data = json.loads(path.read_text())
    assert data["schema_version"] == 3
    trace = load_trace(path)  # validates every field
    assert trace.new_tokens == 24 and trace.steps and trace.meta["page_settings"]["mode"] == "baseline"

    fresh = page.context.new_page()  # a new session: no model run, only the file
    fresh.goto(page.url)
    fresh.wait_for_selector("#trace-upload")
    fresh.wait_for_timeout(1000)
    assert fresh.locator("#mode-select input[value=exact]").is_checked()
    fresh.set_input_files("#trace-upload input[type=file]", str(path))
    fresh.wait_for_function("() => /Loaded trace/.test(document.querySelector('#status .sv-status').innerText)",
                            timeout=60_000)
    assert fresh.inner_html("#token-view .sv-tokens") == before
    fresh.wait_for_selector("#gamma-plot .js-plotly-plot", timeout=30_000)
    assert fresh.locator("#mode-select input[value=baseline]").is_checked()
    assert fresh.input_value("#article-input textarea") == "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12"
    assert fresh.locator("#max-new-tokens input[type=number]").input_value() == "24"
    with fresh.expect_download() as again:
        fresh.click("#export-button")
    assert load_trace(again.value.path()).outputs == trace.outputs


def test_three_sequences_show_three_lanes(page, tiny_dirs, shots):
    """Sequences = 3 with sampling: one batch, each iteration shows a lane per sequence under one target
    call, the batch figure and the raggedness figures appear."""
    _use_models(page, *tiny_dirs)
    page.locator("#decoding-select input[value=sample]").check()
    page.locator("#num-sequences input[type=number]").fill("3")
    page.locator("#num-sequences input[type=number]").press("Tab")
    status = _run_text(page, max_new=16)
    assert "Done" in status, status
    lanes = page.locator("#token-view .sv-lane .sv-iter").all_inner_texts()
    assert {text.split()[0] for text in lanes} == {"s1", "s2", "s3"}
    first_call = page.locator("#token-view .sv-step").first.inner_text()
    assert "one target call for 3 sequences" in first_call
    page.wait_for_selector("#batch-plot .js-plotly-plot", timeout=30_000)
    summary = page.inner_text("#run-summary")
    assert "3 sequences, batch of 3" in summary and "padding" in summary
    page.screenshot(path=str(shots / "summarize-three-lanes.png"), full_page=True)


def _hostile_strings(node, payloads, keep=("outcome", "next_kind", "finish", "drafter")):
    """Every free-text string of a trace replaced by markup (enumerated fields keep their values)."""
    if isinstance(node, dict):
        return {k: v if k in keep else _hostile_strings(v, payloads, keep) for k, v in node.items()}
    if isinstance(node, list):
        return [_hostile_strings(v, payloads, keep) for v in node]
    if isinstance(node, str):
        payloads.append(payloads.pop(0))
        return payloads[-1]
    return node


def test_shared_trace_cannot_run_script(page, tiny_pair, batch_prompts, tmp_path):
    """A trace whose every string is markup (an image with onerror, an attribute-closing handler, a script)
    loads and draws in Chromium without running anything or injecting any element."""
    from conftest import decode
    from specviz.config import SamplingConfig, SpecConfig

    trace = decode(tiny_pair, batch_prompts[:2], SpecConfig(sampling=SamplingConfig(temperature=1.0), max_new_tokens=6))
    payloads = ['"><img src=x onerror="window.__pwned=1">', '" onmouseover="window.__pwned=2" x="',
                "<script>window.__pwned=3</script>", "</span><img src=x onerror=window.__pwned=4>"]
    data = _hostile_strings(trace.to_dict(), payloads)
    path = tmp_path / "hostile.json"
    path.write_text(json.dumps(data))
    page.set_input_files("#trace-upload input[type=file]", str(path))
    page.wait_for_function("() => /Loaded trace|⚠/.test(document.querySelector('#status .sv-status').innerText)",
                           timeout=60_000)
    assert "Loaded trace" in _status(page), _status(page)
    tokens = page.locator("#token-view .sv-tok")
    assert tokens.count() > 10
    for i in range(min(tokens.count(), 40)):  # the pointer crosses every token, as a reader's would
        tokens.nth(i).hover()
    page.wait_for_timeout(500)
    assert page.evaluate("() => window.__pwned === undefined")
    for where in ("#token-view", "#run-summary", "#status", "#output-text"):
        assert page.locator(f"{where} img, {where} script").count() == 0, where
    assert "onerror" in page.inner_text("#token-view")  # shown as text, not run


def test_corrupt_trace_shows_error(page, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": 99}')
    page.set_input_files("#trace-upload input[type=file]", str(bad))
    page.wait_for_function("() => /⚠/.test(document.querySelector('#status .sv-status').innerText)", timeout=60_000)
    assert "newer" in _status(page)


def test_empty_article_shows_error_and_page_stays_usable(page, tiny_dirs):
    _use_models(page, *tiny_dirs)
    page.fill("#article-input textarea", "   ")
    assert "article is empty" in _click_and_wait(page, "#run-button")
    assert "Done" in _run_text(page, max_new=8)  # still usable


def test_unloadable_model_shows_error(page):
    _use_models(page, "/no/such/draft", "/no/such/target")
    page.fill("#article-input textarea", "some text")
    assert "could not load the draft model" in _click_and_wait(page, "#run-button")


def test_transcribe_sample_audio(page, shots):
    page.get_by_role("tab", name="Transcribe").click()
    page.click("#sample-audio-button")
    page.wait_for_selector("#audio-input audio, #audio-input .waveform-container, #audio-input button", timeout=30_000)
    page.locator("#max-new-tokens input[type=number]").fill("96")
    page.locator("#measure-speedup input").uncheck()
    page.locator("#decoding-select input[value=greedy]").check()  # the words are checked: no sampling noise
    status = _click_and_wait(page, "#run-button")
    assert "Done" in status, status
    text = page.input_value("#output-text textarea").lower()
    assert "small model" in text and "guesses" in text
    assert "WER" in page.inner_text("#run-summary")
    page.screenshot(path=str(shots / "transcribe-sample.png"), full_page=True)


def test_non_audio_upload_shows_error(page, tmp_path):
    page.get_by_role("tab", name="Transcribe").click()
    fake = tmp_path / "notes.wav"
    fake.write_text("definitely not audio\n" * 50)
    page.set_input_files("#audio-input input[type=file]", str(fake))
    status = _click_and_wait(page, "#run-button")
    assert "⚠" in status and ("could not be decoded" in status or "audio" in status.lower()), status


@pytest.mark.real
def test_embedded_pair_summarizes_the_sample(page, shots):
    page.click("#sample-article-button")
    page.wait_for_function("() => document.querySelector('#article-input textarea').value.length > 200")
    page.locator("#max-new-tokens input[type=number]").fill("48")
    status = _click_and_wait(page, "#run-button")
    assert "Done" in status, status
    # sampled, under the cost policy whose γ follows measured time: the words vary from run to run, the subject not
    output = page.input_value("#output-text textarea").lower()
    assert any(word in output for word in ("harbor", "bike", "bicycle", "cycl")), output
    assert page.locator("#token-view .sv-tok.sv-accepted").count() > 5
    page.screenshot(path=str(shots / "summarize-embedded.png"), full_page=True)


def _wait_status(pg, pattern: str, timeout: int = RUN_TIMEOUT_MS) -> str:
    pg.wait_for_function("(pat) => new RegExp(pat).test(document.querySelector('#status .sv-status').innerText)",
                         arg=pattern, timeout=timeout)
    return _status(pg)


def test_clicking_tokens_explains_each_decision(page, tiny_dirs, shots):
    """A rejected draft's panel gives the verdict in numbers and the distributions; the resampled token's names
    the residual it came from; a discarded draft says it was never examined."""
    _use_models(page, *tiny_dirs)
    assert "Done" in _run_text(page, max_new=32)
    rejected = page.locator("#token-view .sv-rejected.sv-click")
    assert rejected.count() > 0, "sampling with this pair rejects some drafts"
    rejected.first.click()
    page.wait_for_function("() => /: rejected/.test(document.querySelector('#why-panel').innerText)", timeout=30_000)
    why = page.inner_text("#why-panel")
    assert re.search(r"u = 0\.\d+ > p\(x\)/q\(x\) = \d\.\d+: rejected", why), why
    assert "target p" in why and "draft q" in why and "residual" in why and "other tokens" in why
    page.screenshot(path=str(shots / "why-rejected.png"), full_page=True)
    page.locator("#token-view .sv-resampled.sv-click").first.click()
    page.wait_for_function("() => /drawn from the residual/.test(document.querySelector('#why-panel').innerText)",
                           timeout=30_000)
    discarded = page.locator("#token-view .sv-discarded.sv-click")
    if discarded.count():
        discarded.first.click()
        page.wait_for_function("() => /never examined/.test(document.querySelector('#why-panel').innerText)",
                               timeout=30_000)


def test_replay_slider_moves_every_view(page, tiny_dirs):
    _use_models(page, *tiny_dirs)
    assert "Done" in _run_text(page, max_new=32)
    lanes = page.locator("#token-view .sv-lane").count()
    assert lanes >= 3
    box = page.locator("#replay-slider input[type=number]")
    assert box.input_value() == str(lanes)
    box.fill("1")
    box.press("Enter")
    page.wait_for_function("() => document.querySelectorAll('#token-view .sv-lane').length === 1", timeout=30_000)
    assert "1 target forward" not in page.inner_text("#run-summary")  # the summary follows: 1 iteration + prefill
    assert "2 target forward passes" in page.inner_text("#run-summary")
    box.fill(str(lanes))
    box.press("Enter")
    page.wait_for_function(f"() => document.querySelectorAll('#token-view .sv-lane').length === {lanes}",
                           timeout=30_000)


def _start_long_run(pg) -> None:
    """Eight sampled sequences of 256 tokens: long enough with the tiny pair to stop it halfway."""
    pg.locator("#num-sequences input[type=number]").fill("8")
    pg.locator("#num-sequences input[type=number]").press("Tab")
    pg.fill("#article-input textarea", "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12")
    pg.locator("#max-new-tokens input[type=number]").fill("256")
    pg.click("#run-button")
    _wait_status(pg, "Decoding… iteration [1-9]")


def test_stop_ends_the_run_and_keeps_the_partial_trace(page, tiny_dirs, tmp_path):
    _use_models(page, *tiny_dirs)
    _start_long_run(page)
    assert page.locator("#run-button").is_disabled() and page.locator("#compare-button").is_disabled()
    page.click("#stop-button")
    status = _wait_status(page, "Stopped|Done|⚠", timeout=60_000)
    assert status.split("] ", 1)[1].startswith("Stopped"), status
    assert "Stopped" in page.inner_text("#run-summary")
    page.wait_for_function("() => !document.querySelector('#run-button').disabled", timeout=30_000)
    with page.expect_download() as download:
        page.click("#export-button")
    trace = load_trace(download.value.path())
    assert trace.meta["stopped"] is True and trace.steps
    assert trace.new_tokens < 8 * 256


def test_a_closed_tab_stops_its_run(browser, app_url, app_log, tiny_dirs):
    context = browser.new_context(viewport={"width": 1400, "height": 1800})
    pg = context.new_page()
    pg.goto(app_url)
    pg.wait_for_selector("#run-button")
    pg.wait_for_timeout(1000)
    _use_models(pg, *tiny_dirs)
    before = app_log.read_text().count("run stopped after")
    _start_long_run(pg)
    context.close()  # the tab goes away mid-run
    deadline = time.time() + 60
    while time.time() < deadline:
        log = app_log.read_text()
        if log.count("run stopped after") > before:
            break
        time.sleep(0.5)
    assert log.count("run stopped after") > before, log[-2000:]
    assert "browser session closed" in log or "stopped reading" in log


def test_sampled_sigmoid_shows_its_distance_from_exact(page, tiny_dirs):
    _use_models(page, *tiny_dirs)
    page.locator("#mode-select input[value=sigmoid]").check()
    assert "Done" in _run_text(page, max_new=16)
    warning = page.inner_text("#sigmoid-warning")
    assert "sigmoid is far from exact here" in warning and "would have accepted" in warning, warning


def test_measured_speedup_against_target_only(page, tiny_dirs):
    _use_models(page, *tiny_dirs, measure=True)
    page.fill("#article-input textarea", "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12")
    page.locator("#max-new-tokens input[type=number]").fill("16")
    page.click("#run-button")
    _wait_status(page, "speedup measured|⚠")
    summary = page.inner_text("#run-summary")
    assert re.search(r"Measured: \d+\.\d\d× target-only's decoding speed", summary), summary
    page.wait_for_selector("#theory-plot .js-plotly-plot", timeout=30_000)
    assert "measured (vs target-only)" in page.inner_html("#theory-plot")


def test_compare_rounds_show_spread_and_open_a_run(page, tiny_dirs, shots):
    _use_models(page, *tiny_dirs)
    page.fill("#article-input textarea", "w1 w2 w3 w4 w5 w6 w7 w8")
    page.locator("#max-new-tokens input[type=number]").fill("16")
    page.locator("#compare-rounds input[type=number]").fill("2")
    page.locator("#compare-rounds input[type=number]").press("Tab")
    _click_and_wait(page, "#compare-button", "Comparison done|⚠")
    table = page.inner_text("#compare-table")
    for name in ("target-only", "baseline", "exact", "sigmoid"):
        assert name in table
    assert re.search(r"\d\.\d+–\d\.\d+", table), table  # the min–max speedup column
    note = page.inner_text("#compare-note")
    assert "2 interleaved rounds" in note and "sigmoid vs exact" in note and "sampled" in note
    page.wait_for_selector("#compare-plot .js-plotly-plot", timeout=30_000)
    page.screenshot(path=str(shots / "compare-tiny.png"), full_page=True)
    page.locator("#compare-trace-select input").click()
    page.get_by_role("option", name="sigmoid").click()
    page.click("#open-compare-trace")
    _wait_status(page, "Opened the sigmoid run", timeout=60_000)
    assert re.search(r"^sigmoid ·", page.inner_text("#run-summary"), re.M)  # the line after the glance cards
    assert page.locator("#mode-select input[value=sigmoid]").is_checked()
    with page.expect_download() as download:
        page.click("#export-button")
    assert "sigmoid" in download.value.suggested_filename


def test_phone_viewport(browser, app_url, tiny_dirs, shots):
    """390 × 844: no sideways scrolling of the page; the token view scrolls as a whole; a tap explains."""
    context = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True)
    pg = context.new_page()
    pg.goto(app_url)
    pg.wait_for_selector("#run-button")
    pg.wait_for_timeout(1000)
    _use_models(pg, *tiny_dirs)
    assert "Done" in _run_text(pg)
    assert pg.evaluate("() => document.documentElement.scrollWidth") <= 390
    pg.locator("#token-view .sv-rejected.sv-click, #token-view .sv-accepted.sv-click").first.tap()
    pg.wait_for_function("() => /u = /.test(document.querySelector('#why-panel').innerText)", timeout=30_000)
    pg.screenshot(path=str(shots / "phone.png"), full_page=True)
    context.close()


def test_evaluate_tab_runs_a_small_sweep_then_reloads_its_results(page, tiny_dirs, shots, tmp_path):
    _use_models(page, *tiny_dirs)
    page.get_by_role("tab", name="Evaluate").click()
    page.locator("#eval-examples input[type=number]").fill("1")
    page.locator("#eval-examples input[type=number]").press("Tab")
    assert "Done: 4 of 4 runs" in _click_and_wait(page, "#eval-button", "Done:|⚠")
    table1 = page.inner_text("#eval-table1")
    for name in ("target-only", "baseline", "exact", "sigmoid", "ROUGE-1"):
        assert name in table1, table1
    assert "default" in page.inner_text("#eval-table2")
    page.wait_for_selector("#eval-tradeoff-plot .js-plotly-plot", timeout=30_000)
    page.wait_for_selector("#eval-gamma-plot .js-plotly-plot", timeout=30_000)
    page.screenshot(path=str(shots / "evaluate-tiny.png"), full_page=True)
    with page.expect_download() as download:
        page.click("#eval-download")
    saved = tmp_path / download.value.suggested_filename
    download.value.save_as(saved)
    assert saved.suffix == ".jsonl" and len(saved.read_text().splitlines()) == 5  # header + 4 cells
    page.set_input_files("#eval-upload input[type=file]", str(saved))
    _wait_status(page, "Loaded the sweep", timeout=60_000)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"kind": "sweep"}\n{"kind": "cell"}\n{"kind": "sweep"}\n')
    page.set_input_files("#eval-upload input[type=file]", str(bad))
    _wait_status(page, "⚠", timeout=60_000)
    assert "line 2" in _status(page)


# ---- the README's API example ------------------------------------------------------------------------------
# Here rather than in a module of its own: the page's server above has the embedded pair loaded by now, so the
# example does not pay for another server and another load of the pair (~30 s of the test command).


def _readme_api_example() -> str:
    section = (ROOT / "README.md").read_text(encoding="utf-8").split("## The API", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.real
def test_the_readme_api_example_runs_a_summary_and_downloads_its_trace(app_url, monkeypatch):
    """The README's gradio_client example, run as it is written against the running app on the embedded models."""
    code = _readme_api_example()
    assert 'api_name="/run"' in code and "Client(" in code
    code = code.replace('"http://127.0.0.1:7860/"', repr(app_url))
    monkeypatch.chdir(ROOT)  # the example opens assets/ as a reader of this README in a checkout would
    printed = io.StringIO()
    scope: dict = {}
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md (The API)", "exec"), scope)  # noqa: S102 (our own README)
    assert "Done: 24 tokens" in scope["status"] and "speedup measured" in scope["status"], scope["status"]
    trace = json.loads(Path(scope["trace_file"]).read_text(encoding="utf-8"))
    assert trace["meta"]["task"] == "summarize" and trace["meta"]["config"]["max_new_tokens"] == 24
    assert sum(len(s["output_ids"]) for s in trace["sequences"]) == 24
    assert trace["meta"]["target_only"]["tokens_per_s"] > 0  # the speedup was measured, not only predicted
    assert scope["status"] in printed.getvalue()
