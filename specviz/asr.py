"""Speech: speculative Whisper transcription on the shared engine.

The encoder runs once per 30 s window; both decoders read its output. The embedded draft is
self-speculative: a shallower decoder made of some of the target's own decoder layers (weights shared,
not copied), the way Distil-Whisper initializes its students. A separate assistant (e.g.
distil-whisper/distil-small.en for openai/whisper-small.en) works too, reusing the target's encoder output.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import nn
from transformers import DynamicCache, EncoderDecoderCache, WhisperForConditionalGeneration, WhisperProcessor

from .audio import SAMPLE_RATE, windows
from .config import SpecConfig
from .engine import DecodeState, Stopwatch, Vocabulary, autoregressive, speculate
from .machine import device_name
from .models import DEFAULT, ModelLoadError, Progress, _silent
from .trace import IterationRecord, Trace
from .whisper_ct2 import load_whisper

# Chosen by measurement on the sample clip (docs/benchmarks.md, "Speech"): base without its fourth decoder
# layer is the only shallower decoder that still agrees with the full one most of the time.
DEFAULT_DRAFT_LAYERS = (0, 1, 2, 4, 5)


@dataclass
class SpeechPair:
    target: WhisperForConditionalGeneration
    draft: WhisperForConditionalGeneration
    processor: WhisperProcessor
    target_name: str
    draft_name: str

    @property
    def device(self) -> torch.device:
        return self.target.device

    @property
    def dtype(self) -> torch.dtype:
        return self.target.dtype

    @property
    def vocab_size(self) -> int:
        return self.target.config.vocab_size


def _relabel(layer: nn.Module, index: int) -> nn.Module:
    """A view of a decoder layer that shares its weights but writes to KV-cache slot `index`."""
    view = copy.copy(layer)
    view._modules = dict(layer._modules)
    for name in ("self_attn", "encoder_attn"):
        attention = copy.copy(layer._modules[name])
        attention.layer_idx = index
        view._modules[name] = attention
    return view


def layer_draft(target: WhisperForConditionalGeneration, layers: tuple[int, ...]) -> WhisperForConditionalGeneration:
    """A draft whose decoder is `layers` of the target's decoder; embeddings, norms and head are shared."""
    n = target.config.decoder_layers
    if not layers or any(not 0 <= i < n for i in layers) or list(layers) != sorted(set(layers)):
        raise ValueError(f"draft layers must be increasing indices in [0, {n}), got {layers}")
    decoder = copy.copy(target.model.decoder)
    decoder._modules = dict(target.model.decoder._modules)
    decoder._modules["layers"] = nn.ModuleList([_relabel(target.model.decoder.layers[i], k) for k, i in enumerate(layers)])
    inner = copy.copy(target.model)
    inner._modules = dict(target.model._modules)
    inner._modules["decoder"] = decoder
    draft = copy.copy(target)
    draft._modules = dict(target._modules)
    draft._modules["model"] = inner
    draft.config = copy.deepcopy(target.config)
    draft.config.decoder_layers = len(layers)
    return draft


def parse_layers(spec: str) -> tuple[int, ...]:
    """'layers:0,5' -> (0, 5)."""
    try:
        return tuple(int(x) for x in spec.removeprefix("layers:").split(","))
    except ValueError:
        raise ValueError(f"draft layer list must look like 'layers:0,5', got {spec!r}") from None


def check_speech_pair(draft: WhisperForConditionalGeneration, draft_proc: WhisperProcessor,
                      target: WhisperForConditionalGeneration, target_proc: WhisperProcessor,
                      draft_name: str, target_name: str) -> None:
    """The draft reads the target's encoder output and shares its vocabulary; refuse pairs that cannot."""
    dv, tv = draft_proc.tokenizer.get_vocab(), target_proc.tokenizer.get_vocab()
    if dv != tv or draft.config.vocab_size != target.config.vocab_size:
        raise ModelLoadError(
            f"vocabularies differ: draft {draft_name!r} has {len(dv):,} tokens ({draft.config.vocab_size:,} logits) and "
            f"target {target_name!r} has {len(tv):,} ({target.config.vocab_size:,}); e.g. an English-only draft "
            "cannot check a multilingual target"
        )
    for key in ("d_model", "num_mel_bins", "max_source_positions"):
        if getattr(draft.config, key) != getattr(target.config, key):
            raise ModelLoadError(
                f"draft {draft_name!r} cannot read the target's encoder output: {key} is "
                f"{getattr(draft.config, key)} in the draft and {getattr(target.config, key)} in {target_name!r}"
            )


