"""FlexAttention calls, checked: ``flex_attention(q, k, v, score_mod, block_mask, scale, enable_gqa)`` with
AS = Q·Kᵀ (op "scores") and CL = P̃·V (op "context") verified per tile and repaired in place, the score_mod and the
BlockMask applied per tile (attention/tile_mods.py) in the PyTorch tile loop (attention/backends/tiled_torch.py),
which visits only the key blocks the mask keeps. Its gradient comes from attention/backward/modded.py, so a protected
flex model trains on CPU, where FlexAttention itself has no backward.

The call goes through the backend contract (attention/backends: an AttentionCall with ``mods``), which the tile loop
takes. When neither op is due on a step, the call runs the caller's own flex_attention (``fused``, compiled or not):
with tier 1 on, its output is tested for INF/NaN/near-INF and, without a score_mod (which may raise any score), its
row log-sum-exp against the bound ‖q‖·‖k‖ sets; a trip reruns the call checked. On CPU with autograd on, every call
takes the checked path (flex_attention cannot differentiate there).

Legend: B batch, H query heads, Hk key/value heads, T queries, S keys, D head dim.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

from ..checks.context import LayerContext
from ..checks.records import _count_trips
from ..tripwire import lse_over_bound, tripped
from .backends import AttentionCall, choose, requested
from .backward.fused import _expand_heads
from .tile_mods import ScoreMod, TileMods, flex_lse
from .tripwire import _emit_trip, _Trip, _which_trip

__all__ = ["Fused", "checked", "checked_call", "fused_tier1", "protected_flex_attention"]

Fused = Callable[[], tuple[torch.Tensor, torch.Tensor]]
"""The caller's own kernel for this call, returning (out, row log-sum-exp in FlexAttention's convention)."""


def protected_flex_attention(
    q_BHTD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    *,
    ctx: LayerContext,
    score_mod: ScoreMod | None = None,
    block_mask: Any = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    fused: Fused | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``flex_attention``'s function, checked. q: (B, H, T, D), k/v: (B, Hk, S, D) (Hk divides H with enable_gqa);
    block_mask: a ``BlockMask`` for (T, S) or None. Returns out (B, H, T, D), and with return_lse the row
    log-sum-exp (B, H, T) fp32 (-INF on a row with every key masked, as flex_attention's). fused: the caller's
    flex_attention for this call (tier-1 steps off CPU training); None: always the checked path.
    One host-device sync per call on clean input, plus one per BlockMask (tile_mods)."""
    if q_BHTD.dim() != 4 or k_BHSD.dim() != 4 or v_BHSD.dim() != 4:
        raise ValueError(f"flex_attention takes (B, H, T, D) tensors; got q {tuple(q_BHTD.shape)}, "
                         f"k {tuple(k_BHSD.shape)}, v {tuple(v_BHSD.shape)}")
    b, h, t, d = q_BHTD.shape
    hk, s = k_BHSD.shape[1], k_BHSD.shape[2]
    if hk != h and not (enable_gqa and h % hk == 0):
        raise ValueError(f"q has {h} heads and k/v {hk}: pass enable_gqa=True with a divisor head count")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    mods = TileMods.of_flex(block_mask, score_mod, batch=b, heads=h, t=t, s=s)
    # Checksums passed from the projections (paper mode) describe q/k before RoPE and sum over every token: the tile
    # loop does not take them, so q/k/v are left unverified there (the coverage map then says so).
    for name in ("q", "k", "v"):
        ctx.passed.take(name)
    out, lse = checked_call(q_BHTD, k_BHSD, v_BHSD, ctx=ctx, mods=mods, scale=scale, is_causal=False, fused=fused,
                            lse_bound=score_mod is None)
    return (out, lse) if return_lse else out


