"""The protected attention call: tier 1 where nothing is due, else one checked backend (``backends/``) picked per
call; and the protected self-attention layer over it (Q/K/V projections, attention, output projection).

Per call: AS = Q·Kᵀ (op "scores") and CL = AP·V (op "context") are verified and repaired in place by the backend that
runs the call (ATTNChecker, DESIGN.md). On a step where neither op is due, the fused kernel the unprotected model runs,
with the tier-1 tripwire (tripwire.py); a trip runs the call again through a checked backend with both ops forced.
The choice of backend, and why the ones ahead of it did not take the call, go to the runtime's call log, which the
coverage map shows.

Legend: B batch, H query heads, Hk key/value heads, T query tokens, S key tokens, D head dim, I input features,
O output features, N a projection's leading dims flattened, 2 a checksum pair (weights ones and 1..n).
Syncs: the backend's (one per call on the CPU backends, to decide whether the slow path runs) and tier 1's.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from ..checks.context import LayerContext
from ..checks.passed import PassedProjection
from ..checks.product import _verify as _verify  # re-exported: tests and bench/coverage.py verify through it
from ..gemm.projection import _ProjectionInput as _ProjectionInput  # re-exported, as _verify
from ..gemm.projection import check_linear, protected_linear
from ..gemm.schedule import whole_step_checked, whole_step_due
from .backends import AttentionBackend, AttentionCall, choose, requested
from .backends.native_cpu import NativeBackend
from .backends.tiled_torch import TiledBackend
from .backends.triton import KernelFailed, TritonBackend
from .backends.unfused import UnfusedBackend
from .backends.unfused import context_checks as context_checks  # re-exported: tests and bench verify through them
from .backends.unfused import scores_checks as scores_checks
from .tripwire import _emit_trip, _Trip, _tripwire_sdpa, cpu_flash_takes

__all__ = [
    "PassedProjection",
    "check_linear",
    "protected_linear",
    "protected_sdpa",
    "protected_self_attention",
]


TRITON = TritonBackend()
BACKEND_ORDER: tuple[AttentionBackend, ...] = (TRITON, NativeBackend(), TiledBackend(), UnfusedBackend())
"""The backends auto tries, fastest first (backends.BACKENDS); the unfused one takes every call."""

unfused_tier1 = True
"""False: tier-1 steps of a dropout attention run SDPA (its math backend on the CPU), its backward unchecked, as before
``_tier1_loses_backward`` (bench/overhead.py's ``all_tier1_sdpa`` prices it side by side)."""


def _tier1_loses_backward(q_BHTD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor, dropout_p: float,
                          attn_mask: torch.Tensor | None, ctx: LayerContext) -> bool:
    """Whether tier 1 on SDPA would leave this call's backward without the step's check, so that the call runs
    through the checked backends instead. Under protect(scope="all") the backward gets tier 1, or its full check on
    the ``out`` op's schedule, on every step. Tier 1 gives it that where it runs the CPU flash kernel itself
    (``tripwire.cpu_flash_takes``: the backward is then ours) or the Triton kernels (tried first); anywhere else it
    would be SDPA's own backward, unseen: attention dropout, a mask that requires grad, a call the Triton kernels
    decline off the CPU (a head dim past theirs, a mask they do not take, a TorchDispatchMode, no Triton). The
    checked backends (the unfused path, or the tile loop) give such a call's forward tier 1 in full and its backward
    the step's check (attention.backward.unfused, or attention.backward.fused), at their cost."""
    return (unfused_tier1 and not cpu_flash_takes(q_BHTD, attn_mask, dropout_p) and torch.is_grad_enabled()
            and any(x.requires_grad for x in (q_BHTD, k_BHSD, v_BHSD)) and whole_step_checked(ctx.runtime))


def _backward_due(q_BHTD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor, ctx: LayerContext) -> bool:
    """Whether this call's backward is checked in full on this step (protect(scope="all"), the ``out`` op's schedule:
    gemm/schedule.py), which the fused kernel's own backward would not be."""
    return (torch.is_grad_enabled() and any(x.requires_grad for x in (q_BHTD, k_BHSD, v_BHSD))
            and whole_step_due(ctx.runtime))


def protected_sdpa(
    q_BHTD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    *,
    ctx: LayerContext,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    enable_gqa: bool = False,
    return_probs: bool = False,
    use_passed: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``F.scaled_dot_product_attention`` with AS = QKᵀ (op "scores") and CL = AP·V (op "context") verified in both
    directions and repaired in place. q: (B, H, T, D), k/v: (B, Hk, S, D) (Hk divides H with enable_gqa).
    attn_mask: bool (True = attend) or additive float, broadcastable to (B, H, T, S).
    use_passed: take q/k/v checksums from ``ctx.passed`` (paper-faithful mode); pass False when q/k were transformed
    after their projection (RoPE). Returns out (B, H, T, Dv), or (out, AP) with return_probs.
    One host-device sync on clean input (after both products: optimistic), more only on the slow path.
    """
    if q_BHTD.dim() != 4:
        raise ValueError(f"protected_sdpa expects (B, H, T, D) tensors, got q of shape {tuple(q_BHTD.shape)}")
    h, d = q_BHTD.shape[1], q_BHTD.shape[3]
    hk = k_BHSD.shape[-3]
    if hk != h and not (enable_gqa and h % hk == 0):
        raise ValueError(f"q has {h} heads and k/v {hk}: pass enable_gqa=True with a divisor head count")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    cfg = ctx.config
    injector = ctx.runtime.injector
    # Only a fault planned for this call's products keeps it off the vendor's kernel: with attnchecker.inject
    # attached, the other layers and steps run as they would without it, so a drill costs what training does.
    injected = injector is not None and any(injector.fires(op=op, layer=ctx.layer, step=ctx.step)
                                            for op in ("scores", "context"))

    def call_with(force: frozenset[str]) -> AttentionCall:
        return AttentionCall(
            q_BHTD=q_BHTD, k_BHSD=k_BHSD, v_BHSD=v_BHSD, ctx=ctx, attn_mask=attn_mask, is_causal=is_causal,
            scale=scale, dropout_p=dropout_p, return_probs=return_probs, paper=not cfg.source_repair and use_passed,
            force=force, injected=injected, requested=requested(), caught=[0])

    if (not (cfg.checks("scores") or cfg.checks("context")) and not injected and not return_probs
            and not (is_causal and attn_mask is not None)):
        # Nothing to verify or inject in this call (an adaptive step that skips both ops, or mode off): the fused
        # kernel, exactly what the unprotected model runs. Passed checksums of this layer are dropped unused.
        for name in ("q", "k", "v"):
            ctx.passed.take(name)
        trips = cfg.trips("scores") or cfg.trips("context")
        # Under protect(scope="all") the backward follows the ``out`` op's schedule, not these ops': a step can check
        # it in full while they are off (the policy's tripwire off) or get tier 1 (after a fault in a Linear GEMM
        # or the backward, ``out``'s period drops and theirs stays). Its products are then ours, not the kernel's.
        if not trips and not _backward_due(q_BHTD, k_BHSD, v_BHSD, ctx):
            return F.scaled_dot_product_attention(q_BHTD, k_BHSD, v_BHSD, attn_mask=attn_mask, dropout_p=dropout_p,
                                                  is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        # Tier 1 reads no passed checksums: paper-faithful mode does not keep it off the kernel.
        tier1 = dataclasses.replace(call_with(frozenset()), paper=False)
        if not TRITON.not_supported_reasons(tier1, tier1=True, trip=trips):
            # Tier 1 in the Triton kernel: a trip is recovered by its repair kernel, on the device, with no sync.
            try:
                return TRITON.tier1(tier1, trip=trips)
            except KernelFailed:
                pass  # logged, and the kernel declines from now on: SDPA's tier 1 below
        if _tier1_loses_backward(q_BHTD, k_BHSD, v_BHSD, dropout_p, attn_mask, ctx):
            # The checked backends' tier 1 (tripped ops verified in full there, under tier "tripwire"), with their
            # references from the operands, as tier 1's.
            return _checked_call(tier1, None, return_probs)
        fused, trip = _tripwire_sdpa(q_BHTD, k_BHSD, v_BHSD, ctx=ctx, attn_mask=attn_mask, is_causal=is_causal,
                                     scale=scale, dropout_p=dropout_p, enable_gqa=enable_gqa, trip=trips)
        if trip is None or cfg.mode != "correct":
            if trip is not None:
                _emit_trip(ctx, trip, action="detected")
            return fused
        # Tier 1 tripped: drop the fused result and run the layer's attention again through the checked path, both
        # ops verified (a transient fault does not repeat; one that does is located and corrected there).
        force = frozenset(("scores", "context"))
    else:
        trip, force = None, frozenset()
    return _checked_call(call_with(force), trip, return_probs)


def _checked_call(call: AttentionCall, trip: _Trip | None, return_probs: bool
                  ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The call through the first checked backend that takes it; trip: what tier 1 saw before (its event, where
    the backend found nothing left to locate)."""
    ctx = call.ctx
    choice = choose(call, BACKEND_ORDER)
    try:
        got = choice.backend.run(call)
    except KernelFailed:
        # The Triton kernel failed before writing anything (logged; it declines from now on): the next backend.
        choice = choose(call, BACKEND_ORDER)
        got = choice.backend.run(call)
    ctx.runtime.calls.ran(ctx.layer, choice.backend.name, choice.declined)
    if trip is not None and not call.caught[0]:
        _emit_trip(ctx, trip, action="recomputed")
    if return_probs:
        assert got.probs_BHTS is not None
        return got.out_BHTD, got.probs_BHTS
    return got.out_BHTD


def protected_self_attention(
    x_BTC: torch.Tensor,
    *,
    ctx: LayerContext,
    num_heads: int,
    w_o: torch.Tensor,
    b_o: torch.Tensor | None = None,
    w_q: torch.Tensor | None = None,
    b_q: torch.Tensor | None = None,
    w_k: torch.Tensor | None = None,
    b_k: torch.Tensor | None = None,
    w_v: torch.Tensor | None = None,
    b_v: torch.Tensor | None = None,
    w_qkv: torch.Tensor | None = None,
    b_qkv: torch.Tensor | None = None,
    num_kv_heads: int | None = None,
    weight_layout: str = "out_in",
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> torch.Tensor:
    """One protected self-attention layer: separate (w_q, w_k, w_v) or fused (w_qkv, GPT-2 c_attn) projections, with
    or without bias; all six ops verified per ctx.config. x: (B, T, C) -> (B, T, C_out)."""
    b, t, _ = x_BTC.shape
    kv_heads = num_kv_heads or num_heads
    if w_qkv is not None:
        out_features = w_qkv.shape[0] if weight_layout == "out_in" else w_qkv.shape[1]
        d = out_features // (num_heads + 2 * kv_heads)
        splits = (("q", num_heads * d), ("k", kv_heads * d), ("v", kv_heads * d))
        qkv = protected_linear(x_BTC, w_qkv, b_qkv, ctx=ctx, splits=splits, weight_layout=weight_layout)
        q, k, v = torch.split(qkv, [size for _, size in splits], dim=-1)
    else:
        if w_q is None or w_k is None or w_v is None:
            raise ValueError("protected_self_attention needs w_qkv or all of w_q, w_k, w_v")
        q = protected_linear(x_BTC, w_q, b_q, ctx=ctx, op="q", weight_layout=weight_layout)
        k = protected_linear(x_BTC, w_k, b_k, ctx=ctx, op="k", weight_layout=weight_layout)
        v = protected_linear(x_BTC, w_v, b_v, ctx=ctx, op="v", weight_layout=weight_layout)
    q_BHTD = q.view(b, t, num_heads, -1).transpose(1, 2)
    k_BHTD = k.view(b, t, kv_heads, -1).transpose(1, 2)
    v_BHTD = v.view(b, t, kv_heads, -1).transpose(1, 2)
    out_BHTD = protected_sdpa(q_BHTD, k_BHTD, v_BHTD, ctx=ctx, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                              dropout_p=dropout_p, enable_gqa=kv_heads != num_heads)
    assert isinstance(out_BHTD, torch.Tensor)
    merged_BTC = out_BHTD.transpose(1, 2).reshape(b, t, -1)
    return protected_linear(merged_BTC, w_o, b_o, ctx=ctx, op="out", weight_layout=weight_layout)
