"""specviz's Whisper beside faster-whisper (CTranslate2) on the same files, cores and clips, taking turns.

    python -m specviz.bench.faster_whisper CLIP [CLIP ...] --system specviz --repeat 3 --json FILE
    python -m specviz.bench.faster_whisper CLIP [CLIP ...] --system faster-whisper --repeat 3 --json FILE

Both transcribe every 30 s window on its own, greedy, without timestamps or a voice-activity filter, from
audio already decoded (16 kHz), with 2 threads; the clock covers features, encoder and decoding. Rows: specviz
target-only with the encoder as `auto` chooses and in fp32, faster-whisper int8 and fp32 on the embedded
model's own CTranslate2 files, each system in a process of its own (run them in turns). Median of `repeat`
rounds after one warm-up, every row once a round.
faster-whisper is a benchmark-only package (not in requirements.txt); PYTHONPATH may point at it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from specviz import machine
from specviz.cache import cache_dir
from specviz.config import SpecConfig
from specviz.runs.decode import transcribe
from specviz.speech import encoder
from specviz.speech.asr import load_speech_pair
from specviz.speech.audio import load_audio
from specviz.speech.whisper_loader import EMBEDDED_WHISPER, _data_dir, assemble_model_bin


def _specviz(pair, audio, precision: str) -> Callable[[], str]:
    def run() -> str:
        encoder.choose(pair.target, pair.target_name, precision)
        cfg = SpecConfig(max_new_tokens=224)
        return transcribe(pair, [("clip", audio)], cfg, target_only=True).output_text
    return run


def _faster_whisper(model, audio) -> Callable[[], str]:
    def run() -> str:
        segments, _ = model.transcribe(audio, language="en", beam_size=1, without_timestamps=True,
                                       condition_on_previous_text=False, vad_filter=False, temperature=0.0)
        return " ".join(s.text.strip() for s in segments)
    return run


def ct2_files(dest: Path) -> Path:
    """The embedded model's CTranslate2 directory (the part packages' model.bin joined and checked, beside their
    config and vocabulary), which faster-whisper reads; specviz's cache holds its transformers conversion."""
    dest.mkdir(parents=True, exist_ok=True)
    source = _data_dir(EMBEDDED_WHISPER.data_module, EMBEDDED_WHISPER)
    for name in ("config.json", "tokenizer.json", "vocabulary.txt"):
        shutil.copyfile(source / name, dest / name)
    if not (dest / "model.bin").is_file():
        assemble_model_bin(EMBEDDED_WHISPER, dest)
    return dest


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("clips", nargs="+")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--system", choices=["specviz", "faster-whisper"], required=True,
                        help="one per process: the two runtimes' OpenMP threads spin after a call and slowed the other "
                        "by 10-60%% on 2 cores when both lived in one process; alternate invocations instead")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    encoder_auto = None
    if args.system == "specviz":
        pair = load_speech_pair(device="cpu", dtype="fp32")
        encoder_auto = pair.encoder
        auto = pair.encoder["encoder"]
        make = lambda audio: {f"specviz target-only, encoder {auto} (auto)": _specviz(pair, audio, auto),  # noqa: E731
                              "specviz target-only, encoder fp32": _specviz(pair, audio, "fp32")}
    else:
        from faster_whisper import WhisperModel  # benchmark-only

        files = str(ct2_files(cache_dir() / "bench" / "whisper-base-ct2"))
        fw = {kind: WhisperModel(files, device="cpu", compute_type=kind, cpu_threads=args.threads)
              for kind in ("int8", "float32")}
        make = lambda audio: {"faster-whisper int8": _faster_whisper(fw["int8"], audio),  # noqa: E731
                              "faster-whisper fp32": _faster_whisper(fw["float32"], audio)}
    results = []
    for clip in args.clips:
        audio = load_audio(clip)
        rows = make(audio)
        texts = {name: run() for name, run in rows.items()}  # warm-up
        seconds: dict[str, list[float]] = {name: [] for name in rows}
        for _ in range(args.repeat):
            for name, run in rows.items():
                t0 = time.perf_counter()
                run()
                seconds[name].append(time.perf_counter() - t0)
        for name in rows:
            median = statistics.median(seconds[name])
            results.append({"clip": Path(clip).name, "audio_s": len(audio) / 16_000, "row": name,
                            "median_s": median, "rounds_s": seconds[name], "text": texts[name]})
            print(f"{Path(clip).name:28s} {name:44s} {median:6.2f} s  ({min(seconds[name]):.2f}–"
                  f"{max(seconds[name]):.2f})")
    if args.system == "specviz":
        encoder.choose(pair.target, pair.target_name, auto)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine.describe(), "threads": args.threads,
                                               "system": args.system, "repeat": args.repeat,
                                               "encoder_auto": encoder_auto,
                                               "statistic": "median of the rounds after one warm-up, rows in turn",
                                               "results": results}, indent=1))


if __name__ == "__main__":
    main()
