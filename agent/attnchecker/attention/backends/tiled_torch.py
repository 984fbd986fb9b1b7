"""Protected attention in tiles (issue 12): the PyTorch backend of the tile contract in ``abft.tiled``.

Legend as in attention.py: B batch, H query heads, T queries, S keys, D head dim; Tq / Tk one tile's rows / keys.

Why tiles: the unfused checked path holds AS and AP (B·H·T·S) per protected layer; this one holds one tile of each
(B·H·Tq·Tk) plus O(B·H·T·D), so a protected step at long context fits where the unprotected (fused) one does.

Flow, with at most one host-device sync on clean input:
- Fast pass: for every query block, every key block it needs: AS tile, its checks, online-softmax fold, CL tile
  (P̃·V), its checks, fold into the running output. Flags and a small per-tile summary (``abft.tiled.summarize``)
  stay on the device; nothing waits for them.
- One sync: did any tile flag?
- Slow path (only then): every query block with a flagged tile is recomputed from Q, K and V, tile by tile, each
  tile verified and repaired (``abft.repair``) before it is folded in, so a persistent fault is located and corrected
  as on the unfused path. A tile flagged in the fast pass that comes back clean held a transient fault: it is
  reported from its summary with action "recomputed". In detect mode nothing is recomputed (the output keeps the
  fault, as the unfused path's does) and every flagged tile is reported "detected".
A fused GPU kernel can move the verify-and-repair of step 3 inside the tile loop; the contract is the same.

Backward: the verified output and row log-sum-exp feed the fused CPU kernel
(attention.backward.fused._VerifiedAttention), as on the unfused path; under protect(scope="all"), on a step whose
whole-step checks are due, that kernel on checksum-encoded operands (attention.backward.encoded: O(T·D) memory), whose
recovery runs the checked products of attention.backward.checked a block of query rows at a time (O(block·S) memory, as
this forward), and the fused kernel with the tripwire on its dQ/dK/dV on the others. On other devices the gradient comes
from recomputing the fused SDPA in backward, which is the gradient of the same function at the same verified q, k, v;
under protect(scope="all") it is checked there too: by the Triton kernels (attention.backward.triton_backward, no host
sync), or the checked products where those do not run (attention.backward.fused._off_cpu_backward).
"""
from __future__ import annotations

import functools
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ...abft import GROUP_MIN, Tolerance, acc_dtype, col_norms, repair
from ...abft.operand_moments import context_moments, query_weighted_sums, references_of, scores_moments
from ...abft.repair import MatrixReport, pattern_of
from ...abft.tiled import (
    TILE_BUDGET,
    TilePlan,
    augment_v,
    causal_offset,
    context_refs,
    finish,
    fold_scores,
    gram,
    grams_pay,
    scores_refs,
    scores_weights,
    square_sums,
    summarize,
    tile_mask,
    v_row_checksums,
)
from ...checks import records
from ...checks.context import LayerContext
from ...checks.product import _dot, _exact_math, _groups, _tolerance, _verify, operand_rounding
from ...checks.records import _count, _count_trips, _record_ratio, _worst_ratio
from ...kernels import fused_attention
from ...matmul_precision import fp32_matmul_operand_roundoff, full_precision_reductions, ieee_fp32_matmul
from ..backward.fused import _additive_mask, _expand_heads, _Forward, _VerifiedAttention
from ..backward.modded import ModdedForward, captured_parameters, modded_attention
from ..tile_mods import TileMods
from . import BACKEND_ENV, AttentionCall, BackendOutput
from .native_rules import kernel_checks, kernel_rules

__all__ = ["PATH_ENV", "TILED_MIN_ENV", "TILE_ENV", "TileChoice", "TiledBackend", "default_tiles", "kernel_applies",
           "mods_reasons", "plan_tiles", "run_modded", "run_tiled", "tile_choice", "tile_reasons", "tiled_sdpa"]

PATH_ENV = BACKEND_ENV
TILED_MIN_ENV = "ATTNCHECKER_TILED_MIN_TS"
"""The T·S from which auto picks the tiled path."""
TILE_ENV = "ATTNCHECKER_TILE"
"""Tile size "Tq,Tk" (or one number for both)."""

DEFAULT_MIN_TS = 512 * 512
"""Measured on CPU (docs/performance.md §4), forward + backward of one causal layer, tiled / unfused time: 1.15× at
T = 256, 0.82× at 512, 0.63× at 1024. Below the crossover the unfused path's T×S tensors are small anyway."""
DEFAULT_BLOCK_Q = 256
"""Query rows per block. Measured on CPU (docs/performance.md §4), one causal layer at T = 2048, B·H = 8, all keys in
one tile: 256 rows ran the checked forward in 0.75× the time of 64 (fewer Python iterations of the per-tile checks;
the unchecked passes alone prefer smaller tiles, which stay in cache)."""
MIN_BLOCK_K = 256


@dataclass(frozen=True, slots=True)
class TileChoice:
    block_q: int
    block_k: int


