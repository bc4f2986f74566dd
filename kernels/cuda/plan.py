"""Launch planning, device-agnostic and without CuPy: validation, grids, the buffer layout and argument lists.

The grids, workspace layout and argument lists depend only on a call's `LaunchSpec` (mode, shapes, dtypes,
strides, settings), so they are planned once per spec (`_cached_plan`) and a call only patches its data pointers
in (`_prepare`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

from .sources import DTYPE_SUFFIX, UNROLL_SPAN
from .spec import LaunchSpec


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def plan_chunks(mode: str, batch: int, gamma: int, vocab: int, sms: int) -> tuple[int, int]:
    """(stats_chunk, residual_chunk) in columns: enough blocks to fill `sms` multiprocessors.

    Launch 1 (exact; sigmoid with top-k / top-p) has ceil(V / stats_chunk)·(2γ+1)·B blocks, aimed at ~4 per
    SM; the residual launch has ceil(V / residual_chunk)·B blocks (exact, ~2 per SM) or ·(2γ+1)·B (sigmoid).
    The residual chunk also bounds the last block's final scan, so it stays within [1024, 4096].
    """
    rows = 2 * gamma + 1
    stats = _round_up(-(-vocab * rows * batch // (4 * sms)), UNROLL_SPAN)
    stats = min(max(stats, 2048), 32768)
    if mode == "exact":
        residual = -(-vocab * batch // (2 * sms))
    else:
        residual = -(-vocab * rows * batch // (4 * sms))
    residual = min(max(_round_up(residual, UNROLL_SPAN), 1024), 4096)
    return stats, residual


# Where a pointer slot's address comes from: the tensors of `_inputs`, in order, then the call's buffer and the
# state (see `_materialize`).
_SRC_TARGET, _SRC_DRAFT, _SRC_TOKENS, _SRC_U, _SRC_URES, _SRC_BUFFER, _SRC_STATE = range(7)


@dataclass
class Plan:
    """What every call of one `LaunchSpec` launches, minus the pointers.

    launches: [(entry point, grid, argument template, pointer slots)]; a slot (i, source, offset) means
    argument i is the data pointer of source (_SRC_*) plus offset bytes. Built once per spec by `_plan`,
    so a call only patches pointers into copies of the templates.
    """

    launches: list
    out_bytes: int  # the leading bytes of the buffer that hold the outputs
    total_bytes: int  # outputs, then workspace
    cast: bool  # the logits go through fp32 (mixed or unsupported dtypes)
    copy_target: bool  # read from a contiguous copy (cast, or the last dimension is not contiguous)
    copy_draft: bool
    state_entries: int
    slot_arrays: dict  # entry point -> `_slot_arrays` of its slots


@dataclass
class Prepared:
    """Everything one call launches, and the views of its outputs (see `_prepare`)."""

    launches: list  # [(entry point, grid, args)]
    buffer: torch.Tensor  # uint8: outputs, then workspace
    out_bytes: int  # the leading bytes of `buffer` that hold the outputs
    keep: tuple  # tensors the launches read (contiguous copies, if any were made)


def state_size(batch: int, gamma: int) -> int:
    """int32 entries of the zero-initialized state a call needs: B ticket counters, then B·(2γ+1) error words."""
    return batch + batch * (2 * gamma + 1)


def sigmoid_inv_den(alpha: float, beta: float) -> np.float32:
    """fp32(1) / fp32(β - α): the factor torch on CUDA multiplies by for `t / (β - α)` (a Python scalar)."""
    return np.float32(1) / np.float32(beta - alpha)


def topk_scale(temperature: float) -> np.float32:
    """fp32(1) / fp32(T): the factor torch on CUDA multiplies by for `standardize`'s `z / T`."""
    return np.float32(1) / np.float32(temperature)


def topp_value(top_p: float) -> np.float32:
    """fp32(top_p): `standardize` compares a float32 tensor with the Python float, which torch casts to fp32."""
    return np.float32(top_p)


def _inputs(draft_logits: torch.Tensor, target_logits: torch.Tensor, tokens: torch.Tensor, u: torch.Tensor,
            u_res: torch.Tensor, plan: Plan) -> tuple:
    """The tensors the kernels read, converted as the plan says (no-ops in the usual case)."""
    # Copies are contiguous, whatever the input's layout: the plan's stride arguments assume it. (`.float()`
    # would keep a permuted layout and so cost a second copy.)
    if plan.cast:
        draft_logits = draft_logits.to(torch.float32, memory_format=torch.contiguous_format)
        target_logits = target_logits.to(torch.float32, memory_format=torch.contiguous_format)
    if plan.copy_target:
        target_logits = target_logits.contiguous()
    if plan.copy_draft:
        draft_logits = draft_logits.contiguous()
    if not tokens.is_contiguous():
        tokens = tokens.contiguous()
    if u.dtype != torch.float32 or not u.is_contiguous():
        u = u.to(torch.float32).contiguous()
    if u_res.dtype != torch.float32 or not u_res.is_contiguous():
        u_res = u_res.to(torch.float32).contiguous()
    return target_logits, draft_logits, tokens, u, u_res


