"""Speech: audio decoding and its refusals, Whisper decoders on the shared loop (tiny random Whisper), the
layer-sharing draft, and, marked real, the embedded Whisper base on the bundled clip."""

from __future__ import annotations

import copy
import math

from types import SimpleNamespace

import numpy as np
import pytest
import soundfile as sf
import torch
from torch import nn
from transformers import GenerationConfig, WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

from specviz.speech.asr import (SpeechPair, SpeechSource, WhisperDecoder, decoder_prompt, decoder_weights,
                                kernel_decoder, layer_draft, load_speech_pair, quantized_layer_draft, word_error_rate)
from specviz.speech import encoder, lean_decoder
from specviz.speech.audio import SAMPLE_RATE, AudioError, load_audio, to_model_input
from specviz.config import SamplingConfig, SpecConfig
from specviz.models import cpu_kernels
from specviz.models.half_linear import HalfLinear
from specviz.models.loading import ModelLoadError
from specviz.text.prompts import ASSETS
from specviz.runs.decode import transcribe as transcribe_clips

from conftest import word_tokenizer

SAMPLE = ASSETS / "sample_speech.flac"
REFERENCE = (ASSETS / "sample_speech.txt").read_text()
TINY_V = 300


# ---- audio in ---------------------------------------------------------------------------------------

def _tone(seconds: float, rate: int, freq: float = 220) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


@pytest.mark.parametrize("fmt, subtype", [("WAV", "PCM_16"), ("FLAC", "PCM_16"), ("OGG", "VORBIS")])
def test_formats_decode_to_16k_mono(tmp_path, fmt, subtype):
    path = tmp_path / f"tone.{fmt.lower()}"
    stereo = np.stack([_tone(1.5, 44_100), _tone(1.5, 44_100)], axis=1)
    sf.write(path, stereo, 44_100, format=fmt, subtype=subtype)
    audio = load_audio(path)
    assert audio.dtype == np.float32 and audio.ndim == 1
    assert abs(len(audio) - 1.5 * SAMPLE_RATE) <= 1


def test_empty_file(tmp_path):
    path = tmp_path / "empty.wav"
    path.write_bytes(b"")
    with pytest.raises(AudioError, match="empty"):
        load_audio(path)


def test_not_audio(tmp_path):
    path = tmp_path / "notes.wav"
    path.write_text("this is a text file, not a recording\n" * 20)
    with pytest.raises(AudioError, match="could not be decoded as audio.*readable formats: .*FLAC"):
        load_audio(path)


def test_unsupported_container(tmp_path):
    path = tmp_path / "clip.m4a"
    path.write_bytes(b"\x00\x00\x00\x20ftypM4A " + bytes(400))
    with pytest.raises(AudioError, match="could not be decoded"):
        load_audio(path)


def test_truncated_wav(tmp_path):
    path = tmp_path / "full.wav"
    sf.write(path, _tone(2.0, 16_000), 16_000, subtype="PCM_16")
    cut = tmp_path / "cut.wav"
    cut.write_bytes(path.read_bytes()[: 44 + 16_000])  # header + half a second of the announced two
    with pytest.raises(AudioError, match="truncated: its header announces 64,000 bytes"):
        load_audio(cut)


def test_truncated_flac(tmp_path):
    path = tmp_path / "full.flac"
    sf.write(path, _tone(2.0, 16_000), 16_000)
    cut = tmp_path / "cut.flac"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(AudioError, match="truncated or corrupt"):
        load_audio(cut)


def test_silence(tmp_path):
    path = tmp_path / "silence.wav"
    sf.write(path, np.zeros(16_000, dtype=np.float32), 16_000)
    with pytest.raises(AudioError, match="silent"):
        load_audio(path)


def test_missing_file(tmp_path):
    with pytest.raises(AudioError, match="no such audio file"):
        load_audio(tmp_path / "nope.wav")


def test_resampling_uses_the_right_ratio():
    for rate in (8_000, 22_050, 44_100, 48_000):
        out = to_model_input(_tone(2.0, rate)[:, None], rate)
        assert abs(len(out) - 2 * SAMPLE_RATE) <= 2


# ---- tiny Whisper on the shared loop --------------------------------------------------------------

def transcribe(pair, audio, cfg, target_only=False, **kwargs):
    return transcribe_clips(pair, [("clip", audio)], cfg, target_only=target_only, **kwargs)


def tiny_whisper(seed: int = 0) -> WhisperForConditionalGeneration:
    torch.manual_seed(seed)
    config = WhisperConfig(
        vocab_size=TINY_V, num_mel_bins=80, d_model=64, encoder_layers=2, decoder_layers=4,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
        max_source_positions=1500, max_target_positions=448, decoder_start_token_id=TINY_V - 3,
        pad_token_id=TINY_V - 1, eos_token_id=TINY_V - 1, bos_token_id=TINY_V - 1, init_std=0.3,
    )
    model = WhisperForConditionalGeneration(config).float().eval()
    model.generation_config = GenerationConfig(
        decoder_start_token_id=TINY_V - 3, eos_token_id=TINY_V - 1, pad_token_id=TINY_V - 1,
        no_timestamps_token_id=TINY_V - 2, suppress_tokens=[1, 2, 3], begin_suppress_tokens=[4, 5],
        is_multilingual=False,
    )
    return model


@pytest.fixture(scope="module")
def tiny_speech_pair() -> SpeechPair:
    target = tiny_whisper()
    processor = SimpleNamespace(tokenizer=word_tokenizer(TINY_V), feature_extractor=WhisperFeatureExtractor())
    return SpeechPair(target, layer_draft(target, (0, 1, 3)), processor, "tiny-whisper", "tiny layers [0, 1, 3]")


