"""Audio in: decode with libsndfile (soundfile), mix down to mono, resample to 16 kHz, cut into 30 s windows."""

from __future__ import annotations

import re
from math import gcd
from pathlib import Path

import numpy as np
import soundfile as sf
from scipy.signal import resample_poly

SAMPLE_RATE = 16_000
WINDOW_SECONDS = 30.0
SILENCE_PEAK = 1e-4  # about -80 dBFS: nothing a microphone would call speech


class AudioError(ValueError):
    """Audio that cannot be transcribed; the message says why."""


def _formats() -> str:
    return ", ".join(sorted(sf.available_formats()))


def decode_audio(path: str | Path) -> tuple[np.ndarray, int]:
    """Read any format libsndfile knows; returns (samples [frames, channels] float32, sample rate)."""
    path = Path(path)
    if not path.is_file():
        raise AudioError(f"no such audio file: {path}")
    if path.stat().st_size == 0:
        raise AudioError(f"{path.name} is empty (0 bytes)")
    try:
        info = sf.info(str(path))
    except (sf.LibsndfileError, RuntimeError, TypeError) as e:
        raise AudioError(
            f"{path.name} could not be decoded as audio ({e}); readable formats: {_formats()}"
        ) from None
    # libsndfile reads what a cut-off WAV/AIFF still holds and notes the shortfall in its log
    shortfall = re.search(r"data : (\d+) \(should be (\d+)\)", info.extra_info or "")
    if shortfall:
        raise AudioError(f"{path.name} is truncated: its header announces {int(shortfall.group(1)):,} bytes of audio "
                         f"but the file holds {int(shortfall.group(2)):,}")
    try:
        data, rate = sf.read(str(path), dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError) as e:
        raise AudioError(f"{path.name} is truncated or corrupt: decoding stopped with '{e}'") from None
    if data.shape[0] == 0:
        raise AudioError(f"{path.name} contains no audio samples")
    if not np.isfinite(data).all():
        raise AudioError(f"{path.name} contains NaN or infinite samples")
    return data, int(rate)


def to_model_input(data: np.ndarray, rate: int, name: str = "the audio") -> np.ndarray:
    """Mono float32 at 16 kHz; refuses silence."""
    mono = data.mean(axis=1) if data.ndim == 2 else data
    if rate != SAMPLE_RATE:
        g = gcd(SAMPLE_RATE, rate)
        mono = resample_poly(mono, SAMPLE_RATE // g, rate // g).astype(np.float32)
    if float(np.abs(mono).max(initial=0.0)) < SILENCE_PEAK:
        raise AudioError(f"{name} is silent: there is no speech to transcribe")
    return mono.astype(np.float32, copy=False)


def load_audio(path: str | Path) -> np.ndarray:
    """Decode, mix down and resample an audio file for Whisper."""
    data, rate = decode_audio(path)
    return to_model_input(data, rate, Path(path).name)


def windows(audio: np.ndarray, seconds: float = WINDOW_SECONDS) -> list[tuple[float, np.ndarray]]:
    """Consecutive windows of at most `seconds`, each with its start time in seconds."""
    step = int(seconds * SAMPLE_RATE)
    return [(start / SAMPLE_RATE, audio[start:start + step]) for start in range(0, len(audio), step)]
