"""The page on a device, checked on the CPU: its --device reaches the model loaders, ZeroGPU's `spaces.GPU` holds
the handlers that decode only where `spaces` imports and the models run on CUDA, the traces say which path
verified, and kernels/cuda/page_check.py (the GPU machine's check of the running page) passes here with --device
cpu on tiny random Qwen2 models with the real Qwen tokenizer."""

from __future__ import annotations

import argparse
import inspect
import json
import shutil
import subprocess
import sys
import types
from functools import partial
from pathlib import Path

import pytest
import torch

from specviz.config import SamplingConfig, SpecConfig
from specviz.page import actions as page, handlers, sessions, zerogpu

ROOT = Path(__file__).resolve().parents[1]


class FakeSpaces:
    """A stand-in for the `spaces` package: GPU(duration=...) records what it was asked to hold and each call."""

    def __init__(self):
        self.held: list[tuple[object, int]] = []  # (function, duration)
        self.calls: list[object] = []
        self.module = types.ModuleType("spaces")
        self.module.GPU = self.GPU

    def GPU(self, duration: int = 60):
        def decorate(fn):
            self.held.append((fn, duration))

            def held(*args, **kwargs):
                self.calls.append(fn)
                return fn(*args, **kwargs)
            return held
        return decorate


@pytest.fixture
def fake_spaces(monkeypatch) -> FakeSpaces:
    fake = FakeSpaces()
    monkeypatch.setitem(sys.modules, "spaces", fake.module)
    return fake


@pytest.fixture
def no_spaces(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "spaces", None)  # `import spaces` raises ImportError


def _streaming(values, caller):
    yield {"status": "one"}
    yield {"status": "two"}


def _plain(values):
    return {"status": "plain"}


def test_without_spaces_the_handlers_are_the_plain_functions(no_spaces):
    assert zerogpu.decorator("cuda") is None and zerogpu.decorator("cuda:0") is None
    assert zerogpu.on_gpu(_streaming, "run", zerogpu.decorator("cuda")) is _streaming


def test_with_spaces_on_the_cpu_nothing_changes(fake_spaces):
    assert zerogpu.decorator("cpu") is None
    assert zerogpu.on_gpu(_plain, "compare", zerogpu.decorator("cpu")) is _plain
    assert not fake_spaces.held


def test_with_spaces_on_cuda_a_handler_is_held_on_the_gpu_and_still_streams(fake_spaces):
    gpu = zerogpu.decorator("cuda")
    assert gpu is fake_spaces.module.GPU
    streamed = zerogpu.on_gpu(_streaming, "run", gpu)
    assert streamed is not _streaming and inspect.isgeneratorfunction(streamed)  # the wiring streams it
    assert fake_spaces.held == [(_streaming, zerogpu.SECONDS["run"])]
    assert [u["status"] for u in streamed({}, None)] == ["one", "two"] and fake_spaces.calls == [_streaming]
    plain = zerogpu.on_gpu(_plain, "compare", gpu)
    assert not inspect.isgeneratorfunction(plain) and plain({}) == {"status": "plain"}
    assert fake_spaces.held[-1] == (_plain, zerogpu.SECONDS["compare"]) and fake_spaces.calls[-1] is _plain


def _built_handlers(fake: FakeSpaces) -> set:
    return {fn.func for fn, _ in fake.held if isinstance(fn, partial)}


DECODING = {handlers.run, handlers.compare, handlers.evaluate, handlers.rerun}


def test_the_page_holds_exactly_its_decoding_handlers_on_the_gpu(fake_spaces, monkeypatch):
    from specviz.page import app

    monkeypatch.setattr(page, "device_summary", lambda device=None: f"device {device}")  # no GPU to name here
    app.build(sessions.ModelCache(loader=lambda *a, **k: None, device="cuda"))
    assert _built_handlers(fake_spaces) == DECODING
    assert {d for _, d in fake_spaces.held} == {zerogpu.SECONDS[n] for n in ("run", "compare", "evaluate", "rerun")}