def test_layer_draft_shares_weights_and_keeps_the_target_intact(tiny_speech_pair):
    target, draft = tiny_speech_pair.target, tiny_speech_pair.draft
    assert len(draft.model.decoder.layers) == 3 and len(target.model.decoder.layers) == 4
    assert draft.model.decoder.layers[2].fc1.weight is target.model.decoder.layers[3].fc1.weight
    assert [layer.self_attn.layer_idx for layer in draft.model.decoder.layers] == [0, 1, 2]
    assert [layer.self_attn.layer_idx for layer in target.model.decoder.layers] == [0, 1, 2, 3]
    assert draft.model.encoder is target.model.encoder
    with pytest.raises(ValueError, match="increasing indices"):
        layer_draft(target, (3, 1))


@pytest.mark.parametrize("mode", ["baseline", "exact"])
@pytest.mark.parametrize("policy", ["constant", "hf", "bass", "optimal"])
def test_greedy_speculative_transcript_equals_target_only(tiny_speech_pair, mode, policy):
    audio = _tone(3.0, SAMPLE_RATE)
    cfg = SpecConfig(mode=mode, gamma_policy=policy, max_new_tokens=30)
    reference = transcribe(tiny_speech_pair, audio, cfg, target_only=True)
    trace = transcribe(tiny_speech_pair, audio, cfg)
    assert trace.outputs == reference.outputs
    assert len(trace.outputs[0]) > 0
    assert all(t not in (1, 2, 3) for t in trace.outputs[0])  # suppressed tokens never appear
    assert trace.sequences[0].prompt_ids == [TINY_V - 3, TINY_V - 2]  # start + no-timestamps are the marked prompt


@pytest.mark.parametrize("batch_size", [1, 3])
def test_long_audio_is_windowed_and_its_windows_batch(tiny_speech_pair, batch_size):
    """65 s: three windows, each one sequence; decoded together they give what each gives alone."""
    audio = _tone(65.0, SAMPLE_RATE) + 0.1 * np.random.default_rng(0).standard_normal(65 * SAMPLE_RATE).astype(np.float32)
    cfg = SpecConfig(mode="exact", max_new_tokens=12)
    trace = transcribe(tiny_speech_pair, audio, cfg, batch_size=batch_size)
    assert [s.info["start_s"] for s in trace.sequences] == [0.0, 30.0, 60.0]
    assert trace.sequences[-1].info["end_s"] == pytest.approx(65.0)
    assert {len(step.sequences) for step in trace.steps} <= {1, 2, 3} and trace.batch_size == batch_size
    alone = [transcribe_clips(tiny_speech_pair, [("w", chunk)], cfg, target_only=True).outputs[0]
             for chunk in (audio[:30 * SAMPLE_RATE], audio[30 * SAMPLE_RATE:60 * SAMPLE_RATE], audio[60 * SAMPLE_RATE:])]
    assert trace.outputs == alone
    assert list(trace.texts()) == ["clip"]  # one clip, one output text


def test_several_clips_decode_as_one_batch(tiny_speech_pair):
    clips = [(f"c{i}", _tone(f, SAMPLE_RATE, freq=220 * (i + 1))) for i, f in enumerate((2.0, 4.0, 3.0))]
    cfg = SpecConfig(mode="baseline", gamma_policy="bass", max_new_tokens=20)
    batched = transcribe_clips(tiny_speech_pair, clips, cfg)
    assert batched.batch_size == 3
    for i, clip in enumerate(clips):
        assert batched.outputs[i] == transcribe_clips(tiny_speech_pair, [clip], cfg, target_only=True).outputs[0]


def test_the_quantized_layer_draft_leaves_the_target_unquantized():
    target = tiny_whisper()
    before = {k: v.clone() for k, v in target.state_dict().items()}
    draft, kind = quantized_layer_draft(target, (0, 1, 3))
    assert kind == ("4-bit" if cpu_kernels.has_int8_activations() else "int8")
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())
    assert isinstance(target.model.decoder.layers[0].fc1, torch.nn.Linear)
    assert isinstance(target.model.decoder.layers[0].self_attn.q_proj, torch.nn.Linear)
    assert isinstance(target.proj_out, torch.nn.Linear) and not isinstance(draft.proj_out, torch.nn.Linear)
    assert not isinstance(draft.model.decoder.layers[2].fc1, torch.nn.Linear)  # the draft's copy is quantized
    assert draft.model.encoder is target.model.encoder


@pytest.mark.parametrize("fp16_target", [False, True])
@pytest.mark.parametrize("draft_vocab", [0, 40])
@pytest.mark.parametrize("confidence", [0.0, 0.5])
def test_greedy_equality_with_the_quantized_draft_and_a_reduced_head(draft_vocab, confidence, fp16_target):
    """Quantized copies of three of four layers, a head over 40 of 300 tokens (plus the specials), a draft-confidence
    stop that ends rows at different points: three clips in one batch still give target-only's transcripts; also
    with the target's decoder on specviz's kernels (kernel_decoder, as the embedded Whisper runs on the CPU)."""
    target = tiny_whisper()
    if fp16_target:
        with torch.no_grad():
            for p in target.parameters():
                p.copy_(p.half().float())
        assert kernel_decoder(target) == (4 * 10 + 1 if cpu_kernels.available() else 0)  # 10 linears a layer, the head
        lean_decoder.attach(target)
    processor = SimpleNamespace(tokenizer=word_tokenizer(TINY_V), feature_extractor=WhisperFeatureExtractor())
    # as load_speech_pair runs it: the quantized draft's cross-attention keys and values in fp16, the target's own
    # (computed once a window) where both decoders are lean
    pair = SpeechPair(target, lean_decoder.attach(quantized_layer_draft(target, (0, 1, 3))[0], torch.float16),
                      processor, "tiny", "tiny quantized", draft_layers=(0, 1, 3))
    clips = [(f"c{i}", _tone(f, SAMPLE_RATE, freq=220 * (i + 1))) for i, f in enumerate((2.0, 4.0, 3.0))]
    cfg = SpecConfig(mode="exact", gamma_policy="bass", max_new_tokens=24, draft_vocab=draft_vocab,
                     draft_confidence=confidence)
    reference = transcribe_clips(pair, clips, cfg, target_only=True)
    trace = transcribe_clips(pair, clips, cfg)
    assert trace.outputs == reference.outputs
    assert trace.meta["draft_vocab_size"] == (TINY_V if draft_vocab == 0 else 40 + 3)  # + start, no-timestamps, EOS
    if confidence:
        steps = {}
        for d in trace.decisions():
            steps.setdefault(d.step, set()).add(d.gamma)
        assert any(len(g) > 1 for g in steps.values()), "no ragged iteration: the test would prove little"


