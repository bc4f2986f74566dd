"""Speech: Whisper on the shared driver. Each 30 s window of each clip is one sequence of the batch.

The encoder runs once per window; both decoders read its output. The embedded draft is
self-speculative: a shallower decoder made of some of the target's own decoder layers (weights shared,
not copied), the way Distil-Whisper initializes its students. A separate assistant (e.g.
distil-whisper/distil-small.en for openai/whisper-small.en) works too, reusing the target's encoder output.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
import numpy as np
import torch
from torch import nn
from transformers import DynamicCache, EncoderDecoderCache, WhisperForConditionalGeneration, WhisperProcessor

from specviz.speech import encoder, lean_decoder
from specviz.speech.audio import SAMPLE_RATE, windows
from specviz.decoding.decoder import SlottedDecoder
from specviz.decoding.drafts import SubsetHead, draft_head_size, special_ids, subset_head
from specviz.machine import device_name
from specviz.models.loading import DEFAULT, ModelLoadError, OnTarget, Progress, _silent
from specviz.models.kv_cache import BufferedCache
from specviz.models import cpu_attention, cpu_kernels
from specviz.models.half_linear import HalfLinear, halve_linears
from specviz.models.packed import PackedLinear
from specviz.models.quant import q4_linears, quantize_draft_int8
from specviz.decoding.source import SequenceSpec, Vocabulary, unique_names, with_token_texts_kept
from specviz.speech.whisper_loader import load_whisper

# Chosen by measurement on the sample clip (docs/benchmarks.md, "Speech"): base without its fourth decoder
# layer is the only shallower decoder that still agrees with the full one most of the time.
DEFAULT_DRAFT_LAYERS = (0, 1, 2, 4, 5)


@dataclass
class SpeechPair(OnTarget):
    target: WhisperForConditionalGeneration
    draft: WhisperForConditionalGeneration
    processor: WhisperProcessor
    target_name: str
    draft_name: str
    # the target's decoder layers a layer draft is made of (None: a separate assistant). Their cross-attention keys
    # and values are the target's, computed once per window for both (SpeechSource.decoders).
    draft_layers: tuple[int, ...] | None = None
    # the encoder's precision and why (speech.encoder.choose); None: as loaded
    encoder: dict | None = None

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
    draft.__dict__.pop("lean_decoder", None)  # the target's lean forward runs the target's layers: never the draft's
    draft._modules = dict(target._modules)
    draft._modules["model"] = inner
    draft.config = copy.deepcopy(target.config)
    draft.config.decoder_layers = len(layers)
    return draft


def kernel_decoder(model: WhisperForConditionalGeneration) -> int:
    """Whisper's decoder on specviz's CPU kernels, in place, where the model is fp32 on the CPU: its linear layers
    and output head on the fp16-weight kernel (models.half_linear) where its weights are fp16 values (the embedded
    model's are: the same weights in half the bytes, γ + 1 positions scored for about one's cost), and its
    attention on the batch-invariant one (models.cpu_attention). Every decoder row then gets the same bits in any
    call, as the packed text models' do. The encoder (1,500 rows once per window) stays on torch's GEMM and
    SDPA: the decoder gets a config of its own naming the attention. Returns how many linear layers changed."""
    if model.device.type != "cpu" or model.dtype != torch.float32:
        return 0
    changed = halve_linears(model.model.decoder)
    head = HalfLinear.from_linear(model.proj_out) if isinstance(model.proj_out, nn.Linear) else None
    if head is not None:  # the input embedding keeps its fp32 weight, which the head shared
        model.proj_out = head
        changed += 1
    if cpu_kernels.available() and cpu_kernels.has_attention():  # available(): no build here is no error
        config = copy.copy(model.model.decoder.config)
        config._attn_implementation = cpu_attention.register()
        for module in model.model.decoder.modules():  # the decoder, its layers and their attention modules
            if getattr(module, "config", None) is not None:
                module.config = config
    return changed


def decoder_weights(model: WhisperForConditionalGeneration) -> str:
    """What a Whisper decoder's layers run on, named in traces as the text models' are (models.packed.describe)."""
    decoder = model.model.decoder
    linears = [m for layer in decoder.layers for m in lean_decoder.layer_linears(layer)]

    def kind(m: nn.Module) -> str:
        if isinstance(m, HalfLinear):
            return "fp16 weights, specviz fp16-weight kernel"
        if isinstance(m, PackedLinear):
            activations = "int8 activations (per row, groups of 32)" if m.int8_activations else "fp32 activations"
            return f"{m.source} blocks, specviz {cpu_kernels.isa()} kernel, {activations}"
        if isinstance(m, nn.Linear):
            return f"dense {str(m.weight.dtype).removeprefix('torch.')}"
        return "dense int8 (dynamic quantization)"

    kinds = sorted({kind(m) for m in linears})
    implementation = decoder.config._attn_implementation
    attention = "batch-invariant attention" if implementation == cpu_attention.NAME else f"{implementation} attention"
    lean_forward = getattr(model, "lean_decoder", None)
    lean = "" if lean_forward is None else (", layers in one native call" if lean_forward.native is not None
                                            else ", lean forward")
    return f"{' + '.join(kinds)}, {attention}{lean}"


def quantized_layer_draft(target: WhisperForConditionalGeneration, layers: tuple[int, ...]
                          ) -> tuple[WhisperForConditionalGeneration, str]:
    """layer_draft with quantized copies of the kept decoder layers and of the output head, and what they are:
    4-bit on specviz's kernels with 8-bit activations where they build with AVX2 (quant.q4_linears: batch
    invariant, a 4.7 ms step against int8's 5.9 on the sample clip before the lean forward, 3.9 with it; greedy
    agreement with the target 0.90 against 0.92), else torch's dynamic int8. Embeddings, norms and the encoder stay shared with the (never quantized)
    target; quantizing in place would reach the target's own modules through the shared ones, so only private
    copies are quantized."""
    draft = layer_draft(target, layers)
    decoder = draft.model.decoder
    kept, head = copy.deepcopy(decoder.layers), nn.Sequential(copy.deepcopy(target.proj_out))
    if cpu_kernels.available() and cpu_kernels.has_int8_activations():
        decoder._modules["layers"], draft._modules["proj_out"] = q4_linears(kept), q4_linears(head)[0]
        return draft, "4-bit"
    decoder._modules["layers"], draft._modules["proj_out"] = quantize_draft_int8(kept), quantize_draft_int8(head)[0]
    return draft, "int8"


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
    quantized_draft: bool | None = None,
    encoder_dtype: str | None = None,
    progress: Progress = _silent,
) -> SpeechPair:
    """target: 'default' (embedded Whisper base), a hub id or a directory. draft: 'default' (the target's
    layers DEFAULT_DRAFT_LAYERS), 'layers:i,j,...', or another Whisper (hub id or directory). quantized_draft:
    quantized draft weights (quantized_layer_draft; None: exactly when the models run on the CPU; needs an fp32
    target there). An fp32 target on the CPU runs its decoder on specviz's kernels (kernel_decoder). encoder_dtype:
    'auto' (None: $SPECVIZ_SPEECH_ENCODER, else auto), 'fp32' or 'bf16' (speech.encoder.choose)."""
    t_model, processor = load_whisper(target, device=device, dtype=dtype, progress=progress)
    t_name = "whisper-base" if target == DEFAULT else target
    if quantized_draft is None:
        quantized_draft = t_model.device.type == "cpu" and t_model.dtype == torch.float32
    if quantized_draft and (t_model.device.type != "cpu" or t_model.dtype != torch.float32):
        raise ModelLoadError("the quantized speech draft runs on the CPU beside an fp32 target only")
    kernel_decoder(t_model)
    progress("choosing the encoder's precision", None)
    try:
        encoder_choice = encoder.choose(t_model, t_name, encoder_dtype)  # before a draft shares the encoder
    except ValueError as e:
        raise ModelLoadError(str(e)) from None
    layers = None
    if draft == DEFAULT or draft.startswith("layers:"):
        layers = DEFAULT_DRAFT_LAYERS if draft == DEFAULT else parse_layers(draft)
        try:
            if quantized_draft:
                d_model, kind = quantized_layer_draft(t_model, layers)
            else:
                d_model, kind = layer_draft(t_model, layers), ""
        except ValueError as e:
            raise ModelLoadError(str(e)) from None
        d_name = f"{t_name} decoder layers {list(layers)}" + (f" ({kind})" if kind else "")
    else:
        d_model, d_proc = load_whisper(draft, device=t_model.device, dtype=t_model.dtype, progress=progress)
        check_speech_pair(d_model, d_proc, t_model, processor, draft, t_name)
        if quantized_draft:
            d_model = quantize_draft_int8(d_model)
        else:
            kernel_decoder(d_model)
        d_name = draft + (" (int8)" if quantized_draft else "")
    # the quantized draft keeps its cross-attention keys and values in fp16 (lean_decoder: half of what its steps
    # read, 3.36 → 2.88 ms a step on the sample clip, greedy agreement with the target 0.92 → 0.90 teacher-forced)
    cross_kv = torch.float16 if quantized_draft else torch.float32
    # the quantized draft's layers in one native call a step (speech.native_whisper; the target keeps the lean forward)
    draft_model = lean_decoder.attach(d_model, cross_kv, native=quantized_draft)
    return SpeechPair(lean_decoder.attach(t_model), draft_model, processor, t_name, d_name, layers, encoder_choice)


class WhisperDecoder(SlottedDecoder):
    """One Whisper decoder over a batch of encoder outputs, with its own self-attention cache.

    Applies the generation config's suppress lists (begin-suppress only where a row predicts its first new
    token), so draft, target and the reference all see the same standardized logits.
    """

    shares_identical_prompts = False  # every window's cross-attention cache is its own

    def __init__(self, model: WhisperForConditionalGeneration, encoder_out: torch.Tensor, prompt_len: int,
                 suppress: list[int], begin_suppress: list[int], head: SubsetHead | None = None,
                 cross: list[tuple[torch.Tensor, torch.Tensor]] | None = None):
        """cross: every layer's cross-attention keys and values [B, H, frames, D], computed already (else each
        layer computes its own on the window's first call)."""
        self.model, self.prompt_len, self.head = model, prompt_len, head
        self.encoder_out = encoder_out  # [B, frames, d_model]: shared with the other decoder, read-only
        self.cross = cross  # taken by the first _new_cache: the cache then holds them (and its row selections)
        self.suppress = torch.tensor(suppress, dtype=torch.long, device=model.device)
        self.begin_suppress = torch.tensor(begin_suppress, dtype=torch.long, device=model.device)
        super().__init__(encoder_out.shape[0], model.device)

    def _new_cache(self) -> EncoderDecoderCache:
        # self-attention grows every step: written in place (models.kv_cache); cross-attention once per window
        cross, given = DynamicCache(), self.cross
        self.cross = None  # not kept beside the cache: once rows leave, these full-batch tensors would linger
        for i, (k, v) in enumerate(given or ()):
            cross.update(k, v, i)
        return EncoderDecoderCache(BufferedCache(), cross)  # marks the layers given as computed (is_updated)

    def _run(self, input_ids, attention_mask, position_ids, keep, cache, rows) -> torch.Tensor:
        encoder_out = self.encoder_out if len(rows) == self.encoder_out.shape[0] else self.encoder_out[rows]
        lean = getattr(self.model, "lean_decoder", None)  # speech.lean_decoder.attach, where it applies
        if lean is not None:
            hidden = lean.hidden(input_ids, attention_mask, position_ids, cache, encoder_out, keep)  # [b, keep, d]
            logits = (self.model.proj_out(hidden) if self.head is None else self.head(hidden)).float()
        else:
            inputs = dict(decoder_input_ids=input_ids, encoder_outputs=(encoder_out,),
                          decoder_attention_mask=attention_mask.long(), decoder_position_ids=position_ids,
                          past_key_values=cache, use_cache=True)
            if self.head is None:
                logits = self.model(**inputs).logits[:, -keep:].float()  # [b, keep, V]
            else:  # the reduced draft head: only its rows of the output projection are computed
                logits = self.head(self.model.model(**inputs).last_hidden_state[:, -keep:])
        if len(self.suppress):
            logits[..., self.suppress] = float("-inf")
        if len(self.begin_suppress):
            first = (position_ids[:, -keep:] == self.prompt_len - 1)[..., None]  # column predicts the first new token
            logits[..., self.begin_suppress] = logits[..., self.begin_suppress].masked_fill(first, float("-inf"))
        return logits

    def _select_rows(self, index: torch.Tensor) -> None:
        self.encoder_out = self.encoder_out.index_select(0, index)


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