def _contiguous_strides(rows: int, vocab: int) -> tuple[int, int, int]:
    """The strides of a contiguous [B, rows, V] tensor, in elements."""
    return rows * vocab, vocab, 1


def _plan(spec: LaunchSpec) -> Plan:
    """Validate once and lay out buffers, grids and argument templates (see `Plan`)."""
    spec.validate()
    mode, B, gamma, V, scale, topk = spec.mode, spec.batch, spec.gamma, spec.vocab, spec.scale, spec.topk
    # Logits: fp32 / fp16 / bf16 are read as they are; anything else (or a mixed pair) goes through fp32,
    # which is what the torch path computes in anyway (`logits.float()`).
    cast = spec.draft_dtype != spec.target_dtype or spec.target_dtype not in DTYPE_SUFFIX
    copy_target, copy_draft = cast or spec.target_strides[-1] != 1, cast or spec.draft_strides[-1] != 1
    target_strides = _contiguous_strides(gamma + 1, V) if copy_target else spec.target_strides
    draft_strides = _contiguous_strides(gamma, V) if copy_draft else spec.draft_strides
    suffix = DTYPE_SUFFIX[torch.float32 if cast else spec.target_dtype]
    if topk >= V:
        topk = 0  # keeps every token, as `standardize` skips top_k >= V
    topp = topp_value(spec.top_p)  # the kernels filter while it is below 1 (fp32)
    filtered = bool(topk) or topp < 1

    R = 2 * gamma + 1
    auto_stats, auto_residual = plan_chunks(mode, B, gamma, V, spec.sms)
    chunk1 = int(spec.stats_chunk or auto_stats)
    chunk2 = int(spec.residual_chunk or auto_residual)
    if chunk1 < 1 or not 1 <= chunk2 <= 1 << 30:
        raise ValueError(f"chunk sizes must be >= 1 (residual <= 2^30), got {chunk1}, {chunk2}")
    K1 = -(-V // chunk1)
    K2 = -(-V // chunk2)
    if mode == "sigmoid" and K2 * R >= 1 << 32:
        raise ValueError("too many blocks per row for the 32-bit ticket counter")
    if max(K1, K2) > (1 << 31) - 1 or K1 * max(topk, 1) > (1 << 31) - 1:
        raise ValueError("vocabulary too large for the grid")

    # One allocation: outputs [n (B) | next_token (B) | errors (5B)] int64, [accept_prob | p | q | u] fp32
    # (B·γ each), then the workspace: partials [B, 2γ+1, K1] (max, sum), top-k candidates [B, 2γ+1, K1, k],
    # their tie counts [B, 2γ+1, K1] and the rows' (threshold, normalizer) [B, 2γ+1, 2], masses [B, K2]
    # (residual, p).
    off_f32 = 7 * B * 8
    out_bytes = off_f32 + 4 * B * gamma * 4
    off_part = _round_up(out_bytes, 256)
    part_bytes = B * R * K1 * 2 * 4 if mode == "exact" or filtered else 0
    off_cand = _round_up(off_part + part_bytes, 256)
    off_extra = _round_up(off_cand + B * R * K1 * topk * 4, 256)
    off_rowstat = _round_up(off_extra + (B * R * K1 * 4 if topk else 0), 256)
    off_mass = _round_up(off_rowstat + (B * R * 2 * 4 if filtered else 0), 256)
    total = off_mass + B * K2 * 2 * 4

    i32, i64, f32 = np.int32, np.int64, np.float32
    null = np.uint64(0)
    # (argument index -> source, offset): filled per call by `_materialize`
    logits = [null, i64(target_strides[0]), i64(target_strides[1]), null, i64(draft_strides[0]), i64(draft_strides[1])]
    logit_slots = [(0, _SRC_TARGET, 0), (3, _SRC_DRAFT, 0)]
    ctx = logits + [null, null, null, i32(B), i32(gamma), i64(V), f32(scale), f32(spec.lenience),
                    f32(spec.sigmoid_alpha), sigmoid_inv_den(spec.sigmoid_alpha, spec.sigmoid_beta), null, null]
    ctx_slots = logit_slots + [(6, _SRC_TOKENS, 0), (7, _SRC_U, 0), (8, _SRC_URES, 0), (16, _SRC_BUFFER, 0),
                               (17, _SRC_BUFFER, off_f32)]
    n = len(ctx)
    # Launch 1 of exact; with top-k / top-p also the thresholds, for either mode
    stats = logits + [i32(gamma), i64(V), f32(scale), i64(chunk1), null, i32(topk), topp, null, null, null, null]
    stats_slots = logit_slots + [(10, _SRC_BUFFER, off_part)]
    if topk:
        stats_slots += [(13, _SRC_BUFFER, off_cand), (14, _SRC_BUFFER, off_extra)]
    if filtered:  # row tickets: the state's error-word region, which launch 1 does not otherwise use
        stats_slots += [(15, _SRC_BUFFER, off_rowstat), (16, _SRC_STATE, 4 * B)]
    stats_kind = "exact_stats_topp" if topp < 1 else ("exact_stats_topk" if topk else "exact_stats")
    launches = [(f"sv_{stats_kind}_{suffix}", (K1, R, B), stats, stats_slots)] if mode == "exact" or filtered else []
    if mode == "exact":
        resample = ctx + [i64(chunk2), i32(K1), null, null, null, i32(filtered), null]
        resample_slots = ctx_slots + [(n + 2, _SRC_BUFFER, off_part), (n + 3, _SRC_BUFFER, off_mass),
                                      (n + 4, _SRC_STATE, 0)]
        if filtered:
            resample_slots += [(n + 6, _SRC_BUFFER, off_rowstat)]
        launches.append((f"sv_exact_resample_{suffix}", (K2, B, 1), resample, resample_slots))
    else:
        sig = ctx + [i64(chunk2), null, null, null, null]
        sig_slots = ctx_slots + [(n + 1, _SRC_BUFFER, off_mass), (n + 2, _SRC_STATE, 4 * B), (n + 3, _SRC_STATE, 0)]
        if filtered:
            sig_slots += [(n + 4, _SRC_BUFFER, off_rowstat)]
        launches.append((f"sv_sigmoid{'_filtered' if filtered else ''}_{suffix}", (K2, R, B), sig, sig_slots))
    return Plan(launches, out_bytes, total, cast, copy_target, copy_draft, state_size(B, gamma),
                {name: _slot_arrays(slots) for name, _, _, slots in launches})


# Plans by spec. Guarded: a page run and a compare can decode in two threads at once. The lock covers the lookup
# and the insert only; a miss builds its plan outside it (pure Python, no device work), and when two threads miss
# on one spec together, the first insert wins and both use that plan.
_plans: dict[LaunchSpec, Plan] = {}
_plans_lock = threading.Lock()
_MAX_PLANS = 256  # shapes vary with B and γ; beyond this the cache starts over (a plan is cheap to rebuild)


def _cached_plan(spec: LaunchSpec) -> Plan:
    """The plan of this spec: built and validated on the spec's first call, then reused."""
    with _plans_lock:
        plan = _plans.get(spec)
    if plan is None:
        built = _plan(spec)
        with _plans_lock:
            plan = _plans.get(spec)
            if plan is None:
                if len(_plans) >= _MAX_PLANS:
                    _plans.clear()
                plan = _plans[spec] = built
    return plan


def _slot_arrays(slots: list) -> tuple:
    """(argument indices, source indices, byte offsets as uint64) of a launch's pointer slots."""
    return ([i for i, _, _ in slots], np.array([src for _, src, _ in slots], dtype=np.intp),
            np.array([off for _, _, off in slots], dtype=np.uint64))


def _materialize(plan: Plan, sources: tuple, buffer: torch.Tensor, state: torch.Tensor) -> list:
    """[(entry point, grid, args)]: the plan's templates with this call's pointers patched in."""
    base = np.array([t.data_ptr() for t in sources] + [buffer.data_ptr(), state.data_ptr()], dtype=np.uint64)
    launches = []
    for name, grid, template, _ in plan.launches:  # slots: as arrays in plan.slot_arrays
        idx, src, off = plan.slot_arrays[name]
        args = list(template)
        for i, v in zip(idx, base[src] + off):  # one numpy op per launch, np.uint64 scalars out
            args[i] = v
        launches.append((name, grid, tuple(args)))
    return launches


def _prepare(spec: LaunchSpec, draft_tokens: torch.Tensor, draft_logits: torch.Tensor, target_logits: torch.Tensor,
             u: torch.Tensor, u_res: torch.Tensor, state: torch.Tensor) -> Prepared:
    """Validate (once per plan), allocate the buffer and patch the argument lists. Any device (no CuPy here).

    spec: `LaunchSpec.of` these tensors (draft_tokens LongTensor[B, γ], draft_logits [B, γ, V], target_logits
    [B, γ+1, V], u [B, γ], u_res [B]). state: int32, zero, at least state_size(B, γ) entries; the kernels
    leave it zero again.
    """
    plan = _cached_plan(spec)
    device = target_logits.device
    for name, t in (("draft_tokens", draft_tokens), ("draft_logits", draft_logits), ("u", u), ("u_res", u_res)):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, target_logits on {device}")
    if state.dtype != torch.int32 or state.numel() < plan.state_entries or state.device != device:
        raise ValueError("state must be a zero int32 tensor of at least state_size(B, γ) entries on the logits' device")
    sources = _inputs(draft_logits, target_logits, draft_tokens, u, u_res, plan)
    buffer = torch.empty(plan.total_bytes, dtype=torch.uint8, device=device)
    return Prepared(_materialize(plan, sources, buffer, state), buffer, plan.out_bytes, sources + (state,))
