"""A causal LM built straight from a GGUF file's blocks (specviz.models.gguf_file, gguf_model) is transformers' own
GGUF model, bit for bit, without its dense copy.

A small qwen2 GGUF file is written here with gguf's writer: random blocks of every type the embedded pair uses
(Q4_K, Q6_K, Q5_0, Q8_0), plain F32 norms and biases, and a byte-level tokenizer. Against it:
- the fast header reader gives gguf's GGUFReader's metadata and tensor bytes;
- the config and tokenizer are transformers' (AutoConfig / AutoTokenizer with gguf_file);
- the model built from the blocks gives transformers' logits exactly: dense, packed, packed with 8-bit activations;
- the 4-bit draft from the blocks is quantize_draft_q4 of transformers' dense model;
- the embedded-model cache (ensure_embedded) holds no dense copy and no GGUF file, replaces an old fp32 copy, and
  load_pair runs on it; corrupt and truncated files are refused by name.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFWriter

from specviz.models import cpu_kernels, gguf_model, loading
from specviz.models.gguf_file import GGUFFile, GGUFFormatError
from specviz.models.packed import apply_packed, pack_gguf
from specviz.models.quant import quantize_draft_q4

from test_packed import random_blocks

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler to build the CPU kernels")

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 256, 512, 2, 4, 2
KV = HIDDEN // HEADS * KV_HEADS
PER_BLOCK = {QT.Q4_K: 256, QT.Q6_K: 256, QT.Q5_0: 32, QT.Q8_0: 32}


def _byte_tokens() -> tuple[list[str], list[str]]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = list(bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he"]
    return chars + ["Ġt", "he", "Ġthe", "<|endoftext|>", "<|im_start|>", "<|im_end|>"], merges


def write_tiny_gguf(path, seed: int = 0) -> None:
    """A 2-layer qwen2 model as a GGUF file, its weights random blocks of the embedded pair's types."""
    tokens, merges = _byte_tokens()
    vocab = len(tokens)
    w = GGUFWriter(str(path), "qwen2")
    w.add_name("tiny qwen2")
    w.add_context_length(1024)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(15)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (vocab - 3) + [3, 3, 3])
    w.add_token_merges(merges)
    w.add_eos_token_id(vocab - 1)
    w.add_bos_token_id(vocab - 3)
    w.add_pad_token_id(vocab - 3)
    w.add_add_bos_token(False)
    rng = np.random.default_rng(seed)
    count = [seed * 100]

    def blocks(name: str, kind: QT, rows: int, cols: int) -> None:
        count[0] += 1
        w.add_tensor(name, random_blocks(kind, rows, cols // PER_BLOCK[kind], seed=count[0]), raw_dtype=kind)

    def plain(name: str, n: int, around: float) -> None:
        w.add_tensor(name, (around + 0.05 * rng.standard_normal(n)).astype(np.float32))

    blocks("token_embd.weight", QT.Q4_K, vocab, HIDDEN)
    blocks("output.weight", QT.Q6_K, vocab, HIDDEN)
    plain("output_norm.weight", HIDDEN, 1.0)
    for i in range(LAYERS):
        plain(f"blk.{i}.attn_norm.weight", HIDDEN, 1.0)
        plain(f"blk.{i}.ffn_norm.weight", HIDDEN, 1.0)
        blocks(f"blk.{i}.attn_q.weight", QT.Q4_K, HIDDEN, HIDDEN)
        blocks(f"blk.{i}.attn_k.weight", QT.Q5_0, KV, HIDDEN)
        blocks(f"blk.{i}.attn_v.weight", QT.Q8_0, KV, HIDDEN)
        plain(f"blk.{i}.attn_q.bias", HIDDEN, 0.0)
        plain(f"blk.{i}.attn_k.bias", KV, 0.0)
        plain(f"blk.{i}.attn_v.bias", KV, 0.0)
        blocks(f"blk.{i}.attn_output.weight", QT.Q4_K, HIDDEN, HIDDEN)
        blocks(f"blk.{i}.ffn_gate.weight", QT.Q4_K, FFN, HIDDEN)
        blocks(f"blk.{i}.ffn_up.weight", QT.Q4_K, FFN, HIDDEN)
        blocks(f"blk.{i}.ffn_down.weight", QT.Q6_K, HIDDEN, FFN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-qwen2.gguf"
    write_tiny_gguf(path)
    return path


def _transformers_model(path, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32, **kwargs).eval()


IDS = torch.tensor([[5, 80, 17, 200, 3, 3, 99, 255, 258, 140, 7, 64]])


def _logits(model) -> torch.Tensor:
    with torch.inference_mode():
        return model(IDS).logits


def test_the_header_reader_gives_ggufs_own_metadata_and_bytes(tiny_gguf):
    from transformers.integrations.ggml import _gguf_parse_value

    mine, theirs = GGUFFile(tiny_gguf), GGUFReader(tiny_gguf)
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):
            continue
        value = [_gguf_parse_value(field.parts[i], field.types) for i in field.data]
        expected = value if field.types[0] == 9 else value[0]
        assert mine.metadata[key] == expected, key
    assert set(mine.tensors) == {t.name for t in theirs.tensors}
    for t in theirs.tensors:
        info = mine.tensors[t.name]
        assert info.kind == t.tensor_type and info.shape == tuple(int(d) for d in reversed(t.shape))
        assert np.array_equal(mine.raw(t.name), np.asarray(t.data).reshape(-1).view(np.uint8)), t.name


def test_config_and_tokenizer_are_transformers_own(tiny_gguf):
    from transformers import AutoConfig, AutoTokenizer

    gguf = GGUFFile(tiny_gguf)
    config = gguf_model.hf_config(gguf)
    expected = AutoConfig.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    drop = lambda d: {k: v for k, v in d.items() if k not in ("_name_or_path", "dtype")}  # noqa: E731
    assert drop(config.to_dict()) == drop(expected.to_dict())
    assert config.vocab_size == len(_byte_tokens()[0]) and config.tie_word_embeddings is False
    tokenizer = gguf_model.hf_tokenizer(gguf, config)
    reference = AutoTokenizer.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    assert type(tokenizer) is type(reference) and tokenizer.get_vocab() == reference.get_vocab()
    text = "the thé the<|im_end|> 3.14  spaced"
    assert tokenizer(text).input_ids == reference(text).input_ids
    assert (tokenizer.eos_token, tokenizer.pad_token) == (reference.eos_token, reference.pad_token)


@pytest.mark.parametrize("weights", ["dense", "packed", "packed-a8"])
def test_the_model_from_blocks_is_transformers_model_bit_for_bit(tiny_gguf, weights):
    gguf = GGUFFile(tiny_gguf)
    config = gguf_model.hf_config(gguf)
    blocks = gguf_model.read_blocks(gguf, config)
    assert all(t.dtype == torch.float32 and t.dim() == 1 for t in blocks.dense.values())  # norms and biases only
    a8 = weights == "packed-a8"
    built = gguf_model.build(config, blocks, packed=weights != "dense", int8_activations=a8)
    reference = _transformers_model(tiny_gguf)
    assert torch.equal(built.model.embed_tokens.weight, reference.model.embed_tokens.weight)
    if weights != "dense":
        apply_packed(reference, pack_gguf(reference, tiny_gguf), int8_activations=a8)
    assert torch.equal(_logits(built), _logits(reference))


def test_the_4bit_draft_from_blocks_is_quantize_draft_q4_of_the_dense_model(tiny_gguf):
    gguf = GGUFFile(tiny_gguf)
    config = gguf_model.hf_config(gguf)
    blocks = gguf_model.read_blocks(gguf, config)
    q4 = gguf_model.requantized_q4(config, blocks)
    built = gguf_model.build(config, gguf_model.Blocks({**blocks.packed, **q4}, blocks.dense), packed=True,
                             int8_activations=True)
    assert torch.equal(_logits(built), _logits(quantize_draft_q4(_transformers_model(tiny_gguf))))


def test_blocks_survive_the_cache_and_a_cut_file_is_not_trusted(tiny_gguf, tmp_path):
    gguf = GGUFFile(tiny_gguf)
    config = gguf_model.hf_config(gguf)
    blocks = gguf_model.read_blocks(gguf, config)
    gguf_model.save_blocks(blocks, tmp_path)
    again = gguf_model.load_blocks(tmp_path)
    assert again.packed.keys() == blocks.packed.keys() and again.dense.keys() == blocks.dense.keys()
    assert all(torch.equal(again.packed[k].q, blocks.packed[k].q) for k in blocks.packed)
    dense = tmp_path / gguf_model.DENSE_FILE
    dense.write_bytes(dense.read_bytes()[:50])  # a write killed half way
    assert gguf_model.load_blocks(tmp_path) is None


def test_not_a_gguf_and_a_cut_gguf_are_refused_by_name(tiny_gguf, tmp_path):
    bad = tmp_path / "notes.gguf"
    bad.write_bytes(b"this is not a model file at all, just text" * 10)
    with pytest.raises(GGUFFormatError, match="magic"):
        GGUFFile(bad)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf.read_bytes()[: tiny_gguf.stat().st_size // 2])
    with pytest.raises(GGUFFormatError, match="cut short"):
        GGUFFile(cut)
    with pytest.raises(loading.ModelLoadError, match="cut.gguf is not a readable GGUF file|cut short"):
        loading.load_model(str(cut), "target", device=torch.device("cpu"), dtype=torch.float32, weights="auto")


@pytest.fixture
def embedded_tiny(tiny_gguf, tmp_path, monkeypatch):
    """The tiny file as an 'embedded' model split over two part files, with its cache in tmp_path."""
    whole = tiny_gguf.read_bytes()
    parts = [tmp_path / "p1.bin", tmp_path / "p2.bin"]
    parts[0].write_bytes(whole[: len(whole) // 3])
    parts[1].write_bytes(whole[len(whole) // 3:])
    spec = loading.EmbeddedGGUF("tiny-qwen2", ("a", "b"), "tiny-qwen2.gguf", len(whole), hashlib.sha256(whole).hexdigest())
    monkeypatch.setitem(loading.EMBEDDED, spec.name, spec)
    monkeypatch.setattr(loading, "_part_paths", lambda s: parts)
    monkeypatch.setenv("SPECVIZ_CACHE", str(tmp_path / "cache"))
    return spec


def test_the_embedded_cache_holds_blocks_not_a_dense_copy(embedded_tiny, tiny_gguf, tmp_path):
    old = tmp_path / "cache" / embedded_tiny.name
    old.mkdir(parents=True)
    (old / "model.safetensors").write_bytes(bytes(1000))  # what specviz 0.4 wrote: an fp32 copy
    said = []
    directory = loading.ensure_embedded(embedded_tiny.name, lambda m, f: said.append(m))
    assert any("removing the fp32 copy" in m for m in said)
    names = {p.name for p in directory.iterdir()}
    assert {"config.json", "packed.safetensors", "dense.safetensors", "tokenizer.json"} <= names
    assert "model.safetensors" not in names and not any(n.endswith(".gguf") for n in names)
    weights = sum((directory / name).stat().st_size for name in ("packed.safetensors", "dense.safetensors"))
    assert weights < 1.6 * tiny_gguf.stat().st_size  # its blocks with their scales unpacked beside (fp32: ~7×)
    stamp = (directory / "packed.safetensors").stat().st_mtime_ns
    assert loading.ensure_embedded(embedded_tiny.name) == directory
    assert (directory / "packed.safetensors").stat().st_mtime_ns == stamp  # read back, not packed again


def test_load_pair_runs_on_the_embedded_cache_with_the_4bit_draft(embedded_tiny, tiny_gguf):
    pair = loading.load_pair(embedded_tiny.name, embedded_tiny.name, device="cpu")
    assert pair.draft_name.endswith("(4-bit)") and "Q4 (re-quantized by specviz)" in pair.draft_weights
    assert "GGUF" in pair.target_weights and "int8 activations" in pair.target_weights
    directory = loading.cache_dir() / embedded_tiny.name
    assert (directory / loading.Q4_DRAFT_FILE).exists()  # re-quantized once, then read back
    again = loading.load_pair(embedded_tiny.name, embedded_tiny.name, device="cpu")
    assert torch.equal(_logits(pair.draft), _logits(again.draft))
    assert torch.equal(_logits(pair.target), _logits(again.target))
    reference = _transformers_model(tiny_gguf)
    apply_packed(reference, pack_gguf(reference, tiny_gguf), int8_activations=cpu_kernels.has_int8_activations())
    assert torch.equal(_logits(pair.target), _logits(reference))
