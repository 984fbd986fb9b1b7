"""The checks of the native attention forward (kernels/fused_attention.py): its row sums against references from
Q, K, V, bounded as the unfused and tiled paths bound them. Per call, not per tile.

What each op's rows are (Legend of kernels/fused_attention.py; g checksum groups of G keys per scores row):
- scores AS = Q Kᵀ (N, T, S), row i and group h: (Σ_j AS_ij, Σ_j j·AS_ij) over the group's keys against
  q_i · (K_hᵀ [e, w]) (the grouped layout of abft/checksum.py, as the unfused path checks AS); a group the kernel did
  not compute (past a causal block's last key) holds 0 on both sides;
- context CL = P̃ V (N, T, D), unnormalised: row i against P̃_i (V [e, w]), out of the same GEMM, with ‖P̃_i‖₂ <=
  sqrt(Σ_j P̃_ij) (0 <= P̃ <= 1, abft/tiled.py) and K = S (a causal row sums fewer keys: the bound is the longer one's).
One direction, the rows: it detects any single corrupted element (gemm.check.FAST_DIRECTIONS says why that is the
fast path's choice); a flag is recovered by recomputing the call through the tiled path, which checks both.

The kernel verifies its rows itself: ``kernel_rules`` makes what it needs, O(S·D) per matrix (the K group sums its
references multiply, and the per-group terms of the row rule, abft.tolerance.row_terms). ``kernel_checks`` makes the
same checks from the sums and references it returns, in Python (``checks.product._verify`` with the sums given, so no
pass over the scores or the context): the report of a flagged call, and what its tests hold its verdict to.
"""
from __future__ import annotations

import torch

from ...abft import Tolerance, col_norms
from ...abft.checksum import group_sums_cols
from ...abft.tolerance import row_terms
from ...checks.product import Checks, _verify
from ...kernels.fused_attention import KernelOutput, KernelRules

__all__ = ["kernel_checks", "kernel_rules"]


def kernel_rules(q_acc_NTD: torch.Tensor, k_acc_NSD: torch.Tensor, v_acc_NSD: torch.Tensor, vw_NS2: torch.Tensor, *,
                 tol: Tolerance, groups: int) -> KernelRules:
    """What the kernel verifies each row against: the same references and bounds as ``kernel_checks`` (no sync;
    O(T + S·D) per matrix, nothing T×S or T·g-sized)."""
    d = q_acc_NTD.shape[-1]
    s = k_acc_NSD.shape[1]
    kbar_ND2g = group_sums_cols(k_acc_NSD, groups).flatten(-2)
    scores = row_terms(torch.linalg.vector_norm(k_acc_NSD, dim=-1).unflatten(-1, (groups, -1)),
                       torch.linalg.vector_norm(kbar_ND2g, dim=-2).unflatten(-1, (groups, 2)), k=d, tol=tol)
    context = row_terms(col_norms(v_acc_NSD)[:, None, :], torch.linalg.vector_norm(vw_NS2, dim=-2)[:, None, :], k=s,
                        tol=tol)
    return KernelRules(kbar_ND2g=kbar_ND2g.contiguous(), q_norm_NT=torch.linalg.vector_norm(q_acc_NTD, dim=-1),
                       scores=scores, context=context)


def kernel_checks(
    k_acc_NSD: torch.Tensor,
    v_acc_NSD: torch.Tensor,
    vw_NS2: torch.Tensor,
    got: KernelOutput,
    rules: KernelRules,
    *,
    tol: Tolerance,
) -> dict[str, Checks]:
    """{"scores": row checks (N, T·g), "context": row checks (N, T)} of one kernel call made with ``rules`` (no
    sync)."""
    d = rules.kbar_ND2g.shape[1]
    s = k_acc_NSD.shape[1]
    groups = rules.groups
    # Scores: q_i · k̄_h per group as the kernel made them (zero where its block did not compute group h).
    sums = got.scores_sums_NTg3
    ref_norm = torch.linalg.vector_norm(rules.kbar_ND2g, dim=-2)
    scores = _verify(
        # Only C's dtype and device are read when its row sums are given: a scalar stand-in, no T×S tensor.
        k_acc_NSD.new_zeros(()),
        got.scores_refs_NTg2.flatten(-3, -2),
        None,
        rules.q_norm_NT,
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
        k_acc_NSD.new_zeros(()),
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

