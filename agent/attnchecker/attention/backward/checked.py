"""The attention core's backward with every product verified (issue 17), for ``protect(scope="all")``.

``_VerifiedAttention`` (attention.py) normally differentiates through the fused CPU flash-attention backward, where no
checksum reaches the intermediate products. On a step the whole-step checks are due, its backward calls
``checked_backward`` instead, which recomputes the products explicitly and verifies each one (``gemm.check``):

  S  = Q Kᵀ          (op ``scores_bwd``: the scores again, to rebuild AP from the forward's row log-sum-exp)
  dP = dO Vᵀ         (op ``grad_probs``)
  AP = exp(scale·S + mask - lse);  dS = AP ⊙ (dP - rowsum(dO ⊙ O))   (elementwise: not a GEMM, not checked)
  dV = APᵀ dO        (op ``grad_v``)
  dQ = scale · dS K  (op ``grad_q``);   dK = scale · dSᵀ Q  (op ``grad_k``)

Same function as the fused kernel's, in another summation order (gradients agree to round-off). Two host-device
syncs per layer's backward: S and dP are verified before AP and dS are built from them. attnchecker.inject's planned
faults hit each product right after it is made (``check=False``: the products a tier-1 or unchecked step runs when a
fault is planned in them, which the fused kernels keep to themselves).

Legend: B batch, H heads (K/V already expanded to H), T query tokens, S key tokens, D head dim.
"""
from __future__ import annotations

import math

import torch

from ...abft.tiled import TILE_BUDGET
from ...checks.caches import fill_future_
from ...checks.context import LayerContext
from ...gemm.check import check_gemms
from ...inject import WindowHit

__all__ = ["BACKWARD_OPS", "checked_backward"]

BACKWARD_OPS: tuple[str, ...] = ("scores_bwd", "grad_probs", "grad_v", "grad_q", "grad_k")