def _env_int(name: str, raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer; unset it or give a positive whole number") from None
    if value < 1:
        raise ValueError(f"{name}={raw!r} must be >= 1")
    return value


def tile_reasons(call: AttentionCall) -> list[str]:
    """Why no tiled pass (this loop or the native one) can take ``call``: its backward is the fused kernel at the
    verified output and log-sum-exp, and its tiles see one block of keys and queries at a time."""
    reasons = []
    if call.dropout_p > 0.0:
        reasons.append(f"attention dropout (p = {call.dropout_p:g}): the fused backward cannot replay our keep-mask")
    if call.return_probs:
        reasons.append("the caller asked for AP itself (return_probs), which tiles never hold whole")
    if call.paper:
        reasons.append("paper-faithful checksum passing: its references sum over all T tokens, not one tile's")
    if call.mask_grad:
        reasons.append("a mask that requires grad (a learned bias): the fused backward has no gradient for it")
    return reasons


def tile_choice(s: int, batch_heads: int) -> TileChoice:
    """ATTNCHECKER_TILE ("Tq,Tk" or one size for both), else ``default_tiles``. batch_heads: B·H, which with the tile
    sizes sets one tile's memory (TILE_BUDGET)."""
    raw_tile = os.environ.get(TILE_ENV)
    if raw_tile is None:
        return default_tiles(s, batch_heads)
    parts = [p for p in raw_tile.replace("x", ",").split(",") if p.strip()]
    if len(parts) not in (1, 2):
        raise ValueError(f"{TILE_ENV}={raw_tile!r}: give 'Tq,Tk' or one size for both, e.g. 256,256")
    sizes = [_env_int(TILE_ENV, p.strip()) for p in parts]
    return TileChoice(sizes[0], sizes[-1])


def min_tiled_ts() -> int:
    """The T·S from which auto takes the PyTorch tile loop over the unfused path (ATTNCHECKER_TILED_MIN_TS)."""
    raw = os.environ.get(TILED_MIN_ENV)
    return DEFAULT_MIN_TS if raw is None else _env_int(TILED_MIN_ENV, raw)


class TiledBackend:
    """The tile contract of ``abft.tiled`` as a PyTorch loop over (query block, key block) tiles: O(T) extra memory,
    any device and dtype. Auto takes it from T·S = ATTNCHECKER_TILED_MIN_TS (below that the unfused path is
    faster and its T×S tensors are small anyway)."""

    name = "tiled"

    def not_supported_reasons(self, call: AttentionCall) -> list[str]:
        reasons = tile_reasons(call)
        t, s = call.q_BHTD.shape[-2], call.k_BHSD.shape[-2]
        # A FlexAttention or varlen call has no other backend (mods_reasons): the tile loop at every size.
        modded = call.mods is not None or call.return_lse
        if modded and call.attn_mask is not None:
            reasons.append("an explicit mask with per-tile mods or a returned log-sum-exp (their backward, "
                           "attention/backward/modded.py, takes the mods only)")
        if call.requested != self.name and t * s < min_tiled_ts() and not modded:
            reasons.append(f"T·S = {t}·{s} is below {TILED_MIN_ENV} = {min_tiled_ts()}, where the unfused path is "
                           "faster")
        return reasons

    def run(self, call: AttentionCall) -> BackendOutput:
        if call.mods is not None or call.return_lse:
            return run_modded(call)
        return run_tiled(call, kernel=False)


def mods_reasons(call: AttentionCall, backend: str) -> list[str]:
    """Why a backend that is not the tile loop cannot take a FlexAttention or varlen call."""
    reasons = []
    if call.mods is not None and (call.mods.masks or call.mods.score_mod is not None):
        reasons.append(f"a FlexAttention score_mod / BlockMask or a varlen window, which {backend} does not apply "
                       "(the tile loop applies them per tile)")
    if call.return_lse:
        reasons.append(f"the caller takes the row log-sum-exp with its own gradient, which {backend}'s backward "
                       "does not give")
    return reasons


def run_modded(call: AttentionCall) -> BackendOutput:
    """A FlexAttention or varlen call (call.mods), or one whose row log-sum-exp the caller takes: the tile loop with
    the mods applied per tile, and its gradient from attention/backward/modded.py (lse +INF on fully masked rows)."""
    q, k, v, ctx = call.q_BHTD, call.k_BHSD, call.v_BHSD, call.ctx
    b, h, t, _ = q.shape
    s = k.shape[-2]
    mods = call.mods if call.mods is not None else TileMods(batch=b, heads=h, t=t, s=s)
    for name in ("q", "k", "v"):
        ctx.passed.take(name)
    k_rep, v_rep = _expand_heads(k, h), _expand_heads(v, h)
    tiles = tile_choice(s, b * h)
    with torch.no_grad():
        out, lse = _forward(q.detach(), k_rep.detach(), v_rep.detach(), ctx=ctx, attn_mask=call.attn_mask,
                            is_causal=call.is_causal, scale=call.scale, tiles=tiles, force=call.force,
                            caught=call.caught, kernel=False, mods=mods)
    params = captured_parameters(mods.score_mod, q.device) if torch.is_grad_enabled() else ()
    if not (call.needs_grad or any(p.requires_grad for p in params)):
        return BackendOutput(out, lse)
    plan = plan_tiles(t, s, tiles, is_causal=call.is_causal, mods=mods)
    out, lse = modded_attention(q, k_rep, v_rep, ModdedForward(out_BHTD=out, lse_BHT=lse, plan=plan, mods=mods,
                                                               scale=call.scale), params)
    return BackendOutput(out, lse)


def run_tiled(call: AttentionCall, *, kernel: bool) -> BackendOutput:
    """A call through ``tiled_sdpa``; kernel: the native pass first (backends/native_cpu.py), this loop where it
    declines and as its recovery."""
    ctx = call.ctx
    for name in ("q", "k", "v"):
        # Tiles take their references from the operands: a projection's passed checksums go unused.
        ctx.passed.take(name)
    tiles = tile_choice(call.k_BHSD.shape[-2], call.q_BHTD.shape[:-2].numel())
    out = tiled_sdpa(call.q_BHTD, call.k_BHSD, call.v_BHSD, ctx=ctx, attn_mask=call.attn_mask,
                     is_causal=call.is_causal, scale=call.scale, tiles=tiles, force=call.force, caught=call.caught,
                     kernel=kernel)
    return BackendOutput(out)


def plan_tiles(t: int, s: int, tiles: TileChoice, *, is_causal: bool, mods: TileMods | None = None) -> TilePlan:
    """The tiles of a T × S call: causal ones skipped, and with mods (a block-sparse mask) the keys outside what each
    query block may attend."""
    plan = TilePlan(t, s, tiles.block_q, tiles.block_k, is_causal)
    if mods is None or not mods.masks:
        return plan
    return TilePlan(t, s, tiles.block_q, tiles.block_k, is_causal,
                    key_ranges=mods.key_ranges([plan.rows(i) for i in range(plan.n_q)]))


def default_tiles(s: int, batch_heads: int) -> TileChoice:
    """DEFAULT_BLOCK_Q query rows; all S keys in one tile while B·H·Tq·S <= TILE_BUDGET, else key blocks that fit it."""
    fit = TILE_BUDGET // max(1, batch_heads * DEFAULT_BLOCK_Q)
    return TileChoice(DEFAULT_BLOCK_Q, s if s <= fit else max(MIN_BLOCK_K, fit))


@dataclass(slots=True)
class _Pass:
    """One pass's device-side record of the checks: per query block, per op, the flag per key tile (n_k, B, H) and
    the summary (n_k, B, H, 2 directions, 5); plus the worst clean residual/bound ratio per op for the histogram."""

    flags: dict[str, list[torch.Tensor | None]]
    summaries: dict[str, list[torch.Tensor | None]]
    worst: dict[str, torch.Tensor | None]
    seconds: dict[str, float]


def tiled_sdpa(
    q_BHTD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    *,
    ctx: LayerContext,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    tiles: TileChoice,
    force: frozenset[str] = frozenset(),
    caught: list[int] | None = None,
    kernel: bool = True,
) -> torch.Tensor:
    """protected_sdpa's tiled path: out (B, H, T, D), verified and repaired, with autograd attached.
    force: ops verified whatever the step's config says (a tier-1 recovery). An op that is not due but has the
    tier-1 tripwire is verified in full here too (per tile that costs about what the tripwire would), its events
    under tier "tripwire". caught: [n], incremented by the number of detections emitted. kernel: try the native pass
    (kernels/fused_attention.py) first."""

    h = q_BHTD.shape[1]
    k_rep, v_rep = _expand_heads(k_BHSD, h), _expand_heads(v_BHSD, h)
    # The additive form of the mask, made once: the native pass reads it, and the fused backward takes it. A padded
    # batch's mask is (B, 1, T, S): 64 MB a call at T = 4096, which making twice cost as much as the pass's checks.
    mask_add = _additive_mask(attn_mask, q_BHTD.dtype) if q_BHTD.device.type == "cpu" else None
    with torch.no_grad():
        out, lse = _forward(q_BHTD.detach(), k_rep.detach(), v_rep.detach(), ctx=ctx, attn_mask=attn_mask,
                            is_causal=is_causal, scale=scale, tiles=tiles, force=force, caught=caught,
                            mask_add=mask_add, kernel=kernel)
    if not (torch.is_grad_enabled() and (q_BHTD.requires_grad or k_BHSD.requires_grad or v_BHSD.requires_grad)):
        return out
    # Under protect(scope="all") the backward is checked too: on the CPU by the fused kernel on encoded operands
    # (attention.backward.encoded), whose recovery runs the checked products a block of this forward's query rows at a
    # time, so that it keeps O(block·S) as this forward does; off the CPU by the Triton kernels, or those products
    # (attention.backward.fused._off_cpu_backward).
    return _VerifiedAttention.apply(q_BHTD, k_rep, v_rep, _Forward(
        out_BHTD=out, lse_BHT=lse, mask_add=mask_add, scale=scale, is_causal=is_causal, attn_mask=attn_mask,
        layer=ctx, block_q=tiles.block_q))


def _forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    ctx: LayerContext,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    tiles: TileChoice,
    force: frozenset[str] = frozenset(),
    caught: list[int] | None = None,
    kernel: bool = True,
    mask_add: torch.Tensor | None = None,
    mods: TileMods | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """out and lse of one call, verified and repaired. kernel: try the native pass first (kernels/fused_attention.py);
    the PyTorch tile loop below runs where it declines, and as its recovery (kernel=False). mask_add: attn_mask's
    additive form, where the caller has made it (attention.backward.fused._additive_mask). mods: a FlexAttention
    call's score_mod and block mask, or a varlen window (attention/tile_mods.py), applied per tile; such a call runs
    the tile loop, which visits only the keys the mask keeps."""

    b, h, t, _ = q.shape
    s = k.shape[-2]
    cfg = ctx.config
    tol = _tolerance(ctx)
    plan = plan_tiles(t, s, tiles, is_causal=is_causal, mods=mods)
    if mods is not None:
        kernel = False
    mask = None if attn_mask is None else torch.broadcast_to(attn_mask, (b, h, t, s))
    tiers = {op: "abft" if cfg.checks(op) and op not in force else "tripwire"
             for op in ("scores", "context") if cfg.checks(op) or op in force or cfg.trips(op)}
    ops = tuple(tiers)
    injector = ctx.runtime.injector
    hits = {op: [] if injector is None else injector.resolve(op=op, layer=ctx.layer, step=ctx.step, shape=shape)
            for op, shape in (("scores", (b, h, t, s)), ("context", (b, h, t, v.shape[-1])))}
    # attnchecker.inject writes its faults tile by tile into the PyTorch loop's tensors: a call it targets runs there.
    if kernel and not any(hits.values()):
        done = _kernel_forward(q, k, v, ctx=ctx, attn_mask=attn_mask, is_causal=is_causal, scale=scale, tol=tol,
                               tiers=tiers, tiles=tiles, force=force, caught=caught, mask_add=mask_add)
        if done is not None:
            return done
    acc = acc_dtype(q.dtype)
    with _exact_math(q):
        # O(T·D) per call: the operands in the acc dtype (contiguous: heads are strided views) and what every tile
        # of them shares.
        # The products run on contiguous operands too: heads split out of a fused projection are strided, and a tile
        # GEMM on K_jᵀ of such a view ran ~5× slower on CPU than on a contiguous copy (BLAS cannot take that layout).
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        q_acc, k_acc, v_acc = q.to(acc), k.to(acc), v.to(acc)
        q_norm, k_norm = torch.linalg.vector_norm(q_acc, dim=-1), torch.linalg.vector_norm(k_acc, dim=-1)
        # Grouped checksums (abft/checksum.py) as on the unfused path: CL's rows run over the D features (one group
        # below 2·GROUP_MIN), so V w is made once per call in that layout; a tile's other groups depend on its size.
        g_v = _groups(tol, v.shape[-1])
        vw = v_row_checksums(v_acc, g_v)
        v_aug = augment_v(v, vw) if "context" in ops else None
    shared = _Shared(q=q, k=k, v=v, q_acc=q_acc, k_acc=k_acc, v_acc=v_acc, q_norm=q_norm, k_norm=k_norm, vw=vw,
                     v_aug=v_aug, g_v=g_v,
                     rounding=q.dtype == torch.float32 and fp32_matmul_operand_roundoff(q.device) is not None,
                     grams=_KeyGrams(k_acc),
                     mask=mask, is_causal=is_causal, scale=scale, tol=tol, plan=plan, ops=ops, tiers=tiers,
                     caught=caught, mods=mods)
    out = q.new_empty((b, h, t, v.shape[-1]))  # V's head dim: it differs from Q's in latent attention (MLA)
    lse = torch.empty(b, h, t, device=q.device, dtype=torch.promote_types(q.dtype, torch.float32))
    record = _Pass({op: [] for op in ops}, {op: [] for op in ops}, dict.fromkeys(ops), dict.fromkeys(ops, 0.0))
    for i in range(plan.n_q):
        _query_block(shared, i, out, lse, hits, record=record)
    for op in ops:
        worst = record.worst[op]
        if worst is not None:
            _record_ratio(ctx, worst, op)
    if ops:
        flat = [f for op in ops for f in record.flags[op] if f is not None]
        any_bad = torch.stack([f.any() for f in flat]).any() if flat else torch.zeros((), dtype=torch.bool)
        if bool(any_bad):  # sync: the one per protected attention call; decides whether the slow path runs
            t0 = time.perf_counter()
            _slow_path(shared, ctx, record, out, lse)
            record.seconds["scores" if "scores" in ops else "context"] += time.perf_counter() - t0
    for op in ops:
        if tiers[op] == "abft":
            _count(ctx, op, record.seconds[op])
        else:
            _count_trips(ctx, [op], record.seconds[op])
    return out, lse


KERNEL_BLOCK_Q = 64
"""Query rows per block of the native pass: a block's scores (64 x S fp32) stay in L2 up to S = 8192 while the row
sums, the softmax and the second GEMM read them (one causal layer, T = 2048, B·H = 8, D = 32, one thread: 64, 128
and 256 rows within 5 % of each other)."""


def kernel_applies(q_BHTD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor, *,
                   attn_mask: torch.Tensor | None, is_causal: bool, scale: float) -> bool:
    """Whether the tiled path would run this call on the native pass (fused_attention.applies, and no
    ATTNCHECKER_TILE, which asks for the PyTorch loop's tiles, and a block KERNEL_BLOCK_Q x S within the tile budget
    the loop keeps to)."""
    return (os.environ.get(TILE_ENV) is None and KERNEL_BLOCK_Q * k_BHSD.shape[-2] <= TILE_BUDGET
            and fused_attention.applies(q_BHTD, k_BHSD, v_BHSD, is_causal=is_causal, scale=scale,
                                        attn_mask=attn_mask))


def _kernel_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    ctx: LayerContext,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    tol: Tolerance,
    tiers: dict[str, str],
    tiles: TileChoice,
    force: frozenset[str],
    caught: list[int] | None,
    mask_add: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The call through the native pass (kernels/fused_attention.py), its row checks (native_rules.py), one sync; None
    where the kernel declines. A flag: in correct mode the call is recomputed through the PyTorch tile loop, which
    verifies both directions and locates and repairs a fault that repeats; a flagged op the recompute finds clean
    held a transient fault, reported "recomputed" from the kernel's row summary. In detect mode the kernel's output
    is kept and each flagged (batch, head) reported "detected"."""
    b, h, t, d = q.shape
    s = k.shape[-2]
    if not kernel_applies(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale):
        return None
    q3, k3, v3 = (x.reshape(b * h, x.shape[-2], d) for x in (q, k, v))
    groups = _groups(tol, s)
    ops = tuple(tiers)
    with _exact_math(q):
        t0 = time.perf_counter()
        q3, k3, v3 = q3.contiguous(), k3.contiguous(), v3.contiguous()
        vw = v_row_checksums(v3)
        va = augment_v(v3, vw)
        rules = kernel_rules(q3, k3, v3, vw, tol=tol, groups=groups)
        # This call's share of the rules (split evenly) joins the kernel's own timed checks below.
        shared = (time.perf_counter() - t0) / max(1, len(ops))
        got = None if va is None else fused_attention.run(
            q3, k3, va, rules, scale=scale, is_causal=is_causal, block_q=KERNEL_BLOCK_Q,
            faults=fused_attention.take_faults(), heads=h,
            mask_add=mask_add if mask_add is not None else _additive_mask(attn_mask, torch.float32))
        if got is None:
            return None
        which = [fused_attention.OPS.index(op) for op in ops]
        if ops:
            _record_ratio(ctx, got.worst_2[which], list(ops))
    seconds = {"scores": got.seconds[0] + shared, "context": got.seconds[1] + shared}
    out, lse = got.out_NTD.view(b, h, t, d), got.lse_NT.view(b, h, t)
    if ops and bool(got.flagged_N2[:, which].any()):  # the one decision per call (CPU tensors: no device sync)
        # Slow path only from here: the same checks in Python, for the flagged rows' report.
        t0 = time.perf_counter()
        checks = kernel_checks(k3, v3, vw, got, rules, tol=tol)
        flags = {op: checks[op]["row"].bad.view(b, h, -1).any(-1) for op in ops}
        correct = ctx.config.mode == "correct"
        found = [0]
        if correct:
            out, lse = _forward(q, k, v, ctx=ctx, attn_mask=attn_mask, is_causal=is_causal, scale=scale, tiles=tiles,
                                force=force, caught=found, kernel=False, mask_add=mask_add)
        made = 0
        if not found[0]:
            no_cols = torch.tensor([0.0, -1.0, 0.0, 0.0, -1.0])
            for op, flag in flags.items():
                row = checks[op]["row"]
                summary = summarize(row.bad, row.diff, row.bound, row.groups).view(b, h, 5)
                reports = [_from_summary(torch.stack([summary[i, j], no_cols]), (i, j), None,
                                         "recomputed" if correct else "detected")
                           for i, j in flag.nonzero().tolist()]  # sync: slow path only
                records._emit(ctx, op, reports, heads=True, tier=tiers[op])
                made += len(reports)
        if caught is not None:
            caught[0] += found[0] + made
        seconds["scores" if "scores" in ops else "context"] += time.perf_counter() - t0
    for op in ops:
        if tiers[op] == "abft":
            _count(ctx, op, seconds[op])
        else:
            _count_trips(ctx, [op], seconds[op])
    return out, lse


@dataclass(slots=True, kw_only=True)
class _Shared:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_acc: torch.Tensor
    k_acc: torch.Tensor
    v_acc: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    vw: torch.Tensor
    """(B, H, S, 2·g_v) V w per run of D/g_v features."""
    v_aug: torch.Tensor | None
    """(B, H, S, D + 2·g_v) [V | V w] (abft.tiled.augment_v), or None."""
    g_v: int
    """Checksum groups per row of CL (over the D features)."""
    rounding: bool
    """The tile GEMMs round their fp32 operands (TF32 or oneDNN bf16 in force): their references are made apart."""
    grams: _KeyGrams
    mask: torch.Tensor | None
    is_causal: bool
    scale: float
    tol: Tolerance
    plan: TilePlan
    ops: tuple[str, ...]
    tiers: dict[str, str]
    """op -> who verifies it on this call: "abft" (due on this step) or "tripwire" (tier 1, or its recovery)."""
    caught: list[int] | None
    mods: TileMods | None = None


@dataclass(slots=True)
class _KeyGrams:
    """K_hᵀK_h (B, H, g, D, D) per run of keys of a scores tile's row groups, for ΣAS² from the operands
    (abft.tiled.square_sums). Made once per call: each key's outer products are formed once, in chunks of GROUP_MIN
    keys, and a tile's groups sum their chunks (a causal prefix, which grows by one query block per block, costs a
    sum of D × D matrices, not a Gram of the whole prefix per query block). A range off the chunk grid (an odd S or
    tile size) is made directly and kept: the next query blocks visit the same key tiles."""

    k_acc: torch.Tensor
    chunks: torch.Tensor | None = None
    """(B, H, S // GROUP_MIN, D, D), made on first use."""
    off_grid: dict[tuple[int, int, int], torch.Tensor] = field(default_factory=dict)

    def of(self, c0: int, c1: int, groups: int) -> torch.Tensor:
        length = (c1 - c0) // groups
        if c0 % GROUP_MIN == 0 and length % GROUP_MIN == 0:
            if self.chunks is None:
                n = self.k_acc.shape[-2] // GROUP_MIN
                self.chunks = gram(self.k_acc[..., : n * GROUP_MIN, :], n)
            return self.chunks[..., c0 // GROUP_MIN : c1 // GROUP_MIN, :, :].unflatten(-3, (groups, -1)).sum(-3)
        key = (c0, c1, groups)
        if key not in self.off_grid:
            self.off_grid[key] = gram(self.k_acc[..., c0:c1, :], groups)
        return self.off_grid[key]


@dataclass(slots=True)
class _Repair:
    """Slow path: the query block being recomputed is verified and repaired tile by tile."""

    ctx: LayerContext
    tol: Tolerance
    flagged: dict[str, dict[int, list[tuple[int, int]]]]
    """op -> key tile j -> [(batch, head)] flagged in the fast pass."""
    summaries: dict[str, torch.Tensor | None]
    """op -> (n_k, B, H, 2, 5) summaries of this query block from the fast pass."""
    shared: _Shared


def _query_block(
    sh: _Shared,
    i: int,
    out: torch.Tensor,
    lse: torch.Tensor,
    hits: dict[str, list[Any]],
    *,
    record: _Pass | None = None,
    fix: _Repair | None = None,
) -> None:
    """Compute query block i over its key tiles and write its rows of out and lse. Fast pass (record): checks are
    kept on the device. Slow path (fix): each tile is verified and repaired before it is folded."""

    plan = sh.plan
    r0, r1 = plan.rows(i)
    q_i = sh.q[..., r0:r1, :]
    lead = q_i.shape[:-2]
    soft = torch.promote_types(q_i.dtype, torch.float32)
    m = torch.full((*lead, r1 - r0), -math.inf, device=q_i.device, dtype=soft)
    l_ = torch.zeros_like(m)
    o = torch.zeros((*lead, r1 - r0, sh.v.shape[-1]), device=q_i.device, dtype=soft)
    rows_by_op: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]] = {
        op: [] for op in sh.ops}
    # Q_hᵀQ_h per query group of this block, made on its first tile that uses Grams (abft.tiled.square_sums).
    q_grams: dict[int, torch.Tensor] = {}
    ieee = functools.partial(ieee_fp32_matmul, q_i.device)
    # The tile GEMMs run in the model's fp32 precision (TF32 where it is on; the checks' bound models it, and IEEE fp32
    # would run them ~7x below a tensor core's rate) and, for half products, with fp32 reductions (ours to choose,
    # and what the bound then models); the checks' own products run in IEEE fp32 (ieee).
    with torch.no_grad(), torch.autocast(q_i.device.type, enabled=False), full_precision_reductions():
        qbar_src = sh.q_acc[..., r0:r1, :]
        # n: the tile's place among the block's visits (its flags and summaries are kept in that order); j: its key
        # block, c0..c1 its keys (a block-sparse mask narrows them).
        for n, (_, c0, c1) in enumerate(plan.keys(i)):
            k_j, v_j = sh.k[..., c0:c1, :], sh.v[..., c0:c1, :]
            s_ij = q_i @ k_j.mT
            for hit in hits["scores"]:
                hit.apply(s_ij, r0, c0)
            if "scores" in sh.ops:
                t0 = time.perf_counter()
                with ieee():
                    checks = scores_tile_checks(s_ij, qbar_src, sh.k_acc[..., c0:c1, :], sh.q_norm[..., r0:r1],
                                                sh.k_norm[..., c0:c1], tol=sh.tol,
                                                grams=_tile_grams(sh, q_grams, qbar_src, c0, c1))
                if fix is not None:
                    _repair_tile(fix, "scores", s_ij, checks, n, r0, c0,
                                 lambda key, rows, cols, q_i=q_i, k_j=k_j: _dot(q_i[key][rows], k_j[key][cols]))
                else:
                    rows_by_op["scores"].append(_keep(checks))
                if record is not None:
                    record.seconds["scores"] += time.perf_counter() - t0
            blocked, additive = tile_mask(sh.mask, r0, r1, c0, c1)
            score_mod = None
            if sh.mods is not None:
                masked = sh.mods.blocked(r0, r1, c0, c1, s_ij.device)
                if masked is not None:
                    blocked = masked if blocked is None else blocked | masked
                score_mod = sh.mods.score_fn(r0, c0)
            p, alpha, m, l_, p_sum = fold_scores(s_ij, m, l_, scale=sh.scale, blocked=blocked, additive=additive,
                                                 causal_offset=causal_offset(r0, c0, c1, is_causal=sh.is_causal),
                                                 score_mod=score_mod)
            p_c = p.to(v_j.dtype)
            cl_rows: torch.Tensor | None = None
            if sh.v_aug is not None and not sh.rounding:
                # One GEMM for CL and its row references: (Tq, Tk) @ (Tk, D + 2·g_v).
                pv_aug = p_c @ sh.v_aug[..., c0:c1, :]
                d = sh.v.shape[-1]
                pv, cl_rows = pv_aug[..., :d], pv_aug[..., d:]
            else:
                pv = p_c @ v_j
                if sh.v_aug is not None:
                    # Under TF32 the references stay IEEE products of their own: rounded operands in [V | V w] would
                    # put the rounding of V w itself into the references the bound does not model.
                    with ieee():
                        cl_rows = p_c.to(sh.vw.dtype) @ sh.vw[..., c0:c1, :]
            if n == 0:
                # A fault in CL (B, H, T, D) lands in the first partial product its row block folds in.
                for hit in hits["context"]:
                    hit.apply(pv, r0, 0)
            if "context" in sh.ops:
                t0 = time.perf_counter()
                with ieee():
                    checks = context_tile_checks(pv, p_c, sh.v_acc[..., c0:c1, :], sh.vw[..., c0:c1, :], p_sum,
                                                 cl_rows, tol=sh.tol, g_v=sh.g_v)
                if fix is not None:
                    _repair_tile(fix, "context", pv, checks, n, r0, 0,
                                 lambda key, rows, cols, p_c=p_c, v_j=v_j: _dot(p_c[key][rows], v_j[key].mT[cols]))
                else:
                    rows_by_op["context"].append(_keep(checks))
                if record is not None:
                    record.seconds["context"] += time.perf_counter() - t0
            o = o * alpha[..., None] + pv.to(soft)
        res_out, res_lse = finish(o, m, l_, out.dtype)
        out[..., r0:r1, :] = res_out
        lse[..., r0:r1] = res_lse
        if record is not None:
            for op, kept in rows_by_op.items():
                _summarize_block(record, op, kept)


