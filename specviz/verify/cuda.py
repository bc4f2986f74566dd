"""The CUDA kernels behind `verify`: loading the project's own kernels/cuda/ package by path, when they apply, and
the arguments they take (the same uniforms in the same order as the torch path, so decisions agree)."""

from __future__ import annotations

import importlib.util
import sys
import threading
from types import ModuleType
from typing import NamedTuple

import torch

from specviz.config import SamplingConfig
from specviz.paths import KERNELS
from specviz.sampling import standardize
from specviz.verify.verdict import Verdict, VerifyHost, VerifyResult

BACKENDS = ("auto", "torch", "cuda")


_KERNELS_MODULE = "specviz_kernels"  # its submodules load as specviz_kernels.<name>
_kernels_lock = threading.Lock()  # two threads' first calls must not both load it, nor see it half-executed


def project_kernels() -> ModuleType:
    """specviz's own kernels/cuda/ package, loaded from its path under a private module name.

    A PyPI package is also called `kernels`; a plain `import kernels` could pick that one up (or miss ours
    when the working directory is elsewhere), so specviz never imports it by that name. The package's
    submodules import each other relatively, so they resolve under `specviz_kernels` from kernels/cuda/ too.
    """
    with _kernels_lock:
        module = sys.modules.get(_KERNELS_MODULE)
        if module is None:
            module = _load_kernels()
    return module


def _load_kernels() -> ModuleType:
    spec = importlib.util.spec_from_file_location(_KERNELS_MODULE, KERNELS / "cuda" / "__init__.py",
                                                  submodule_search_locations=[str(KERNELS / "cuda")])
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


def use_kernels(mode: str, sampling: SamplingConfig, target_logits: torch.Tensor, backend: str) -> bool:
    if mode == "baseline":
        return False  # transformers' algorithm, the reference the kernels are measured against: torch always
    # greedy needs only argmaxes, which torch does well on any device
    wanted = not sampling.greedy and target_logits.is_cuda
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
    B, gamma = draft_tokens.shape
    u = torch.rand((B, gamma), generator=generator, device=target_logits.device)
    u_res = torch.rand((B,), generator=generator, device=target_logits.device)
    how, scale, topk, top_p = kernel_sampling(mode, sampling, target_logits.shape[-1])
    if how == "standardize":
        draft_logits, target_logits = standardize(draft_logits, sampling), standardize(target_logits, sampling)
    return KernelArgs(draft_logits, target_logits, u, u_res, dict(scale=scale, topk=topk, top_p=top_p))


def verify_kernels(mode: str, draft_tokens: torch.Tensor, draft_logits: torch.Tensor, target_logits: torch.Tensor,
                   sampling: SamplingConfig, generator: torch.Generator | None, lenience: float, alpha: float,
                   beta: float) -> VerifyResult:
    """The kernel path (draft_tokens [B, γ], draft_logits [B, γ, V], target_logits [B, γ+1, V]).

    Without `standardize` the kernels draw through `launch_sampled`: one CUDA graph per plan (kernels/cuda/
    graphs.py) that draws u then u_res from `generator` as `kernel_args` does. Graph-safe Philox reads the
    generator's seed and offset at each replay and advances the offset by what the two draws consume, so the
    uniforms are the ones `kernel_args` would draw from the same state (same Philox offsets); what differs is
    only torch's work around them (the seed and offset written to the device before each replay; the capture
    consumes no offsets). The result's tensors are then the graph's buffer, rewritten by its next replay (the
    next verification of the same shapes and generator): read them (or host()) before that.
    """
    kernels = project_kernels()
    how, scale, topk, top_p = kernel_sampling(mode, sampling, target_logits.shape[-1])
    if how != "standardize":
        done = kernels.launch_sampled(mode, draft_tokens, draft_logits, target_logits, generator, scale=scale,
                                      topk=topk, top_p=top_p, lenience=lenience, sigmoid_alpha=alpha,
                                      sigmoid_beta=beta)
    else:  # torch standardizes first: its logits are fresh tensors every call, so a graph would never replay
        args = kernel_args(mode, draft_tokens, draft_logits, target_logits, sampling, generator)
        done = kernels.launch(mode, draft_tokens, args.draft_logits, args.target_logits, args.u, args.u_res,
                              lenience=lenience, sigmoid_alpha=alpha, sigmoid_beta=beta, **args.options)
    # kernels/cuda/ hands back plain dicts keyed like Verdict's fields: typed here, at the boundary
    return VerifyResult.of(Verdict(**done.outputs), host=VerifyHost(**done.host))
