"""Autograd for an attention output computed and verified outside autograd: the fused CPU kernel's backward at the
verified q, k, v, output and row log-sum-exp (under protect(scope="all"), on a checked step, the same kernel on
checksum-encoded operands: attention.backward.encoded), and the mask and head layout that kernel takes. Shared by the
unfused and the tiled attention.

Off the CPU (``_off_cpu_backward``) that kernel does not exist: the gradient is SDPA's, recomputed in backward, and
under protect(scope="all") the backward is checked by the Triton kernels (attention.backward.triton_backward: no host
sync) where they run, else by the checked PyTorch products (attention.backward.checked). ``cpu_kernel = False`` sends
CPU calls down that branch: the suite runs it that way (the Triton kernels under TRITON_INTERPRET=1)."""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ...checks.context import LayerContext
from ...checks.records import _count_trips, _emit_unplaced_trip
from ...tripwire import extreme, extreme_each
from .triton_backward import planned

log = logging.getLogger("attnchecker")

cpu_kernel = True
"""False: CPU calls take the branch other devices take (``_off_cpu_backward``), as a CUDA call would; for tests."""


@dataclass(slots=True)
class _Forward:
    """What _VerifiedAttention's backward needs besides q, k, v: the verified output and how AP was formed."""

    out_BHTD: torch.Tensor
    lse_BHT: torch.Tensor
    mask_add: torch.Tensor | None
    """The mask in the CPU kernel's form (``_additive_mask``); None off the CPU, where attn_mask is read instead."""
    scale: float
    is_causal: bool
    attn_mask: torch.Tensor | None = None
    """The call's mask as given (bool or additive, broadcastable to (B, H, T, S)): what the backward off the CPU
    takes."""
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
        ctx.save_for_backward(q, k, v, fwd.out_BHTD, fwd.lse_BHT, fwd.mask_add, fwd.attn_mask)
        ctx.scale, ctx.is_causal, ctx.layer, ctx.block_q = fwd.scale, fwd.is_causal, fwd.layer, fwd.block_q
        return fwd.out_BHTD

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        q, k, v, out, lse, mask_add, attn_mask = ctx.saved_tensors
        d, d_v = q.shape[-1], v.shape[-1]
        if d == d_v:
            return (*_verified_backward(ctx, grad_out, q, k, v, out, lse, mask_add, attn_mask), None)
        # V's head dim differs from Q's and K's (multi-head latent attention: DeepSeek-V2/V3). Every backward below
        # takes one head dim (the CPU kernel's, the encoded and checked products', the Triton kernels'), so the
        # narrower side is padded with zeros: a zero column adds exactly 0 to QKᵀ, to AP·V and to dO·Vᵀ, and its
        # gradient columns, cut off here, are the only ones it changes. lse and the scale do not depend on it.
        width = max(d, d_v)
        grad_out, q, k, v, out = (pad_head_dim(x, width) for x in (grad_out, q, k, v, out))
        dq, dk, dv = _verified_backward(ctx, grad_out, q, k, v, out, lse, mask_add, attn_mask)
        return dq[..., :d], dk[..., :d], dv[..., :d_v], None


def pad_head_dim(x_BHTD: torch.Tensor, width: int) -> torch.Tensor:
    """x with zero columns appended up to head dim ``width`` (x itself where it is that wide)."""
    return x_BHTD if x_BHTD.shape[-1] == width else F.pad(x_BHTD, (0, width - x_BHTD.shape[-1]))


