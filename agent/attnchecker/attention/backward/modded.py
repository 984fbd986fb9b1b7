"""Autograd for a checked attention whose scores a FlexAttention ``score_mod`` / ``block_mask`` or a varlen window
changes (attention/tile_mods.py): the gradient recomputed a block of query rows at a time from q, k, v, the verified
output and row log-sum-exp, as a flash-attention backward does, so it keeps O(block·S) memory as the tiled forward.

Per tile (rows of block i, keys c0..c1), with z = score_mod(scale·Q Kᵀ) masked and P = exp(z - lse):
  dV += Pᵀ dO;  dP = dO Vᵀ;  dZ = P ⊙ (dP - δ + dlse) with δ = rowsum(dO ⊙ O);
  dS = dZ through score_mod (autograd on the tile: its derivative, and the gradient of any tensor it captured that
  requires one, e.g. a learned bias);  dQ += scale·dS K;  dK += scale·dSᵀ Q.
The same function FlexAttention differentiates (on CPU it has no backward at all). The products are not checked: under
the default scope the attention backward is unprotected (DESIGN.md), and under protect(scope="all") this backward is
not yet one of the checked ones (docs/architectures.md says so).

Legend: B batch, H heads (K/V expanded to H), T queries, S keys, D head dim, Tq/Tk one tile's rows/keys.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ...abft.tiled import TilePlan, causal_offset
from ..tile_mods import ScoreMod, TileMods

__all__ = ["ModdedForward", "captured_parameters", "modded_attention"]


@dataclass(slots=True)
class ModdedForward:
    """What the backward needs besides q, k, v: the verified output, the row log-sum-exp (+INF for a row with every key
    masked) and how the scores were formed."""

    out_BHTD: torch.Tensor
    lse_BHT: torch.Tensor
    plan: TilePlan
    mods: TileMods
    scale: float


def captured_parameters(score_mod: ScoreMod | None, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The tensors requiring grad that score_mod reads besides its arguments (a learned bias it closes over), found by
    calling it once on 0-d inputs and walking the autograd graph of what it returns to its leaves. They become inputs
    of the autograd Function, so their gradients reach them as FlexAttention's own backward makes them."""
    if score_mod is None:
        return ()
    zero = torch.zeros((), device=device, dtype=torch.int64)
    with torch.enable_grad():
        z = score_mod(torch.zeros((), device=device), zero, zero, zero, zero)
    if not isinstance(z, torch.Tensor) or z.grad_fn is None:
        return ()
    leaves: dict[int, torch.Tensor] = {}
    seen: set[Any] = set()
    stack: list[Any] = [z.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            leaves[id(variable)] = variable
        stack.extend(nxt for nxt, _ in node.next_functions)
    return tuple(leaves.values())


def modded_attention(q_BHTD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor, fwd: ModdedForward,
                     params: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) with autograd attached: the forward's verified values; the gradients of q, k, v, of the row
    log-sum-exp's consumers and of score_mod's captured tensors (``params``) as _ModdedAttention makes them."""
    out, lse = _ModdedAttention.apply(q_BHTD, k_BHSD, v_BHSD, fwd, *params)
    return out, lse


class _ModdedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fwd: ModdedForward,
                *params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(q, k, v, fwd.out_BHTD, fwd.lse_BHT, *params)
        ctx.fwd = fwd
        # The row log-sum-exp is an output of its own, differentiable (torchtitan's out_transform reads it).
        return fwd.out_BHTD, fwd.lse_BHT.clone()

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor | None, grad_lse: torch.Tensor | None) -> tuple[Any, ...]:
        q, k, v, out, lse, *params = ctx.saved_tensors
        fwd: ModdedForward = ctx.fwd
        dq, dk, dv, dparams = _backward(q, k, v, out, lse, grad_out, grad_lse, fwd, tuple(params))
        return (dq, dk, dv, None, *dparams)


def _backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor | None,
    grad_lse: torch.Tensor | None,
    fwd: ModdedForward,
    params: tuple[torch.Tensor, ...],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor | None]]:
    # Half inputs are differentiated in fp32, as the forward's softmax ran (and FlexAttention's kernels accumulate).
    acc = torch.promote_types(q.dtype, torch.float32)
    q_a, k_a, v_a = q.detach().to(acc), k.detach().to(acc), v.detach().to(acc)
    do_a = torch.zeros_like(out, dtype=acc) if grad_out is None else grad_out.to(acc)
    # δ = rowsum(dO ⊙ O); a gradient reaching lse adds P·dlse to dZ, folded into δ.
    delta_BHT = (do_a * out.to(acc)).sum(-1)
    if grad_lse is not None:
        delta_BHT = delta_BHT - torch.where(torch.isfinite(lse), grad_lse.to(acc), 0.0)
    dq, dk, dv = torch.zeros_like(q_a), torch.zeros_like(k_a), torch.zeros_like(v_a)
    dparams: list[torch.Tensor | None] = [None] * len(params)
    plan, mods, scale = fwd.plan, fwd.mods, fwd.scale
    modded = mods.score_mod is not None
    for i in range(plan.n_q):
        r0, r1 = plan.rows(i)
        q_i, do_i = q_a[..., r0:r1, :], do_a[..., r0:r1, :]
        lse_i, delta_i = lse[..., r0:r1, None].to(acc), delta_BHT[..., r0:r1, None]
        for _, c0, c1 in plan.keys(i):
            k_j, v_j = k_a[..., c0:c1, :], v_a[..., c0:c1, :]
            s_ij = (q_i @ k_j.mT).mul_(scale)
            score_fn = mods.score_fn(r0, c0)
            if modded and score_fn is not None:
                s_ij.requires_grad_()
                with torch.enable_grad():
                    z_ij = score_fn(s_ij)
            else:
                z_ij = s_ij
            z = z_ij.detach().clone()
            masked = mods.blocked(r0, r1, c0, c1, z.device)
            if masked is not None:
                z.masked_fill_(masked, -math.inf)
            offset = causal_offset(r0, c0, c1, is_causal=plan.is_causal)
            if offset is not None:
                z.masked_fill_(torch.ones(r1 - r0, c1 - c0, dtype=torch.bool, device=z.device).triu_(offset + 1),
                               -math.inf)
            # lse is +INF on a row with every key masked: P = 0 there, and so is its gradient.
            p = torch.exp(z - lse_i)
            dv[..., c0:c1, :] += p.mT @ do_i
            dz = p * (do_i @ v_j.mT - delta_i)
            if modded and z_ij.requires_grad:
                wrt = (s_ij, *params)
                grads = torch.autograd.grad(z_ij, wrt, dz, allow_unused=True, retain_graph=bool(params))
                ds = grads[0] if grads[0] is not None else torch.zeros_like(dz)
                for n, g in enumerate(grads[1:]):
                    prev = dparams[n]
                    if g is not None:
                        dparams[n] = g if prev is None else prev + g
            else:
                ds = dz
            dq[..., r0:r1, :] += (ds @ k_j).mul_(scale)
            dk[..., c0:c1, :] += (ds.mT @ q_i).mul_(scale)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dparams
