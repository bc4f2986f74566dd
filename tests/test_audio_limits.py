"""Hostile audio: headers that lie about rate, length, channels or size, absurd sample values, and a fixed-seed
fuzz over mutated files. Every file is real (soundfile or hand-built bytes); nothing is mocked."""

from __future__ import annotations

import struct
import time
import tracemalloc

import numpy as np
import pytest
import soundfile as sf
from scipy.signal import resample_poly

from specviz.speech.audio import SAMPLE_RATE, AudioError, decode_audio, load_audio, to_model_input

MiB = 1 << 20
# Per-call overhead allowed on top of 2x the 16 kHz result: one decoded block (1 MiB), its mono mix, the
# resampler's slice and output step, and designing a filter: up to 80,001 taps for the oddest rates (4,001 Hz
# resamples by 3,999/1,000), whose float64 design temporaries peak near 3.7 MiB.
OVERHEAD = 6 * MiB


def _wav_bytes(rate: int, channels: int = 1, bits: int = 16, data: bytes = b"", data_size: int | None = None,
               fmt_tag: int = 1) -> bytes:
    """A canonical 44-byte-header WAV with every field under the caller's control, lies included."""
    size = len(data) if data_size is None else data_size
    align = channels * bits // 8
    fmt = struct.pack("<HHIIHH", fmt_tag, channels, rate & 0xFFFFFFFF, (rate * align) & 0xFFFFFFFF,
                      align & 0xFFFF, bits)
    return (b"RIFF" + struct.pack("<I", (36 + size) & 0xFFFFFFFF) + b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt
            + b"data" + struct.pack("<I", size & 0xFFFFFFFF) + data)