def _verified_backward(ctx: Any, grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, mask_add: torch.Tensor | None,
                       attn_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """_VerifiedAttention's backward, q, k, v, out and grad_out of one head dim."""
    layer: LayerContext | None = ctx.layer
    if q.device.type != "cpu" or not cpu_kernel:
        return _off_cpu_backward(layer, grad_out, q, k, v, out, lse, attn_mask, mask_add, scale=ctx.scale,
                                 is_causal=ctx.is_causal, block_q=ctx.block_q)
    # A fault planned in this backward's products (attnchecker.inject) needs them made where it can reach them:
    # the checked products, checked or (off the full check) not; the fused kernel keeps them to itself.
    hit = planned(layer)
    if layer is not None:
        from ...gemm.schedule import whole_step_due
        from .checked import checked_backward
        from .encoded import encoded_backward, supports

        if whole_step_due(layer.runtime):
            if supports(q) and not hit:
                dq, dk, dv = encoded_backward(layer, grad_out, q, k, v, out, lse, mask_add, scale=ctx.scale,
                                              is_causal=ctx.is_causal, block_q=ctx.block_q)
            else:
                dq, dk, dv, _ = checked_backward(layer, grad_out, q, k, v, out, lse, mask_add, scale=ctx.scale,
                                                 is_causal=ctx.is_causal, block_q=ctx.block_q)
            return dq, dk, dv
    if hit:
        from .checked import checked_backward

        assert layer is not None
        dq, dk, dv, _ = checked_backward(layer, grad_out, q, k, v, out, lse, mask_add, scale=ctx.scale,
                                         is_causal=ctx.is_causal, block_q=ctx.block_q, check=False)
    else:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out.contiguous(), q, k, v, out, lse, 0.0, ctx.is_causal, attn_mask=mask_add, scale=ctx.scale)
    if layer is not None:
        from ...gemm.schedule import whole_step_trips

        if whole_step_trips(layer.runtime):
            dq, dk, dv = _tripwire_backward(layer, (dq, dk, dv), grad_out, q, k, v, out, lse, mask_add,
                                            scale=ctx.scale, is_causal=ctx.is_causal, block_q=ctx.block_q)
    return dq, dk, dv


