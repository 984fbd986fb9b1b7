"""Autograd for an attention output computed and verified outside autograd: the fused CPU kernel's backward at the
verified q, k, v, output and row log-sum-exp (under protect(scope="all"), on a checked step, the same kernel on
checksum-encoded operands: attention.backward.encoded), and the mask and head layout that kernel takes. Shared by the
unfused and the tiled attention."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from ...checks.context import LayerContext
from ...checks.records import _count_trips, _emit_unplaced_trip
from ...tripwire import extreme


@dataclass(slots=True)
class _Forward:
    """What _VerifiedAttention's backward needs besides q, k, v: the verified output and how AP was formed."""

    out_BHTD: torch.Tensor
    lse_BHT: torch.Tensor
    mask_add: torch.Tensor | None
    scale: float
    is_causal: bool
    layer: LayerContext | None = None
    """Set: under protect(scope="all") backward may run its full check (attention.backward.encoded,
    attention.backward.checked)."""
    block_q: int | None = None
    """Query rows per block of those checked products (the tiled path's); None: as many as the tile budget allows
    (attention.backward.checked.checked_backward)."""


class _VerifiedAttention(torch.autograd.Function):
    """Autograd for an attention output computed, verified and repaired outside autograd (under no_grad).

    The gradient is the fused CPU kernel's backward (aten._scaled_dot_product_flash_attention_for_cpu_backward) at
    q, k, v, the verified output and the row log-sum-exp: the gradient of softmax(scale·QKᵀ + mask)·V, the same
    function the unfused graph would differentiate, without keeping AS and AP alive for backward or running softmax
    backward over them. What it reads (q, k, v, out) is what the checks verified; docs/abft.md (performance) has the
    reasoning. Under the default scope the backward itself is unprotected (DESIGN.md). Under protect(scope="all") it
    runs the kernel on checksum-encoded operands (attention.backward.encoded; the checked products of
    attention.backward.checked off the CPU and to recover from a flag) on a step the whole-step checks are due, and the
    fused kernel with the tripwire on its dQ/dK/dV (``_tripwire_backward``) on the others.
    """

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fwd: _Forward) -> torch.Tensor:
        ctx.save_for_backward(q, k, v, fwd.out_BHTD, fwd.lse_BHT, fwd.mask_add)
        ctx.scale, ctx.is_causal, ctx.layer, ctx.block_q = fwd.scale, fwd.is_causal, fwd.layer, fwd.block_q
        return fwd.out_BHTD

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        q, k, v, out, lse, mask_add = ctx.saved_tensors
        layer: LayerContext | None = ctx.layer
        if layer is not None:
            from ...gemm.schedule import whole_step_due
            from .checked import checked_backward
            from .encoded import encoded_backward, supports

            if whole_step_due(layer.runtime):
                if supports(q):
                    dq, dk, dv = encoded_backward(layer, grad_out, q, k, v, out, lse, mask_add, scale=ctx.scale,
                                                  is_causal=ctx.is_causal, block_q=ctx.block_q)
                else:
                    dq, dk, dv, _ = checked_backward(layer, grad_out, q, k, v, out, lse, mask_add, scale=ctx.scale,
                                                     is_causal=ctx.is_causal, block_q=ctx.block_q)
                return dq, dk, dv, None
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out.contiguous(), q, k, v, out, lse, 0.0, ctx.is_causal, attn_mask=mask_add, scale=ctx.scale)
        if layer is not None:
            from ...gemm.schedule import whole_step_trips

            if whole_step_trips(layer.runtime):
                dq, dk, dv = _tripwire_backward(layer, (dq, dk, dv), grad_out, q, k, v, out, lse, mask_add,
                                                scale=ctx.scale, is_causal=ctx.is_causal, block_q=ctx.block_q)
        return dq, dk, dv, None


GRAD_OPS: tuple[str, ...] = ("grad_q", "grad_k", "grad_v")
"""The ops of the fused backward's outputs (attention.backward.checked names its products the same way)."""


def _tripwire_backward(
    layer: LayerContext,
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask_add: torch.Tensor | None,
    *,
    scale: float,
    is_causal: bool,
    block_q: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tier 1 on the fused backward (protect(scope="all"), full checks not due): dQ, dK and dV summed for INF, NaN or
    near-INF. The kernel keeps its products to itself, so a trip is recovered by running the backward again through
    the checked products (attention.backward.checked), whose events say tier "tripwire". When those find nothing, a
    tripped gradient that is now clean is reported as recomputed (the fault was in the thrown-away result); one that
    trips again is what the operands give (values past 1e10 in diverged training: no event), or, if not finite, an
    upstream fault this backward cannot repair (detected)."""
    from .checked import checked_backward

    t0 = time.perf_counter()
    tripped = torch.stack([extreme(g) for g in grads]).tolist()  # sync: the one per layer's backward on tier 1
    _count_trips(layer, GRAD_OPS, time.perf_counter() - t0)
    if not any(tripped):
        return grads
    t0 = time.perf_counter()
    fresh = checked_backward(layer, grad_out, q, k, v, out, lse, mask_add, scale=scale, is_causal=is_causal,
                             tier="tripwire", block_q=block_q)
    if not fresh[3]:
        for op, grad, new, trip in zip(GRAD_OPS, grads, fresh[:3], tripped, strict=True):
            if not trip:
                continue
            if not bool(extreme(new)):  # sync: slow path only
                _emit_unplaced_trip(layer, op, grad, action="recomputed")
            elif not bool(new.isfinite().all()):  # sync: slow path only
                _emit_unplaced_trip(layer, op, new, action="detected")
    _count_trips(layer, [], time.perf_counter() - t0)
    return fresh[0], fresh[1], fresh[2]


def _additive_mask(attn_mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The mask as the fused backward takes it: additive, 4-D. A 3-D (H, T, S) mask, valid for SDPA (it broadcasts
    from the right), is misread by the CPU kernel's backward, which then fails on its size."""
    if attn_mask is None:
        return None
    if attn_mask.dtype == torch.bool:
        mask = torch.zeros(attn_mask.shape, dtype=dtype, device=attn_mask.device).masked_fill_(~attn_mask, -math.inf)
    else:
        mask = attn_mask.to(dtype)
    return mask.view(*(1,) * (4 - mask.dim()), *mask.shape) if mask.dim() < 4 else mask


def _expand_heads(x_BHSD: torch.Tensor, heads: int) -> torch.Tensor:
    """GQA: repeat each key/value head for its query-head group (SDPA's enable_gqa). expand + reshape rather than
    repeat_interleave, which syncs on CUDA to size its output."""
    hk = x_BHSD.shape[-3]
    if hk == heads:
        return x_BHSD
    lead, tail = x_BHSD.shape[:-3], x_BHSD.shape[-2:]
    grouped = x_BHSD.unsqueeze(-3).expand(*lead, hk, heads // hk, *tail)
    return grouped.reshape(*lead, heads, *tail)