def load_speech_pair(
    target: str = DEFAULT,
    draft: str = DEFAULT,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    progress: Progress = _silent,
) -> SpeechPair:
    """target: 'default' (embedded Whisper base), a hub id or a directory. draft: 'default' (the target's
    layers DEFAULT_DRAFT_LAYERS), 'layers:i,j,...', or another Whisper (hub id or directory)."""
    t_model, processor = load_whisper(target, device=device, dtype=dtype, progress=progress)
    t_name = "whisper-base" if target == DEFAULT else target
    if draft == DEFAULT or draft.startswith("layers:"):
        layers = DEFAULT_DRAFT_LAYERS if draft == DEFAULT else parse_layers(draft)
        try:
            d_model = layer_draft(t_model, layers)
        except ValueError as e:
            raise ModelLoadError(str(e)) from None
        return SpeechPair(t_model, d_model, processor, t_name, f"{t_name} decoder layers {list(layers)}")
    d_model, d_proc = load_whisper(draft, device=t_model.device, dtype=t_model.dtype, progress=progress)
    check_speech_pair(d_model, d_proc, t_model, processor, draft, t_name)
    return SpeechPair(t_model, d_model, processor, t_name, draft)


class WhisperDecoder:
    """One Whisper decoder on a fixed encoder output, with its own self-attention cache.

    Applies the generation config's suppress lists (begin-suppress only where the first new token is
    predicted), so draft, target and the reference all see the same standardized logits.
    """

    def __init__(self, model: WhisperForConditionalGeneration, encoder_out: torch.Tensor, prompt_len: int,
                 suppress: list[int], begin_suppress: list[int]):
        self.model, self.encoder_out, self.prompt_len = model, encoder_out, prompt_len
        self.cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        self.cached = 0
        self.suppress = torch.tensor(suppress, dtype=torch.long, device=model.device)
        self.begin_suppress = torch.tensor(begin_suppress, dtype=torch.long, device=model.device)

    def length(self) -> int:
        return self.cached

    def forward(self, ids: list[int], keep: int) -> torch.Tensor:
        device = self.model.device
        positions = torch.arange(self.cached, self.cached + len(ids), device=device)
        out = self.model(
            decoder_input_ids=torch.tensor([ids], device=device), encoder_outputs=(self.encoder_out,),
            past_key_values=self.cache, use_cache=True, cache_position=positions,
        )
        self.cached += len(ids)
        logits = out.logits[0, -keep:].float()
        if len(self.suppress):
            logits[:, self.suppress] = float("-inf")
        first = self.prompt_len - 1 - (self.cached - keep)  # row that predicts the first new token
        if 0 <= first < keep and len(self.begin_suppress):
            logits[first, self.begin_suppress] = float("-inf")
        return logits

    def crop(self, length: int) -> None:
        if self.cached > length:
            self.cache.crop(length - self.cached)
            self.cached = length


def decoder_prompt(processor: WhisperProcessor, model: WhisperForConditionalGeneration, language: str | None) -> list[int]:
    """<|startoftranscript|> [<|lang|> <|transcribe|>] <|notimestamps|>: the tokens marked as prompt."""
    gc = model.generation_config
    tok = processor.tokenizer
    ids = [gc.decoder_start_token_id]
    if getattr(gc, "is_multilingual", False) and getattr(gc, "lang_to_id", None):
        lang_token = f"<|{language or 'en'}|>"
        if lang_token not in gc.lang_to_id:
            raise ValueError(f"unknown language {language!r} for this Whisper model")
        ids += [gc.lang_to_id[lang_token], gc.task_to_id["transcribe"]]
    ids.append(gc.no_timestamps_token_id if gc.no_timestamps_token_id is not None else tok.convert_tokens_to_ids("<|notimestamps|>"))
    return ids


