"""Whisper's encoder, once per 30 s window: in fp32, or with its matrix products in bf16 where this CPU runs them
faster (measured once per machine and model, cached).

The encoder is most of what a transcription costs on a CPU (42 G multiply-adds a window: 0.6 s of a 13 s clip's
1.0 s on the 2-core Zen 4, at its fp32 FMA floor), and the same for target-only and speculative runs. With
`bf16` its linear layers and convolutions run in bf16 (torch's autocast's numbers: its layer norms and attention
stay fp32 in arithmetic, and so does its output; the stored weights too), walked by speech.lean_encoder (the same
bits without transformers' strided residuals; bf16 copies of the products' weights): on that Zen 4 (AVX-512 BF16) 0.63 → 0.44 s a
window, then 0.34 s with the attention on specviz's kernel (`_fp32_attention`); the output within 1.2% (relative
L2) of fp32's; the target's next-token distributions along its transcripts of the eval clips, the sample and an
unseen clip, 331 positions: KL mean 0.9e-4 from fp32's (the text target's 8-bit activations: 19e-4), the same
greedy token at all but one near-tie, the same transcript of 14 of 15 clips and the same WER (docs/benchmarks.md,
"Speech"). It is a different target from the fp32 one, named in every trace (`target_encoder`); a speculative
run and its target-only baseline read the same encoder, so their outputs stay equal. The decoders, their
cross-attention keys and values included, are unchanged.

Each window is encoded alone, so a window's output never depends on which other windows share its batch.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from transformers import WhisperForConditionalGeneration
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.whisper.modeling_whisper import eager_attention_forward

from specviz.cache import cache_dir, write_json
from specviz.decoding.calibration import timed_rounds
from specviz.machine import describe as describe_machine
from specviz.models import cpu_kernels
from specviz.speech.lean_encoder import LeanWhisperEncoder

ENCODER_ENV = "SPECVIZ_SPEECH_ENCODER"
CHOICES = ("auto", "fp32", "bf16")  # auto: bf16 where it measures at least MARGIN faster here, else fp32
ATTENTION = "specviz_fp32_sdpa"  # the encoder's attention while its products are bf16 (_fp32_attention)
MARGIN = 0.10  # bf16 rounds the encoder's products: taken only for a clear gain, not a tie within the host's noise
TIMING_ROUNDS = 2  # alternating rounds of one window each way, after a warm-up (~3 s once per machine and model)
CACHE_VERSION = 3  # bump when what is measured changes (2: bf16 attention on the kernel; 3: the lean forward): older ignored

Timer = Callable[[dict[str, Callable[[], None]]], dict[str, float]]  # calls by name -> seconds by name


def requested(spec: str | None) -> str:
    """The precision asked for: `spec`, else $SPECVIZ_SPEECH_ENCODER, else auto."""
    value = (spec or os.environ.get(ENCODER_ENV) or "auto").strip().lower()
    if value not in CHOICES:
        raise ValueError(f"speech encoder precision {value!r}: use one of {', '.join(CHOICES)} "
                         f"(the argument or ${ENCODER_ENV})")
    return value


def _bf16_capable() -> bool:
    """Whether torch has bf16 kernels for this CPU at all (without them bf16 is emulated: not worth timing)."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(torch.backends.mkldnn.is_available() and check is not None and check())


