"""Audio in: decode with libsndfile (soundfile), mix down to mono, resample to 16 kHz, cut into 30 s windows.

Files come from uploads, so their headers are untrusted: every limit below is checked against the header
before any sample is decoded, and decoding then streams in bounded blocks (mix-down and resampling per
block), so memory follows the audio that is really there, never what a header claims."""

from __future__ import annotations

import os
import re
from fractions import Fraction
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import soundfile as sf
from scipy.signal import firwin, upfirdn

SAMPLE_RATE = 16_000
WINDOW_SECONDS = 30.0
SILENCE_PEAK = 1e-4  # about -80 dBFS: nothing a microphone would call speech

# 4 kHz is half the lowest rate speech is ever stored at (8 kHz telephony); below it the 2 kHz band holds
# too little speech for Whisper, and such values (1 Hz, 7 Hz) are corrupt headers, whose 16 kHz output
# would be thousands of times the file. 384 kHz is the highest rate audio interfaces and DXD masters use;
# above it a header is corrupt too, and the resampler would read hundreds of samples per output sample.
MIN_SAMPLE_RATE = 4_000
MAX_SAMPLE_RATE = 384_000
# 64 channels is 7th-order ambisonics, the largest layout in real use; speech never needs more.
MAX_CHANNELS = 64
DEFAULT_MAX_SECONDS = 30 * 60.0  # 30 minutes: 115 MB of 16 kHz float32, an hour of decoding on a CPU
DEFAULT_MAX_BYTES = 1 << 30  # 1 GiB: 30 minutes of 32-bit 96 kHz stereo is under half of it
# Whisper's input is normalised to about [-1, 1]; float files may overshoot a little (a hot master reads
# 1.5), but a peak past 1e3 (+60 dBFS) is garbage or unnormalised integers, and would reach the model as
# overflowing log-mel features (first seen as "draft logits contain NaN").
MAX_PEAK = 1e3
BLOCK_VALUES = 1 << 18  # samples decoded per read across all channels: 1 MiB of float32
OUT_BLOCK = 1 << 16  # 16 kHz samples resampled per step
MAX_RATIO_TERM = 4_000  # largest up/down factor of the resampler (filter: 20 x this taps)


class AudioError(ValueError):
    """Audio that cannot be transcribed; the message says why."""


def _formats() -> str:
    return ", ".join(sorted(sf.available_formats()))


def _limit(value: float | None, env: str, default: float, unit: str) -> float:
    """The caller's value, else the environment's, else the default; a bad setting is an error, not ignored."""
    if value is None:
        raw = os.environ.get(env, "").strip()
        if not raw:
            return default
        try:
            value = float(raw)
        except ValueError:
            raise AudioError(f"{env}={raw!r} is not a number of {unit}") from None
    if not (value > 0 and np.isfinite(value)):
        raise AudioError(f"the audio limit must be a positive number of {unit}, got {value!r} "
                         f"(from {env} or the caller)")
    return float(value)


def _check_rate(rate: int, name: str) -> None:
    if not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
        raise AudioError(
            f"{name} declares a sample rate of {rate:,} Hz; accepted: {MIN_SAMPLE_RATE:,} to {MAX_SAMPLE_RATE:,} Hz. "
            f"The header is probably corrupt; a genuine recording can be converted first "
            f"(e.g. ffmpeg -i IN -ar 16000 OUT.wav)")


def _check_channels(channels: int, name: str) -> None:
    if not 1 <= channels <= MAX_CHANNELS:
        raise AudioError(f"{name} declares {channels:,} channels; accepted: 1 to {MAX_CHANNELS}. "
                         f"Mix it down first (e.g. ffmpeg -i IN -ac 1 OUT.wav)")


def _check_samples(block: np.ndarray, name: str) -> None:
    # max/min propagate NaN and need no temporary array, unlike np.abs or np.isfinite
    hi, lo = float(block.max()), float(block.min())
    if not (np.isfinite(hi) and np.isfinite(lo)):
        raise AudioError(f"{name} contains NaN or infinite samples")
    if max(hi, -lo) > MAX_PEAK:
        raise AudioError(f"{name} has samples of magnitude {max(hi, -lo):.3g}: Whisper expects samples roughly "
                         f"within [-1, 1], and past {MAX_PEAK:g} the file is corrupt or not normalised "
                         f"(normalise it first, e.g. ffmpeg -i IN -af loudnorm OUT.wav)")


