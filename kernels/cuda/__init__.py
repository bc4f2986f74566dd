"""CUDA verification kernels (verify.cu) on torch tensors: the public names, gathered from the submodules.

The kernels are compiled at run time with CuPy's NVRTC and launched on torch's current stream.

    from specviz.verify import project_kernels  # never `import kernels`: a PyPI package has that name
    kernels = project_kernels()
    if kernels.available():
        fields = kernels.verify_cuda("exact", draft_tokens, draft_logits, target_logits, u, u_res,
                             scale=1 / temperature, lenience=1.0, sigmoid_alpha=-1e4, sigmoid_beta=1e4)
        # top-k / top-p inside the kernels, on raw logits (`standardize`'s semantics, see verify.cu):
        fields = kernels.verify_cuda("exact", ..., scale=kernels.topk_scale(T), topk=50, top_p=0.9)

`launch_sampled` draws the uniforms itself (u then u_res, from the caller's generator) and, where it can,
replays one CUDA graph per plan: draws, kernels and the readback's copy in one launch (`graphs`; switched
off by SPECVIZ_VERIFY_GRAPHS=0 or `set_graphs_enabled(False)`). This is the path `specviz.verify` takes.

`verify_cuda` decides exactly as `specviz.verify.tiled.verify_tiled` (same random numbers, same acceptance
rule, same two-level residual scan) and returns the same keys. The caller draws the random numbers from its
generator in tiled.py's order, `u = rand((B, γ))` then `u_res = rand((B,))`, and passes them in.

Launches per call: two for `exact` (per-chunk softmax statistics, with `topk` each chunk's k largest
values, and with `topk` or `top_p` each row's threshold and normalizer, found by the last block of the
row; then acceptance, residual masses and sampling in the last block of each batch row), one for
`sigmoid`, two with `topk` or `top_p` (the first launch of `exact` for the thresholds, then the sigmoid
one). Top-p without top-k reads each row 2 more times (fp16 / bf16) or 4 (fp32), by the last block of the
row, from L2; with top-k it ranks the K1·k candidate lists only, no pass over the vocabulary. All on torch's
current CUDA stream, no copies of the logits (any batch/row strides; the last dimension must be contiguous
or it is copied). One readback (a few bytes per row, into pinned memory) when `check=True`: it raises on
NaN / +inf / all -inf logits or drafted tokens outside the vocabulary, and `launch` hands its host copy back
so that callers need no further sync; `check=False` makes the call fully asynchronous and skips those errors.

Submodules, one idea each: `sources` (verify.cu's files, sizes and entry points), `build` (compiling,
availability), `spec` (`LaunchSpec`: one call's launch without its data: layout, settings, their checks),
`plan` (grids, buffer layout, argument lists; cached per `LaunchSpec`), `outputs` (the output bytes: views,
host lists, errors), `launcher` (launching on torch's stream, the readback), `graphs` (one CUDA graph per
plan: the cache, capture and replay). They import each other relatively only: specviz loads this package
(kernels/cuda/) by path as `specviz_kernels` (`specviz.verify.project_kernels`), never as `kernels`, the
name of an unrelated PyPI package.

Importing this package needs neither CuPy nor a GPU: CuPy is imported inside the functions that use it.
Its caches (compiled functions, plans, state buffers, stream handles, graphs) are guarded by locks: a page
run and a compare can decode in two threads at once.
"""

from .build import available, compile_check, nvrtc_check, unavailable_reason
from .graphs import GraphCache, graphs_enabled, set_graphs_enabled
from .launcher import Launched, launch, launch_sampled, verify_cuda
from .outputs import host_lists, raise_for_errors
from .plan import plan_chunks, sigmoid_inv_den, state_size, topk_scale, topp_value
from .sources import ENTRY_POINTS, MAX_GAMMA, MAX_TOPK, THREADS, source_files
from .spec import LaunchSpec

__all__ = [
    "available",
    "unavailable_reason",
    "verify_cuda",
    "source_files",
    "compile_check",
    "nvrtc_check",
    "MAX_GAMMA",
    "MAX_TOPK",
    "launch",
    "launch_sampled",
    "Launched",
    "GraphCache",
    "graphs_enabled",
    "set_graphs_enabled",
    "LaunchSpec",
    "sigmoid_inv_den",
    "topk_scale",
    "topp_value",
    "ENTRY_POINTS",
    "THREADS",
    "plan_chunks",
    "state_size",
    "host_lists",
    "raise_for_errors",
]
