"""Tier 1 on the fused attention kernel: the output (and on CPU the row log-sum-exp) tested for values near INF, and the
event of a trip that the full check run after it had nothing left to locate."""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..checks.context import LayerContext
from ..checks.records import _count_trips, _deliver
from ..events import Detection, kind_of, value_to_wire
from ..gemm.schedule import whole_step_checked
from ..tripwire import NEAR_INF, extreme, extreme_value, lse_over_bound, tripped
from .backward import fused
from .backward.fused import _additive_mask, _expand_heads, _Forward, _VerifiedAttention, pad_head_dim


@dataclass(frozen=True, slots=True)
class _Trip:
    """What tier 1 saw in a fused attention call: which op, the extreme value and where (batch, head, row[, col])."""

    op: str
    value: float
    index: tuple[int, ...]


def _tripwire_sdpa(
    q_BHTD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    *,
    ctx: LayerContext,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    dropout_p: float,
    enable_gqa: bool,
    trip: bool = True,
) -> tuple[torch.Tensor, _Trip | None]:
    """Tier 1 on the fused kernel: (out, None), or (out, what tripped). On CPU without dropout the kernel is called
    directly for its row log-sum-exp, checked against the q/k norm bound (tripwire.lse_over_bound); elsewhere the
    output alone is checked (INF/NaN in AS reach it; a finite near-INF score that does not is left to tier 2).
    trip False: the fused kernel unchecked, (out, None), with the backward protect(scope="all") gives it."""
    h = q_BHTD.shape[1]
    lse_BHT: torch.Tensor | None = None
    mask_add: torch.Tensor | None = None
    if cpu_flash_takes(q_BHTD, attn_mask, dropout_p):
        k_rep, v_rep = _expand_heads(k_BHSD, h), _expand_heads(v_BHSD, h)
        mask_add = _additive_mask(attn_mask, q_BHTD.dtype)
        d_v, width = v_BHSD.shape[-1], max(q_BHTD.shape[-1], v_BHSD.shape[-1])
        # Under protect(scope="all") the backward gets the step's check too, on the ``out`` op's schedule: tier 1
        # (attention.backward.fused._tripwire_backward) or, where it is due while these ops are not, the full check
        # (the encoded kernel). The kernel runs outside autograd and _VerifiedAttention differentiates it with the
        # same backward kernel and arguments the op's own derivative would use.
        ours = whole_step_checked(ctx.runtime) and torch.is_grad_enabled() and any(
            x.requires_grad for x in (q_BHTD, k_BHSD, v_BHSD))
        # What F.scaled_dot_product_attention runs on CPU for these inputs, with its log-sum-exp kept.
        with torch.no_grad() if ours else contextlib.nullcontext():
            out, lse_BHT = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                *(pad_head_dim(x, width) for x in (q_BHTD, k_rep, v_rep)), 0.0, is_causal, attn_mask=mask_add,
                scale=scale)
            out = out[..., :d_v]
        if ours:
            out = _VerifiedAttention.apply(q_BHTD, k_rep, v_rep, _Forward(
                out_BHTD=out, lse_BHT=lse_BHT, mask_add=mask_add, scale=scale, is_causal=is_causal, layer=ctx))
        t0 = time.perf_counter()  # tier-1 time is the tests, not the attention the unprotected model runs too
        # The mask's largest value joins the bound only after a trip (masks are <= 0 but for ALiBi-style biases):
        # reading it on every call would cost as much as the rest of the tripwire.
        flags = [lse_over_bound(q_BHTD, k_rep, lse_BHT, scale=scale)] if trip else []
    else:
        k_rep = k_BHSD
        out = F.scaled_dot_product_attention(q_BHTD, k_BHSD, v_BHSD, attn_mask=attn_mask, dropout_p=dropout_p,
                                             is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        t0 = time.perf_counter()
        flags = []
    if not trip:
        return out, None
    trip_of: _Trip | None = None
    if tripped(flags, out):  # sync: the one per attention call on a tier-1 step

        def lse_trips() -> bool:
            assert lse_BHT is not None  # called only with a log-sum-exp
            mask_max = 0.0 if mask_add is None else float(mask_add.amax())  # sync: slow path only
            return bool(lse_over_bound(q_BHTD, k_rep, lse_BHT, scale=scale, mask_max=mask_max))  # sync: slow path

        trip_of = _which_trip(out, lse_BHT, lse_trips)
    _count_trips(ctx, ["scores", "context"], time.perf_counter() - t0)
    return out, trip_of


def cpu_flash_takes(q_BHTD: torch.Tensor, attn_mask: torch.Tensor | None, dropout_p: float) -> bool:
    """Whether tier 1 calls the CPU flash kernel itself (``_tripwire_sdpa``), which keeps its row log-sum-exp for
    the tripwire and, under protect(scope="all"), for the backward we check. That kernel has no gradient for the mask
    (a learned bias: a mask that requires grad) nor our dropout; F.sdpa falls back to its math path there. It takes
    one head dim for q, k and v: where V's differs (multi-head latent attention), the narrower side is padded with
    zeros, which change no product, and the output's padding cut off. Its masks are made 4-D (``_additive_mask``).
    ``fused.cpu_kernel`` False: never, as on every other device (tests take the branch a GPU call takes)."""
    return (fused.cpu_kernel and q_BHTD.device.type == "cpu" and dropout_p == 0.0 and q_BHTD.dim() == 4
            and (attn_mask is None or (attn_mask.dim() <= 4 and not attn_mask.requires_grad)))


def _which_trip(out_BHTD: torch.Tensor, lse_BHT: torch.Tensor | None, lse_trips: Callable[[], bool]) -> _Trip | None:
    """Slow path, after a trip: the output's extreme value (op "context": INF/NaN in AS reach it too), else the row
    log-sum-exp's (op "scores", a huge score that never reached memory) when ``lse_trips`` confirms it."""
    if bool(extreme(out_BHTD)):  # sync: slow path only
        value, index = extreme_value(out_BHTD)
        return _Trip("context", value, index[:3])
    if lse_BHT is not None and lse_trips():
        value, index = extreme_value(lse_BHT)
        return _Trip("scores", value, index)
    return None


def _emit_trip(ctx: LayerContext, trip: _Trip, *, action: str) -> None:
    """The event of a tier-1 trip that the full check run after it had nothing left to locate (the fault was in a
    result that was thrown away and computed again)."""
    kind = kind_of(trip.value)
    if trip.op == "scores" and kind == "silent":
        kind = "near_inf"  # a log-sum-exp over its bound: a score near INF, scaled and logged down
    idx = trip.index
    det = Detection(op=trip.op, layer=ctx.layer, step=ctx.step, pattern="0d", kind=kind, action=action,
                    batch=idx[0] if idx else None, head=idx[1] if len(idx) > 1 else None,
                    row=idx[2] if len(idx) > 2 else None, value=value_to_wire(trip.value), residual=None,
                    bound=NEAR_INF, tier="tripwire")
    _deliver(ctx, det)
