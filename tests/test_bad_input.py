"""Bad input gets a clear message: empty or huge text, NaN logits, bad settings, CLI errors."""

from __future__ import annotations

import io

import pytest
import torch

from specviz.cli import commands as cli
from specviz import verify
from specviz.config import SamplingConfig, SpecConfig
from specviz.models.loading import ModelPair
from specviz.text.prompts import InputError, max_prompt_tokens, sample_article, summarization_prompt
from specviz.sampling import InvalidLogitsError

from conftest import VOCAB, decode, tiny_qwen


def test_empty_article(tokenizer):
    for text in ("", "   \n\t "):
        with pytest.raises(InputError, match="empty"):
            summarization_prompt(tokenizer, text, 1000)


def test_huge_article_is_refused_with_sizes(tokenizer):
    article = " ".join(f"w{i % 5000}" for i in range(3000))
    with pytest.raises(InputError, match=r"too long: its prompt is 3,\d{3} tokens .* at most 2,000"):
        summarization_prompt(tokenizer, article, 2000)
    assert max_prompt_tokens(32768, 128) == 16384 - 128


def test_sample_article_is_bundled():
    assert len(sample_article().split()) > 200


@pytest.mark.parametrize("mode", ["baseline", "exact", "sigmoid"])
@pytest.mark.parametrize("bad, what", [(float("nan"), "NaN"), (float("inf"), r"\+inf")])
def test_nan_and_inf_logits_are_named(mode, bad, what):
    g = torch.Generator().manual_seed(0)
    draft = torch.randn(2, 3, 50, generator=g)
    target = torch.randn(2, 4, 50, generator=g)
    target[1, 2, 17] = bad
    tokens = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(InvalidLogitsError, match=rf"target logits contain {what} at index \[1, 2\]"):
        verify(mode, tokens, draft, target, SamplingConfig(temperature=1.0), g)


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=0.7), SamplingConfig(temperature=0.7, top_k=5),
                                      SamplingConfig(temperature=0)], ids=["temperature", "top-k", "greedy"])
def test_exact_names_the_first_bad_row_on_each_of_its_paths(sampling):
    """exact checks its logits from the normalizers it computes (the C++ pass gives a bad row a non-finite one)
    where it runs there, up front elsewhere: the same message either way, the draft's before the target's."""
    g = torch.Generator().manual_seed(1)
    draft, target = torch.randn(3, 2, 40, generator=g), torch.randn(3, 3, 40, generator=g)
    tokens = torch.zeros(3, 2, dtype=torch.long)
    nan_draft, inf_target, masked_target = draft.clone(), target.clone(), target.clone()
    nan_draft[2, 1, 39] = float("nan")
    inf_target[1, 0, 3] = float("inf")
    masked_target[0, 2] = float("-inf")
    for d, t, message in [(nan_draft, target, r"draft logits contain NaN at index \[2, 1\]"),
                          (draft, inf_target, r"target logits contain \+inf at index \[1, 0\]"),
                          (draft, masked_target, r"target logits contain only -inf .* at index \[0, 2\]"),
                          (nan_draft, inf_target, r"draft logits contain NaN")]:
        with pytest.raises(InvalidLogitsError, match=message):
            verify("exact", tokens, d, t, sampling, g)
    assert verify("exact", tokens, draft, target, sampling, g).n_accepted.shape == (3,)  # valid logits pass


def test_all_masked_row_is_refused():
    draft = torch.randn(1, 2, 10)
    draft[0, 1] = float("-inf")
    with pytest.raises(InvalidLogitsError, match="only -inf"):
        verify("exact", torch.zeros(1, 2, dtype=torch.long), draft, torch.randn(1, 3, 10))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(draft_tokens=torch.zeros(1, 3)), "LongTensor"),
        (dict(target_logits=torch.randn(1, 3, 10)), "target_logits must be"),
        (dict(draft_logits=torch.randn(1, 3, 11)), "draft_logits must be|vocabularies differ"),
        (dict(draft_tokens=torch.full((1, 3), 10, dtype=torch.long)), r"lie in \[0, 10\)"),
        (dict(mode="fast"), "unknown verification mode"),
    ],
)
def test_verify_argument_errors(kwargs, message):
    args = dict(mode="exact", draft_tokens=torch.zeros(1, 3, dtype=torch.long),
                draft_logits=torch.randn(1, 3, 10), target_logits=torch.randn(1, 4, 10))
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        verify(args.pop("mode"), **args)


