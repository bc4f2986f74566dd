"""Verification: one public function, three modes.

    result = specviz.verify("exact", draft_tokens, draft_logits, target_logits, sampling=..., generator=g)

Shapes: draft_tokens LongTensor[B, γ], draft_logits [B, γ, V], target_logits [B, γ+1, V] (raw model
logits; the sampling settings are applied here, identically to both models). Per row the result says how
many drafted tokens were accepted and which token comes next: the correction sampled from the residual
on a rejection, the bonus token from the target's last position when all γ were accepted.

Ragged batches: `draft_lengths` (γ_b per row, 1 ≤ γ_b ≤ γ) lets rows draft fewer tokens than γ (the
draft-confidence stop ends rows at different points). Row b then uses draft positions [0, γ_b) and target
positions [0, γ_b]; whatever lies beyond is padding that is never read into a decision, and the bonus of
a row that kept all γ_b drafts comes from target position γ_b. Omitted, every row drafted γ.

Random numbers are drawn from `generator` in a fixed order: one uniform per drafted position (a [B, γ]
tensor), then the residual draw. `baseline` draws the residual with torch.multinomial, as transformers
does, so that both make identical decisions from identically seeded generators.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import torch

from ..config import MODES, SamplingConfig
from ..sampling import check_logits
from .baseline import verify_baseline
from .tiled import DEFAULT_TILE, verify_tiled

__all__ = ["VerifyHost", "VerifyResult", "verify", "MODES", "BACKENDS", "kernels_active", "kernel_args",
           "kernel_sampling", "KernelArgs", "KernelSampling", "project_kernels"]


@dataclass(frozen=True)
class VerifyHost:
    """A VerifyResult's fields as Python lists on the host (what the engine records)."""

    n_accepted: list[int]  # [B]
    next_token: list[int]  # [B]
    accept_prob: list[list[float]]  # [B][γ]
    uniforms: list[list[float]]  # [B][γ]
    p_draft: list[list[float]]  # [B][γ]
    q_draft: list[list[float]]  # [B][γ]


@dataclass
class VerifyResult:
    n_accepted: torch.Tensor  # LongTensor[B]: drafted tokens kept, a prefix of each row
    next_token: torch.Tensor  # LongTensor[B]: correction on a rejection, bonus when all γ were kept
    accept_prob: torch.Tensor  # [B, γ]: min(1, p(x) / (l·q(x))) at each drafted token
    uniforms: torch.Tensor  # [B, γ]: the uniform each position was compared with
    p_draft: torch.Tensor  # [B, γ]: target probability of each drafted token, as the mode computes it
    q_draft: torch.Tensor  # [B, γ]: draft probability of each drafted token, as the mode computes it
    # The host copy: set by the kernel path from its one readback, else made by the first host() call.
    _host: VerifyHost | None = field(default=None, repr=False, compare=False)

    def host(self) -> VerifyHost:
        """All fields as Python lists. The kernel path already read them back (no new sync); the torch
        path reads them with one stacked copy the first time, then keeps it."""
        if self._host is None:
            B, gamma = self.accept_prob.shape
            # One readback: ids < 2^53 are exact in float64, and so is every float32 value.
            flat = torch.cat([self.n_accepted.reshape(-1).double(), self.next_token.reshape(-1).double(),
                              *(getattr(self, k).reshape(-1).double() for k in _FLOAT_FIELDS)]).tolist()
            rows = [flat[2 * B + i * B * gamma: 2 * B + (i + 1) * B * gamma] for i in range(len(_FLOAT_FIELDS))]
            floats = {k: [r[b * gamma:(b + 1) * gamma] for b in range(B)] for k, r in zip(_FLOAT_FIELDS, rows)}
            self._host = VerifyHost(n_accepted=[int(x) for x in flat[:B]], next_token=[int(x) for x in flat[B:2 * B]],
                                    **floats)
        return self._host

    def emitted(self, draft_tokens: torch.Tensor, row: int = 0) -> list[int]:  # draft_tokens [B, γ]
        """The tokens this verification appends to sequence `row`: kept drafts, then next_token."""
        h = self.host()
        n = h.n_accepted[row]
        return draft_tokens[row, :n].tolist() + [h.next_token[row]]