def _fp32_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The encoder's attention in fp32 arithmetic even under autocast ([B, H, frames, D] -> [B, frames, H, D]): the
    softmax's logits are where bf16's 8 bits cost most (every clip of the eval set and the sample, 297 positions:
    KL mean 1.1e-4 and greedy agreement 99.7% with bf16 attention, 0.9e-4 and 100% with this). Under autocast the
    queries, keys and values are bf16 numbers already; where the kernels have it (AVX-512 BF16), specviz's
    attention takes them as they are (q · k as exact bf16 products summed in fp32, the rest fp32: 33 → 20 ms a
    layer on the 2-core Zen 4, within fp32's rounding of SDPA's); else SDPA on their fp32 copies. An fp32 call is
    plain SDPA."""
    unmasked = attention_mask is None and not dropout and not getattr(module, "is_causal", False)
    if (unmasked and query.dtype == key.dtype == value.dtype == torch.bfloat16 and query.device.type == "cpu"
            and query.shape == key.shape == value.shape and query.shape[-1] in cpu_kernels.BF16_HEAD_DIMS
            and cpu_kernels.has_bf16_attention()):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        # heads as the projections laid them out (read in place) and the output rounded to bf16 by the kernel: no
        # transposed copies and no fp32 output to convert (three copies and a conversion a layer), the same bits
        heads = [t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value)]
        return cpu_kernels.bf16_attention(*heads, scale, out_dtype=query.dtype), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    with torch.autocast("cpu", enabled=False):
        out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask,
                                              scaling=scaling, dropout=dropout, **kwargs)
    return out.to(query.dtype), weights


_registered = False
_lock = threading.Lock()  # two pairs loading at once (the page's sessions) register once


def _register() -> str:
    global _registered
    with _lock:
        if not _registered:
            from transformers import AttentionInterface

            AttentionInterface.register(ATTENTION, _fp32_attention)
            _registered = True
    return ATTENTION


def _mark(encoder: nn.Module, bf16: bool) -> None:
    # read by encode(); the model's weights stay fp32 (the lean forward keeps bf16 copies of the products' weights,
    # 40 MB for base), so the model's dtype and its fp32 path are unchanged. Set when a pair loads (choose), before
    # any thread decodes with it; only benchmarks and tests switch it later, between runs of their own thread.
    encoder.bf16_products = bf16
    if bf16 and encoder.config._attn_implementation != ATTENTION:
        config = copy.copy(encoder.config)  # the encoder's own: the decoders keep their attention
        config._attn_implementation = _register()
        for module in encoder.modules():  # the encoder, its layers and their attention modules
            if getattr(module, "config", None) is not None:
                module.config = config
    encoder.lean_bf16 = _lean(encoder, True) if bf16 else None


def _lean(encoder: nn.Module, bf16: bool) -> LeanWhisperEncoder:
    """The encoder's forward (speech.lean_encoder): with bf16 products (and their weights' bf16 copies) and
    specviz's attention, or in the model's dtype with the attention its config names (references only: cheap)."""
    name = _register() if bf16 else encoder.config._attn_implementation
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(name, eager_attention_forward)
    return LeanWhisperEncoder(encoder, attention, torch.bfloat16 if bf16 else None)


def _uses_bf16(encoder: nn.Module) -> bool:
    return getattr(encoder, "bf16_products", False)


def _encode(model: WhisperForConditionalGeneration, features: torch.Tensor, forward: LeanWhisperEncoder
            ) -> torch.Tensor:
    return torch.cat([forward(features[b:b + 1].to(model.device, model.dtype)).to(model.dtype)
                      for b in range(features.shape[0])])


def encode(model: WhisperForConditionalGeneration, features: torch.Tensor) -> torch.Tensor:
    """features [B, mel bins, 3000] -> the encoder's output [B, frames, d_model] in the model's dtype, one window
    per call, in the precision `choose` set."""
    encoder = model.model.encoder
    forward = encoder.lean_bf16 if _uses_bf16(encoder) else _lean(encoder, False)
    return _encode(model, features, forward)


def describe(model: WhisperForConditionalGeneration) -> str:
    """What the encoder runs in, for traces."""
    if _uses_bf16(model.model.encoder):
        return "bf16 linear layers and convolutions (autocast), fp32 norms and attention"
    return str(model.dtype).removeprefix("torch.")


def _cache_path(model_name: str) -> Path:
    key = json.dumps({"model": model_name, "machine": describe_machine(), "threads": torch.get_num_threads(),
                      "version": CACHE_VERSION}, sort_keys=True)
    return cache_dir() / "encoder" / (hashlib.sha256(key.encode()).hexdigest()[:24] + ".json")


def _measure(model: WhisperForConditionalGeneration, timer: Timer) -> dict[str, float]:
    """Seconds a window in fp32 and in bf16, one process, the two alternating."""
    config = model.config
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(1, config.num_mel_bins, 2 * config.max_source_positions, generator=generator)
    fp32, bf16 = _lean(model.model.encoder, False), _lean(model.model.encoder, True)
    with torch.inference_mode():
        return timer({"fp32": lambda: _encode(model, features, fp32), "bf16": lambda: _encode(model, features, bf16)})


def choose(model: WhisperForConditionalGeneration, model_name: str, spec: str | None = None,
           timer: Timer | None = None) -> dict:
    """Set the encoder's precision (on the encoder module, which a layer draft shares) and say why: {"encoder":
    "fp32" | "bf16", "why": ..., and the seconds a window where measured}. Only an fp32 model on the CPU is a
    candidate for bf16; "auto" measures once per machine and model (cached under the specviz cache's encoder/)."""
    choice = requested(spec)
    if model.device.type != "cpu" or model.dtype != torch.float32:
        return {"encoder": describe(model), "why": "the model's own dtype (bf16 is a choice for fp32 CPU models)"}
    _mark(model.model.encoder, choice == "bf16")
    if choice != "auto":
        return {"encoder": choice, "why": "asked for"}
    if not _bf16_capable():
        return {"encoder": "fp32", "why": "torch has no bf16 kernels for this CPU"}
    path = _cache_path(model_name)
    try:
        seconds = json.loads(path.read_text())
        seconds = {"fp32": float(seconds["fp32"]), "bf16": float(seconds["bf16"])}
    except (OSError, ValueError, KeyError, TypeError):
        seconds = _measure(model, timer or (lambda calls: timed_rounds(calls, TIMING_ROUNDS)))
        write_json(path, seconds)
    faster = seconds["bf16"] <= (1 - MARGIN) * seconds["fp32"]
    _mark(model.model.encoder, faster)
    verdict = "bf16 taken" if faster else f"fp32 kept (bf16 must be {MARGIN:.0%} faster)"
    return {"encoder": "bf16" if faster else "fp32", **{f"{k}_s_per_window": v for k, v in seconds.items()},
            "why": f"measured on this machine: {seconds['fp32']:.2f} s a window in fp32, {seconds['bf16']:.2f} s "
                   f"in bf16; {verdict}"}