def scores_tile_checks(
    s_NTqTk: torch.Tensor,
    q_acc_NTqD: torch.Tensor,
    k_acc_NTkD: torch.Tensor,
    q_norm_NTq: torch.Tensor,
    k_norm_NTk: torch.Tensor,
    *,
    tol: Tolerance,
    grams: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> dict[str, Any]:
    """Both directions of AS_ij = Q_i K_jᵀ (B, H, Tq, Tk), grouped as the unfused path groups (checks.product._groups
    on the tile's row and column lengths). ΣAS² for the calibrated bound from D × D Grams where AS is in the acc dtype
    and the Grams are the cheaper way (abft.tiled.grams_pay), else from the tile inside _verify. grams: (g_r, g_c) ->
    (K_hᵀK_h (..., g_r, D, D), Q_hᵀQ_h (..., g_c, D, D)) from a cache shared by the call's tiles (None: made here)."""
    tq, tk = s_NTqTk.shape[-2:]
    d = q_acc_NTqD.shape[-1]
    groups = (_groups(tol, tk), _groups(tol, tq))
    rounded = operand_rounding(s_NTqTk, tol)
    weights = scores_weights(q_acc_NTqD, k_acc_NTkD, groups) if rounded else None
    row_ref, col_ref, ref_norms = scores_refs(q_acc_NTqD, k_acc_NTkD, groups, weights)
    sq = None
    if (s_NTqTk.dtype == q_acc_NTqD.dtype and tol.mode == "roundoff" and tol.calibrated
            and grams_pay(tq, tk, d, groups)):
        gram_k, gram_q = (gram(k_acc_NTkD, groups[0]), gram(q_acc_NTqD, groups[1])) if grams is None else grams(*groups)
        sq = square_sums(q_acc_NTqD, k_acc_NTkD, gram_k, gram_q)
    moments: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
    if weights is not None:
        # The tile GEMM rounded Q and K (TF32): their moments bound that error (abft/operand_moments.py).
        kbar, qbar = weights
        moments = scores_moments(q_acc_NTqD, k_acc_NTkD, qbar, kbar, groups)
    return _verify(s_NTqTk, row_ref, col_ref, q_norm_NTq, k_norm_NTk, k=d, tol=tol, sq_sums=sq, ref_norms=ref_norms,
                   groups=groups, operand_moments=moments)


def _tile_grams(sh: _Shared, q_grams: dict[int, torch.Tensor], q_acc_i: torch.Tensor, c0: int, c1: int
                ) -> Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]:
    """scores_tile_checks' grams for tile (i, j): K's from the call's cache, Q_i's made once per query block."""
    def grams(g_r: int, g_c: int) -> tuple[torch.Tensor, torch.Tensor]:
        if g_c not in q_grams:
            q_grams[g_c] = gram(q_acc_i, g_c)
        return sh.grams.of(c0, c1, g_r), q_grams[g_c]
    return grams