_FLOAT_FIELDS = ("accept_prob", "uniforms", "p_draft", "q_draft")


def _check_shapes(draft_tokens: torch.Tensor, draft_logits: torch.Tensor, target_logits: torch.Tensor,
                  draft_lengths: list[int] | None) -> None:
    """Shapes, dtypes and draft_lengths: no device work."""
    if draft_tokens.dim() != 2 or draft_tokens.dtype != torch.long:
        raise ValueError(f"draft_tokens must be a LongTensor [B, γ], got {draft_tokens.dtype} {tuple(draft_tokens.shape)}")
    B, gamma = draft_tokens.shape
    if gamma < 1:
        raise ValueError("need at least one drafted token (γ >= 1)")
    if draft_logits.dim() != 3 or draft_logits.shape[:2] != (B, gamma):
        raise ValueError(f"draft_logits must be [B={B}, γ={gamma}, V], got {tuple(draft_logits.shape)}")
    if target_logits.dim() != 3 or target_logits.shape[:2] != (B, gamma + 1):
        raise ValueError(f"target_logits must be [B={B}, γ+1={gamma + 1}, V], got {tuple(target_logits.shape)}")
    if draft_logits.shape[-1] != target_logits.shape[-1]:
        raise ValueError(
            f"draft and target vocabularies differ: {draft_logits.shape[-1]} vs {target_logits.shape[-1]} columns"
        )
    if draft_lengths is not None:
        if len(draft_lengths) != B or any(not 1 <= int(n) <= gamma for n in draft_lengths):
            raise ValueError(f"draft_lengths must hold B={B} counts in [1, γ={gamma}], got {list(draft_lengths)}")


def _check_token_range(draft_tokens: torch.Tensor, vocab: int) -> None:
    """Drafted ids in [0, V): one reduction and one host sync (the kernels check this in their error slot)."""
    if bool(((draft_tokens < 0) | (draft_tokens >= vocab)).any()):
        raise ValueError(f"draft_tokens must lie in [0, {vocab})")


def _lengths(draft_lengths: list[int] | None, draft_tokens: torch.Tensor) -> torch.Tensor:
    """γ_b per row as LongTensor[B] on the tokens' device (γ everywhere when not given)."""
    B, gamma = draft_tokens.shape
    if draft_lengths is None:
        return torch.full((B,), gamma, dtype=torch.long, device=draft_tokens.device)
    return torch.tensor([int(n) for n in draft_lengths], dtype=torch.long, device=draft_tokens.device)