def _cross_attention(pair: SpeechPair, encoder_out: torch.Tensor, with_draft: bool) -> tuple[list | None, list | None]:
    """A window's cross-attention keys and values for (target, draft), computed once (lean_decoder.cross_kv), for
    target-only runs as for speculative ones. A layer draft's layers are the target's, so it reads the target's
    own (fp16 copies where its lean decoder keeps them so), where before it projected the encoder's output again
    through its 4-bit copies of the same layers (~35 ms a window on the 2-core EPYC; its agreement with the target
    can only gain). None where the target's decoder is not on the kernels (transformers' forward computes its own
    on the first call), and for a draft that is not made of the target's layers."""
    cross = lean_decoder.cross_kv(pair.target, encoder_out)
    if cross is None or not with_draft or pair.draft_layers is None:
        return cross, None
    draft = getattr(pair.draft, "lean_decoder", None)
    return cross, [draft.kept(*cross[i]) if draft is not None else cross[i] for i in pair.draft_layers]


def _clock(seconds: float) -> str:
    return f"{int(seconds) // 60}:{int(seconds) % 60:02d}"


class SpeechSource:
    """Audio clips as sequences: every 30 s window of every clip is one sequence, decoded independently
    (no text carried between windows), so the windows of one long clip batch as well as several clips do.
    The encoder runs once per window when its group enters the batch; draft and target both read it."""

    def __init__(self, pair: SpeechPair, clips: list[tuple[str, np.ndarray]], language: str | None = "en",
                 draft_vocab: int = 0):
        self.pair, self.language = pair, language
        self.prompt = decoder_prompt(pair.processor, pair.target, language)
        tok = pair.processor.tokenizer
        # timestamps and language tokens are specials: they stay in the draft's head whatever its size
        self.draft_head = subset_head(pair.draft, pair.vocab_size, draft_vocab, special_ids(tok) | set(self.prompt))
        gc = pair.target.generation_config
        self.vocab = Vocabulary(with_token_texts_kept(tok.decode), frozenset({gc.eos_token_id}), pair.vocab_size)
        self.suppress, self.begin = list(gc.suppress_tokens or []), list(gc.begin_suppress_tokens or [])
        self.device = pair.device
        self.sequences: list[SequenceSpec] = []
        self.chunks: list[np.ndarray] = []
        self.clip_seconds = []
        names = unique_names([name for name, _ in clips])
        for c, (name, (_, audio)) in enumerate(zip(names, clips)):
            parts = windows(audio)
            self.clip_seconds.append(len(audio) / SAMPLE_RATE)
            for w, (start, chunk) in enumerate(parts):
                end = start + len(chunk) / SAMPLE_RATE
                label = name if len(parts) == 1 else f"{name} · {_clock(start)}–{_clock(end)}"
                self.sequences.append(SequenceSpec(list(self.prompt), label, name,
                                                   {"input": c, "window": w, "start_s": start, "end_s": end}))
                self.chunks.append(chunk)

    def decoders(self, rows: list[int], with_draft: bool) -> tuple[WhisperDecoder | None, WhisperDecoder]:
        pair = self.pair
        features = pair.processor.feature_extractor([self.chunks[r] for r in rows], sampling_rate=SAMPLE_RATE,
                                                    return_tensors="pt").input_features
        encoder_out = encoder.encode(pair.target, features)
        target_cross, draft_cross = _cross_attention(pair, encoder_out, with_draft)
        make = lambda model, head, cross: WhisperDecoder(model, encoder_out, len(self.prompt),  # noqa: E731
                                                         self.suppress, self.begin, head, cross)
        draft = make(pair.draft, self.draft_head, draft_cross) if with_draft else None
        return draft, make(pair.target, None, target_cross)

    def detokenize(self, ids: list[int]) -> str:
        return self.pair.processor.tokenizer.decode(ids, skip_special_tokens=True).strip()

    def meta(self) -> dict:
        pair = self.pair
        return {"task": "transcribe", "draft": pair.draft_name, "target": pair.target_name,
                "device": device_name(pair.device), "dtype": str(pair.dtype).removeprefix("torch."),
                "vocab_size": pair.vocab_size, "draft_vocab_size": draft_head_size(self.draft_head, pair.vocab_size),
                "audio_seconds": sum(self.clip_seconds), "language": self.language,
                "draft_weights": decoder_weights(pair.draft), "target_weights": decoder_weights(pair.target),
                "target_encoder": encoder.describe(pair.target),
                "prompt_text": pair.processor.tokenizer.decode(self.prompt)}


def word_error_rate(reference: str, hypothesis: str) -> float:
    """WER after Whisper's English text normalization (jiwer for the alignment)."""
    import jiwer
    from transformers.models.whisper.english_normalizer import EnglishTextNormalizer

    normalize = EnglishTextNormalizer({})
    ref, hyp = normalize(reference), normalize(hypothesis)
    if not ref.strip():
        raise ValueError("the reference transcript is empty")
    return float(jiwer.wer(ref, hyp))
