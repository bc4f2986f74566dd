"""A transformers causal LM built straight from a GGUF file's blocks: no dense copy of the weights, ever.

transformers' own GGUF loading dequantizes every tensor to a dense fp32 model (6.2 GB for the embedded
1.5B target, ~70 s on 2 cores, ~9 GB of peak memory) that specviz then threw away for its packed kernels.
Here the file's header gives the config and tokenizer (gguf_file.GGUFFile, ~1 s), the model is built on
the meta device, and each tensor goes where it is used:

- a linear layer's quantized weight stays in its blocks (gguf_pack.pack): the packed kernels read them;
- the input embedding is looked up densely, so it is dequantized once at build time (the same bits gguf's
  own dequantization gives: gguf_pack.dequantize_reference, tested);
- plain F32 tensors (norms, biases) are taken as they are.

`weights="dense"` (a user's explicit choice) dequantizes the linear layers too, at build time. Only
architectures whose tensors transformers loads without rewriting them (no llama-style q/k permutation, no
special config handling) take this path (`direct`); the rest keep transformers' loader.

`save_blocks` / `load_blocks` keep the packed form in the cache: the embedded pair is packed once (seconds)
and later starts read it back (models/loading.py).
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from specviz.models.gguf_file import GGUFFile
from specviz.models.gguf_pack import SUPPORTED, Packed, dequantize_reference, pack
from specviz.models.packed import PACKED_FILE, load_packed, save_packed

Progress = Callable[[str, "float | None"], None]

DENSE_FILE = "dense.safetensors"
EMBEDDING = "model.embed_tokens"  # the input embedding's module name in transformers' causal LMs
HEAD = "lm_head"
# Architectures transformers' GGUF loader treats specially (config or tensors rewritten on the way in): loaded
# by transformers, never here.
SPECIAL = {"llama", "mistral", "t5", "t5encoder", "umt5", "qwen2moe", "qwen3moe", "gpt-oss", "gpt_oss", "stablelm",
           "gemma2", "gemma3", "gemma4", "lfm2", "minimax-m2", "bloom", "falcon", "gpt2", "mamba", "nemotron", "qwen35",
           "qwen35moe"}


class NotDirect(ValueError):
    """This GGUF file is loaded by transformers (its architecture needs transformers' rewriting)."""


def _silent(message: str, fraction: float | None) -> None:
    pass


def direct(gguf: GGUFFile) -> bool:
    """Whether this file's model is built here (else by transformers' loader)."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    arch = gguf.metadata.get("general.architecture")
    return arch in GGUF_SUPPORTED_ARCHITECTURES and arch not in SPECIAL


def config_dict(gguf: GGUFFile) -> dict:
    """The config transformers derives from the file's metadata (modeling_gguf_pytorch_utils.load_gguf_checkpoint,
    its generic path: renamed keys, tied embeddings when there is no output tensor, the architecture's defaults,
    the vocabulary's size), from the fast reader's values."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_TO_TRANSFORMERS_MAPPING

    if not direct(gguf):
        raise NotDirect(f"{gguf.path.name}: architecture {gguf.metadata.get('general.architecture')!r}")
    arch = gguf.metadata["general.architecture"]
    config: dict = {"tie_word_embeddings": "output.weight" not in gguf.tensors}
    for key, value in GGUF_CONFIG_DEFAULTS_MAPPING.get(arch, {}).items():
        config.setdefault(key, value)
    renames = GGUF_TO_TRANSFORMERS_MAPPING["config"]
    for key, value in gguf.metadata.items():
        prefix, _, rest = key.partition(".")
        renamed = renames.get(prefix, {}).get(rest)
        if renamed is None or renamed == -1:
            continue
        config[renamed] = value[0] if isinstance(value, list) and len(value) == 1 else value
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in gguf.metadata:
        config["vocab_size"] = len(gguf.metadata["tokenizer.ggml.tokens"])
    return config


def hf_config(gguf: GGUFFile) -> PretrainedConfig:
    """The model's transformers config (what AutoConfig.from_pretrained(dir, gguf_file=…) gives, in a second)."""
    from transformers import CONFIG_MAPPING

    values = config_dict(gguf)
    return CONFIG_MAPPING[values["model_type"]].from_dict(values)


def hf_tokenizer(gguf: GGUFFile, config: PretrainedConfig) -> PreTrainedTokenizerBase:
    """The tokenizer AutoTokenizer builds from the file, without its second reading of the whole header."""
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

    tokenizer_class = TOKENIZER_MAPPING[type(config)]
    if isinstance(tokenizer_class, (tuple, list)):  # (slow, fast) in some versions: the fast one
        tokenizer_class = tokenizer_class[-1] or tokenizer_class[0]
    return tokenizer_class.from_pretrained(str(gguf.path.parent), gguf_file=gguf.path.name)


def _meta_model(config: PretrainedConfig) -> PreTrainedModel:
    """The model's modules with parameters on the meta device (no memory, no initialisation); buffers such as
    the rotary frequencies are computed as usual."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _hf_names(model: PreTrainedModel) -> dict[str, str]:
    """GGUF tensor name -> transformers parameter name, for this model (gguf-py's name tables)."""
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

    return get_gguf_hf_weights_map(model, TensorProcessor())


@dataclass
class Blocks:
    """A model's weights as the file holds them: `packed` by module name (every linear layer, and the input
    embedding where its blocks pack), `dense` by parameter name (norms, biases, and anything whose blocks have
    no packed form, dequantized by gguf)."""

    packed: dict[str, Packed]
    dense: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes + sum(t.numel() * t.element_size() for t in (p.sub, p.sup) if t is not None)
                   for p in self.packed.values()) + sum(t.numel() * t.element_size() for t in self.dense.values())


def read_blocks(gguf: GGUFFile, config: PretrainedConfig, progress: Progress = _silent) -> Blocks:
    """Every tensor of the file, packed where its blocks pack, else dense fp32."""
    from gguf import GGMLQuantizationType as QT
    from gguf import quants

    names = _hf_names(_meta_model(config))
    unknown = sorted(set(gguf.tensors) - set(names))
    if unknown:
        raise NotDirect(f"{gguf.path.name}: tensors with no transformers parameter ({', '.join(unknown[:3])})")
    plain = (QT.F32, QT.F16, QT.BF16)

    def read(name: str) -> tuple[str, Packed | torch.Tensor]:
        info, parameter = gguf.tensors[name], names[name]
        module, _, kind = parameter.rpartition(".")
        if info.kind in plain:
            return parameter, torch.from_numpy(np.array(gguf.values(name), dtype=np.float32))
        if kind == "weight" and info.kind.name in SUPPORTED and len(info.shape) == 2:
            return module, pack(gguf.raw(name), info.kind, info.rows)
        # blocks without a packed form: gguf's own dequantization (what transformers would hold)
        values = quants.dequantize(np.asarray(gguf.raw(name)), info.kind).reshape(info.shape)
        return parameter, torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))

    packed, dense = {}, {}
    # numpy's array operations release the GIL: two threads pack two tensors at once (one per core here)
    with ThreadPoolExecutor(max_workers=min(2, os.cpu_count() or 1)) as pool:
        for i, (key, value) in enumerate(pool.map(read, gguf.tensors)):
            progress(f"packing {gguf.path.name}'s blocks", i / len(gguf.tensors))
            (packed if isinstance(value, Packed) else dense)[key] = value
    return Blocks(packed, dense)