def _off_cpu_backward(
    layer: LayerContext | None,
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    attn_mask: torch.Tensor | None,
    mask_add: torch.Tensor | None,
    *,
    scale: float,
    is_causal: bool,
    block_q: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward where the fused CPU kernel does not run. Under protect(scope="all"), on a step whose whole-step
    checks are due: the Triton kernels' full check (no sync; ATTNCHECKER_ATTENTION_BACKWARD), else the checked
    products; on a tier-1 step: SDPA's gradient with the tripwire on dQ, dK, dV, in the Triton kernels' tier-1 pass
    (``sdpa_tier1_on_device``: no sync) or on the host (``_tripwire_backward``). Otherwise SDPA's
    gradient, recomputed at the verified q, k, v (no T×S kept from the forward)."""
    from . import triton_backward

    mode = "off" if layer is None else triton_backward.check_mode(layer.runtime)
    # A fault planned in this backward's products (attnchecker.inject): made where it can reach them, our kernels or
    # the checked products (checked or not, as this step checks them), not SDPA's.
    hit = triton_backward.planned(layer)
    if mode != "off" or hit:
        assert layer is not None
        reasons = triton_backward.not_supported_reasons(q, k, v, attn_mask)
        if not reasons and mode == "tripwire" and not hit:
            return sdpa_tier1_on_device(layer, grad_out, q, k, v, out, lse, attn_mask, scale=scale,
                                        is_causal=is_causal)
        if not reasons:
            # The PyTorch tile loop's forward rounds its half-precision scores to their dtype.
            half = q.dtype in (torch.float16, torch.bfloat16)
            try:
                return triton_backward.backward(q, k, v, out, lse, grad_out, scale=scale, is_causal=is_causal,
                                                attn_mask=attn_mask, check=mode, ctx=layer,
                                                scores_dtype=q.dtype if half else None)
            except triton_backward.KernelFailed as exc:
                reasons = [str(exc)]  # logged: the checked PyTorch products below
        if triton_backward.requested() == "triton" and reasons[0] not in _warned:
            _warned.add(reasons[0])
            log.warning("attnchecker: %s=triton cannot take this attention backward (%s); it runs the checked "
                        "PyTorch products", triton_backward.BACKWARD_ENV, "; ".join(reasons))
        if mask_add is None:
            mask_add = _additive_mask(attn_mask, q.dtype)
        if mode == "abft" or hit:
            from .checked import checked_backward

            dq, dk, dv, _ = checked_backward(layer, grad_out, q, k, v, out, lse, mask_add, scale=scale,
                                             is_causal=is_causal, block_q=block_q, check=mode == "abft")
            if mode != "tripwire":
                return dq, dk, dv
            grads = dq, dk, dv
    if not hit:
        grads = _sdpa_backward(grad_out, q, k, v, attn_mask, scale=scale, is_causal=is_causal)
    if mode == "tripwire":
        assert layer is not None
        grads = _tripwire_backward(layer, grads, grad_out, q, k, v, out, lse, mask_add, scale=scale,
                                   is_causal=is_causal, block_q=block_q)
    return grads


_warned: set[str] = set()


def sdpa_tier1_on_device(
    layer: LayerContext,
    grad_out: torch.Tensor,
    q_BHTD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    out_BHTD: torch.Tensor,
    lse_BHT: torch.Tensor,
    attn_mask: torch.Tensor | None,
    *,
    scale: float,
    is_causal: bool,
    vendor_backward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                              tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tier 1 of the attention backward where the Triton kernels run (no dropout: SDPA's own mask is not the
    forward's): SDPA's gradient, the vendor's kernels an unprotected step runs, then one Triton pass that reads dQ,
    dK and dV for INF, NaN and |x| > NEAR_INF block by block, and the kernels' repair launches, which recompute only
    a flagged block (attention.backward.triton_backward, ``given``). No sync: what trips is reported at the step
    boundary. k, v (B, HK, S, D); dk, dv summed over each KV head's query heads. Tier 1 has no checksums to fold into
    the products, so it need not run them in its own kernels, which are slower than the vendor's.
    vendor_backward: where the vendor's forward made out and lse (attention/vendor.py), its backward at them, which
    needs no forward again; else SDPA differentiates its recompute."""
    from . import triton_backward

    heads, kv_heads = q_BHTD.shape[1], k_BHSD.shape[1]
    if vendor_backward is not None:
        dq, dk, dv = vendor_backward(grad_out, q_BHTD, k_BHSD, v_BHSD)
    else:
        dq, dk, dv = _sdpa_backward(grad_out, q_BHTD, _expand_heads(k_BHSD, heads), _expand_heads(v_BHSD, heads),
                                    attn_mask, scale=scale, is_causal=is_causal)
    return triton_backward.backward(q_BHTD, k_BHSD, v_BHSD, out_BHTD, lse_BHT, grad_out, scale=scale,
                                    is_causal=is_causal, attn_mask=attn_mask, check="tripwire", ctx=layer,
                                    given=(dq, sum_groups(dk, kv_heads), sum_groups(dv, kv_heads)))


def _sdpa_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   attn_mask: torch.Tensor | None, *, scale: float, is_causal: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradient of fused SDPA at the verified q, k, v (unchecked), by recomputing it: the same function the
    forward verified, at the same inputs."""
    if is_causal and attn_mask is not None:
        attn_mask, is_causal = _causal_into_mask(attn_mask, q.shape[-2], k.shape[-2]), False
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    with torch.enable_grad():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad_out)
    return dq, dk, dv


def _causal_into_mask(attn_mask: torch.Tensor, t: int, s: int) -> torch.Tensor:
    """SDPA takes is_causal or attn_mask, not both: one mask with the future (top-left aligned) masked too. T×S, but
    only in backward off CPU, and only for this rare combination."""
    future_TS = torch.ones(t, s, dtype=torch.bool, device=attn_mask.device).triu(1)
    if attn_mask.dtype == torch.bool:
        return attn_mask & ~future_TS
    return attn_mask.masked_fill(future_TS, -math.inf)


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
    tripped = extreme_each(grads)  # sync: the one per layer's backward on tier 1 (none on CPU)
    _count_trips(layer, GRAD_OPS, time.perf_counter() - t0)
    if not any(tripped):
        return grads
    t0 = time.perf_counter()
    fresh = checked_backward(layer, grad_out, q, k, v, out, lse, mask_add, scale=scale, is_causal=is_causal,
                             tier="tripwire", block_q=block_q, attempt=1)
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


def sum_groups(grad_BHSD: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """dK (dV) of the expanded heads summed back onto the kv_heads (GQA)."""
    b, h, s, d = grad_BHSD.shape
    return grad_BHSD if h == kv_heads else grad_BHSD.view(b, kv_heads, h // kv_heads, s, d).sum(2)


def _expand_heads(x_BHSD: torch.Tensor, heads: int) -> torch.Tensor:
    """GQA: repeat each key/value head for its query-head group (SDPA's enable_gqa). expand + reshape rather than
    repeat_interleave, which syncs on CUDA to size its output."""
    hk = x_BHSD.shape[-3]
    if hk == heads:
        return x_BHSD
    lead, tail = x_BHSD.shape[:-3], x_BHSD.shape[-2:]
    grouped = x_BHSD.unsqueeze(-3).expand(*lead, hk, heads // hk, *tail)
    return grouped.reshape(*lead, heads, *tail)