def test_model_emitting_nan_stops_with_message(tokenizer):
    """A broken target (NaN weights) is reported as such, in the loop and in the reference."""
    target = tiny_qwen(0)
    with torch.no_grad():
        target.lm_head.weight[5, 0] = float("nan")
    draft = tiny_qwen(1)
    pair = ModelPair(draft, target, tokenizer, "ok", "broken", VOCAB)
    with pytest.raises(InvalidLogitsError, match="target logits contain NaN"):
        decode(pair, [[1, 2, 3]], SpecConfig(max_new_tokens=5))
    with pytest.raises(InvalidLogitsError, match="target logits contain NaN"):
        decode(pair, [[1, 2, 3], [4, 5]], SpecConfig(max_new_tokens=5), target_only=True)


@pytest.mark.parametrize(
    "factory, message",
    [
        (lambda: SamplingConfig(temperature=-1), "temperature"),
        (lambda: SamplingConfig(top_p=0), "top_p"),
        (lambda: SpecConfig(mode="nope"), "unknown verification mode"),
        (lambda: SpecConfig(gamma_policy="nope"), "unknown γ policy"),
        (lambda: SpecConfig(lenience=0), "lenience"),
        (lambda: SpecConfig(sigmoid_alpha=1, sigmoid_beta=-1), "α"),
        (lambda: SpecConfig(max_new_tokens=0), "max_new_tokens"),
    ],
)
def test_bad_settings(factory, message):
    with pytest.raises(ValueError, match=message):
        factory()


def test_cli_empty_stdin_fails_fast(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("  \n"))
    assert cli.main(["generate", "-"]) == 2
    assert "article is empty" in capsys.readouterr().err