def verify(
    mode: str,
    draft_tokens: torch.Tensor,
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    sampling: SamplingConfig = SamplingConfig(),
    generator: torch.Generator | None = None,
    *,
    lenience: float = 1.0,
    sigmoid_alpha: float = -1e4,
    sigmoid_beta: float = 1e4,
    tile_size: int = DEFAULT_TILE,
    backend: str = "auto",
    draft_lengths: list[int] | None = None,
) -> VerifyResult:
    """Decide which drafted tokens to keep and sample the next token; see the module docstring.

    mode: 'baseline' (transformers' algorithm), 'exact' (Wagner et al. §3.2.1 tiled pass) or 'sigmoid'
    (Wagner et al. §3.2.2, approximate). lenience l in (0, 1] multiplies q before the comparison
    (Leviathan et al. A.5); 1 keeps the output distribution exact. backend: 'auto' runs `exact` and
    `sigmoid` on CUDA tensors with the CuPy kernels in kernels/ when they work (same random numbers, same
    decisions up to floating-point near-ties), 'torch' forces the torch path, 'cuda' requires the kernels.
    draft_lengths: drafted tokens per row when rows drafted fewer than γ (see the module docstring); ragged
    rows verify on the torch path, which the kernels do not yet take.

    On the kernel path a call launches the two uniform draws and the kernels and reads back once (the
    result's `host()` is that copy); input problems (bad logits, drafted ids outside [0, V)) are raised
    from that readback. The kernels apply temperature, top-k and top-p themselves in both modes (see
    `kernel_sampling`); only top_k above their MAX_TOPK standardizes the logits with torch first.
    """
    if mode not in MODES:
        raise ValueError(f"unknown verification mode {mode!r}; choose one of {', '.join(MODES)}")
    if not 0 < lenience <= 1:
        raise ValueError(f"lenience must be in (0, 1], got {lenience}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown verification backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    _check_shapes(draft_tokens, draft_logits, target_logits, draft_lengths)
    ragged = draft_lengths is not None and min(draft_lengths) < draft_tokens.shape[1]
    if ragged and backend == "cuda":
        raise ValueError("the CUDA kernels verify rows of equal length; ragged draft_lengths need backend 'auto' or 'torch'")
    if _use_kernels(mode, sampling, target_logits, "torch" if ragged and backend == "auto" else backend):
        # No device checks here: the kernels flag bad logits and out-of-range tokens in their one readback.
        return _verify_kernels(mode, draft_tokens, draft_logits, target_logits, sampling, generator,
                               lenience, sigmoid_alpha, sigmoid_beta)
    _check_token_range(draft_tokens, target_logits.shape[-1])
    check_logits(draft_logits, "draft")
    check_logits(target_logits, "target")
    lengths = _lengths(draft_lengths, draft_tokens)
    if mode == "baseline":
        fields = verify_baseline(draft_tokens, draft_logits, target_logits, lengths, sampling, generator, lenience)
    else:
        fields = verify_tiled(
            draft_tokens, draft_logits, target_logits, lengths, sampling, generator,
            lenience=lenience, sigmoid=(sigmoid_alpha, sigmoid_beta) if mode == "sigmoid" else None,
            tile=tile_size,
        )
    return VerifyResult(**fields)


BACKENDS = ("auto", "torch", "cuda")


_KERNELS_DIR = Path(__file__).resolve().parents[2] / "kernels"
_KERNELS_MODULE = "specviz_kernels"  # its submodules load as specviz_kernels.<name>
_kernels_lock = threading.Lock()  # two threads' first calls must not both load it, nor see it half-executed


def project_kernels() -> ModuleType:
    """specviz's own top-level kernels/ package, loaded from its path under a private module name.

    A PyPI package is also called `kernels`; a plain `import kernels` could pick that one up (or miss ours
    when the working directory is elsewhere), so specviz never imports it by that name. The package's
    submodules import each other relatively, so they resolve under `specviz_kernels` from kernels/ too.
    """
    with _kernels_lock:
        module = sys.modules.get(_KERNELS_MODULE)
        if module is None:
            module = _load_kernels()
    return module


def _load_kernels() -> ModuleType:
    spec = importlib.util.spec_from_file_location(_KERNELS_MODULE, _KERNELS_DIR / "__init__.py",
                                                  submodule_search_locations=[str(_KERNELS_DIR)])
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs: its relative imports find the parent package in sys.modules.
    sys.modules[_KERNELS_MODULE] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        for name in [n for n in sys.modules if n == _KERNELS_MODULE or n.startswith(_KERNELS_MODULE + ".")]:
            del sys.modules[name]  # a later call retries from scratch instead of finding a broken package
        raise
    return module


def kernels_active() -> bool:
    """True when the CuPy verification kernels can run here (a CUDA device, CuPy, a working compiler)."""
    return project_kernels().available()


def _use_kernels(mode: str, sampling: SamplingConfig, target_logits: torch.Tensor, backend: str) -> bool:
    # greedy needs only argmaxes, which torch does well on any device; baseline is transformers' algorithm
    wanted = mode != "baseline" and not sampling.greedy and target_logits.is_cuda
    if backend == "cuda":
        if not wanted:
            raise ValueError("the CUDA kernels verify exact/sigmoid on CUDA tensors with sampling (not greedy)")
        if not kernels_active():
            raise RuntimeError(f"the CUDA verification kernels cannot run: {project_kernels().unavailable_reason()}")
        return True
    return backend == "auto" and wanted and kernels_active()


class KernelSampling(NamedTuple):
    """How the kernel path applies a SamplingConfig (see `kernel_sampling`)."""

    how: str  # 'scale', 'filter' or 'standardize'
    scale: float  # the factor the kernels multiply the logits they receive by
    topk: int  # in-kernel top-k (0: none)
    top_p: float  # in-kernel top-p (1.0: none)


def kernel_sampling(mode: str, sampling: SamplingConfig, vocab: int) -> KernelSampling:
    """How the kernel path applies `sampling` (non-greedy; mode 'exact' and 'sigmoid' route alike):

    - ('scale', 1/T, 0, 1.0): temperature only, fused into the kernels' reads;
    - ('filter', s, k, p): top-k and / or top-p inside the kernels, on raw logits times s = fp32(1)/fp32(T)
      (torch's `z / T` on CUDA), with `standardize`'s semantics (ties with the top-p boundary value kept);
    - ('standardize', 1.0, 0, 1.0): logits standardized by torch first. Only for top_k > MAX_TOPK, whose
      candidate lists the last block of a row could not merge quickly (with or without top-p).
    """
    if sampling.temperature_only:
        return KernelSampling("scale", 1.0 / sampling.temperature, 0, 1.0)
    top_k = sampling.top_k if sampling.top_k < vocab else 0  # standardize skips top_k >= V
    # standardize's `z / T` is z · (fp32(1) / fp32(T)) on CUDA: the kernels multiply by that factor
    scale = 1.0 if sampling.temperature == 1.0 else float(project_kernels().topk_scale(sampling.temperature))
    if sampling.top_p == 1.0 and not top_k:
        return KernelSampling("scale", scale, 0, 1.0)
    if top_k > project_kernels().MAX_TOPK:
        return KernelSampling("standardize", 1.0, 0, 1.0)
    return KernelSampling("filter", scale, top_k, sampling.top_p)


class KernelArgs(NamedTuple):
    """What kernels.launch takes for one call besides mode and drafted tokens."""

    draft_logits: torch.Tensor  # [B, γ, V]: raw, or standardized by torch ('standardize')
    target_logits: torch.Tensor  # [B, γ+1, V]: likewise
    u: torch.Tensor  # [B, γ]: acceptance uniforms
    u_res: torch.Tensor  # [B]: residual uniforms
    options: dict  # scale, topk, top_p


def kernel_args(mode: str, draft_tokens: torch.Tensor, draft_logits: torch.Tensor, target_logits: torch.Tensor,
                sampling: SamplingConfig, generator: torch.Generator | None) -> KernelArgs:
    """kernels.launch's inputs for this call (draft_tokens [B, γ], draft_logits [B, γ, V], target_logits
    [B, γ+1, V]), with the same draws in the same order as the torch path, so decisions agree."""
    from ..sampling import standardize

    B, gamma = draft_tokens.shape
    u = torch.rand((B, gamma), generator=generator, device=target_logits.device)
    u_res = torch.rand((B,), generator=generator, device=target_logits.device)
    how, scale, topk, top_p = kernel_sampling(mode, sampling, target_logits.shape[-1])
    if how == "standardize":
        draft_logits, target_logits = standardize(draft_logits, sampling), standardize(target_logits, sampling)
    return KernelArgs(draft_logits, target_logits, u, u_res, dict(scale=scale, topk=topk, top_p=top_p))


def _verify_kernels(mode, draft_tokens, draft_logits, target_logits, sampling, generator, lenience, alpha,
                    beta) -> VerifyResult:
    args = kernel_args(mode, draft_tokens, draft_logits, target_logits, sampling, generator)
    done = project_kernels().launch(mode, draft_tokens, args.draft_logits, args.target_logits, args.u, args.u_res,
                                    lenience=lenience, sigmoid_alpha=alpha, sigmoid_beta=beta, **args.options)
    return VerifyResult(**done.outputs, _host=VerifyHost(**done.host))
