"""The gradient of an attention forward with dropout that ran outside autograd (the Triton kernel), recomputed a block
of query rows at a time from q, k, v, the verified output and row log-sum-exp, with the forward's keep mask regenerated
from its seed (kernels/triton_dropout.keep_mask): FlashAttention-2's backward in PyTorch ops.

The Triton backend's fallback where the Triton backward declines a dropout call (ATTNCHECKER_ATTENTION_BACKWARD=torch:
SDPA's and the CPU kernel's backward draw masks of their own). Unchecked, and the mask is made whole (B·H·T·S bytes)
from a seed read back once: a fallback, not a fast path.

Legend: B batch, H query heads, Hk key/value heads, T queries, S keys, D head dim, R a block of query rows.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...abft.given_backward import GradientAccumulation
from ...abft.tiled import TILE_BUDGET
from ...kernels import triton_dropout
from .fused import _expand_heads

__all__ = ["Replay", "replay_backward"]


@dataclass(frozen=True, slots=True)
class Replay:
    """How the forward made its output, besides q, k, v."""

    out_BHTD: torch.Tensor
    lse_BHT: torch.Tensor
    attn_mask: torch.Tensor | None
    is_causal: bool
    scale: float
    dropout_p: float
    seed: torch.Tensor | None
    """(1,) int64 on the device: the keep mask's seed (kernels/triton_dropout.keep)."""
    vendor_backward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                              tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
    """Where the vendor's fused forward made out and lse (attention/vendor.py): its backward at them,
    (grad_out, q, k, v) -> (dq, dk, dv) with k, v and their gradients on the query heads. None: SDPA differentiates
    its recompute."""
    vendor_accumulation: GradientAccumulation | None = None
    """Set where a full check of this backward tests the vendor's gradients (backends/triton._backward_over_vendor):
    how the vendor's backward rounds its sums (abft/given_backward.py). None: our checked backward checks it."""


def replay_backward(
    q_BHTD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    out_BHTD: torch.Tensor,
    lse_BHT: torch.Tensor,
    dout_BHTD: torch.Tensor,
    how: Replay,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of out = dropout(softmax(scale·QKᵀ + mask))·V, in fp32, a block of query rows at a time: P from
    the saved lse (exact: exp(z - lse)), the forward's keep mask (made once, whole), Δ = rowsum(dO ∘ O)
    (FlashAttention-2). One host-device sync with dropout (the seed)."""
    b, h, t, d = q_BHTD.shape
    hk, s = k_BHSD.shape[1], k_BHSD.shape[2]
    f32 = torch.float32
    k_rep, v_rep = (_expand_heads(x, h).to(f32) for x in (k_BHSD, v_BHSD))
    q32, o32, do32 = q_BHTD.to(f32), out_BHTD.to(f32), dout_BHTD.to(f32)
    delta_BHT = (do32 * o32).sum(-1)
    dq = torch.empty_like(q32)
    dk_rep = torch.zeros_like(k_rep)
    dv_rep = torch.zeros_like(v_rep)
    mask = None if how.attn_mask is None else torch.broadcast_to(how.attn_mask, (b, h, t, s))
    rows = max(1, min(t, TILE_BUDGET // max(1, b * h * s)))
    inv_keep = 1.0 / (1.0 - how.dropout_p) if how.dropout_p > 0.0 else 1.0
    keep_all = None
    if how.dropout_p > 0.0:
        assert how.seed is not None
        seed = int(how.seed.item())  # sync: the seed, once, in this fallback only (the Triton backward reads it there)
        keep_all = triton_dropout.keep_mask(seed, (b, h, t, s), how.dropout_p, q_BHTD.device)
    for r0 in range(0, t, rows):
        r1 = min(t, r0 + rows)
        z = q32[:, :, r0:r1] @ k_rep.mT * how.scale
        if how.is_causal:
            future = torch.ones(r1 - r0, s, dtype=torch.bool, device=z.device).triu_(r0 + 1)
            z.masked_fill_(future, -math.inf)
        if mask is not None:
            part = mask[:, :, r0:r1]
            z = z.masked_fill(~part, -math.inf) if part.dtype == torch.bool else z + part.to(f32)
        # exp(z - lse); a row with every key masked has lse = +INF: P = 0 there.
        p = torch.exp(z - lse_BHT[:, :, r0:r1, None].to(f32))
        scaled = None if keep_all is None else keep_all[:, :, r0:r1].to(f32) * inv_keep
        pd = p if scaled is None else p * scaled
        dv_rep += pd.mT @ do32[:, :, r0:r1]
        dp = do32[:, :, r0:r1] @ v_rep.mT
        if scaled is not None:
            dp = dp * scaled
        ds = p * (dp - delta_BHT[:, :, r0:r1, None])
        dq[:, :, r0:r1] = ds @ k_rep * how.scale
        dk_rep += ds.mT @ q32[:, :, r0:r1] * how.scale
    dk, dv = dk_rep, dv_rep
    if hk != h:
        dk = dk.view(b, hk, h // hk, s, d).sum(2)
        dv = dv.view(b, hk, h // hk, s, d).sum(2)
    return dq.to(q_BHTD.dtype), dk.to(k_BHSD.dtype), dv.to(v_BHSD.dtype)