def _too_long(name: str, max_seconds: float, announced: float | None = None) -> AudioError:
    said = f" (its header announces {announced:,.1f} s)" if announced is not None else ""
    return AudioError(f"{name} is longer than the {max_seconds:,g} s limit{said}; raise it with max_seconds= "
                      f"or the SPECVIZ_MAX_AUDIO_SECONDS environment variable")


# bytes per sample of the uncompressed subtypes: the file must be at least frames x channels x this long
_PCM_BYTES = {"PCM_S8": 1, "PCM_U8": 1, "ULAW": 1, "ALAW": 1, "PCM_16": 2, "PCM_24": 3, "PCM_32": 4,
              "FLOAT": 4, "DOUBLE": 8}
_UNCOMPRESSED = {"WAV", "WAVEX", "RF64", "W64", "AIFF", "AU", "CAF", "IRCAM", "NIST", "RAW"}  # not FLAC: PCM_16 too


def _open(path: Path, max_seconds: float | None, max_bytes: float | None) -> tuple[sf.SoundFile, float]:
    """Open after every check the header allows; returns the open file and the duration cap in seconds."""
    if not path.is_file():
        raise AudioError(f"no such audio file: {path}")
    size = path.stat().st_size
    if size == 0:
        raise AudioError(f"{path.name} is empty (0 bytes)")
    byte_cap = _limit(max_bytes, "SPECVIZ_MAX_AUDIO_BYTES", DEFAULT_MAX_BYTES, "bytes")
    if size > byte_cap:
        raise AudioError(f"{path.name} is {size:,} bytes, over the {int(byte_cap):,}-byte limit; raise it with "
                         f"max_bytes= or the SPECVIZ_MAX_AUDIO_BYTES environment variable")
    seconds_cap = _limit(max_seconds, "SPECVIZ_MAX_AUDIO_SECONDS", DEFAULT_MAX_SECONDS, "seconds")
    try:
        f = sf.SoundFile(str(path))
    except (RuntimeError, TypeError, ValueError) as e:
        raise AudioError(
            f"{path.name} could not be decoded as audio ({e}); readable formats: {_formats()}"
        ) from None
    try:
        _check_rate(f.samplerate, path.name)
        _check_channels(f.channels, path.name)
        # libsndfile reads what a cut-off WAV/AIFF still holds and notes the shortfall in its log
        shortfall = re.search(r"data : (\d+) \(should be (\d+)\)", f.extra_info or "")
        if shortfall:
            raise AudioError(f"{path.name} is truncated: its header announces {int(shortfall.group(1)):,} bytes "
                             f"of audio but the file holds {int(shortfall.group(2)):,}")
        # other uncompressed containers: a header may claim more frames than the bytes could hold
        width = _PCM_BYTES.get(f.subtype) if f.format in _UNCOMPRESSED else None
        if width and 0 < f.frames < 2 ** 62 and f.frames * f.channels * width > size:
            raise AudioError(f"{path.name} is truncated: its header announces {f.frames * f.channels * width:,} "
                             f"bytes of audio but the file is {size:,} bytes")
        # 2**62 and beyond means 'length unknown' (streamed files): the block reader enforces the cap instead
        if f.frames < 2 ** 62 and f.frames > seconds_cap * f.samplerate:
            raise _too_long(path.name, seconds_cap, f.frames / f.samplerate)
    except BaseException:
        f.close()
        raise
    return f, seconds_cap