def test_cli_refuses_samples_with_greedy_and_bad_batch_sizes(tmp_path, capsys):
    article = tmp_path / "a.txt"
    article.write_text("Some text to summarize.")
    assert cli.main(["generate", str(article), "--num-sequences", "3"]) == 2
    assert "greedy" in capsys.readouterr().err
    assert cli.main(["generate", str(article), "--batch-size", "0"]) == 2
    assert "--batch-size" in capsys.readouterr().err
    assert cli.main(["generate", str(article), str(tmp_path / "missing.txt")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert cli.main(["compare", str(article), str(tmp_path / "clip.wav"), "--max-new-tokens", "4"]) == 2
    assert "not both" in capsys.readouterr().err


def test_cli_missing_and_binary_files(tmp_path, capsys):
    assert cli.main(["compare", str(tmp_path / "missing.txt")]) == 2
    assert "no such file" in capsys.readouterr().err
    binary = tmp_path / "a.bin"
    binary.write_bytes(b"\xff\xfe\x00\x81" * 10)
    assert cli.main(["generate", str(binary)]) == 2
    assert "not UTF-8 text" in capsys.readouterr().err


def test_verify_backend_choices():
    args = (torch.zeros(1, 2, dtype=torch.long), torch.randn(1, 2, 10), torch.randn(1, 3, 10), SamplingConfig(temperature=1.0))
    with pytest.raises(ValueError, match="unknown verification backend"):
        verify("exact", *args, backend="tpu")
    with pytest.raises(ValueError, match="CUDA tensors"):
        verify("exact", *args, backend="cuda")  # CPU tensors: the kernels cannot take them
    forced = verify("exact", *args, generator=torch.Generator().manual_seed(3), backend="torch")
    auto = verify("exact", *args, generator=torch.Generator().manual_seed(3))
    assert torch.equal(forced.n_accepted, auto.n_accepted) and torch.equal(forced.next_token, auto.next_token)
    # baseline has no kernel: under 'cuda' it runs on torch (a compare of all modes with the kernels forced ran
    # baseline first and stopped there, on an H100), with the same decisions as under 'torch'
    on_cuda = verify("baseline", *args, generator=torch.Generator().manual_seed(4), backend="cuda")
    on_torch = verify("baseline", *args, generator=torch.Generator().manual_seed(4), backend="torch")
    assert on_cuda.host() == on_torch.host()
    # greedy under 'cuda' is refused when the run is set up, not at its first verification
    with pytest.raises(ValueError, match="kernels verify sampled runs"):
        SpecConfig(sampling=SamplingConfig(temperature=0.0), verify_backend="cuda")
    SpecConfig(sampling=SamplingConfig(temperature=0.8), verify_backend="cuda")
    SpecConfig(mode="baseline", sampling=SamplingConfig(temperature=0.0), verify_backend="cuda")  # torch anyway


def test_public_page_accepts_local_models_only_under_named_dirs(tmp_path):
    """With --models-dir (a public address), paths elsewhere are refused with one message whether they
    exist or not; hub ids, the default pair and layer drafts pass; paths inside the named dir pass."""
    from specviz.models.loading import ModelLoadError
    from specviz.page.sessions import ModelAccess

    allowed = tmp_path / "models"
    (allowed / "mine").mkdir(parents=True)
    access = ModelAccess((allowed.resolve(),))
    for ok, role in (("default", "target"), ("layers:0,5", "draft"), ("Qwen/Qwen2.5-0.5B", "target"),
                     (str(allowed / "mine"), "target"), (str(allowed / "not-yet"), "draft")):
        access.check(ok, role)
    messages = set()
    for bad in ("/etc", "/no/such/dir", str(tmp_path), "~/.ssh", str(allowed / ".." / "x"), "../models"):
        with pytest.raises(ModelLoadError) as e:
            access.check(bad, "draft")
        messages.add(str(e.value).replace(repr(bad), "NAME"))
    assert len(messages) == 1 and "--models-dir" in messages.pop()
    ModelAccess().check("/etc", "draft")  # localhost: the visitor is the operator


def test_an_uncached_hub_id_is_refused_within_seconds_when_the_hub_cannot_be_reached(monkeypatch):
    """Issue 22: offline, transformers would retry for half a minute; specviz asks the hub once, briefly."""
    import time

    from huggingface_hub import constants

    from specviz.models import hub
    from specviz.models.loading import ModelLoadError, load_pair

    monkeypatch.setattr(constants, "ENDPOINT", "https://hub.invalid")  # .invalid never resolves (RFC 2606)
    monkeypatch.setattr(hub, "_known", None)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    started = time.monotonic()
    with pytest.raises(ModelLoadError, match="not in the local Hugging Face cache and the model hub cannot be reached"):
        load_pair("specviz-tests/no-such-model", "specviz-tests/no-such-model")
    assert time.monotonic() - started < hub.REACH_TIMEOUT_S + 2
    assert hub.reachable() is False  # remembered: the next load does not wait again
    monkeypatch.setattr(hub, "cached", lambda name, file="config.json": True)
    assert hub.sources("owner/cached-model", "draft") == {"local_files_only": True}
    assert hub.sources("/a/missing/path", "draft") == {}  # not a hub id: transformers refuses it without a network


@pytest.mark.parametrize("raw", ["zero", "0", "-3", "2.5"])
def test_a_bad_session_state_bound_stops_the_page_with_a_message(raw):
    from specviz.page import app

    with pytest.raises(SystemExit, match="SPECVIZ_SESSIONS_KEPT must be a whole number"):
        app.sessions_kept({"SPECVIZ_SESSIONS_KEPT": raw})
    assert app.sessions_kept({}) == app.SESSIONS_KEPT and app.sessions_kept({"SPECVIZ_SESSIONS_KEPT": " 8 "}) == 8
