"""The page in a real browser: Playwright drives Debian's Chromium (headless) against `python app.py`.

Text runs use tiny random models saved to local directories (typed into the page's model fields, the same
path a user with local checkpoints takes); one test runs the embedded pair; speech uses the embedded
Whisper base. A screenshot of each run lands in $SPECVIZ_SCREENSHOTS (default: a pytest temp dir).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from specviz.prompts import ASSETS
from specviz.trace import Trace

from conftest import VOCAB, perturbed_copy, save_tokenizer, tiny_llama, word_tokenizer

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
    root = tmp_path_factory.mktemp("page-models")
    target = tiny_llama(0)
    draft = perturbed_copy(target, noise=0.03, seed=1)
    tok = word_tokenizer(VOCAB - 64)  # reloading registers <eos> once more; the heads stay wider, as Qwen's do
    for name, model in (("draft", draft), ("target", target)):
        model.save_pretrained(root / name)
        save_tokenizer(tok, root / name)
    return str(root / "draft"), str(root / "target")


@pytest.fixture(scope="module")
def app_url(tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("app") / "app.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "app.py", "--port", str(port)], cwd=ROOT, stdout=out,
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


def _use_models(pg, draft: str, target: str) -> None:
    pg.get_by_text("Sampling, sigmoid, lenience, drafts, models").click()
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
    tip = page.locator("#token-view .sv-line .sv-tok").first.get_attribute("title")
    assert "p(x)=" in tip and "q(x)=" in tip and "uniform=" in tip
    for plot in ("#gamma-plot", "#acceptance-plot", "#timing-plot", "#theory-plot"):
        page.wait_for_selector(f"{plot} .js-plotly-plot", timeout=30_000)
    assert "tokens/s" in page.inner_text("#run-summary")
    page.screenshot(path=str(shots / "summarize-tiny.png"), full_page=True)

    page.locator("#mode-select input[value=baseline]").check()
    page.fill("#article-input textarea", "w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15")
    status = _click_and_wait(page, "#run-button")
    assert "Done" in status, status
    page.wait_for_function("() => /^baseline ·/m.test(document.querySelector('#run-summary').innerText)",
                           timeout=30_000)


def test_export_and_reload_trace(page, tiny_dirs, tmp_path):
    _use_models(page, *tiny_dirs)
    assert "Done" in _run_text(page)
    before = page.inner_html("#token-view .sv-tokens")
    with page.expect_download() as download:
        page.click("#export-button")
    path = tmp_path / "trace.json"
    download.value.save_as(path)
    data = json.loads(path.read_text())
    assert data["schema_version"] == 3
    trace = Trace.load(path)  # validates every field
    assert trace.new_tokens == 24 and trace.steps

    fresh = page.context.new_page()  # a new session: no model run, only the file
    fresh.goto(page.url)
    fresh.wait_for_selector("#trace-upload")
    fresh.set_input_files("#trace-upload input[type=file]", str(path))
    fresh.wait_for_function("() => /Loaded trace/.test(document.querySelector('#status .sv-status').innerText)",
                            timeout=60_000)
    assert fresh.inner_html("#token-view .sv-tokens") == before
    fresh.wait_for_selector("#gamma-plot .js-plotly-plot", timeout=30_000)


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


def test_compare_side_by_side(page, tiny_dirs, shots):
    _use_models(page, *tiny_dirs)
    page.fill("#article-input textarea", "w1 w2 w3 w4 w5 w6 w7 w8")
    page.locator("#max-new-tokens input[type=number]").fill("16")
    _click_and_wait(page, "#compare-button", "Comparison done|⚠")
    table = page.inner_text("#compare-table")
    for name in ("target-only", "baseline", "exact", "sigmoid"):
        assert name in table
    page.wait_for_selector("#compare-plot .js-plotly-plot", timeout=30_000)
    assert "sigmoid vs exact" in page.inner_text("#compare-note")
    page.screenshot(path=str(shots / "compare-tiny.png"), full_page=True)


def test_transcribe_sample_audio(page, shots):
    page.get_by_role("tab", name="Transcribe").click()
    page.click("#sample-audio-button")
    page.wait_for_selector("#audio-input audio, #audio-input .waveform-container, #audio-input button", timeout=30_000)
    page.locator("#max-new-tokens input[type=number]").fill("96")
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
    assert "Harbor" in page.input_value("#output-text textarea") or "bike" in page.input_value("#output-text textarea")
    assert page.locator("#token-view .sv-tok.sv-accepted").count() > 5
    page.screenshot(path=str(shots / "summarize-embedded.png"), full_page=True)
