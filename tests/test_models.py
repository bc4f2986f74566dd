"""Model loading: local directories, vocabulary checks, the embedded GGUF assembly, clear failures."""

from __future__ import annotations

import hashlib

import pytest
import torch

from specviz.models import loading as models
from specviz.models.loading import EmbeddedGGUF, ModelLoadError, assemble_gguf, cache_dir, load_pair

from conftest import save_tokenizer, tiny_qwen, word_tokenizer

SMALL_V = 1000
HEAD_ROWS = 1024  # padded output heads, as the real Qwen pair has (151,936 rows for 151,665 tokens)


@pytest.fixture(scope="module")
def saved_dirs(tmp_path_factory):
    """Two tiny models sharing a tokenizer, and a third whose tokenizer differs, saved as local dirs."""
    root = tmp_path_factory.mktemp("models")
    out = {}
    for name, seed, prefix in (("draft", 1, "w"), ("target", 2, "w"), ("alien", 3, "x")):
        path = root / name
        tiny_qwen(seed, vocab_size=HEAD_ROWS).save_pretrained(path)
        save_tokenizer(word_tokenizer(SMALL_V, prefix), path)
        out[name] = str(path)
    return out


def test_local_directories_load_as_a_pair(saved_dirs):
    pair = load_pair(saved_dirs["draft"], saved_dirs["target"], device="cpu")
    assert pair.vocab_size == HEAD_ROWS
    assert pair.dtype == torch.float32  # the CPU default (no fast bf16 matrix multiply there)
    assert pair.device.type == "cpu"
    pair16 = load_pair(saved_dirs["draft"], saved_dirs["target"], device="cpu", dtype="bf16")
    assert pair16.dtype == torch.bfloat16


def test_mismatched_vocabularies_are_refused_naming_both(saved_dirs):
    with pytest.raises(ModelLoadError) as err:
        load_pair(saved_dirs["alien"], saved_dirs["target"], device="cpu")
    message = str(err.value)
    assert "vocabularies differ" in message
    assert saved_dirs["alien"] in message and saved_dirs["target"] in message


def test_unloadable_model_names_role_and_id():
    with pytest.raises(ModelLoadError, match=r"draft model '/no/such/model'"):
        load_pair("/no/such/model", "/no/such/target", device="cpu")


def test_unknown_dtype():
    with pytest.raises(ValueError, match="unknown dtype"):
        models.parse_dtype("int3")


def test_cache_dir_follows_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECVIZ_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"


def _fake_parts(tmp_path, chunks: list[bytes]):
    paths = []
    for i, chunk in enumerate(chunks):
        p = tmp_path / f"part{i}.bin"
        p.write_bytes(chunk)
        paths.append(p)
    return paths


def test_assembly_checks_size_and_hash(tmp_path, monkeypatch):
    chunks = [b"GGUF" + bytes(range(200)), bytes(1000), b"tail"]
    whole = b"".join(chunks)
    monkeypatch.setattr(models, "_part_paths", lambda spec: _fake_parts(tmp_path, chunks))
    good = EmbeddedGGUF("fake", ("a", "b", "c"), "fake.gguf", len(whole), hashlib.sha256(whole).hexdigest())
    seen = []
    out = assemble_gguf(good, tmp_path, progress=lambda m, f: seen.append(f))
    assert out.read_bytes() == whole
    assert seen[-1] == pytest.approx(1.0)

    bad = EmbeddedGGUF("fake", ("a", "b", "c"), "fake.gguf", len(whole), "0" * 64)
    with pytest.raises(ModelLoadError, match="corrupt"):
        assemble_gguf(bad, tmp_path)
    assert not (tmp_path / "fake.gguf").exists()  # a bad file is not left behind for a later load


def test_missing_part_package_names_it(monkeypatch):
    spec = EmbeddedGGUF("fake", ("specviz_no_such_part_pkg",), "x.gguf", 1, "0" * 64)
    with pytest.raises(ModelLoadError, match="specviz-no-such-part-pkg"):
        models._part_paths(spec)


def test_packed_weights_need_a_gguf_model_and_say_so(saved_dirs):
    with pytest.raises(ModelLoadError, match="packed weights need a GGUF target model on the CPU in fp32"):
        load_pair(saved_dirs["draft"], saved_dirs["target"], device="cpu", weights="packed")
    with pytest.raises(ValueError, match="unknown weights"):
        load_pair(saved_dirs["draft"], saved_dirs["target"], device="cpu", weights="int3")


def test_a_sealed_directory_is_trusted_only_whole(tmp_path):
    from specviz.cache import MARKER, damage, seal

    made = tmp_path / "model"
    (made / "sub").mkdir(parents=True)
    (made / "weights.bin").write_bytes(b"x" * 100)
    (made / "sub" / "tok.json").write_text("{}")
    assert damage(made, {"sha256": "a"}) == ""  # never sealed: nothing converted there
    seal(made, {"sha256": "a"})
    assert damage(made, {"sha256": "a"}) is None
    assert damage(made, {"sha256": "b"}) == "it was made from another sha256"
    (made / "weights.bin").write_bytes(b"x" * 40)
    assert damage(made, {"sha256": "a"}) == "weights.bin is 40 bytes, not 100"
    (made / "sub" / "tok.json").unlink()
    (made / "weights.bin").write_bytes(b"x" * 100)
    assert damage(made, {"sha256": "a"}) == "sub/tok.json is missing"
    (made / MARKER).write_text('{"sha256": "a"}')  # sealed before sizes were recorded: trusted as then
    assert damage(made, {"sha256": "a"}) is None
    (made / MARKER).write_text("{not json")
    assert damage(made, {"sha256": "a"}) == "its marker file is unreadable"


def test_a_killed_conversions_work_dir_is_removed_by_the_next_start(tmp_path, monkeypatch):
    """Work dirs are named by their process; the next start removes those of dead processes only (the
    fault tests SIGKILL real conversions; this is the rule itself, for any converted name)."""
    import subprocess
    import sys

    from specviz import cache

    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path))
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / f".qwen2.5-coder-1.5b-instruct.partial-{int(done.stdout)}"
    live = cache.work_dir("qwen2.5-coder-1.5b-instruct")
    other = tmp_path / ".whisper-base.partial-1"  # another model's: not this name's to remove
    for d in (dead, live, other):
        (d / "gguf").mkdir(parents=True)
    cache.remove_dead_work("qwen2.5-coder-1.5b-instruct")
    assert not dead.exists() and live.exists() and other.exists()
