"""CTranslate2 Whisper into transformers: WhisperSpec weights, config and generation config, and whole directories.

The embedded Whisper base ships as a CTranslate2 (faster-whisper) checkpoint, a format transformers cannot
read; this maps it onto `WhisperForConditionalGeneration` (see `whisper_loader` for the cache it fills).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from transformers import GenerationConfig, WhisperConfig, WhisperForConditionalGeneration, WhisperProcessor
from transformers.models.whisper.tokenization_whisper import LANGUAGES

from specviz.speech.ct2_format import CT2FormatError, CT2Model, read_ct2
from specviz.speech.whisper_tokenizer import read_vocabulary, whisper_processor, whisper_tokenizer

WHISPER_SPEC = "WhisperSpec"

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


def convert_ct2_dir(
    directory: str | os.PathLike, model_bin: str | os.PathLike | None = None
) -> tuple[WhisperForConditionalGeneration, WhisperProcessor]:
    """Convert a faster-whisper style directory (model.bin, config.json, tokenizer.json, vocabulary.txt) into a
    float32 model and its processor. `model_bin` overrides where model.bin is read from."""
    model, processor, _ = convert_ct2_files(Path(directory), Path(model_bin) if model_bin else None)
    return model, processor


def convert_ct2_files(
    directory: Path, model_bin: Path | None
) -> tuple[WhisperForConditionalGeneration, WhisperProcessor, bool]:
    """As convert_ct2_dir, also saying whether every float weight was stored as fp16."""
    ct2_config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    vocabulary = read_vocabulary(directory)
    ct2 = read_ct2(model_bin if model_bin is not None else directory / "model.bin")
    all_fp16 = all(a.dtype == np.float16 for a in ct2.variables.values() if a.dtype.kind == "f")
    model = to_whisper(ct2, ct2_config, vocabulary)
    del ct2  # drops the memory map before the caller deletes the file
    tokenizer = whisper_tokenizer(directory / "tokenizer.json", vocabulary, model.config.vocab_size)
    return model, whisper_processor(tokenizer, model.config.num_mel_bins), all_fp16


def is_ct2_dir(source: str | Path) -> bool:
    """A local faster-whisper directory: model.bin plus a CT2 config.json (which has no model_type)."""
    if not isinstance(source, Path) or not (source / "model.bin").is_file():
        return False
    try:
        config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return "model_type" not in config