def context_tile_checks(
    pv_NTqD: torch.Tensor,
    p_NTqTk: torch.Tensor,
    v_acc_NTkD: torch.Tensor,
    vw_NTk2g: torch.Tensor,
    p_sum_NTq: torch.Tensor,
    cl_rows_NTq2g: torch.Tensor | None,
    *,
    tol: Tolerance,
    g_v: int,
) -> dict[str, Any]:
    """Both directions of CL_ij = P̃_ij V_j (B, H, Tq, D) (abft.tiled.context_refs), grouped as the unfused path groups:
    g_v runs of features per row (vw's layout), runs of queries per column (checks.product._groups on Tq)."""
    groups = (g_v, _groups(tol, pv_NTqD.shape[-2]))
    p_acc = p_NTqTk.to(v_acc_NTkD.dtype)
    rounded = operand_rounding(pv_NTqD, tol)
    # Under TF32 the column references' weighted sums and the moments' in one pass over P̃.
    query_sums = query_weighted_sums(p_acc, p_sum_NTq.to(p_acc.dtype), groups[1]) if rounded else None
    row_ref, col_ref, p_norm, ref_norms = context_refs(p_acc, v_acc_NTkD, vw_NTk2g, p_sum_NTq, cl_rows_NTq2g, groups,
                                                       None if query_sums is None else references_of(query_sums))
    p_norm = p_norm.to(v_acc_NTkD.dtype)
    moments: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
    if query_sums is not None:
        # The tile GEMM rounded P̃ and V (TF32): their moments bound that error (abft/operand_moments.py).
        moments = context_moments(p_acc, v_acc_NTkD, p_sum_NTq.to(p_norm.dtype), groups, vw_NS2g=vw_NTk2g,
                                  query_sums_Ng4S=query_sums)
    return _verify(pv_NTqD, row_ref, col_ref, p_norm, col_norms(v_acc_NTkD),
                   k=v_acc_NTkD.shape[-2], tol=tol, ref_norms=ref_norms, groups=groups, operand_moments=moments)