@pytest.mark.skipif(not cpu_kernels.available() or not cpu_kernels.has_attention(), reason="needs specviz's kernels")
def test_a_layer_draft_reads_the_targets_cross_attention_keys_and_values():
    """A window's cross-attention keys and values are computed once, by the target: a layer draft's caches hold
    fp16 copies of its layers' (not a second projection through its 4-bit copies); the target's are the same
    bits whichever windows share the batch."""
    target = tiny_whisper()
    with torch.no_grad():
        for p in target.parameters():
            p.copy_(p.half().float())
    kernel_decoder(target)
    lean_decoder.attach(target)
    processor = SimpleNamespace(tokenizer=word_tokenizer(TINY_V), feature_extractor=WhisperFeatureExtractor())
    pair = SpeechPair(target, lean_decoder.attach(quantized_layer_draft(target, (0, 1, 3))[0], torch.float16),
                      processor, "tiny", "tiny quantized", draft_layers=(0, 1, 3))
    source = SpeechSource(pair, [("a", _tone(2.0, SAMPLE_RATE)), ("b", _tone(3.0, SAMPLE_RATE, freq=440))])
    draft, tgt = source.decoders([0, 1], with_draft=True)
    encoder_out = tgt.encoder_out
    _, alone = SpeechSource(pair, [("b", _tone(3.0, SAMPLE_RATE, freq=440))]).decoders([0], with_draft=False)
    for i, layer in enumerate(target.model.decoder.layers):
        a = layer.encoder_attn
        keys = tgt.cache.cross_attention_cache.layers[i].keys
        # torch's GEMM a window at a time: the kernel's values up to rounding, and the same bits for a window
        # decoded alone (target-only and speculative runs alike)
        torch.testing.assert_close(keys, a.k_proj(encoder_out).view(2, -1, 4, 16).transpose(1, 2), rtol=1e-5, atol=1e-5)
        assert torch.equal(keys[1:], alone.cache.cross_attention_cache.layers[i].keys)
    for i, t in enumerate((0, 1, 3)):
        kept = draft.cache.cross_attention_cache.layers[i]
        assert kept.keys.dtype == torch.float16
        assert torch.equal(kept.values, tgt.cache.cross_attention_cache.layers[t].values.half())
    assert all(draft.cache.is_updated.values()) and len(draft.cache.is_updated) == 3


def test_a_draft_keeps_fp16_cross_attention_only_where_every_number_fits():
    """lean_decoder's fp16 copies: a layer whose keys or values leave fp16's range (or hold a NaN) keeps fp32, so a
    draft never reads an infinity its fp32 numbers did not have."""
    forward = lean_decoder.LeanWhisperDecoder(tiny_whisper(), torch.float16)
    k, v = torch.randn(1, 4, 30, 16), torch.randn(1, 4, 30, 16)
    kept_k, kept_v = forward.kept(k, v)
    assert kept_k.dtype == kept_v.dtype == torch.float16 and torch.equal(kept_k, k.half())
    largest = torch.finfo(torch.float16).max
    for bad in (largest * 1.01, -largest * 1.01, float("nan"), float("inf")):
        out_of_range = v.clone()
        out_of_range[0, 2, 7, 3] = bad
        kept_k, kept_v = forward.kept(k, out_of_range)
        assert kept_k is k and kept_v is out_of_range
    at_the_edge = v.clone()
    at_the_edge[0, 0, 0, 0] = -largest
    assert torch.isfinite(forward.kept(k, at_the_edge)[1]).all()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_sampled_ragged_speech_batch_keeps_every_distribution_finite(seed):
    """Issue 22: clips of different lengths decoded as one batch, rows stopping their drafts at different
    points (confidence stop) over a reduced int8 head, sampled: this once produced NaN draft logits. The
    verifier refuses NaN or inf logits (InvalidLogitsError), so a finished run with finite p and q at every
    drafted token is the check."""
    target = tiny_whisper()
    processor = SimpleNamespace(tokenizer=word_tokenizer(TINY_V), feature_extractor=WhisperFeatureExtractor())
    pair = SpeechPair(target, quantized_layer_draft(target, (0, 1, 3))[0], processor, "tiny", "tiny quantized")
    clips = [(f"c{i}", _tone(f, SAMPLE_RATE, freq=220 * (i + 1))) for i, f in enumerate((1.0, 7.0, 3.5))]
    cfg = SpecConfig(mode="exact", sampling=SamplingConfig(temperature=1.0), gamma_policy="bass", max_new_tokens=24,
                     draft_vocab=40, draft_confidence=0.5, seed=seed)
    trace = transcribe_clips(pair, clips, cfg)
    drafted = trace.drafted()
    assert drafted
    for d in drafted:
        assert all(math.isfinite(x) and 0 <= x <= 1 for x in d.p + d.q + d.accept_prob), d
    gammas: dict[int, set[int]] = {}
    for d in drafted:
        gammas.setdefault(d.step, set()).add(d.gamma)
    assert any(len(g) > 1 for g in gammas.values()), "no ragged iteration: the test would prove little"


def test_word_error_rate_normalizes():
    assert word_error_rate("Hello, World!", "hello world") == 0.0
    assert word_error_rate("the cat sat down", "the cat down") == pytest.approx(0.25)
    assert word_error_rate("it costs 11 dollars", "it costs eleven dollars") == 0.0  # Whisper-style numbers
    with pytest.raises(ValueError, match="empty"):
        word_error_rate("  ", "x")