def _blocks(f: sf.SoundFile, name: str, seconds_cap: float) -> Iterator[np.ndarray]:
    """[frames, channels] float32 blocks of at most BLOCK_VALUES samples, each checked; the buffer is reused,
    so a consumer that keeps a block must copy it. Stops with an error once the cap is passed, whatever the
    header said."""
    # a short file gets a short buffer; a header that overstates its length still gets at most one block
    frames = min(max(1, BLOCK_VALUES // f.channels), max(0, f.frames) + 1)
    buffer = np.empty((frames, f.channels), dtype=np.float32)
    frame_cap, total = seconds_cap * f.samplerate, 0
    while True:
        try:
            block = f.read(out=buffer)
        except (RuntimeError, ValueError) as e:
            if f.frames >= 2 ** 62:  # soundfile's bookkeeping seek fails at the end of a length-less stream
                raise AudioError(f"{name} is truncated or corrupt, or a stream without a length in its header "
                                 f"(re-encode it, e.g. ffmpeg -i IN OUT.flac): decoding stopped with '{e}'") from None
            raise AudioError(f"{name} is truncated or corrupt: decoding stopped with '{e}'") from None
        if len(block) == 0:
            break
        total += len(block)
        if total > frame_cap:
            raise _too_long(name, seconds_cap)
        _check_samples(block, name)
        yield block
    if total == 0:
        raise AudioError(f"{name} contains no audio samples")


@lru_cache(maxsize=16)
def _ratio(rate: int) -> tuple[int, int]:
    """up/down factors from `rate` to 16 kHz. Odd rates (44,101 Hz: 16,000/44,101) would need a filter of
    20 x 44,101 taps; those are approximated by the nearest ratio with terms <= MAX_RATIO_TERM, at most
    125 ppm off for any rate in range (a 0.2-cent pitch shift), which Whisper cannot notice."""
    exact = Fraction(SAMPLE_RATE, rate)
    if max(exact.numerator, exact.denominator) <= MAX_RATIO_TERM:
        return exact.numerator, exact.denominator
    near = exact.limit_denominator(max(1, MAX_RATIO_TERM * min(rate, SAMPLE_RATE) // SAMPLE_RATE))
    return near.numerator, near.denominator


@lru_cache(maxsize=16)
def _filter(up: int, down: int) -> tuple[np.ndarray, int]:
    """scipy's resample_poly filter (Kaiser-windowed sinc, 10 zero crossings a side), with its front padding,
    and how many leading outputs it discards to centre the filter."""
    max_rate = max(up, down)
    half_len = 10 * max_rate
    h = firwin(2 * half_len + 1, 1.0 / max_rate, window=("kaiser", 5.0)).astype(np.float32)
    h *= up
    pre_pad = down - half_len % down
    h = np.concatenate([np.zeros(pre_pad, dtype=np.float32), h])
    h.setflags(write=False)
    return h, (half_len + pre_pad) // down


class _Resampler:
    """resample_poly, fed and drained in blocks so that only the filter's context is kept between blocks.

    Output n (before the leading discard) is sum_k h[k] * up_x[n * down - k], where up_x is the input with
    up - 1 zeros after each sample: it needs input samples up to floor(n * down / up), and none older than
    ceil((n * down - len(h) + 1) / up). Any slice of the input that starts at a multiple of `down` gives
    the same outputs from upfirdn, shifted by start * up / down."""

    def __init__(self, rate: int):
        self.up, self.down = _ratio(rate)
        self.identity = self.up == self.down
        if not self.identity:
            self.h, self.skip = _filter(self.up, self.down)
            self.next = self.skip  # next output to emit, counted before the discard
        self.buf = np.zeros(0, dtype=np.float32)
        self.base = 0  # input index of buf[0]
        self.n_in = 0

    def push(self, x: np.ndarray) -> Iterator[np.ndarray]:
        if self.identity:
            self.n_in += len(x)
            yield x.astype(np.float32, copy=True)
            return
        self.buf = np.concatenate([self.buf, x.astype(np.float32, copy=False)])
        self.n_in += len(x)
        yield from self._emit(-(-self.n_in * self.up // self.down))  # every output whose inputs all arrived

    def finish(self) -> Iterator[np.ndarray]:
        if not self.identity:
            yield from self._emit(self.skip - (-self.n_in * self.up // self.down))  # n_out = ceil(n_in*up/down)

    def _first_input(self, n: int) -> int:
        oldest = max(0, -(-(n * self.down - len(self.h) + 1) // self.up))
        return oldest // self.down * self.down

    def _emit(self, end: int) -> Iterator[np.ndarray]:
        while self.next < end:
            n0, n1 = self.next, min(end, self.next + OUT_BLOCK)
            start = self._first_input(n0)
            stop = min(self.n_in, (n1 - 1) * self.down // self.up + 1)
            out = np.zeros(n1 - n0, dtype=np.float32)  # beyond the input's reach the filter sees zeros
            if stop > start:
                y = upfirdn(self.h, self.buf[start - self.base:stop - self.base], self.up, self.down)
                shift = start * self.up // self.down
                part = y[n0 - shift:n1 - shift]
                out[:len(part)] = part
            self.next = n1
            yield out
        start = self._first_input(self.next)
        if start > self.base:  # drop input no later output can reach
            self.buf = self.buf[start - self.base:].copy()
            self.base = start


def _stream_to_16k(blocks: Iterable[np.ndarray], rate: int, name: str) -> np.ndarray:
    """Mix each [frames, channels] block to mono, resample it, and join: the only full-length arrays are the
    16 kHz pieces and their join, so peak memory is about twice the result plus one block."""
    resampler = _Resampler(rate)
    pieces: list[np.ndarray] = []
    for block in blocks:
        mono = block[:, 0] if block.shape[1] == 1 else block.mean(axis=1, dtype=np.float32)
        pieces.extend(resampler.push(mono))
    pieces.extend(resampler.finish())
    peak = max((max(float(p.max()), -float(p.min())) for p in pieces if len(p)), default=0.0)
    if peak < SILENCE_PEAK:
        raise AudioError(f"{name} is silent: there is no speech to transcribe")
    return np.concatenate(pieces) if len(pieces) != 1 else pieces[0]


def decode_audio(path: str | Path, *, max_seconds: float | None = None,
                 max_bytes: float | None = None) -> tuple[np.ndarray, int]:
    """Read any format libsndfile knows; returns (samples [frames, channels] float32, sample rate).
    Limits: max_seconds (SPECVIZ_MAX_AUDIO_SECONDS, default 30 min), max_bytes (SPECVIZ_MAX_AUDIO_BYTES,
    default 1 GiB), 4-384 kHz, at most 64 channels, |samples| <= 1e3."""
    path = Path(path)
    f, seconds_cap = _open(path, max_seconds, max_bytes)
    with f:
        data = np.concatenate([b.copy() for b in _blocks(f, path.name, seconds_cap)])
        return data, int(f.samplerate)


def _checked(block: np.ndarray, name: str) -> np.ndarray:
    _check_samples(block, name)
    return block


def to_model_input(data: np.ndarray, rate: int, name: str = "the audio") -> np.ndarray:
    """Mono float32 at 16 kHz; refuses silence, absurd rates, channel counts and sample values."""
    rate = int(rate)
    _check_rate(rate, name)
    data = np.asarray(data)
    data = data[:, None] if data.ndim == 1 else data
    if data.ndim != 2:
        raise AudioError(f"{name} must be [frames] or [frames, channels], got shape {data.shape}")
    _check_channels(data.shape[1], name)
    if len(data) == 0:
        raise AudioError(f"{name} contains no audio samples")
    step = max(1, BLOCK_VALUES // data.shape[1])
    blocks = (data[i:i + step].astype(np.float32, copy=False) for i in range(0, len(data), step))
    return _stream_to_16k((_checked(b, name) for b in blocks), rate, name)


def load_audio(path: str | Path, *, max_seconds: float | None = None, max_bytes: float | None = None) -> np.ndarray:
    """Decode, mix down and resample an audio file for Whisper, block by block (limits: see decode_audio)."""
    path = Path(path)
    f, seconds_cap = _open(path, max_seconds, max_bytes)
    with f:
        return _stream_to_16k(_blocks(f, path.name, seconds_cap), f.samplerate, path.name)


def windows(audio: np.ndarray, seconds: float = WINDOW_SECONDS) -> list[tuple[float, np.ndarray]]:
    """Consecutive windows of at most `seconds`, each with its start time in seconds."""
    step = int(seconds * SAMPLE_RATE)
    return [(start / SAMPLE_RATE, audio[start:start + step]) for start in range(0, len(audio), step)]