def checked_call(
    q_BHTD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    *,
    ctx: LayerContext,
    mods: TileMods,
    scale: float,
    is_causal: bool,
    fused: Fused | None,
    lse_bound: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse in FlexAttention's convention) of one call: the caller's kernel with tier 1 where nothing is due and it
    can run, else the checked call (ops not due but tripwired are verified there in full, tier "tripwire")."""
    kept, trip = fused_tier1(q_BHTD, k_BHSD, v_BHSD, ctx=ctx, scale=scale, fused=fused, lse_bound=lse_bound)
    if kept is not None:
        return kept
    force = frozenset(("scores", "context")) if trip is not None else frozenset()
    caught = [0]
    out, lse = checked(q_BHTD, k_BHSD, v_BHSD, ctx=ctx, mods=mods, scale=scale, is_causal=is_causal, force=force,
                       caught=caught, return_lse=True)
    if trip is not None and not caught[0]:
        _emit_trip(ctx, trip, action="recomputed")
    assert lse is not None
    return out, flex_lse(lse)


def fused_tier1(
    q_BHTD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    *,
    ctx: LayerContext,
    scale: float,
    fused: Fused | None,
    lse_bound: bool,
) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, _Trip | None]:
    """The caller's kernel where no op is due on this step (nor a fault planned), with tier 1 on its result:
    ((out, lse), None) when that result stands; (None, trip) when tier 1 tripped in correct mode (the call runs
    checked, both ops forced); (None, None) when the call takes the checked path anyway. On CPU with autograd on the
    caller's kernel is never used: FlexAttention has no CPU backward, varlen no CPU kernel."""
    cfg = ctx.config
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q_BHTD, k_BHSD, v_BHSD))
    injector = ctx.runtime.injector
    injected = injector is not None and any(injector.fires(op=op, layer=ctx.layer, step=ctx.step)
                                            for op in ("scores", "context"))
    if (fused is None or cfg.checks("scores") or cfg.checks("context") or injected
            or (grad and q_BHTD.device.type == "cpu")):
        return None, None
    out, lse = fused()
    if not (cfg.trips("scores") or cfg.trips("context")):
        return (out, lse), None
    trip = _tripwire(q_BHTD, k_BHSD, out, lse, ctx=ctx, scale=scale, lse_bound=lse_bound)
    if trip is None:
        return (out, lse), None
    if cfg.mode != "correct":
        _emit_trip(ctx, trip, action="detected")
        return (out, lse), None
    # Tier 1 tripped: the call again through the checked path, both ops verified (a transient fault does not repeat;
    # one that does is located and corrected there).
    return None, trip


def checked(
    q_BHTD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    *,
    ctx: LayerContext,
    mods: TileMods | None,
    scale: float,
    is_causal: bool,
    force: frozenset[str],
    caught: list[int],
    return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out, lse with +INF on fully masked rows, or None where not asked for) of the call through the backend contract
    (attention/backends): the backend that takes it is chosen and logged as for an SDPA call. mods None (no score_mod,
    mask or window) and no lse asked for: a plain (causal) attention, which any backend may take."""
    from .pipeline import BACKEND_ORDER

    injector = ctx.runtime.injector
    call = AttentionCall(
        q_BHTD=q_BHTD, k_BHSD=k_BHSD, v_BHSD=v_BHSD, ctx=ctx, attn_mask=None, is_causal=is_causal, scale=scale,
        dropout_p=0.0, return_probs=False, paper=False, force=force,
        injected=injector is not None and any(injector.fires(op=op, layer=ctx.layer, step=ctx.step)
                                              for op in ("scores", "context")),
        requested=requested(), caught=caught, mods=mods, return_lse=return_lse)
    choice = choose(call, BACKEND_ORDER)
    ctx.runtime.calls.ran(ctx.layer, choice.backend.name, choice.declined)
    got = choice.backend.run(call)
    return got.out_BHTD, got.lse_BHT


def _tripwire(q_BHTD: torch.Tensor, k_BHSD: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, *,
              ctx: LayerContext, scale: float, lse_bound: bool) -> _Trip | None:
    """Tier 1 on the caller's kernel: what tripped (the output's extreme value, or a row log-sum-exp over its bound),
    or None."""
    t0 = time.perf_counter()
    flags: list[torch.Tensor] = []
    # A row with every key masked has lse -INF in flex's convention: not a fault.
    lse_t = torch.where(torch.isneginf(lse), 0.0, lse) if lse_bound else None
    if lse_t is not None:
        flags.append(lse_over_bound(q_BHTD, _expand_heads(k_BHSD, q_BHTD.shape[1]), lse_t, scale=scale))
    trip: _Trip | None = None
    if tripped(flags, out):  # sync: the one per attention call on a tier-1 step
        trip = _which_trip(out, lse_t, lambda: True)
    _count_trips(ctx, ["scores", "context"], time.perf_counter() - t0)
    return trip