def test_speech_pair_checks_vocabulary_and_encoder():
    from specviz.speech.asr import check_speech_pair

    target = tiny_whisper()
    same = SimpleNamespace(tokenizer=word_tokenizer(TINY_V))
    other = SimpleNamespace(tokenizer=word_tokenizer(TINY_V, prefix="x"))
    with pytest.raises(ModelLoadError, match="vocabularies differ: draft 'english-only'.*target 'multi'"):
        check_speech_pair(tiny_whisper(1), other, target, same, "english-only", "multi")
    wide = WhisperForConditionalGeneration(WhisperConfig(
        vocab_size=TINY_V, d_model=96, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, pad_token_id=TINY_V - 1,
        bos_token_id=TINY_V - 1, eos_token_id=TINY_V - 1, decoder_start_token_id=TINY_V - 3))
    with pytest.raises(ModelLoadError, match="cannot read the target's encoder output: d_model"):
        check_speech_pair(wide, same, target, same, "wide", "tiny")
    check_speech_pair(tiny_whisper(2), same, target, same, "ok", "tiny")  # compatible: no error


def test_mismatched_speech_pair_is_refused(tmp_path):
    target_dir = tmp_path / "t"
    tiny_whisper().save_pretrained(target_dir)
    with pytest.raises(ModelLoadError, match="could not load the Whisper model"):
        load_speech_pair(str(target_dir), "default", device="cpu")  # no processor saved beside the model


# ---- the encoder's precision (speech.encoder) ----------------------------------------------------------------

