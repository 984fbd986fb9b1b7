"""The unfused backend: AS = Q·Kᵀ and AP = softmax(scale·AS + mask) materialised whole (B, H, T, S), both products
verified in both directions and repaired in place (``abft.repair``), with checksum passing from the projections in
paper-faithful mode. It takes every call: the one backend for attention dropout (the fused backward cannot replay our
keep-mask), ``return_probs`` (AP itself is asked for), paper-faithful checksum passing, and a mask that requires grad
(its graph differentiates through the mask). Its memory is O(B·H·T·S).

Legend as in pipeline.py. One host-device sync on clean input (after both products: optimistic), more only on the
slow path. Corrections happen under no_grad on tensors autograd never saved, so backward sees the fault-free values.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from ...abft import (
    Tolerance,
    acc_dtype,
    col_norms,
    group_sums_cols,
    group_sums_rows,
    repair,
    times_skinny,
    weighted_cols,
)
from ...abft.operand_moments import context_moments, query_weighted_sums, references_of, scores_moments, value_row_terms
from ...checks.caches import fill_future_
from ...checks.context import LayerContext
from ...checks.passed import PassedProjection
from ...checks.product import Checks, _dot, _exact_math, _groups, _tolerance, _verify, operand_rounding
from ...checks.records import _any_bad, _count, _count_trips, _emit, _inject, _observe, _seen
from ...tripwire import extreme
from ..backward.fused import _additive_mask, _expand_heads, _Forward, _VerifiedAttention
from ..backward.unfused import context_product, scores_product
from . import AttentionCall, BackendOutput
from .tiled_torch import mods_reasons

__all__ = ["UnfusedBackend", "context_checks", "scores_checks"]


class UnfusedBackend:
    """The backend of last resort, and the only one for attention dropout, return_probs, paper-faithful checksum
    passing and a mask that requires grad. It takes every call but a FlexAttention or varlen call's (per-tile mods,
    the row log-sum-exp as an output), which the tile loop takes whatever its size."""

    name = "unfused"

    def not_supported_reasons(self, call: AttentionCall) -> list[str]:
        return mods_reasons(call, "the unfused path")

    def run(self, call: AttentionCall) -> BackendOutput:
        q_BHTD, k_BHSD, v_BHSD, attn_mask = call.q_BHTD, call.k_BHSD, call.v_BHSD, call.attn_mask
        # The fused CPU backward stands in for autograd through this graph where it can (_fused_backward_ok): the
        # forward then runs without autograd, and AS and AP are freed when the call returns.
        fused_grad = _fused_backward_ok(q_BHTD, call.dropout_p, call.return_probs, attn_mask)
        with torch.no_grad() if fused_grad else contextlib.nullcontext():
            out, probs, lse = _checked_attention(
                q_BHTD, k_BHSD, v_BHSD, ctx=call.ctx, attn_mask=attn_mask, is_causal=call.is_causal,
                scale=call.scale, dropout_p=call.dropout_p, use_passed=call.paper and not call.force,
                with_lse=fused_grad, force=call.force, caught=call.caught)
        if fused_grad and call.needs_grad:
            assert lse is not None
            h = q_BHTD.shape[1]
            k_rep, v_rep = _expand_heads(k_BHSD, h), _expand_heads(v_BHSD, h)
            out = _VerifiedAttention.apply(q_BHTD, k_rep, v_rep, _Forward(
                out_BHTD=out, lse_BHT=lse, mask_add=_additive_mask(attn_mask, q_BHTD.dtype), scale=call.scale,
                is_causal=call.is_causal, layer=call.ctx))
        return BackendOutput(out, lse, probs if call.return_probs else None)


softmax_function = True
"""False: the unfused path with autograd differentiates scale, mask, softmax and dropout op by op, as before
``_SoftmaxDropout`` (bench/overhead.py's ``full_softmax_ops`` prices it side by side)."""



def _dead_rows(attn_mask: torch.Tensor | None) -> torch.Tensor | None:
    """(..., T, 1) bool: query rows with every key masked. SDPA returns 0 there (safe softmax), not NaN."""
    if attn_mask is None:
        return None
    if attn_mask.dtype == torch.bool:
        return ~attn_mask.any(-1, keepdim=True)
    return torch.isneginf(attn_mask).all(-1, keepdim=True)



def _probs(
    scores_BHTS: torch.Tensor,
    *,
    scale: float,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    dropout_p: float,
    keep_BHTS: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """AP = dropout(softmax(scale·AS + mask)); the dropout keep-mask is returned so a recompute reuses it."""
    probs, keep, _ = _probs_lse(scores_BHTS, scale=scale, attn_mask=attn_mask, is_causal=is_causal,
                                dropout_p=dropout_p, keep_BHTS=keep_BHTS)
    return probs, keep



def _probs_lse(
    scores_BHTS: torch.Tensor,
    *,
    scale: float,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    dropout_p: float,
    keep_BHTS: torch.Tensor | None,
    with_lse: bool = False,
    probs_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """_probs, and with_lse also the row log-sum-exp of scale·AS + mask (B, H, T) in fp32 (fp64 for fp64 inputs),
    +INF on rows with every key masked (so that exp(s - lse) = 0 there, as AP), for the fused backward
    (_VerifiedAttention). probs_dtype: AP's dtype (V's) when AS was formed wider than the operands (fp16,
    _scores_product); default AS's."""
    if dropout_p > 0.0 and keep_BHTS is None:
        # Scaled by 1/(1-p) once, as SDPA's math backend does: AP is then one product with it, in forward and backward.
        keep_BHTS = torch.empty(scores_BHTS.shape, dtype=probs_dtype or scores_BHTS.dtype,
                                device=scores_BHTS.device).bernoulli_(1.0 - dropout_p).div_(1.0 - dropout_p)
    if (softmax_function and not with_lse and torch.is_grad_enabled() and scores_BHTS.requires_grad
            and scores_BHTS.dtype in (torch.float32, torch.float64) and probs_dtype in (None, scores_BHTS.dtype)
            and not (attn_mask is not None and attn_mask.requires_grad)):
        # The unfused path with autograd (attention dropout, return_probs, off the CPU): one Function for scale, mask,
        # softmax and dropout, whose backward is one softmax backward instead of autograd's pass per op.
        probs: torch.Tensor = _SoftmaxDropout.apply(scores_BHTS, _SoftmaxInputs(scale, attn_mask, is_causal),
                                                    keep_BHTS)
        return probs, keep_BHTS, None
    s = _logits(scores_BHTS, scale, attn_mask, is_causal)
    # Softmax in fp32 for half inputs, like SDPA's kernels: the row sums feed the checksum bound. fp64 stays fp64 (the
    # fused backward wants lse in the inputs' dtype, and an fp32 softmax would cost fp64 inputs their precision).
    soft = torch.promote_types(s.dtype, torch.float32)
    probs_w = torch.softmax(s, dim=-1, dtype=soft)
    lse_BHT = None
    if with_lse:
        # From what softmax already computed: softmax is monotone, so the largest p sits at the largest s = m, where
        # p = exp(m - lse): lse = m - log max(p), with max(p) >= 1/S (no cancellation). Two max passes (values only:
        # max with indices is ~15x slower on CPU) instead of torch.logsumexp's three.
        lse_BHT = s.amax(-1).to(soft) - probs_w.amax(-1).log()
    probs = probs_w.to(probs_dtype or s.dtype)
    dead = _dead_rows(attn_mask)
    if dead is not None:
        # In place where autograd does not track AP (the verified forward runs without it): AP is a fresh tensor
        # there, and the out-of-place fill was one more (B, H, T, S) allocation and copy per layer.
        probs = probs.masked_fill_(dead, 0.0) if not probs.requires_grad else probs.masked_fill(dead, 0.0)
        if lse_BHT is not None:
            lse_BHT = lse_BHT.masked_fill(dead[..., 0], math.inf)
    if keep_BHTS is not None:
        probs = probs * keep_BHTS
    return probs, keep_BHTS, lse_BHT



def _logits(scores_BHTS: torch.Tensor, scale: float, attn_mask: torch.Tensor | None, is_causal: bool) -> torch.Tensor:
    """scale·AS + mask (B, H, T, S), masked keys -INF. One new tensor, then in place: out-of-place masking copied the
    scores once per mask."""
    s = scores_BHTS * scale
    if is_causal:
        fill_future_(s, -math.inf)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            s.masked_fill_(~attn_mask, -math.inf)
        else:
            s.add_(attn_mask)
    return s



@dataclass(frozen=True, slots=True)
class _SoftmaxInputs:
    scale: float
    attn_mask: torch.Tensor | None
    """bool (True = attend) or additive, without a gradient of its own (a learned mask takes autograd's path)."""
    is_causal: bool



class _SoftmaxDropout(torch.autograd.Function):
    """AP = softmax(scale·AS + mask) ⊙ keep (keep: the dropout mask scaled by 1/(1-p), or None), fp32 or fp64 AS.
    Autograd through the separate ops ran a (B, H, T, S) pass per op in backward (the dropout product and its
    scaling, softmax, the causal fill, the scale); the gradient here is one product with keep, one softmax backward
    and the scale in place. Rows with every key masked get AP 0 (SDPA's safe softmax) and a zero gradient."""

    @staticmethod
    def forward(ctx: Any, scores_BHTS: torch.Tensor, how: _SoftmaxInputs, keep_BHTS: torch.Tensor | None
                ) -> torch.Tensor:
        probs = torch.softmax(_logits(scores_BHTS, how.scale, how.attn_mask, how.is_causal), dim=-1)
        dead = _dead_rows(how.attn_mask)
        if dead is not None:
            probs.masked_fill_(dead, 0.0)
        ctx.save_for_backward(probs, keep_BHTS)
        ctx.scale = how.scale
        return probs if keep_BHTS is None else probs * keep_BHTS

    @staticmethod
    def backward(ctx: Any, grad_BHTS: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        probs, keep = ctx.saved_tensors
        g = grad_BHTS if keep is None else grad_BHTS * keep
        ds = torch._softmax_backward_data(g, probs, -1, probs.dtype)
        return ds.mul_(ctx.scale), None, None



def _fused_backward_ok(
    q_BHTD: torch.Tensor, dropout_p: float, return_probs: bool, attn_mask: torch.Tensor | None = None
) -> bool:
    """Whether the CPU flash-attention backward can stand in for autograd through the unfused forward: it recomputes
    AP from Q, K and the row log-sum-exp, so it cannot reproduce our dropout mask, and return_probs hands AP itself
    to the caller's graph. Nor does it return a gradient for the mask: a mask that requires grad (a learned relative
    bias, T5/Swin/ALiBi style) is differentiated through the unfused graph instead, as PyTorch's own SDPA then runs
    its math backend."""
    mask_grad = attn_mask is not None and attn_mask.requires_grad and torch.is_grad_enabled()
    return q_BHTD.device.type == "cpu" and dropout_p == 0.0 and not return_probs and not mask_grad



def _scores_product(q_BHTD: torch.Tensor, k_BHSD: torch.Tensor, layer: LayerContext | None = None) -> torch.Tensor:
    """AS = Q Kᵀ (B, H, T, S). fp16 operands are multiplied into fp32: the unscaled logits pass fp16's 65504 well
    before the scaled ones do, and PyTorch's attention (flash/efficient kernels, the CPU kernel) accumulates them in
    fp32, so an fp16 AS would turn a finite attention into INF/NaN and a false "uncorrectable". fp16 values are exact
    in fp32 (and in TF32), so the checksums of this product are those of an fp32 GEMM. bf16 has fp32's range.
    layer: the product's backward GEMMs are checked under protect(scope="all") (attention.backward.unfused)."""
    if q_BHTD.dtype == torch.float16:
        return scores_product(q_BHTD.float(), k_BHSD.float(), layer)
    return scores_product(q_BHTD, k_BHSD, layer)



def _suspect_heads(passed: PassedProjection | None, x_BHSD: torch.Tensor, heads: int) -> torch.Tensor | None:
    """(B, H) bool, slow path only: this head's q/k/v disagrees with the checksums passed from its projection, so a
    reference built from it is not clean."""
    if passed is None:
        return None
    with _exact_math(x_BHSD):
        return _disagrees(passed, x_BHSD, heads)



def _disagrees(passed: PassedProjection, x_BHSD: torch.Tensor, heads: int) -> torch.Tensor:
    got_BHD2 = weighted_cols(x_BHSD.to(passed.token_ref_NO2.dtype))
    b, hk = passed.token_ref_NO2.shape[0], heads
    ref_BHD2 = passed.token_ref_NO2.view(b, hk, -1, 2)
    bound_BHD = passed.token_bound_NO.view(b, hk, -1)
    ok_BHD = ~torch.isfinite(ref_BHD2[..., 0]) | ((ref_BHD2[..., 0] - got_BHD2[..., 0]).abs() <= bound_BHD)
    return ~ok_BHD.all(-1)



def _take_passed(ctx: LayerContext, name: str, n: int, tokens: int, heads: int, d: int) -> PassedProjection | None:
    passed = ctx.passed.take(name)
    if passed is None:
        return None
    if passed.token_ref_NO2.shape != (n, heads * d, 2) or passed.tokens != tokens:
        return None
    return passed



def _checked_attention(
    q_BHTD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    *,
    ctx: LayerContext,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    dropout_p: float,
    use_passed: bool,
    with_lse: bool,
    force: frozenset[str] = frozenset(),
    caught: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """protected_sdpa's unfused forward with its checks and repairs: (out, AP, row log-sum-exp if with_lse).
    force: ops verified whatever the step's config says (a tier-1 recovery; their events say tier "tripwire").
    caught: [n], incremented by the number of detections emitted."""
    b, h, t, _ = q_BHTD.shape
    hk, s = k_BHSD.shape[-3], k_BHSD.shape[-2]
    cfg = ctx.config
    tol = _tolerance(ctx)
    paper = not cfg.source_repair and use_passed
    passed = {
        name: _take_passed(ctx, name, b, t if name == "q" else s, h if name == "q" else hk, x.shape[-1])
        if paper else None
        for name, x in (("q", q_BHTD), ("k", k_BHSD), ("v", v_BHSD))
    }
    k_rep, v_rep = _expand_heads(k_BHSD, h), _expand_heads(v_BHSD, h)
    scores = _scores_product(q_BHTD, k_rep, ctx)
    _inject(ctx, "scores", scores)
    checks: dict[str, Checks] = {}
    seconds = dict.fromkeys(("scores", "context"), 0.0)
    tier = {op: "tripwire" if op in force else "abft" for op in ("scores", "context")}
    wired: dict[str, torch.Tensor] = {}
    """Tier 1: op -> its trip flag, for the ops only the tripwire looks at on this step."""
    trip_s = 0.0
    if cfg.checks("scores") or "scores" in force:
        t0 = time.perf_counter()
        checks["scores"] = scores_checks(q_BHTD, k_rep, scores.detach(), passed, h, tol)
        _observe(ctx, checks["scores"], "scores")
        # Paper mode: q and k are verified here, through the checksums their projections passed.
        _seen(ctx, [name for name in ("q", "k") if passed[name] is not None])
        seconds["scores"] += time.perf_counter() - t0
    elif cfg.trips("scores"):
        t0 = time.perf_counter()
        wired["scores"] = extreme(scores)
        trip_s += time.perf_counter() - t0
    probs, keep, lse = _probs_lse(scores, scale=scale, attn_mask=attn_mask, is_causal=is_causal, dropout_p=dropout_p,
                                  keep_BHTS=None, with_lse=with_lse, probs_dtype=v_rep.dtype)
    out = context_product(probs, v_rep, ctx)
    _inject(ctx, "context", out)
    if cfg.checks("context") or "context" in force:
        t0 = time.perf_counter()
        checks["context"] = context_checks(probs.detach(), v_rep, out.detach(), passed.get("v"), h, tol, dropout_p)
        _observe(ctx, checks["context"], "context")
        _seen(ctx, ["v"] if passed["v"] is not None else [])
        seconds["context"] += time.perf_counter() - t0
    elif cfg.trips("context"):
        t0 = time.perf_counter()
        wired["context"] = extreme(out)
        trip_s += time.perf_counter() - t0
    if checks or wired:
        any_bad = torch.stack([_any_bad(c) for c in checks.values()] + list(wired.values())).any()
        if bool(any_bad):  # sync: the one per protected attention call; decides whether the slow path runs
            t0 = time.perf_counter()
            for op, flag in wired.items():
                if not bool(flag):  # sync: slow path only, which op tripped
                    continue
                # A trip: the op gets its full check now, which locates and corrects (or recomputes) the fault.
                tier[op] = "tripwire"
                if op == "scores":
                    checks[op] = scores_checks(q_BHTD, k_rep, scores.detach(), passed, h, tol)
                else:
                    checks[op] = context_checks(probs.detach(), v_rep, out.detach(), passed.get("v"), h, tol,
                                                 dropout_p)
            correct = cfg.mode == "correct"
            if "scores" in checks:
                trusted = _trusted(passed.get("q"), passed.get("k"), q_BHTD, k_BHSD, h, hk)

                def recompute_scores() -> torch.Tensor:
                    fresh = _scores_product(q_BHTD.detach(), k_rep.detach())
                    _inject(ctx, "scores", fresh, attempt=1)
                    return fresh

                def exact_scores(key: tuple[int, ...], rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
                    return _dot(q_BHTD.detach()[key][rows], k_rep.detach()[key][cols])

                with _exact_math(scores):
                    reports = repair(scores, checks["scores"], tol, correct=correct, recompute=recompute_scores,
                                     trusted=trusted, exact=None if paper else exact_scores)
                _emit(ctx, "scores", reports, heads=True, tier=tier["scores"])
                if caught is not None:
                    caught[0] += len(reports)
                if correct and any(r.action in ("corrected", "recomputed") for r in reports):
                    # AS was repaired in place: rebuild AP and CL from it, reusing the dropout mask.
                    probs, _, lse = _probs_lse(scores, scale=scale, attn_mask=attn_mask, is_causal=is_causal,
                                               dropout_p=dropout_p, keep_BHTS=keep, with_lse=with_lse,
                                               probs_dtype=v_rep.dtype)
                    out = context_product(probs, v_rep, ctx)
                    _inject(ctx, "context", out, attempt=1)
                    if "context" in checks:
                        checks["context"] = context_checks(probs.detach(), v_rep, out.detach(), passed.get("v"), h,
                                                            tol, dropout_p)
            seconds["scores"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            if "context" in checks:
                # CL's column references (wᵀAP)V are built from V, unverified in paper-faithful mode.
                v_bad = _suspect_heads(passed.get("v"), v_BHSD, hk)
                trusted = None if v_bad is None else {"col": _expand_heads(~v_bad[..., None, None], h)[..., 0, 0]}

                def recompute_context() -> torch.Tensor:
                    fresh = probs.detach() @ v_rep.detach()
                    _inject(ctx, "context", fresh, attempt=1)
                    return fresh

                def exact_context(key: tuple[int, ...], rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
                    return _dot(probs.detach()[key][rows], v_rep.detach()[key].T[cols])

                with _exact_math(out):
                    reports = repair(out, checks["context"], tol, correct=correct, recompute=recompute_context,
                                     trusted=trusted, exact=None if paper else exact_context)
                _emit(ctx, "context", reports, heads=True, tier=tier["context"])
                if caught is not None:
                    caught[0] += len(reports)
            seconds["context"] += time.perf_counter() - t0
    if wired:
        _count_trips(ctx, list(wired), trip_s)
    for op in checks:
        if tier[op] == "abft":
            _count(ctx, op, seconds[op])
        else:
            _count_trips(ctx, [], seconds[op])
    return out, probs, lse



def _trusted(
    passed_q: PassedProjection | None,
    passed_k: PassedProjection | None,
    q_BHTD: torch.Tensor,
    k_BHSD: torch.Tensor,
    h: int,
    hk: int,
) -> dict[str, torch.Tensor] | None:
    """Paper-faithful mode: AS's row references are built from Q and its column references from K, both unverified.
    A head whose Q (K) disagrees with the passed checksums has untrusted row (column) references."""
    q_bad = _suspect_heads(passed_q, q_BHTD, h)
    k_bad = _suspect_heads(passed_k, k_BHSD, hk)
    trusted = {}
    if q_bad is not None:
        trusted["row"] = ~q_bad
    if k_bad is not None:
        trusted["col"] = _expand_heads(~k_bad[..., None, None], h)[..., 0, 0]
    return trusted or None



def scores_checks(
    q_BHTD: torch.Tensor,
    k_BHSD: torch.Tensor,
    scores_BHTS: torch.Tensor,
    passed: dict[str, PassedProjection | None],
    h: int,
    tol: Tolerance,
) -> Checks:
    """AS = Q Kᵀ: per query row Q k̄ᵀ, per key column K q̄ᵀ; q̄, k̄ passed from X when available (paper mode)."""
    with _exact_math(scores_BHTS):
        acc = acc_dtype(q_BHTD.dtype)
        # Heads split out of a projection are strided views: one copy each makes every later reduction fast.
        q_acc, k_acc = q_BHTD.detach().to(acc).contiguous(), k_BHSD.detach().to(acc).contiguous()
        b = q_acc.shape[0]
        pq, pk = passed.get("q"), passed.get("k")
        # Grouped checksums (abft/checksum.py) only with input-derived references: a passed q̄/k̄ is one plain pair.
        g_r = _groups(tol, k_acc.shape[-2]) if pk is None else 1
        g_c = _groups(tol, q_acc.shape[-2]) if pq is None else 1
        if pq is not None:
            qbar_BHD2 = pq.token_ref_NO2.view(b, h, -1, 2)
        else:
            qbar_BHD2 = group_sums_cols(q_acc, g_c).flatten(-2)
        if pk is not None:
            kbar_BHD2 = _expand_heads(pk.token_ref_NO2.view(b, -1, q_acc.shape[-1], 2), h)
        else:
            kbar_BHD2 = group_sums_cols(k_acc, g_r).flatten(-2)
        q_norm_BHT = torch.linalg.vector_norm(q_acc, dim=-1)
        k_norm_BHS = torch.linalg.vector_norm(k_acc, dim=-1)
        # Row references Q k̄ᵀ use a passed k̄: off by ‖k̄ error‖·‖Q_t‖; column references K q̄ᵀ likewise.
        extra_row = None
        if pk is not None:
            kv_heads = pk.token_bound_NO.shape[1] // q_acc.shape[-1]
            extra_row = q_norm_BHT * _expand_heads(pk.token_bound_norm(kv_heads)[..., None], h)[..., 0]
        extra_col = None if pq is None else k_norm_BHS * pq.token_bound_norm(h)
        if (g_r, g_c) == (1, 1):
            ref_norms = (torch.linalg.vector_norm(kbar_BHD2, dim=-2), torch.linalg.vector_norm(qbar_BHD2, dim=-2))
        else:
            ref_norms = (torch.linalg.vector_norm(kbar_BHD2, dim=-2).unflatten(-1, (g_r, 2)),
                         torch.linalg.vector_norm(qbar_BHD2, dim=-2).unflatten(-1, (g_c, 2)))
        moments: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
        if pq is None and pk is None and operand_rounding(scores_BHTS, tol):
            # Under TF32 the product rounded Q and K: their moments bound that error (abft/operand_moments.py).
            moments = scores_moments(q_acc, k_acc, qbar_BHD2, kbar_BHD2, (g_r, g_c))
        return _verify(
            scores_BHTS,
            times_skinny(q_acc, kbar_BHD2).unflatten(-1, (g_r, 2)).flatten(-3, -2),
            times_skinny(k_acc, qbar_BHD2).unflatten(-1, (g_c, 2)).flatten(-3, -2),
            q_norm_BHT,
            k_norm_BHS,
            k=q_acc.shape[-1],
            tol=tol,
            extra_row_NR=extra_row,
            extra_col_NC=extra_col,
            ref_norms=ref_norms,
            groups=(g_r, g_c),
            operand_moments=moments,
        )



def context_checks(
    probs_BHTS: torch.Tensor,
    v_BHSD: torch.Tensor,
    out_BHTD: torch.Tensor,
    passed_v: PassedProjection | None,
    h: int,
    tol: Tolerance,
    dropout_p: float = 0.0,
) -> Checks:
    """CL = AP V: per query row AP (V w) (V w passed from X when available), per feature column (wᵀAP) V.
    AP ≥ 0 with rows summing to 1 (0 when fully masked, 1/(1-p) at most after dropout), so ‖AP_t‖₂ ≤ ‖AP_t‖₁ needs
    no pass over AP; 1.01 covers the rounding of half-precision probabilities."""
    with _exact_math(out_BHTD):
        acc = acc_dtype(v_BHSD.dtype)
        v_acc, p_acc = v_BHSD.detach().to(acc).contiguous(), probs_BHTS.to(acc)
        s = p_acc.shape[-1]
        # An fp32 context under TF32 rounded AP and V: their moments bound that error (abft/operand_moments.py).
        rounded = passed_v is None and operand_rounding(out_BHTD, tol)
        # Grouped checksums (abft/checksum.py): feature groups only with an input-derived V w; query groups always.
        g_r = _groups(tol, v_acc.shape[-1]) if passed_v is None else 1
        g_c = _groups(tol, p_acc.shape[-2])
        if passed_v is not None:
            # v̂ passed from X carries the projection's round-off per token: AP times it bounds the row references'.
            kv_heads = passed_v.weight_OI.shape[0] // v_acc.shape[-1]
            vw_BHS2 = _expand_heads(passed_v.feature_ref(kv_heads), h)
            vbound_BHS1 = _expand_heads(passed_v.feature_bound(kv_heads)[..., None], h)
            row_BHTc = times_skinny(p_acc, torch.cat([vw_BHS2, vbound_BHS1], dim=-1))
        else:
            vw_BHS2 = group_sums_rows(v_acc, g_r).flatten(-2)
            if rounded:
                # P·[β_h, (V_h w)²] and Σ_k P_tk ride along in the row references' skinny product.
                ones_BHS1 = torch.ones_like(vw_BHS2[..., :1])
                row_BHTc = times_skinny(p_acc, torch.cat([vw_BHS2, value_row_terms(v_acc, vw_BHS2, g_r), ones_BHS1],
                                                         dim=-1))
            else:
                row_BHTc = times_skinny(p_acc, vw_BHS2)
        query_sums = None
        if rounded:
            # The column references' weighted sums and the moments' in one pass over AP.
            query_sums = query_weighted_sums(p_acc, row_BHTc[..., -1], g_c)
            pw_BHS2 = references_of(query_sums)
        else:
            pw_BHS2 = group_sums_cols(p_acc, g_c).flatten(-2)
        # (B, H, g·2, D) -> (B, H, D, g, 2) -> (B, H, D·g, 2)
        col_ref_BHD2 = (pw_BHS2.mT @ v_acc).unflatten(-2, (g_c, 2)).permute(0, 1, 4, 2, 3).flatten(-3, -2)
        p_norm_BHT = torch.full(row_BHTc.shape[:-1], 1.01 / (1.0 - dropout_p), device=p_acc.device, dtype=acc)
        ref_norms = (torch.linalg.vector_norm(vw_BHS2, dim=-2), torch.linalg.vector_norm(pw_BHS2, dim=-2))
        if (g_r, g_c) != (1, 1):
            ref_norms = (ref_norms[0].unflatten(-1, (g_r, 2)), ref_norms[1].unflatten(-1, (g_c, 2)))
        moments: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
        if rounded:
            moments = context_moments(p_acc, v_acc, row_BHTc[..., -1], (g_r, g_c),
                                      row_terms_NT4g=row_BHTc[..., 2 * g_r : 6 * g_r], query_sums_Ng4S=query_sums)
        return _verify(
            out_BHTD,
            row_BHTc[..., : 2 * g_r].unflatten(-1, (g_r, 2)).flatten(-3, -2),
            col_ref_BHD2,
            p_norm_BHT,
            col_norms(v_acc),
            k=s,
            tol=tol,
            extra_row_NR=row_BHTc[..., 2] if passed_v is not None else None,
            ref_norms=ref_norms,
            groups=(g_r, g_c),
            operand_moments=moments,
        )