def checked_backward(
    layer: LayerContext,
    grad_out_BHTD: torch.Tensor,
    q_BHTD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    out_BHTD: torch.Tensor,  # noqa: ARG001 - the caller's contract; δ is taken from dP and AP (below)
    lse_BHT: torch.Tensor,
    mask_add: torch.Tensor | None,
    *,
    scale: float,
    is_causal: bool,
    tier: str = "abft",
    block_q: int | None = None,
    check: bool = True,
    attempt: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(dQ, dK, dV, how many products flagged) of softmax(scale·QKᵀ + mask)·V at the verified forward's q, k, v, out
    and row log-sum-exp. tier: "tripwire" when run to recover from a tier-1 trip on the fused backward
    (attention.backward.fused._tripwire_backward): its events say so and its time counts as tier 1's. check: False
    makes the products and lets planned faults hit them, unchecked (what a tier-1 step's kernel computes, before its
    tripwire reads dQ, dK and dV). attempt: 1 when this recomputes a backward (the tripwire's recovery): a persistent
    planned fault hits again, recorded as the recompute's.

    block_q: query rows per block (None: as many as the tile budget allows). The products are taken a block of
    query rows at a time, at most TILE_BUDGET elements of (B, H, rows, S) each, so that the backward keeps O(block·S)
    of the (B, H, T, S) products, as the tiled forward does; this holds on every path that reaches it, the fused
    tier-1 kernel's recovery from a trip at long context included. Each block's S, dP, dQ rows and its contributions
    to dK and dV (dSᵀ Q, APᵀ dO over the block's rows) are products of their own, each verified before it is used or
    added up; under a causal mask a block reads only the keys up to its last row (top-left aligned, as SDPA)."""
    do_BHTD = grad_out_BHTD.contiguous()
    # Heads split out of a projection are strided views: matmul would copy q and k for each of the two products that
    # read them (and the checks would reduce them strided); one copy each, up front, serves all.
    q_BHTD, k_BHSD, v_BHSD = q_BHTD.contiguous(), k_BHSD.contiguous(), v_BHSD.contiguous()
    t, s = q_BHTD.shape[-2], k_BHSD.shape[-2]
    hits = _planned(layer, q_BHTD.shape, k_BHSD.shape[-2], attempt)
    fit = TILE_BUDGET // max(1, math.prod(q_BHTD.shape[:-2]) * s)  # rows of (B, H, rows, S) within the budget
    rows = max(1, min(t, fit, block_q or t))
    if rows >= t:
        return _block(layer, do_BHTD, q_BHTD, k_BHSD, v_BHSD, lse_BHT, mask_add, scale=scale,
                      causal_row0=0 if is_causal else None, tier=tier, check=check, hits=hits, row0=0)
    # dK and dV add up over the blocks: in fp32, as one GEMM over all rows would accumulate them.
    dq_BHTD = torch.empty_like(q_BHTD)
    dk_BHSD = torch.zeros(k_BHSD.shape, dtype=torch.float32, device=k_BHSD.device)
    dv_BHSD = torch.zeros(v_BHSD.shape, dtype=torch.float32, device=v_BHSD.device)
    flagged = 0
    for r0 in range(0, t, rows):
        r1 = min(t, r0 + rows)
        keys = min(s, r1) if is_causal else s
        mask = None
        if mask_add is not None:
            mask = mask_add[..., r0:r1, :keys] if mask_add.shape[-2] == t else mask_add[..., :keys]
        dq, dk, dv, n = _block(layer, do_BHTD[..., r0:r1, :], q_BHTD[..., r0:r1, :], k_BHSD[..., :keys, :],
                               v_BHSD[..., :keys, :], lse_BHT[..., r0:r1], mask, scale=scale,
                               causal_row0=r0 if is_causal else None, tier=tier, check=check, hits=hits, row0=r0)
        dq_BHTD[..., r0:r1, :] = dq
        dk_BHSD[..., :keys, :] += dk
        dv_BHSD[..., :keys, :] += dv
        flagged += n
    return dq_BHTD, dk_BHSD.to(k_BHSD.dtype), dv_BHSD.to(v_BHSD.dtype), flagged


def _block(
    layer: LayerContext,
    do_BHTD: torch.Tensor,
    q_BHTD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    lse_BHT: torch.Tensor,
    mask_add: torch.Tensor | None,
    *,
    scale: float,
    causal_row0: int | None,
    tier: str,
    check: bool,
    hits: dict[str, list[WindowHit]],
    row0: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``checked_backward`` over one block of query rows (T here: the block's) against S keys: (its dQ rows, its
    contributions to dK and dV, how many products flagged). causal_row0: under a causal mask, the absolute index of
    the block's first row (its future keys are zeroed in AP); None without one. hits: the planned faults of each
    product, on its whole shape (``_planned``); row0: the block's first row."""
    # fp16: into fp32, as the forward does (attention._scores_product; not imported: attention imports this module's
    # caller): the unscaled logits pass 65504 well before the scaled ones do, and an fp16 S here was a false
    # "uncorrectable" INF and a skipped step on a finite attention. fp16 values are exact in fp32.
    half = q_BHTD.dtype == torch.float16
    s_BHTS = q_BHTD.float() @ k_BHSD.float().mT if half else q_BHTD @ k_BHSD.mT
    dp_BHTS = do_BHTD @ v_BHSD.mT
    _hit(hits, "scores_bwd", s_BHTS, row0)
    _hit(hits, "grad_probs", dp_BHTS, row0)
    flagged = check_gemms(layer, [("scores_bwd", s_BHTS, q_BHTD, k_BHSD.mT, None),
                                  ("grad_probs", dp_BHTS, do_BHTD, v_BHSD.mT, None)], tier=tier) if check else 0
    # In fp32, like the fused kernel: exp(s - lse) of half-precision scores loses the digits the gradient needs.
    # In place on one fp32 buffer: each (B, H, T, S) temporary is a fresh allocation (page faults) and a pass over
    # memory, which is what this elementwise part costs on CPU; same values as the out-of-place form.
    # S and dP are not read again once verified: an fp32 one is scaled (dP: shifted) in place, a half-precision one
    # upcast into a fresh buffer as before.
    z_BHTS = s_BHTS.mul_(scale) if s_BHTS.dtype == torch.float32 else s_BHTS.float().mul_(scale)
    if mask_add is not None:
        z_BHTS = _add_mask(z_BHTS, mask_add.float())
    # Rows with every key masked carry lse = +INF: exp(-INF) = 0 there, as AP.
    p32_BHTS = z_BHTS.sub_(lse_BHT[..., None]).exp_()
    if causal_row0 is not None:
        # The future keys zeroed after exp, not set to -INF before it: exp of -INF (half of a causal AP) ran 2× slower
        # than of finite scores on CPU; exp there may overflow to INF, which the fill replaces with the same 0.
        fill_future_(p32_BHTS, 0.0, row0=causal_row0)
    # δ = rowsum(dO ⊙ O) = rowsum(AP ⊙ dP), taken in the second form: from the same dP it is subtracted from, so a
    # near one-hot row (massive activations) gives dS ≈ 0 as it should. From the fp16-rounded O, δ carried
    # u·|dO·O| of error that dS then multiplied into dQ/dK (0.1 absolute on gradients of 4e-5 at the fp16 edge).
    dp32_BHTS = dp_BHTS if dp_BHTS.dtype == torch.float32 else dp_BHTS.float()
    delta_BHT1 = (dp32_BHTS * p32_BHTS).sum(-1, keepdim=True)
    ds_BHTS = dp32_BHTS.sub_(delta_BHT1).mul_(p32_BHTS).to(q_BHTD.dtype)
    p_BHTS = p32_BHTS.to(q_BHTD.dtype)
    dv_BHSD = p_BHTS.mT @ do_BHTD
    dq_BHTD = ds_BHTS @ k_BHSD
    dk_BHSD = ds_BHTS.mT @ q_BHTD
    _hit(hits, "grad_q", dq_BHTD, row0)
    if row0 == 0:  # dV and dK are sums over the blocks: a fault lands in the first block's share, once
        _hit(hits, "grad_v", dv_BHSD, 0)
        _hit(hits, "grad_k", dk_BHSD, 0)
    if check:
        flagged += check_gemms(layer, [("grad_v", dv_BHSD, p_BHTS.mT, do_BHTD, None),
                                       ("grad_q", dq_BHTD, ds_BHTS, k_BHSD, None),
                                       ("grad_k", dk_BHSD, ds_BHTS.mT, q_BHTD, None)], tier=tier)
    # Verified fresh tensors, not read again: scaled in place.
    return dq_BHTD.mul_(scale), dk_BHSD.mul_(scale), dv_BHSD, flagged


def _planned(layer: LayerContext, q_shape: torch.Size, s: int, attempt: int) -> dict[str, list[WindowHit]]:
    """attnchecker.inject's faults for this backward's products, located on their whole shapes (Injector.resolve):
    S and dP (B, H, T, S), dQ (B, H, T, D), dV and dK (B, H, S, D). Host-only when none is planned."""
    injector = layer.runtime.injector
    if injector is None:
        return {}
    *lead, t, d = q_shape
    shapes = {"scores_bwd": (*lead, t, s), "grad_probs": (*lead, t, s), "grad_q": (*lead, t, d),
              "grad_v": (*lead, s, d), "grad_k": (*lead, s, d)}
    return {op: got for op in BACKWARD_OPS
            if (got := injector.resolve(op=op, layer=layer.layer, step=layer.step, shape=shapes[op], attempt=attempt))}


def _hit(hits: dict[str, list[WindowHit]], op: str, block: torch.Tensor, row0: int) -> None:
    """Write op's planned faults that fall in this block of its rows (first row row0) right after the product."""
    for hit in hits.get(op, ()):
        hit.apply(block, row0, 0)


def _add_mask(z_BHTS: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """z + mask, in place when the mask broadcasts to z's shape (a mask wider than z, e.g. over more heads, cannot)."""
    if torch.broadcast_shapes(z_BHTS.shape, mask.shape) == z_BHTS.shape:
        return z_BHTS.add_(mask)
    return z_BHTS + mask