def test_the_page_on_the_cpu_holds_nothing_even_with_spaces(fake_spaces):
    from specviz.page import app

    app.build(sessions.ModelCache(loader=lambda *a, **k: None, device="cpu"))
    assert not fake_spaces.held


def test_the_page_hands_its_device_to_the_loaders():
    seen = []

    def loader(draft, target, **kwargs):
        seen.append(kwargs)
        return "pair"

    def progress(message, fraction):
        pass

    sessions.ModelCache(loader=loader, device="cpu").text("d", "t", progress)
    sessions.ModelCache(loader=loader).text("d", "t", progress)
    assert [sorted(k) for k in seen] == [["device", "progress"], ["progress"]] and seen[0]["device"] == "cpu"


def test_the_device_flag_is_checked_at_the_start():
    from specviz.page import app

    assert app._device("cpu") == "cpu"
    with pytest.raises(argparse.ArgumentTypeError):
        app._device("no-such-device")
    if not torch.cuda.is_available():
        with pytest.raises(argparse.ArgumentTypeError, match="no CUDA device"):
            app._device("cuda")


def test_the_trace_says_which_path_verifies():
    sampled = SpecConfig(sampling=SamplingConfig(temperature=0.8))
    cpu = torch.device("cpu")
    exact = page.verification("exact", sampled, cpu)
    assert exact["path"] in ("torch + C++ passes", "torch") and exact["device"] == "cpu"
    assert not exact["cuda_kernels_active"] and exact["backend"] == "auto"
    assert page.verification("sigmoid", sampled, cpu)["path"] == "torch"
    assert page.verification("baseline", sampled, cpu)["path"] == "torch"
    assert page.verification("exact", SpecConfig(), cpu)["path"] == "torch"  # greedy: argmaxes on torch
    assert page.verification("target-only", sampled, cpu)["path"] == "none"


def _tiny_qwen_dirs(root: Path, tokenizer_dir: Path) -> tuple[Path, Path]:
    """Random-weight Qwen2 draft (1 layer) and target (2 layers) with the real vocabulary, saved in bf16 as the
    GPU machine's are, each with the embedded pair's tokenizer files."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    for seed, role, layers in ((1, "draft", 1), (0, "target", 2)):
        config = Qwen2Config(vocab_size=151_936, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                             tie_word_embeddings=True, bos_token_id=151_643, eos_token_id=151_645,
                             initializer_range=0.2)
        torch.manual_seed(seed)
        Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(root / role)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(tokenizer_dir / name, root / role / name)
    return root / "draft", root / "target"


@pytest.mark.real  # the tokenizer comes from the embedded draft's cache (converted on first use)
def test_the_page_check_passes_on_the_cpu(tmp_path):
    from specviz.models.loading import DEFAULT_DRAFT, ensure_embedded

    draft, target = _tiny_qwen_dirs(tmp_path / "models", ensure_embedded(DEFAULT_DRAFT))
    out = tmp_path / "out" / "page.json"
    done = subprocess.run([sys.executable, str(ROOT / "kernels" / "cuda" / "page_check.py"), "--target", str(target),
                           "--draft", str(draft), "--device", "cpu", "--tokens", "24", "--compare-tokens", "16",
                           "--json", str(out), "--start-timeout", "180", "--call-timeout", "240"],
                          capture_output=True, text=True, timeout=600)
    seen = json.loads(out.read_text())
    assert done.returncode == 0 and seen["page_run_ok"] is True, (seen.get("error"), seen.get("app_log_tail"))
    assert seen["run"]["mode"] == "exact" and seen["run"]["temperature"] == 0.8 and seen["run"]["device"] == "cpu"
    assert 0 < seen["run"]["new_tokens"] <= 24 and seen["run"]["verification"]["path"] != "cuda kernels"
    assert set(seen["compare"]["runs"]) == {"baseline", "exact", "sigmoid"}
    assert {"target-only", "baseline", "exact", "sigmoid"} <= set(seen["compare"]["rows"])
    assert seen["compare"]["runs"]["baseline"]["verification"]["path"] == "torch"