def _keep(checks: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(flag (B, H), row summary (B, H, 5), column summary (B, H, 5), worst clean ratio ()) of one tile."""
    row, col = checks["row"], checks["col"]
    flag = row.bad.any(-1) | col.bad.any(-1)
    # The larger of |d1|/bound and |d2|/bound2 (both flag), as the unfused path's histogram takes it: on d1 alone the
    # two paths' margins read differently for the same data.
    return (flag, summarize(row.bad, row.diff, row.bound, row.groups),
            summarize(col.bad, col.diff, col.bound, col.groups), _worst_ratio(checks))


_Kept = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _summarize_block(record: _Pass, op: str, kept: list[_Kept]) -> None:
    if not kept:
        record.flags[op].append(None)
        record.summaries[op].append(None)
        return
    record.flags[op].append(torch.stack([k[0] for k in kept]))
    record.summaries[op].append(torch.stack([torch.stack([k[1], k[2]], dim=-2) for k in kept]))
    worst = torch.stack([k[3] for k in kept]).amax()
    # A non-finite ratio is a check whose inputs already carried a fault reported elsewhere: left out (as _observe).
    worst = torch.where(torch.isfinite(worst), worst, 0.0)
    prev = record.worst[op]
    record.worst[op] = worst if prev is None else torch.maximum(prev, worst)


def _slow_path(sh: _Shared, ctx: LayerContext, record: _Pass, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Report every flagged tile; in correct mode recompute its query block tile by tile, repairing as it goes."""

    correct = ctx.config.mode == "correct"
    blocks: dict[int, dict[str, dict[int, list[tuple[int, int]]]]] = {}
    for op in sh.ops:
        for i, flags in enumerate(record.flags[op]):
            if flags is None:
                continue
            for j, b, h in flags.nonzero().tolist():  # sync: slow path only
                blocks.setdefault(i, {o: {} for o in sh.ops})[op].setdefault(j, []).append((b, h))
    if not correct:
        r0_of = {i: sh.plan.rows(i)[0] for i in blocks}
        for i, by_op in sorted(blocks.items()):
            for op, tiles in by_op.items():
                summaries = record.summaries[op][i]
                assert summaries is not None
                reports = [_shift(_from_summary(summaries[j, b, h], (b, h), None, "detected"), r0_of[i],
                                  _col0(sh.plan, op, i, j))
                           for j, pairs in sorted(tiles.items()) for b, h in pairs]
                _emit(sh, ctx, op, reports)
        return
    injector = ctx.runtime.injector
    b, h, t, s = sh.q.shape[0], sh.q.shape[1], sh.q.shape[2], sh.k.shape[-2]
    hits = {op: [] if injector is None else injector.resolve(op=op, layer=ctx.layer, step=ctx.step, shape=shape,
                                                             attempt=1)
            for op, shape in (("scores", (b, h, t, s)), ("context", (b, h, t, sh.v.shape[-1])))}
    for i, by_op in sorted(blocks.items()):
        fix = _Repair(ctx, sh.tol, by_op, {op: record.summaries[op][i] for op in sh.ops}, sh)
        _query_block(sh, i, out, lse, hits, fix=fix)


def _col0(plan: TilePlan, op: str, i: int, n: int) -> int:
    """The first key of query block i's n-th tile (scores); 0 for the context, whose columns are features."""
    if op != "scores":
        return 0
    return next(c0 for visit, (_, c0, _) in enumerate(plan.keys(i)) if visit == n)


def _repair_tile(
    fix: _Repair, op: str, c: torch.Tensor, checks: dict[str, Any], j: int, r0: int, c0: int, exact: Any
) -> None:
    """Verify a recomputed tile and repair it in place (the recompute already happened: no further rung), then
    report what the fast pass flagged here and the recompute cleared."""

    reports = repair(c, checks, fix.tol, correct=True, recompute=None, exact=exact)
    seen = {r.index for r in reports}
    summaries = fix.summaries.get(op)
    for b, h in fix.flagged.get(op, {}).get(j, []):
        if (b, h) not in seen and summaries is not None:
            reports.append(_from_summary(summaries[j, b, h], (b, h), c[b, h], "recomputed"))
    _emit(fix.shared, fix.ctx, op, [_shift(r, r0, c0) for r in reports])


def _emit(sh: _Shared, ctx: LayerContext, op: str, reports: list[MatrixReport]) -> None:
    records._emit(ctx, op, reports, heads=True, tier=sh.tiers[op])
    if sh.caught is not None:
        sh.caught[0] += len(reports)


def _from_summary(summary_25: torch.Tensor, index: tuple[int, int], clean_RC: torch.Tensor | None,
                  action: str) -> MatrixReport:
    """A report for a tile flagged in the fast pass whose values are gone: pattern and location from the counts and
    first flagged vectors; value = the clean element minus the row residual for a single element (exact for INF, NaN
    and near-INF), else the residual's error sum as seen through the checksum."""
    (nr, fr, d1r, br, _), (nc, fc, d1c, bc, _) = summary_25.tolist()  # sync: slow path only
    nr, nc, fr, fc = int(nr), int(nc), int(fr), int(fc)
    pattern = pattern_of(nr, nc)
    row = fr if nr == 1 else None
    col = fc if nc == 1 else None
    d1, bound = (d1r, br) if nr >= 1 else (d1c, bc)
    value = -d1
    if pattern == "0d" and clean_RC is not None and row is not None and col is not None:
        value = float(clean_RC[row, col]) - d1  # sync: slow path only
    return MatrixReport(index=index, pattern=pattern, row=row, col=col, value=value,
                        residual=abs(d1) if math.isfinite(d1) else None, bound=bound, action=action)


def _shift(rep: MatrixReport, r0: int, c0: int) -> MatrixReport:
    """Tile-local row/col to whole-matrix coordinates."""
    if rep.row is not None:
        rep.row += r0
    if rep.col is not None:
        rep.col += c0
    return rep