def save_blocks(blocks: Blocks, directory: Path) -> None:
    """The packed weights (packed.safetensors, models/packed.py's format) and the dense ones (dense.safetensors),
    each written whole or not at all."""
    save_packed(blocks.packed, directory / PACKED_FILE)
    tmp = directory / f".{DENSE_FILE}.{os.getpid()}.tmp"
    save_file({name: t.contiguous() for name, t in blocks.dense.items()}, str(tmp),
              metadata={"specviz_dense": json.dumps(sorted(blocks.dense))})
    os.replace(tmp, directory / DENSE_FILE)


def load_blocks(directory: Path) -> Blocks | None:
    """What save_blocks wrote; None when either file is missing, unreadable or of another packing version."""
    packed = load_packed(directory / PACKED_FILE)
    if packed is None:
        return None
    try:
        dense = load_file(str(directory / DENSE_FILE))
    except Exception:  # missing or cut short: the caller packs again
        return None
    return Blocks(packed, dense)


def dequantized(packed: Packed, rows_per_piece: int = 8192) -> torch.Tensor:
    """The dense fp32 weight [N, K] of packed blocks, in pieces of rows (a 151,936-row embedding would otherwise
    need three fp32 copies at once); the bits of gguf's dequantization."""
    n = packed.shape[0]
    out = torch.empty(packed.shape, dtype=torch.float32)
    pick = lambda t, a, b: None if t is None else t[a:b]  # noqa: E731
    for start in range(0, n, rows_per_piece):
        end = min(start + rows_per_piece, n)
        part = Packed(packed.kind, packed.q[start:end], packed.scale[start:end], pick(packed.minv, start, end),
                      packed.source)
        out[start:end] = dequantize_reference(part)
    return out


def linear_blocks(model: nn.Module, blocks: Blocks) -> dict[str, Packed]:
    """The blocks of every linear layer of `model` by module name (a tied head: the embedding's)."""
    head = blocks.packed.get(HEAD, blocks.packed.get(EMBEDDING))
    layers = {name: head if name == HEAD else blocks.packed.get(name)
              for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    return {name: layer for name, layer in layers.items() if layer is not None}


def requantized_q4(config: PretrainedConfig, blocks: Blocks, progress: Progress = _silent) -> dict[str, Packed]:
    """Every linear layer re-quantized to the 4-bit draft's format (models/quant.q4_blocks) from its dequantized
    blocks, one layer at a time: the weights quantize_draft_q4 gives on the dense model, without building it."""
    from specviz.models.quant import q4_blocks

    layers = linear_blocks(_meta_model(config), blocks)
    out = {}
    for i, (name, source) in enumerate(layers.items()):
        progress("re-quantizing the draft to 4 bits", i / len(layers))
        out[name] = q4_blocks(dequantized(source))
    return out


def build(config: PretrainedConfig, blocks: Blocks, *, packed: bool, int8_activations: bool = False
          ) -> PreTrainedModel:
    """The model on the CPU in fp32: its linear layers on the packed blocks (`packed`) or dequantized, the input
    embedding dequantized, the rest as stored. Raises ValueError when something the model needs is missing."""
    from specviz.models.packed import apply_packed

    model = _meta_model(config)
    layers = linear_blocks(model, blocks)
    state = dict(blocks.dense)
    if EMBEDDING in blocks.packed:
        state[f"{EMBEDDING}.weight"] = dequantized(blocks.packed[EMBEDDING])
    if not packed:
        state.update({f"{name}.weight": dequantized(layer) for name, layer in layers.items()})
    model.load_state_dict(state, strict=False, assign=True)
    if getattr(model.config, "tie_word_embeddings", False) and not packed and f"{HEAD}.weight" not in state:
        model.tie_weights()
    if packed:
        apply_packed(model, layers, int8_activations=int8_activations)
    missing = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if missing:
        raise ValueError(f"the GGUF file holds no weight for {len(missing)} parameters (e.g. {missing[0]})")
    return model.eval()
