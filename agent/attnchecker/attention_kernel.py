"""The checks of the native attention forward (fused_attention.py): its row sums against references from Q, K, V,
bounded as the unfused and tiled paths bound them (``product_check._verify``, with the sums given, so no pass over
the scores or the context runs here). Per call, not per tile: a few dozen small ops whatever T is.

What each op's rows are (Legend of fused_attention.py; g checksum groups of G keys per scores row):
- scores AS = Q Kᵀ (N, T, S), row i and group h: (Σ_j AS_ij, Σ_j j·AS_ij) over the group's keys against
  q_i · (K_hᵀ [e, w]) (the grouped layout of abft/checksum.py, as the unfused path checks AS); a group the kernel did
  not compute (past a causal block's last key) holds 0 on both sides;
- context CL = P̃ V (N, T, D), unnormalised: row i against P̃_i (V [e, w]), out of the same GEMM, with ‖P̃_i‖₂ <=
  sqrt(Σ_j P̃_ij) (0 <= P̃ <= 1, abft/tiled.py) and K = S (a causal row sums fewer keys: the bound is the longer one's).
One direction, the rows: it detects any single corrupted element (gemm_check.FAST_DIRECTIONS says why that is the
fast path's choice); a flag is recovered by recomputing the call through the tiled path, which checks both.
"""
from __future__ import annotations

import torch

from .abft import Tolerance, col_norms
from .abft.checksum import group_sums_cols, times_skinny
from .fused_attention import KernelOutput
from .product_check import Checks, _verify

__all__ = ["computed_groups", "kernel_checks"]


def computed_groups(t: int, s: int, groups: int, block_q: int, *, is_causal: bool) -> torch.Tensor:
    """(T,) int64: how many checksum groups of its scores row each query row's block computed (the kernel's kend)."""
    rows = torch.arange(t)
    if not is_causal:
        return torch.full((t,), groups, dtype=torch.int64)
    block_end = torch.clamp((rows // block_q + 1) * block_q, max=t)
    last = torch.clamp(block_end - 1, max=s - 1)
    return last // (s // groups) + 1


def kernel_checks(
    q_acc_NTD: torch.Tensor,
    k_acc_NSD: torch.Tensor,
    v_acc_NSD: torch.Tensor,
    vw_NS2: torch.Tensor,
    got: KernelOutput,
    *,
    tol: Tolerance,
    groups: int,
    block_q: int,
    is_causal: bool,
) -> dict[str, Checks]:
    """{"scores": row checks (N, T·g), "context": row checks (N, T)} of one kernel call (no sync)."""
    t, d = q_acc_NTD.shape[1:]
    s = k_acc_NSD.shape[1]
    # Scores: q_i · k̄_h per group, zeroed where the block did not compute group h (the kernel wrote 0 there).
    kbar_ND2g = group_sums_cols(k_acc_NSD, groups).flatten(-2)
    ref_NTg2 = times_skinny(q_acc_NTD, kbar_ND2g).unflatten(-1, (groups, 2))
    live_Tg = torch.arange(groups)[None, :] < computed_groups(t, s, groups, block_q, is_causal=is_causal)[:, None]
    ref_NTg2 = torch.where(live_Tg[None, :, :, None], ref_NTg2, 0.0)
    sums = got.scores_sums_NTg3
    ref_norm = torch.linalg.vector_norm(kbar_ND2g, dim=-2)
    scores = _verify(
        # Only C's dtype and device are read when its row sums are given: a scalar stand-in, no T×S tensor.
        q_acc_NTD.new_zeros(()),
        ref_NTg2.flatten(-3, -2),
        None,
        torch.linalg.vector_norm(q_acc_NTD, dim=-1),
        torch.linalg.vector_norm(k_acc_NSD, dim=-1),
        k=d,
        tol=tol,
        ref_norms=(ref_norm if groups == 1 else ref_norm.unflatten(-1, (groups, 2)), None),
        groups=(groups, 1),
        directions=("row",),
        row_sums=(sums[..., :2].flatten(-3, -2), sums[..., 2].flatten(-2)),
    )
    c_sums = got.context_sums_NT5
    context = _verify(
        q_acc_NTD.new_zeros(()),
        c_sums[..., 3:5],
        None,
        got.p_sum_NT.sqrt() * 1.01,
        col_norms(v_acc_NSD),
        k=s,
        tol=tol,
        ref_norms=(torch.linalg.vector_norm(vw_NS2, dim=-2), None),
        directions=("row",),
        row_sums=(c_sums[..., 0:2], c_sums[..., 2]),
    )
    return {"scores": scores, "context": context}