def _tone(seconds: float, rate: int, freq: float = 440.0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def _pcm16(x: np.ndarray) -> bytes:
    return (x * 32767).astype("<i2").tobytes()


def _peak_while(fn):
    """(result or exception, peak bytes traced while fn ran)."""
    tracemalloc.start()
    try:
        try:
            out = fn()
        except AudioError as e:
            out = e
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# ---- lying headers -----------------------------------------------------------------------------------

@pytest.mark.parametrize("rate", [1, 7, 3_999, 384_001, 2**31 - 1])
def test_absurd_sample_rate_is_refused_before_decoding(tmp_path, rate):
    path = tmp_path / "rate.wav"
    path.write_bytes(_wav_bytes(rate, data=_pcm16(_tone(6.0, 16_000))))  # 192 KB of samples
    err, peak = _peak_while(lambda: load_audio(path))
    assert isinstance(err, AudioError)
    assert f"sample rate of {rate:,} Hz" in str(err) and "4,000 to 384,000 Hz" in str(err)
    assert peak < MiB  # a 1 Hz header once made the resampler ask for 6.3 GB


def test_rates_at_the_limits_are_accepted(tmp_path):
    for rate in (4_000, 384_000):
        path = tmp_path / f"r{rate}.wav"
        sf.write(path, _tone(0.5, rate, 300.0), rate, subtype="PCM_16")
        assert abs(len(load_audio(path)) - 0.5 * SAMPLE_RATE) <= 1


def test_header_claiming_more_than_the_file_holds(tmp_path):
    path = tmp_path / "liar.wav"
    path.write_bytes(_wav_bytes(16_000, data=_pcm16(_tone(0.1, 16_000)), data_size=1_000_000_000))
    err, peak = _peak_while(lambda: load_audio(path))
    assert isinstance(err, AudioError) and "truncated: its header announces 1,000,000,000 bytes" in str(err)
    assert peak < MiB


def test_sparse_file_claiming_gigabytes(tmp_path):
    """2 GiB on paper, a few KB on disk: refused for its size, and with that cap raised, for its length."""
    path = tmp_path / "sparse.wav"
    path.write_bytes(_wav_bytes(16_000, data=_pcm16(_tone(0.1, 16_000)), data_size=2**31 - 64))
    with open(path, "r+b") as f:
        f.truncate(2**31)
    try:
        err, peak = _peak_while(lambda: load_audio(path))
        assert isinstance(err, AudioError)
        assert "over the 1,073,741,824-byte limit" in str(err) and "SPECVIZ_MAX_AUDIO_BYTES" in str(err)
        err, peak = _peak_while(lambda: load_audio(path, max_bytes=2**32))
        assert isinstance(err, AudioError) and "longer than the 1,800 s limit" in str(err)
        assert "its header announces 67,108.9 s" in str(err)
        assert peak < MiB  # the old loader asked for 8 GB here
    finally:
        path.unlink()


def test_too_long_by_keyword_and_environment(tmp_path, monkeypatch):
    path = tmp_path / "three_seconds.flac"
    sf.write(path, _tone(3.0, 16_000), 16_000)
    with pytest.raises(AudioError, match=r"longer than the 2 s limit \(its header announces 3.0 s\).*max_seconds="):
        load_audio(path, max_seconds=2)
    monkeypatch.setenv("SPECVIZ_MAX_AUDIO_SECONDS", "2.5")
    with pytest.raises(AudioError, match="longer than the 2.5 s limit.*SPECVIZ_MAX_AUDIO_SECONDS"):
        load_audio(path)
    assert len(load_audio(path, max_seconds=4)) == 3 * SAMPLE_RATE  # the keyword wins over the environment
    monkeypatch.setenv("SPECVIZ_MAX_AUDIO_SECONDS", "soon")
    with pytest.raises(AudioError, match="SPECVIZ_MAX_AUDIO_SECONDS='soon' is not a number"):
        load_audio(path)


def test_stream_without_length_stops_at_the_cap(tmp_path):
    """A FLAC whose STREAMINFO leaves the total unknown (allowed for streamed encodes) passes the header
    check, so the block reader must stop it once the decoded audio passes the cap."""
    path = tmp_path / "stream.flac"
    sf.write(path, _tone(30.0, 16_000), 16_000)
    raw = bytearray(path.read_bytes())
    assert raw[:4] == b"fLaC" and raw[4] & 0x7F == 0  # STREAMINFO first; its total is the low 36 bits of 18..26
    packed = int.from_bytes(raw[18:26], "big")
    raw[18:26] = (packed & ~(2**36 - 1)).to_bytes(8, "big")
    path.write_bytes(bytes(raw))
    assert sf.info(str(path)).frames >= 2**62
    with pytest.raises(AudioError, match="longer than the 10 s limit; raise it"):
        load_audio(path, max_seconds=10)


def test_file_size_cap_by_keyword_and_environment(tmp_path, monkeypatch):
    path = tmp_path / "clip.wav"
    sf.write(path, _tone(1.0, 16_000), 16_000, subtype="PCM_16")
    with pytest.raises(AudioError, match="32,044 bytes, over the 10,000-byte limit; raise it with max_bytes="):
        load_audio(path, max_bytes=10_000)
    monkeypatch.setenv("SPECVIZ_MAX_AUDIO_BYTES", "10000")
    with pytest.raises(AudioError, match="SPECVIZ_MAX_AUDIO_BYTES"):
        load_audio(path)
    assert len(load_audio(path, max_bytes=40_000)) == SAMPLE_RATE


def test_too_many_channels(tmp_path):
    path = tmp_path / "many.wav"
    sf.write(path, np.tile(_tone(0.1, 16_000)[:, None], (1, 65)), 16_000, format="WAV", subtype="PCM_16")
    with pytest.raises(AudioError, match="declares 65 channels; accepted: 1 to 64. Mix it down"):
        load_audio(path)
    crafted = tmp_path / "crafted.wav"  # 1,000 channels by header, 200 KB of data
    crafted.write_bytes(_wav_bytes(16_000, channels=1000, data=bytes(200_000)))
    err, peak = _peak_while(lambda: load_audio(crafted))
    assert isinstance(err, AudioError) and "1,000 channels" in str(err) and peak < MiB
    sixty_four = tmp_path / "64.wav"  # the limit itself is fine
    sf.write(sixty_four, np.tile(_tone(0.5, 16_000)[:, None], (1, 64)), 16_000, subtype="PCM_16")
    assert abs(len(load_audio(sixty_four)) - 8_000) <= 1


@pytest.mark.parametrize("bad, message", [
    (3e38, r"magnitude 3e\+38: Whisper expects samples roughly within \[-1, 1\]"),
    (-2e3, r"magnitude 2e\+03"),
    (np.nan, "NaN or infinite"),
    (np.inf, "NaN or infinite"),
])
def test_absurd_float_samples(tmp_path, bad, message):
    data = np.stack([_tone(1.0, 16_000), _tone(1.0, 16_000)], axis=1)
    data[8_000, 1] = bad
    path = tmp_path / "float.wav"
    sf.write(path, data, 16_000, subtype="FLOAT")
    with pytest.raises(AudioError, match=message):
        load_audio(path)
    with pytest.raises(AudioError, match=message):
        to_model_input(data, 16_000)


def test_hot_float_file_is_accepted(tmp_path):
    path = tmp_path / "hot.wav"
    sf.write(path, 5 * _tone(1.0, 16_000), 16_000, subtype="FLOAT")  # +14 dBFS: loud, not garbage
    assert np.abs(load_audio(path)).max() == pytest.approx(1.5, rel=1e-3)


def test_to_model_input_refuses_absurd_rates():
    with pytest.raises(AudioError, match="sample rate of 1 Hz"):
        to_model_input(_tone(1.0, 16_000), 1)


# ---- what must still work ----------------------------------------------------------------------------

def test_normal_stereo_44k(tmp_path):
    path = tmp_path / "stereo.wav"
    left, right = _tone(2.0, 44_100, 440.0), _tone(2.0, 44_100, 440.0)
    sf.write(path, np.stack([left, 0.5 * right], axis=1), 44_100, subtype="PCM_16")
    audio = load_audio(path)
    assert audio.dtype == np.float32 and audio.ndim == 1 and np.isfinite(audio).all()
    assert abs(len(audio) - 2.0 * SAMPLE_RATE) <= 1
    spectrum = np.abs(np.fft.rfft(audio * np.hanning(len(audio))))
    assert np.fft.rfftfreq(len(audio), 1 / SAMPLE_RATE)[spectrum.argmax()] == pytest.approx(440.0, abs=1.0)
    assert np.abs(audio).max() == pytest.approx(0.75 * 0.3, rel=0.02)  # mean of the two channels
    data, rate = decode_audio(path)
    assert rate == 44_100 and data.shape == (88_200, 2) and data.dtype == np.float32


@pytest.mark.parametrize("rate", [8_000, 11_025, 22_050, 44_100, 48_000, 96_000])
def test_block_resampling_matches_resample_poly(rate):
    """Resampling block by block gives scipy's resample_poly of the whole signal (several blocks long)."""
    x = (0.3 * np.random.default_rng(rate).standard_normal(8 * rate)).astype(np.float32)
    got = to_model_input(x, rate)
    want = resample_poly(x, SAMPLE_RATE, rate).astype(np.float32)
    assert len(got) == len(want)
    np.testing.assert_allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("rate, channels", [(384_000, 1), (48_000, 8), (8_000, 1)])
def test_memory_follows_the_output_not_the_file(tmp_path, rate, channels):
    """10 s at 384 kHz decodes to 15 MB of float32 but to 640 KB at 16 kHz; only the latter may be held."""
    path = tmp_path / "long.wav"
    sf.write(path, np.tile(_tone(10.0, rate, 300.0)[:, None], (1, channels)), rate, subtype="PCM_16")
    audio, peak = _peak_while(lambda: load_audio(path))
    source_bytes = 10 * rate * channels * 4
    print(f"\n{rate} Hz x {channels}: source {source_bytes / MiB:.1f} MiB, result {audio.nbytes / MiB:.2f} MiB, "
          f"peak {peak / MiB:.2f} MiB")
    assert len(audio) == 10 * SAMPLE_RATE
    assert peak < 2 * audio.nbytes + OVERHEAD


# ---- fuzz --------------------------------------------------------------------------------------------

def _seeds(tmp_path) -> dict[str, bytes]:
    """Short valid files in the formats an upload is likely to be."""
    rng = np.random.default_rng(1)
    specs = [("wav", 16_000, 1, "WAV", "PCM_16"), ("wav", 44_100, 2, "WAV", "FLOAT"),
             ("wav", 48_000, 2, "WAV", "PCM_24"), ("wav", 8_000, 4, "WAVEX", "PCM_16"),
             ("flac", 22_050, 1, "FLAC", "PCM_16"), ("ogg", 32_000, 2, "OGG", "VORBIS"),
             ("aiff", 11_025, 1, "AIFF", "PCM_16"), ("au", 16_000, 1, "AU", "FLOAT"),
             ("caf", 24_000, 1, "CAF", "PCM_32"), ("w64", 12_000, 3, "W64", "DOUBLE"),
             ("mp3", 44_100, 1, "MP3", "MPEG_LAYER_III")]
    seeds = {}
    for i, (ext, rate, channels, fmt, subtype) in enumerate(specs):
        noise = 0.01 * rng.standard_normal((int(0.2 * rate), channels))
        data = np.tile(_tone(0.2, rate, 500.0)[:, None], (1, channels)) + noise
        path = tmp_path / f"seed{i}.{ext}"
        sf.write(path, data.astype(np.float32), rate, format=fmt, subtype=subtype)
        seeds[f"seed{i}.{ext}"] = path.read_bytes()
    return seeds


_FIELD_VALUES = [0, 1, 2, 3, 7, 64, 65, 255, 1000, 3_999, 4_000, 16_000, 44_100, 384_000, 384_001, 65_535,
                 2**31 - 1, 2**32 - 1]
_FLOATS = [3e38, -3e38, np.nan, np.inf, -np.inf, 1e5, 1.5, 0.0]
_EXTS = ["wav", "flac", "ogg", "mp3", "aiff", "au", "caf", "raw", "txt", "m4a"]


def _mutate(kind: int, rng: np.random.Generator, seeds: dict[str, bytes]) -> tuple[str, bytes]:
    name = list(seeds)[rng.integers(len(seeds))]
    raw = bytearray(seeds[name])
    ext = name.rsplit(".", 1)[1]
    if kind == 0:  # one header field, 2 or 4 bytes, set to a value a liar would pick
        width = 4 if rng.random() < 0.6 else 2
        at = int(rng.integers(0, 64 - width))
        value = int(_FIELD_VALUES[rng.integers(len(_FIELD_VALUES))] if rng.random() < 0.7 else rng.integers(0, 2**32))
        raw[at:at + width] = (value % (1 << 8 * width)).to_bytes(width, "little" if rng.random() < 0.5 else "big")
    elif kind == 1:  # random bytes anywhere, mostly in the first few hundred
        for _ in range(int(rng.integers(1, 9))):
            at = int(rng.integers(0, min(len(raw), 400) if rng.random() < 0.7 else len(raw)))
            raw[at] = int(rng.integers(256))
    elif kind == 2:  # cut short
        raw = raw[: int(rng.integers(1, len(raw)))]
    elif kind == 3:  # renamed, sometimes also cut
        ext = _EXTS[rng.integers(len(_EXTS))]
        if rng.random() < 0.3:
            raw = raw[: int(rng.integers(1, len(raw)))]
    elif kind == 4:  # noise behind a real magic number, or none
        magic = [b"RIFF", b"fLaC", b"OggS", b"FORM", b".snd", b"caff", b"ID3", b""][rng.integers(8)]
        raw = bytearray(magic + rng.bytes(int(rng.integers(1, 20_000))))
    elif kind == 5:  # one file's head on another's body
        other = seeds[list(seeds)[rng.integers(len(seeds))]]
        cut = int(rng.integers(1, min(len(raw), 200)))
        raw = raw[:cut] + other[min(cut, len(other) - 1):]
    elif kind == 6:  # special float values dropped into the samples (past the header)
        for _ in range(int(rng.integers(1, 4))):
            at = int(rng.integers(64, len(raw) - 8))
            value = _FLOATS[rng.integers(len(_FLOATS))]
            raw[at:at + 4] = struct.pack("<f" if rng.random() < 0.5 else ">f", value)
    else:  # a hand-built WAV with random fields and random sample bytes
        rate = int(_FIELD_VALUES[rng.integers(len(_FIELD_VALUES))] if rng.random() < 0.5 else rng.integers(1, 400_000))
        channels, bits = int(rng.choice([0, 1, 2, 3, 64, 65, 300])), int(rng.choice([8, 16, 24, 32, 64, 12]))
        data = rng.bytes(int(rng.integers(0, 30_000)))
        size = None if rng.random() < 0.5 else int(rng.choice([0, 2**31 - 1, 2**32 - 1, len(data) * 4]))
        raw = bytearray(_wav_bytes(rate, channels, bits, data, size, fmt_tag=int(rng.choice([1, 3, 1, 0xFFFE]))))
        ext = "wav"
    return ext, bytes(raw)


def test_fuzz_mutated_files(tmp_path):
    """Each mutated file is refused with AudioError or loads as finite mono float32, within bounded memory."""
    rng = np.random.default_rng(20240611)
    seeds = _seeds(tmp_path)
    tried, refused, accepted, crashed = 0, 0, 0, []
    worst = (0, 0, "")  # peak bytes, result bytes, file
    started = time.perf_counter()
    for i in range(400):
        kind = i % 8
        ext, raw = _mutate(kind, rng, seeds)
        path = tmp_path / f"fuzz{i:03d}_{kind}.{ext}"
        path.write_bytes(raw)
        tried += 1
        tracemalloc.start()
        try:
            audio = load_audio(path)
        except AudioError:
            refused += 1
            continue
        except Exception as e:  # anything else is a bug in the loader's refusals
            crashed.append(f"{path.name}: {type(e).__name__}: {e}")
            continue
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            path.unlink()
        accepted += 1
        assert audio.dtype == np.float32 and audio.ndim == 1 and len(audio) > 0, path.name
        assert np.isfinite(audio).all(), path.name
        assert peak < 2 * audio.nbytes + OVERHEAD, (path.name, peak, audio.nbytes)
        if peak - 2 * audio.nbytes > worst[0] - 2 * worst[1]:
            worst = (peak, audio.nbytes, path.name)
    elapsed = time.perf_counter() - started
    print(f"\nfuzz: tried {tried}, refused {refused}, accepted {accepted}, crashed {len(crashed)} in {elapsed:.1f} s; "
          f"worst peak {worst[0] / MiB:.2f} MiB for a {worst[1] / MiB:.3f} MiB result ({worst[2]})")
    assert not crashed, crashed
    assert tried >= 300 and refused > 0 and accepted > 0
