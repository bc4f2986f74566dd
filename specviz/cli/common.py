"""What the CLI's commands share: their flags (settings from specviz.runs.settings), reading inputs, loading
models with a progress bar, and resolving the settings into a SpecConfig."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from specviz.speech.audio import load_audio
from specviz.config import SpecConfig
from specviz.models.loading import WEIGHTS, ModelPair, load_pair
from specviz.text.prompts import InputError, check_article_size, sample_article
from specviz.runs.decode import DEFAULT_BATCH
from specviz.runs.replay import replaying, schedule_file
from specviz.runs.settings import Settings, add_flags

class LoadProgress:
    """Model-loading progress on stderr: a bar for stages with a known length, a line for the others."""

    def __init__(self) -> None:
        self.bar: tqdm | None = None
        self.stage = ""

    def __call__(self, message: str, fraction: float | None) -> None:
        if message != self.stage:
            self.close()
            self.stage = message
            if fraction is None:
                print(f"specviz: {message}", file=sys.stderr)
            else:
                self.bar = tqdm(total=100, desc=message, unit="%", file=sys.stderr, leave=False)
        if self.bar is not None and fraction is not None:
            self.bar.update(round(100 * fraction) - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def add_common(p: argparse.ArgumentParser, inputs: str = "text") -> None:
    """Options every decoding command shares; inputs is 'text', 'audio' or 'either'."""
    audio = inputs != "text"
    src = p.add_argument_group("input")
    if inputs == "audio":
        src.add_argument("inputs", nargs="+", metavar="AUDIO",
                         help="audio files (WAV, FLAC, OGG, MP3, ... anything libsndfile reads), decoded as one batch")
    else:
        src.add_argument("inputs", nargs="*", metavar="ARTICLE" if not audio else "INPUT",
                         help="article files to summarize as one batch ('-' for stdin)"
                         + ("; or audio files to transcribe" if audio else "") + "; default: the bundled sample article")
    add_flags(src, ["max_new_tokens"] + (["sequences"] if inputs != "audio" else []))
    if audio:
        src.add_argument("--language", default="en", help="spoken language for a multilingual Whisper (default en)")
    m = p.add_argument_group("models")
    add_flags(m, ["draft", "target"])
    m.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"],
                   help="default: fp32 on the CPU (no fast bf16 matrix multiply there), bf16 for the text pair on CUDA; "
                   "fp32 for Whisper")
    m.add_argument("--weights", default="auto", choices=WEIGHTS,
                   help="text models on the CPU: 'packed' multiplies straight from a GGUF model's quantized blocks "
                   "(specviz's CPU kernel; fp32 activations), 'dense' uses the dequantized fp32 weights (the same "
                   "model, ~5× the memory traffic per step), 'packed-a8' the same blocks times 8-bit activations "
                   "quantized per row (integer dot products, as llama.cpp runs the file: a slightly different "
                   "target, still batch-invariant); auto: packed-a8 (packed without AVX2) wherever the model comes from a "
                   "GGUF file")
    m.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    if audio:
        m.add_argument("--encoder", default=None, choices=["auto", "fp32", "bf16"],
                       help="Whisper's encoder on the CPU: bf16 runs its products in bf16 (autocast; norms, softmax "
                       "and output fp32: a slightly different target), fp32 as stored; auto (default, or "
                       "$SPECVIZ_SPEECH_ENCODER): bf16 where it measures at least 10%% faster on this machine (once, "
                       "cached)")
    m.add_argument("--quantized-draft", action=argparse.BooleanOptionalAction, default=None,
                   help="a quantized draft on the CPU (default: on there): text, 4 bits per weight on specviz's kernels "
                   "where they build with AVX2, else int8; speech, the same for its layer draft. --no-quantized-draft: "
                   "the draft follows --weights. The target is never re-quantized")
    add_flags(m, ["draft_kind", "lookup_ngram", "draft_vocab"])
    add_flags(p.add_argument_group("sampling (applied identically to draft and target)"),
              ["temperature", "top_k", "top_p", "seed"])
    v = p.add_argument_group("speculation")
    v.add_argument("--batch-size", type=int, default=DEFAULT_BATCH,
                   help=f"sequences decoded together at most (default {DEFAULT_BATCH}); more run in consecutive groups")
    add_flags(v, ["gamma_policy", "gamma_init", "lenience", "verify_backend", "draft_confidence", "sigmoid_alpha",
                  "sigmoid_beta"])
    v.add_argument("--gamma-schedule", metavar="TRACE", default=None,
                   help="decode on TRACE's γ schedule (every iteration's γ as it ran) instead of a policy's: with the "
                        "same input, seed and settings the run repeats decision for decision on any machine")


def config(args: argparse.Namespace, task: str, mode: str | None = None) -> SpecConfig:
    """The settings on the command line resolved for `task` (specviz.runs.settings: the one resolution of "auto");
    `mode` overrides --mode; --gamma-schedule replaces the policy by a trace's schedule."""
    if args.batch_size < 1:
        raise InputError(f"--batch-size must be >= 1, got {args.batch_size}")
    settings = Settings.from_args(args)
    if mode is not None:
        settings = dataclasses.replace(settings, mode=mode)
    cfg = settings.spec(task)
    if getattr(args, "gamma_schedule", None):
        cfg = replaying(cfg, schedule_file(args.gamma_schedule))
    return cfg


def read_article(arg: str) -> str:
    if arg == "-":
        return sys.stdin.read()
    path = Path(arg)
    if not path.is_file():
        raise InputError(f"no such file: {arg}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{arg} is not UTF-8 text; give an article as a text file") from None


def articles(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(label, text) per article; refuses an empty one before minutes go into loading models."""
    if not args.inputs:
        return [("sample article", sample_article())]
    if args.inputs.count("-") > 1:
        raise InputError("stdin ('-') can be read only once")
    out = []
    for arg in args.inputs:
        text = read_article(arg)
        label = "stdin" if arg == "-" else Path(arg).name
        if not text.strip():
            raise InputError(f"the article is empty ({label}): give a file with some text to summarize")
        check_article_size(text)
        out.append((label, text))
    return out

def load_text(args: argparse.Namespace) -> ModelPair:
    progress = LoadProgress()
    try:
        return load_pair(args.draft, args.target, device=args.device, dtype=args.dtype,
                         quantized_draft=args.quantized_draft, weights=args.weights, progress=progress)
    finally:
        progress.close()


def load_speech(args: argparse.Namespace):
    from specviz.speech.asr import load_speech_pair

    progress = LoadProgress()
    try:
        return load_speech_pair(args.target, args.draft, device=args.device, dtype=args.dtype or "fp32",
                                quantized_draft=args.quantized_draft, encoder_dtype=getattr(args, "encoder", None),
                                progress=progress)
    finally:
        progress.close()

def fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


AUDIO_SUFFIXES = {".wav", ".flac", ".ogg", ".oga", ".opus", ".mp3", ".aiff", ".aif", ".au", ".caf", ".w64", ".rf64"}


def is_audio(arg: str | None) -> bool:
    return arg is not None and Path(arg).suffix.lower() in AUDIO_SUFFIXES


def clips(paths: list[str]) -> list[tuple[str, np.ndarray]]:
    return [(Path(p).name, load_audio(p)) for p in paths]