def _vocabulary(pair: SpeechPair) -> Vocabulary:
    tok = pair.processor.tokenizer
    return Vocabulary(lambda t: tok.decode(t), frozenset({pair.target.generation_config.eos_token_id}))


@torch.inference_mode()
def transcribe(
    pair: SpeechPair,
    audio: np.ndarray,
    cfg: SpecConfig,
    *,
    language: str | None = "en",
    target_only: bool = False,
    on_iteration: Callable[[IterationRecord, Trace], None] | None = None,
    meta: dict | None = None,
) -> Trace:
    """Transcribe 16 kHz mono audio window by window; speculative unless target_only."""
    device, gc = pair.device, pair.target.generation_config
    clock = Stopwatch(device)
    vocab = _vocabulary(pair)
    prompt = decoder_prompt(pair.processor, pair.target, language)
    suppress, begin = list(gc.suppress_tokens or []), list(gc.begin_suppress_tokens or [])
    trace = Trace(
        meta={"mode": "target-only" if target_only else cfg.mode, "task": "transcribe", "config": cfg.to_dict(),
              "draft": pair.draft_name, "target": pair.target_name, "device": device_name(device),
              "dtype": str(pair.dtype).removeprefix("torch."), "vocab_size": pair.vocab_size,
              "audio_seconds": len(audio) / SAMPLE_RATE, "language": language, "windows": [],
              "prompt_text": pair.processor.tokenizer.decode(prompt), **(meta or {})},
        prompt_ids=prompt, output_ids=[], output_text="",
    )
    t0 = clock.now()
    texts = []
    for w, (start_s, chunk) in enumerate(windows(audio)):
        p0 = clock.now()
        features = pair.processor.feature_extractor(chunk, sampling_rate=SAMPLE_RATE, return_tensors="pt").input_features
        encoder_out = pair.target.model.encoder(features.to(device, pair.dtype)).last_hidden_state
        state = DecodeState(list(prompt), len(prompt), WhisperDecoder(pair.draft, encoder_out, len(prompt), suppress, begin),
                            WhisperDecoder(pair.target, encoder_out, len(prompt), suppress, begin))
        state.target.forward(prompt[:-1], 1)
        if not target_only:
            state.draft.forward(prompt[:-1], 1)
        trace.prefill_s += clock.now() - p0
        if target_only:
            for _ in autoregressive(state, cfg, vocab, device):
                pass
        else:
            for record in speculate(state, cfg, vocab, device):
                record.index = len(trace.iterations)
                record.window = w
                trace.iterations.append(record)
                trace.total_s = clock.now() - t0
                if on_iteration:
                    on_iteration(record, trace)
        window_ids = state.generated
        text = pair.processor.tokenizer.decode(window_ids, skip_special_tokens=True).strip()
        texts.append(text)
        trace.output_ids.extend(window_ids)
        trace.meta["windows"].append({"index": w, "start_s": start_s, "end_s": start_s + len(chunk) / SAMPLE_RATE,
                                      "output_ids": window_ids, "text": text})
    trace.output_text = " ".join(t for t in texts if t)
    trace.total_s = clock.now() - t0
    return trace


def word_error_rate(reference: str, hypothesis: str) -> float:
    """WER after Whisper's English text normalization (jiwer for the alignment)."""
    import jiwer
    from transformers.models.whisper.english_normalizer import EnglishTextNormalizer

    normalize = EnglishTextNormalizer({})
    ref, hyp = normalize(reference), normalize(hypothesis)
    if not ref.strip():
        raise ValueError("the reference transcript is empty")
    return float(jiwer.wer(ref, hyp))