def _features(windows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(windows, 80, 3000, generator=torch.Generator().manual_seed(seed))


def _timer(seconds: dict[str, float], calls_made: list[str]):
    """A stand-in clock: runs every call once (so the measured paths execute) and reports `seconds`."""
    def timer(calls):
        for name, call in calls.items():
            call()
            calls_made.append(name)
        return dict(seconds)
    return timer


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECVIZ_CACHE", str(tmp_path))
    monkeypatch.delenv(encoder.ENCODER_ENV, raising=False)
    return tmp_path


@pytest.mark.skipif(not encoder._bf16_capable(), reason="torch has no bf16 kernels for this CPU")
def test_auto_takes_bf16_only_where_it_measures_faster_and_caches_the_measurement(own_cache):
    fast, slow = tiny_whisper(), tiny_whisper()
    features = _features(1)
    with torch.inference_mode():
        fp32_out = fast.model.encoder(features).last_hidden_state
    made: list[str] = []
    chosen = encoder.choose(fast, "tiny", timer=_timer({"fp32": 1.0, "bf16": 0.6}, made))
    assert chosen["encoder"] == "bf16" and sorted(made) == ["bf16", "fp32"] and "0.60 s" in chosen["why"]
    with torch.inference_mode():
        out = encoder.encode(fast, features)
    assert out.dtype == torch.float32 and not torch.equal(out, fp32_out)
    assert ((out - fp32_out).norm() / fp32_out.norm()).item() < 0.03  # bf16 products, fp32 norms and attention
    assert "bf16" in encoder.describe(fast) and encoder.describe(slow) == "float32"
    # the cached measurement decides the next load on this machine: no timing
    again = encoder.choose(slow, "tiny", timer=lambda calls: pytest.fail("timed again despite the cache"))
    assert again["encoder"] == "bf16"
    # a bf16 only 5% faster is not worth its rounding (MARGIN): fp32, the same bits as the encoder alone
    other = tiny_whisper()
    assert encoder.choose(other, "tiny-2", timer=_timer({"fp32": 1.0, "bf16": 0.95}, []))["encoder"] == "fp32"
    with torch.inference_mode():
        assert torch.equal(encoder.encode(other, features), fp32_out)


def test_asked_precisions_and_refusals(own_cache, monkeypatch):
    model = tiny_whisper()
    features = _features(1)
    with torch.inference_mode():
        plain = model.model.encoder(features).last_hidden_state
        assert encoder.choose(model, "tiny", "fp32") == {"encoder": "fp32", "why": "asked for"}
        assert torch.equal(encoder.encode(model, features), plain)
        assert encoder.choose(model, "tiny", "bf16")["encoder"] == "bf16"
        assert not torch.equal(encoder.encode(model, features), plain)
        # back to fp32: the encoder's attention wrapper is plain SDPA on fp32 inputs, so the same bits again
        encoder.choose(model, "tiny", "fp32")
        assert torch.equal(encoder.encode(model, features), plain)
    monkeypatch.setenv(encoder.ENCODER_ENV, "fp16")
    with pytest.raises(ValueError, match="use one of auto, fp32, bf16"):
        encoder.choose(model, "tiny")
    # a model that is not fp32 keeps its own dtype: bf16 here is a choice for fp32 CPU models only
    half = tiny_whisper().to(torch.bfloat16)
    assert encoder.choose(half, "tiny", "bf16")["encoder"] == "bfloat16"
    assert not encoder._uses_bf16(half.model.encoder)


def test_bf16_encoder_keeps_windows_apart_and_the_decoders_attention():
    model = tiny_whisper()
    kernel_decoder(model)
    decoder_attention = model.model.decoder.config._attn_implementation
    encoder.choose(model, "tiny", "bf16")
    assert model.model.decoder.config._attn_implementation == decoder_attention
    assert model.model.encoder.layers[0].self_attn.config._attn_implementation == encoder.ATTENTION
    assert model.dtype == torch.float32  # the weights stay fp32: only the products are bf16
    features = _features(3, seed=1)
    with torch.inference_mode():
        together = encoder.encode(model, features)
        alone = [encoder.encode(model, features[b:b + 1]) for b in range(3)]
    assert all(torch.equal(together[b:b + 1], alone[b]) for b in range(3))  # a window's bits, whatever its batch


def _encoder_64(seed: int) -> WhisperForConditionalGeneration:
    """One encoder layer with heads 64 wide (Whisper's: the bf16 attention kernel's width)."""
    torch.manual_seed(seed)
    config = WhisperConfig(vocab_size=TINY_V, num_mel_bins=80, d_model=128, encoder_layers=2, decoder_layers=1,
                           encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=256,
                           decoder_ffn_dim=128, max_source_positions=1500, pad_token_id=TINY_V - 1)
    return WhisperForConditionalGeneration(config).float().eval()


@pytest.mark.parametrize("model_of", [tiny_whisper, _encoder_64], ids=["heads-16", "heads-64"])
def test_the_lean_encoder_gives_transformers_bits(model_of):
    """speech.lean_encoder: in fp32 the bits of transformers' encoder, with bf16 products those of transformers'
    encoder under autocast (the same attention, registered by speech.encoder: the kernel for heads 64 wide where
    it builds, SDPA on fp32 copies elsewhere), every window of a batch on its own."""
    model = model_of(7)
    features = _features(2, seed=8)
    transformers_encoder = model.model.encoder
    with torch.inference_mode():
        encoder.choose(model, "tiny", "fp32")
        fp32 = encoder.encode(model, features)
        reference = torch.cat([transformers_encoder(features[b:b + 1]).last_hidden_state for b in range(2)])
        assert torch.equal(fp32, reference)
        encoder.choose(model, "tiny", "bf16")
        bf16 = encoder.encode(model, features)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            reference = torch.cat([transformers_encoder(features[b:b + 1]).last_hidden_state for b in range(2)])
    assert bf16.dtype == torch.float32 and torch.equal(bf16, reference.float())
    assert not torch.equal(bf16, fp32)  # the products were bf16's
    # the bf16 copies were made once, when the encoder was marked, and are the fp32 weights rounded
    lean = transformers_encoder.lean_bf16
    assert torch.equal(lean.layers[0].fc1[0], transformers_encoder.layers[0].fc1.weight.bfloat16())
    assert transformers_encoder.layers[0].fc1.weight.dtype == torch.float32


@pytest.mark.skipif(not cpu_kernels.has_bf16_attention(), reason="the bf16 attention needs AVX-512 BF16")
def test_bf16_encoder_attention_runs_on_the_kernel_as_fp32_sdpa_would(monkeypatch):
    """Heads 64 wide (Whisper's): under bf16 products the encoder's attention goes to specviz's kernel, whose
    output is fp32 SDPA's on the same bf16 numbers up to fp32 rounding, so at most one bf16 step apart once
    rounded for out_proj; a window keeps its bits whatever its batch."""
    torch.manual_seed(3)
    config = WhisperConfig(vocab_size=TINY_V, num_mel_bins=80, d_model=128, encoder_layers=1, decoder_layers=1,
                           encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=128,
                           decoder_ffn_dim=128, max_source_positions=1500, pad_token_id=TINY_V - 1)
    model = WhisperForConditionalGeneration(config).float().eval()
    encoder.choose(model, "tiny-64", "bf16")
    attention = model.model.encoder.layers[0].self_attn
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 1500, 64, generator=g).bfloat16() for _ in range(3))
    calls = []
    real = cpu_kernels.bf16_attention
    monkeypatch.setattr(cpu_kernels, "bf16_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    with torch.inference_mode():
        on_kernel, _ = encoder._fp32_attention(attention, q, k, v, None, scaling=1.0)
        features = _features(2, seed=5)
        together = encoder.encode(model, features)
        alone = [encoder.encode(model, features[b:b + 1]) for b in range(2)]
        monkeypatch.setattr(cpu_kernels, "has_bf16_attention", lambda: False)
        on_sdpa, _ = encoder._fp32_attention(attention, q, k, v, None, scaling=1.0)
    assert len(calls) == 1 + 2 + 2  # the direct call, then the encoder's one layer per window, twice
    assert on_kernel.dtype == on_sdpa.dtype == torch.bfloat16 and on_kernel.shape == (1, 1500, 2, 64)
    torch.testing.assert_close(on_kernel.float(), on_sdpa.float(), rtol=2 ** -7, atol=1e-6)
    assert (on_kernel != on_sdpa).float().mean().item() < 0.01  # rounded the other way only near a midpoint
    assert all(torch.equal(together[b:b + 1], alone[b]) for b in range(2))


def test_a_speech_trace_names_its_encoder(tiny_speech_pair):
    encoder.choose(tiny_speech_pair.target, "tiny", "fp32")
    trace = transcribe(tiny_speech_pair, _tone(1.0, SAMPLE_RATE), SpecConfig(max_new_tokens=4), target_only=True)
    assert trace.meta["target_encoder"] == "float32"
    from specviz.figures.report import summary_markdown
    from specviz.traces.json_format import loads_trace

    trace.meta["target_weights"] = "dense float32"  # the tiny target's layers are torch's: give the line its start
    assert "the encoder: float32" in summary_markdown(trace)
    trace.meta["target_encoder"] = 32
    with pytest.raises(Exception, match="target_encoder"):  # a malformed trace names the field it refuses
        loads_trace(trace.to_json())


# ---- the speech draft's layers in one native call (speech.native_whisper) ----------------------------------

def _native_pair() -> SpeechPair:
    """The embedded pair's shape of draft on tiny Whisper: the target on the kernels, a 4-bit layer draft whose
    layers run natively (as load_speech_pair builds them)."""
    target = tiny_whisper()
    kernel_decoder(target)
    draft, _ = quantized_layer_draft(target, (0, 1, 3))
    processor = SimpleNamespace(tokenizer=word_tokenizer(TINY_V), feature_extractor=WhisperFeatureExtractor())
    return SpeechPair(lean_decoder.attach(target), lean_decoder.attach(draft, torch.float16, native=True), processor,
                      "tiny", "tiny layers [0, 1, 3] (native)", (0, 1, 3))


needs_native = pytest.mark.skipif(not cpu_kernels.has_int8_activations(), reason="the 8-bit-activation kernels do not "
                                  "build here")


@needs_native
def test_the_native_draft_is_the_lean_drafts_numbers_up_to_rounding_and_batch_invariant():
    pair = _native_pair()
    lean = pair.draft.lean_decoder
    assert lean.native is not None and getattr(pair.target.lean_decoder, "native", None) is None  # drafts only
    clips = [("a", _tone(2.0, SAMPLE_RATE)), ("b", _tone(5.0, SAMPLE_RATE, freq=440))]
    source = SpeechSource(pair, clips)
    feeds = [list(source.prompt) + [7, 8, 9, 10], list(source.prompt) + [11, 12]]

    def logits(native: bool, rows: list[int]) -> torch.Tensor:
        lean_native = lean.native
        lean.native = lean_native if native else None
        try:
            draft, _ = source.decoders(rows, True)
            draft.prefill([feeds[r][:3] for r in rows])
            return draft.forward([feeds[r][3:] for r in rows], 1)[:, -1]  # [rows, V]
        finally:
            lean.native = lean_native
    native, python = logits(True, [0, 1]), logits(False, [0, 1])
    finite = torch.isfinite(python)
    assert torch.equal(finite, torch.isfinite(native))
    # the 8-bit activations turn rounding into whole code steps: the fp64 layer norm moved this forward by 0.2-0.8%
    # on the embedded draft; here within 5%, the same most likely token
    assert ((native - python)[finite].norm() / python[finite].norm()).item() < 0.05
    assert torch.equal(native.argmax(-1), python.argmax(-1))
    # a row's bits whatever else the call holds: alone, or beside a row of another length and clip
    assert torch.equal(logits(True, [1])[0], native[1])


@needs_native
@pytest.mark.parametrize("mode", ["baseline", "exact"])
def test_the_native_draft_output_follows_the_target(mode):
    """The first emitted token follows p with the native draft's q (its logits after the prompt of a real tiny
    Whisper window): chi-square goodness of fit, sample size to detect TV 0.02 with power 0.99 at level
    FAMILY_ALPHA / 2, fixed seeds (tests/test_verify_statistics.py)."""
    from test_verify_statistics import FAMILY_ALPHA, POWER, Pair, gof_failure, probs_of, run_copies, samples_to_detect_tv

    pair = _native_pair()
    source = SpeechSource(pair, [("a", _tone(3.0, SAMPLE_RATE))])
    draft, target = source.decoders([0], True)
    prompt = list(source.prompt)
    draft.prefill([prompt[:-1]])
    target.prefill([prompt[:-1]])
    with torch.inference_mode():
        q = draft.forward([[prompt[-1]]], 1)[0]  # [1, V]: the draft's next-token logits
        p = target.forward([[prompt[-1], 5]], 2)[0]  # [2, V]: the target's, and after one drafted token
    sampling = SamplingConfig(temperature=1.0)
    probs = probs_of(p[0], sampling)
    assert 0.5 * np.abs(probs - probs_of(q[0], sampling)).sum() > 0.1  # a draft far enough from p to test much
    alpha = FAMILY_ALPHA / 2
    n = samples_to_detect_tv(0.02, int((probs > 0).sum()) - 1, alpha, POWER)
    out = run_copies(mode, Pair(f"native_whisper_{mode}", q, p, sampling), n, seed=77)
    counts = torch.bincount(out.first_token, minlength=p.shape[-1]).numpy()
    assert (failure := gof_failure(counts, probs, alpha)) is None, failure


@needs_native
def test_speculation_with_the_native_draft_equals_target_only():
    pair = _native_pair()
    clips = [("a", _tone(2.0, SAMPLE_RATE)), ("b", _tone(6.0, SAMPLE_RATE, freq=330))]
    for sampling in (SamplingConfig(), SamplingConfig(temperature=0.9)):
        cfg = SpecConfig(mode="exact", sampling=sampling, max_new_tokens=20, seed=3)
        reference = transcribe_clips(pair, clips, cfg, target_only=True)
        trace = transcribe_clips(pair, clips, cfg)
        if sampling.temperature == 0:
            assert trace.outputs == reference.outputs
        assert trace.drafted()


# ---- the embedded Whisper base, real speech ------------------------------------------------------

@pytest.fixture(scope="module")
def base_pair():
    return load_speech_pair(device="cpu", dtype="fp32")


@pytest.mark.real
def test_sample_clip_wer(base_pair):
    trace = transcribe(base_pair, load_audio(SAMPLE), SpecConfig(max_new_tokens=200), target_only=True)
    assert word_error_rate(REFERENCE, trace.output_text) <= 0.2, trace.output_text


@pytest.mark.real
@pytest.mark.parametrize("mode, drafts", [("baseline", {}), ("exact", {}),
                                          ("exact", {"draft_vocab": 4096, "draft_kind": "lookup+model"})])
def test_sample_clip_speculative_equals_target_only(base_pair, mode, drafts):
    """The default int8 draft (on this CPU), and a 4,096-token head with prompt lookup first."""
    audio = load_audio(SAMPLE)
    reference = transcribe(base_pair, audio, SpecConfig(max_new_tokens=200), target_only=True)
    trace = transcribe(base_pair, audio, SpecConfig(mode=mode, max_new_tokens=200, **drafts))
    assert trace.outputs == reference.outputs
    assert trace.summary()["acceptance_rate"] > 0.4


@pytest.mark.real
def test_the_bf16_encoder_keeps_the_targets_distributions(base_pair):
    """bf16 products in the encoder against fp32, the target's next-token distributions along its own fp32 greedy
    transcript of the sample clip (teacher-forced): KL mean within 5e-4 (measured 1.0e-4; the text target's 8-bit
    activations cost 19e-4) and the same greedy token at ≥ 98% of positions (measured 100%)."""
    import torch.nn.functional as F

    target, processor = base_pair.target, base_pair.processor
    audio = load_audio(SAMPLE)
    features = processor.feature_extractor([audio], sampling_rate=SAMPLE_RATE, return_tensors="pt").input_features
    prompt = decoder_prompt(processor, target, "en")
    try:
        encoder.choose(target, base_pair.target_name, "fp32")
        ids = transcribe(base_pair, audio, SpecConfig(max_new_tokens=200), target_only=True).outputs[0]
        full = torch.tensor([prompt + ids])
        with torch.inference_mode():
            def logits():  # the positions that predicted each transcript token
                out = encoder.encode(target, features)
                return target(encoder_outputs=(out,), decoder_input_ids=full).logits[0, len(prompt) - 1:-1].float()
            reference = logits()
            encoder.choose(target, base_pair.target_name, "bf16")
            lowered = logits()
    finally:
        encoder.choose(target, base_pair.target_name, base_pair.encoder["encoder"])
    assert len(ids) > 40
    kl = (F.softmax(reference, -1) * (F.log_softmax(reference, -1) - F.log_softmax(lowered, -1))).sum(-1)
    assert kl.mean().item() < 5e-4, kl.mean().item()
    assert (lowered.argmax(-1) == reference.argmax(-1)).float().mean().item() >= 0.98


@pytest.mark.real
def test_rates_and_channels_give_the_same_transcript(base_pair, tmp_path):
    """The same speech at 8 / 16 / 44.1 / 48 kHz, mono or stereo, transcribes alike. The 16 kHz original is
    band-limited to 4 kHz first, so the 8 kHz copy loses nothing and the test measures our decoding and
    resampling, not the information an 8 kHz recording lacks."""
    # the encoder held at fp32: this 4 kHz-limited speech transcribes at WER ~0.55, where a change as small as bf16
    # products moves words; the test is about resampling
    chosen = encoder.choose(base_pair.target, base_pair.target_name, "fp32")
    try:
        _rates_and_channels(base_pair, tmp_path)
    finally:
        encoder.choose(base_pair.target, base_pair.target_name, base_pair.encoder["encoder"])
    assert chosen["encoder"] == "fp32"


def _rates_and_channels(base_pair, tmp_path):
    import scipy.signal

    data, rate = sf.read(SAMPLE, dtype="float32")
    original = scipy.signal.resample_poly(scipy.signal.resample_poly(data, 8_000, rate), 2, 1).astype(np.float32)
    sf.write(tmp_path / "original.wav", original, SAMPLE_RATE)
    base = transcribe(base_pair, load_audio(tmp_path / "original.wav"), SpecConfig(max_new_tokens=200),
                      target_only=True).output_text
    for new_rate, channels in ((8_000, 1), (16_000, 2), (44_100, 2), (48_000, 1)):
        up, down = new_rate // np.gcd(new_rate, SAMPLE_RATE), SAMPLE_RATE // np.gcd(new_rate, SAMPLE_RATE)
        clip = scipy.signal.resample_poly(original, up, down).astype(np.float32)
        if channels == 2:
            clip = np.stack([clip, 0.8 * clip], axis=1)
        path = tmp_path / f"clip_{new_rate}_{channels}.wav"
        sf.write(path, clip, new_rate)
        text = transcribe(base_pair, load_audio(path), SpecConfig(max_new_tokens=200), target_only=True).output_text
        assert word_error_rate(base, text) <= 0.2, (new_rate, channels, base, text)  # resampling filters differ


@pytest.mark.real
def test_the_kernel_decoder_transcribes_as_the_fp32_decoder_does(base_pair):
    """The embedded target runs its decoder on specviz's kernels (kernel_decoder: its own fp16 weights, the
    batch-invariant attention, the lean forward): on the bundled clip the same tokens as transformers' forward on
    fp32 torch linears, teacher-forced logits within fp32 rounding of theirs, and a verification call's rows the
    same bits as one-token steps (batch invariant, which torch's linears and SDPA were not)."""
    assert isinstance(base_pair.target.proj_out, HalfLinear)
    assert all(isinstance(m, HalfLinear) for m in base_pair.target.model.decoder.layers[0].modules()
               if isinstance(m, (nn.Linear, HalfLinear)))
    assert "4-bit" in base_pair.draft_name or not cpu_kernels.has_int8_activations()
    assert decoder_weights(base_pair.target) == ("fp16 weights, specviz fp16-weight kernel, batch-invariant attention, "
                                                 "lean forward")
    assert decoder_weights(base_pair.draft).startswith("Q4 (re-quantized by specviz) blocks")
    assert decoder_weights(base_pair.draft).endswith("layers in one native call")  # speech.native_whisper
    assert decoder_weights(tiny_whisper()).startswith("dense float32, ")
    fp32 = copy.deepcopy(base_pair.target)
    _dense_again(fp32)
    fp32.lean_decoder = None  # transformers' forward (with the batch-invariant attention) on fp32 torch linears
    audio = load_audio(SAMPLE)
    ours = transcribe(base_pair, audio, SpecConfig(max_new_tokens=200), target_only=True)
    theirs = transcribe(SpeechPair(fp32, base_pair.draft, base_pair.processor, "fp32", "d"), audio,
                        SpecConfig(max_new_tokens=200), target_only=True)
    assert ours.outputs == theirs.outputs
    source = SpeechSource(base_pair, [("clip", audio)])
    tokens = source.prompt + list(base_pair.processor.tokenizer(ours.output_text, add_special_tokens=False).input_ids)
    _, half_dec = source.decoders([0], with_draft=False)
    features = half_dec.encoder_out
    fp32_dec = WhisperDecoder(fp32, features, len(source.prompt), source.suppress, source.begin)
    with torch.inference_mode():
        half_dec.prefill([tokens[:3]])
        fp32_dec.prefill([tokens[:3]])
        rest = tokens[3:]
        a, b = half_dec.forward([rest], len(rest))[0], fp32_dec.forward([rest], len(rest))[0]
        finite = torch.isfinite(b)
        assert torch.equal(torch.isfinite(a), finite)
        assert (a[finite] - b[finite]).abs().max() < 1e-3 * b[finite].abs().max()
        half_dec.rollback([3])
        for i, t in enumerate(rest[:12]):  # one token at a time: the bits of the long call's rows
            assert torch.equal(half_dec.forward([[t]], 1)[0, 0], a[i]), f"position {i} differs from the long call"


@pytest.mark.skipif(not cpu_kernels.available() or not cpu_kernels.has_int8_activations(),
                    reason="the lean decoder needs the AVX2 build of the CPU kernels")
def test_the_lean_decoder_gives_transformers_bits():
    """speech.lean_decoder against transformers' Whisper decoder on the same modules (the kernel decoder's target
    and its 4-bit layer draft): prefill, ragged feeds, a rollback and the reduced head, bit for bit."""
    target = tiny_whisper()
    with torch.no_grad():
        for p in target.parameters():
            p.copy_(p.half().float())
    kernel_decoder(target)
    draft = quantized_layer_draft(target, (0, 1, 3))[0]
    processor = SimpleNamespace(tokenizer=word_tokenizer(TINY_V), feature_extractor=WhisperFeatureExtractor())
    pair = SpeechPair(target, draft, processor, "tiny", "tiny quantized")
    clips = [(f"c{i}", _tone(f, SAMPLE_RATE, freq=220 * (i + 1))) for i, f in enumerate((2.0, 3.0))]
    for model in (target, draft):
        lean_decoder.attach(model)
        assert model.lean_decoder is not None
        lean = model.lean_decoder
        for head_size in (0, 40):
            runs = []
            for use in (lean, None):
                model.lean_decoder = use
                source = SpeechSource(pair, clips, draft_vocab=head_size)
                d, t = source.decoders([0, 1], with_draft=True)
                dec = t if model is target else d
                dec.prefill([source.prompt, source.prompt])
                out = [dec.forward([[7, 8, 9], [10]], 3)]
                dec.rollback([len(source.prompt) + 1, len(source.prompt)])
                out.append(dec.forward([[11, 12], [13, 14]], 2))
                out.append(dec.forward([[15, 16, 17], [18, 19, 20]], 1))  # keep < W: the head on the last row only
                dec.select([1])  # a row leaves the batch: its cache and encoder output rows go with it
                out.append(dec.forward([[21, 22]], 2))
                runs.append(out)
            model.lean_decoder = lean
            assert all(torch.equal(a, b) for a, b in zip(*runs)), f"head {head_size}: the lean decoder's bits differ"
    assert lean_decoder.attach(tiny_whisper()).lean_decoder is None  # torch linears: transformers' forward
    # the draft's fp16 cross-attention keys and values: stored so, and logits within their rounding
    source = SpeechSource(pair, clips)
    outs = []
    for kv in (torch.float32, torch.float16):
        lean_decoder.attach(draft, kv)
        dec = source.decoders([0, 1], with_draft=True)[0]
        dec.prefill([source.prompt, source.prompt])
        outs.append(dec.forward([[7, 8], [9, 10]], 2))
        assert dec.cache.cross_attention_cache.layers[0].keys.dtype == kv
    finite = torch.isfinite(outs[0])
    assert torch.equal(finite, torch.isfinite(outs[1])) and not torch.equal(outs[0], outs[1])
    # the tiny model's weights are large (init 0.3), so its keys are too: fp16 rounding moves its logits ~2%
    assert (outs[0] - outs[1])[finite].abs().max() < 0.05 * outs[0][finite].abs().max()


def test_without_the_kernels_the_decoder_stays_on_transformers(monkeypatch):
    """Where the kernels cannot build (no compiler, say), kernel_decoder changes nothing and raises nothing:
    speech loads on torch as before."""
    def no_build():
        raise cpu_kernels.KernelBuildError("no C++ compiler found")

    monkeypatch.setattr(cpu_kernels, "library", no_build)
    target = tiny_whisper()
    with torch.no_grad():
        for p in target.parameters():
            p.copy_(p.half().float())
    implementation = target.model.decoder.config._attn_implementation
    assert kernel_decoder(target) == 0
    assert isinstance(target.proj_out, nn.Linear) and isinstance(target.model.decoder.layers[0].fc1, nn.Linear)
    assert target.model.decoder.config._attn_implementation == implementation
    assert lean_decoder.attach(target).lean_decoder is None
    draft, kind = quantized_layer_draft(target, (0, 1, 3))
    assert kind == "int8"


@pytest.mark.skipif(not cpu_kernels.available() or not cpu_kernels.has_int8_activations(),
                    reason="the lean decoder needs the AVX2 build of the CPU kernels")
def test_a_layer_draft_never_inherits_its_targets_lean_forward():
    """A layer draft is a shallow copy of its target; the target's lean forward would run the target's layers."""
    target = tiny_whisper()
    with torch.no_grad():
        for p in target.parameters():
            p.copy_(p.half().float())
    kernel_decoder(target)
    assert lean_decoder.attach(target).lean_decoder is not None
    draft = layer_draft(target, (0, 2))
    assert getattr(draft, "lean_decoder", None) is None
    lean_decoder.attach(draft)
    assert draft.lean_decoder is not None and len(draft.lean_decoder.layers) == 2
    assert target.lean_decoder.layers == list(target.model.decoder.layers)


def _dense_again(module: nn.Module) -> None:
    """Every HalfLinear under module back to an fp32 nn.Linear with the same weights, in place."""
    for name, child in list(module.named_children()):
        if isinstance(child, HalfLinear):
            dense = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
            with torch.no_grad():
                dense.weight.copy_(child.weight.float())
                if child.bias is not None:
                    dense.bias.copy_(child.bias)
            setattr(module, name, dense)
        else:
            _dense_again(child)
