"""Operand-rounding moments of the attention GEMMs for the calibrated bound under TF32 (docs/abft.md, "The attention
GEMMs' operand rounding"): the context CL = P·V and the scores AS = Q·Kᵀ.

A TF32 GEMM rounds each operand element once before it multiplies: it computes Σ_k P_tk V_kj (1 + ε^P_tk)(1 + ε^V_kj),
|ε| ≤ u_in. An element is shared: V_kj enters every element of column j of CL (every query that attends to key k),
P_tk every element of row t. The Cauchy-Schwarz operand term of `tolerance.direction_bounds`,
2u_in²/3·‖A_i‖²Σ_j w_j²‖B_j‖², sums its per-element errors as independent across the vector, which a shared element's
are not (an attention sink's value row flagged a clean TF32 column at 2× its threshold), and it charges every key of
V_j, attended or not (with peaked attention over 4096 keys, 64× what P_t weights: the 7B TF32 context threshold sat
at 5.5× the RMS element). P ≥ 0 gives, for any correlation along the keys, Cauchy-Schwarz with the weights P_tk:

    (Σ_k P_tk |x_k|)² ≤ ‖P_t‖₁ · Σ_k P_tk x_k².

Per checksum vector, for weights w ≥ 0 (1 and 1..L), the rounding error of d has mean square ≤ u_in²/3 · (M + R),
with R the operand shared by the vector (one rounding per term of the reference's dot product) and M the other,
independent across the vector's elements:

  row t, features j of group h:    R = ‖P_t‖₁ · (P · (V_h w)²)_t             (P_tk, shared by the row)
                                   M = ‖P_t‖₁ · (P · β_h)_t, β_hk = Σ_{j∈h} w_j² V_kj²
  column j, queries t of group h:  R = Σ_k (wᵀP_h)_k · Σ_k (wᵀP_h)_k V_kj²   (V_kj, shared by the column)
                                   M = Σ_k (Σ_{t∈h} w_t² ‖P_t‖₁ P_tk) · V_kj²

(u_in²/3 is one rounding's mean square; the fully correlated worst case is 3× that, inside the threshold's `sigmas`.)
The truncation mean of a truncating tensor core is the rule's linear u_in·|reference| term.

Cost: the row quantities ride in the skinny product the row references already run over P (4·g_r + 1 more
columns); the column ones are one more weighted pass over P (4·g_c rows) and a (4·g_c × S)·(S × D) product like the
column references'. Nothing with the GEMM's O(T·S·D).

The scores AS = Q·Kᵀ share elements the same way (Q_td by row t's keys, K_jd by column j's queries), and with collinear
queries and keys (a shared direction, as massive activations give) a clean truncated-TF32 product read 1.6× its
Cauchy-Schwarz threshold. Q and K are signed, their features distinct values: the roundings are taken as independent
along the head dim (the random-walk model's operand term for projection rows, docs/abft.md), so

  row t, keys j of group h:        R = Σ_d Q_td² (K_hᵀw)_d²,   M = Σ_d Q_td² Σ_{j∈h} w_j² K_jd²
  column j, queries t of group h:  R = Σ_d K_jd² (Q_hᵀw)_d²,   M = Σ_d K_jd² Σ_{t∈h} w_t² Q_td²

two skinny products of Q∘Q and K∘K (T × D and S × D) with 4·g columns each.
"""
from __future__ import annotations

import torch

from .checksum import times_skinny

__all__ = ["context_moments", "query_weighted_sums", "references_of", "scores_moments", "value_row_terms"]

_SLACK = 1.01
"""The fp32 rounding of the moments' own sums and products (K·u ≈ 2.4e-4 at K = 4096), as the bound's other terms."""


def _sq_weights(n: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(n, 2): the squared checksum weights, 1 and (1..n)²."""
    j = torch.arange(1, n + 1, device=device, dtype=dtype)
    return torch.stack([torch.ones_like(j), j.square()], dim=-1)


def value_row_terms(v_NSD: torch.Tensor, vw_NS2g: torch.Tensor, g_r: int) -> torch.Tensor:
    """(..., S, 4·g_r): [β_hk (2·g_r), (V_h w)_k² (2·g_r)] per key k, each laid out as vw (h·2 + w): what the row
    moments multiply P by. vw: V_h w per key (..., S, 2·g_r)."""
    runs = v_NSD.square().reshape(*v_NSD.shape[:-1], g_r, -1)
    beta_NS2g = (runs @ _sq_weights(runs.shape[-1], v_NSD.device, v_NSD.dtype)).flatten(-2)
    return torch.cat([beta_NS2g, vw_NS2g.square()], dim=-1)


def context_moments(
    p_NTS: torch.Tensor,
    v_NSD: torch.Tensor,
    p_l1_NT: torch.Tensor,
    groups: tuple[int, int],
    *,
    row_terms_NT4g: torch.Tensor | None = None,
    vw_NS2g: torch.Tensor | None = None,
    query_sums_Ng4S: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row (..., T·g_r, 4), column (..., D·g_c, 4)) [M for d1, d2; R for d1, d2] of CL = P·V, laid out as the row and
    column references (v = t·g_r + h and j·g_c + h). P ≥ 0 (probabilities, or the tiled path's unnormalised
    P̃ = exp(z - m) ≤ 1) and V in the accumulation dtype; p_l1: Σ_k P_tk. row_terms: P · value_row_terms(V, vw) when the
    caller made it in the skinny product it already runs over P; else vw (..., S, 2·g_r) to make it here (one more
    pass over P). query_sums: `query_weighted_sums` when the caller made it (its column references are in it), else
    made here. Made in fp32: a square below fp32's smallest normal flushes, which a floor of tiny per summed square
    restores (the variance is float64 from here on, in `tolerance`)."""
    g_r, g_c = groups
    tiny = torch.finfo(torch.float32).tiny
    if row_terms_NT4g is None:
        if vw_NS2g is None:
            raise ValueError("context_moments needs row_terms or vw")
        row_terms_NT4g = times_skinny(p_NTS, value_row_terms(v_NSD, vw_NS2g, g_r))
    # Floors: each flushed square is < tiny, weighted by w² (β) or 1 ((V w)²), then by P_tk over k (Σ = ‖P_t‖₁).
    floor_4g = _floor_weights(v_NSD.shape[-1] // g_r, g_r, p_NTS)
    rows_NT4g = _SLACK * p_l1_NT[..., None] * (row_terms_NT4g + tiny * p_l1_NT[..., None] * floor_4g)
    row_NV4 = _moment_layout(rows_NT4g, g_r)

    wp_Ng4S = query_weighted_sums(p_NTS, p_l1_NT, g_c) if query_sums_Ng4S is None else query_sums_Ng4S
    pw_Ng2S, m_Ng2S = wp_Ng4S[..., :2, :], wp_Ng4S[..., 2:, :]
    mass_Ng2 = pw_Ng2S.sum(-1)  # Σ_k (wᵀP_h)_k = Σ_t w_t ‖P_t‖₁
    v_sq_NSD = v_NSD.square()
    # (..., g, 4, S) @ (..., 1, S, D) -> (..., g, 4, D): [M's Σ_k m_k V_kj², R's Σ_k (wᵀP)_k V_kj²]
    sq_Ng4D = torch.cat([m_Ng2S, pw_Ng2S], dim=-2) @ v_sq_NSD[..., None, :, :]
    m_Ng2D = _SLACK * (sq_Ng4D[..., :2, :] + tiny * m_Ng2S.sum(-1)[..., None])
    r_Ng2D = _SLACK * mass_Ng2[..., None] * (sq_Ng4D[..., 2:, :] + tiny * mass_Ng2[..., None])
    # (..., g, 4, D) -> (..., D, g, 4) -> (..., D·g_c, 4), as the column references
    col_Ng4D = torch.cat([m_Ng2D, r_Ng2D], dim=-2)
    col_NV4 = col_Ng4D.movedim(-1, -3).flatten(-3, -2)
    return row_NV4, col_NV4


def query_weighted_sums(p_NTS: torch.Tensor, p_l1_NT: torch.Tensor, g_c: int) -> torch.Tensor:
    """(..., g_c, 4, S): per query group h, Σ_{t∈h} of P's rows weighted by 1, w_t (wᵀP_h, the column references'
    weight vectors), ‖P_t‖₁ and w_t²‖P_t‖₁ (the column M's): one pass over P for all four. `references_of` lays the
    first two out as checksum.group_sums_cols(P, g_c).flatten(-2)."""
    t, s = p_NTS.shape[-2:]
    length = t // g_c
    w = torch.arange(1, length + 1, device=p_NTS.device, dtype=p_NTS.dtype)
    l1_NgL = p_l1_NT.reshape(*p_l1_NT.shape[:-1], g_c, length)
    weights_NgL4 = torch.stack([torch.ones_like(l1_NgL), w.expand_as(l1_NgL), l1_NgL, w.square() * l1_NgL], dim=-1)
    # (..., g, L, 4)ᵀ @ (..., g, L, S) -> (..., g, 4, S)
    return weights_NgL4.mT @ p_NTS.reshape(*p_NTS.shape[:-2], g_c, length, s)


def references_of(query_sums_Ng4S: torch.Tensor) -> torch.Tensor:
    """(..., S, 2·g_c): wᵀP_h per key, group h and weighting (h·2 + w), from `query_weighted_sums`."""
    return query_sums_Ng4S[..., :2, :].movedim(-1, -3).flatten(-2)


def _sq_weighted_col_runs(x_NRC: torch.Tensor, groups: int) -> torch.Tensor:
    """(..., C, 2·g): Σ_i w_i² x_ic over each run of R/g consecutive rows (w = 1 and 1..L), laid out h·2 + w as
    checksum.group_sums_cols(...).flatten(-2)."""
    runs = x_NRC.reshape(*x_NRC.shape[:-2], groups, -1, x_NRC.shape[-1])  # (..., g, L, C)
    sums = _sq_weights(runs.shape[-2], x_NRC.device, x_NRC.dtype).mT @ runs  # (..., g, 2, C)
    return sums.movedim(-1, -3).flatten(-2)


def scores_moments(
    q_NTD: torch.Tensor,
    k_NSD: torch.Tensor,
    qbar_ND2g: torch.Tensor,
    kbar_ND2g: torch.Tensor,
    groups: tuple[int, int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row (..., T·g_r, 4), column (..., S·g_c, 4)) [M for d1, d2; R for d1, d2] of AS = Q·Kᵀ per unit of u_in²/3,
    laid out as the references. qbar, kbar: the references' weight vectors Q_hᵀw (..., D, 2·g_c) and K_hᵀw
    (..., D, 2·g_r) (checksum.group_sums_cols(...).flatten(-2)). fp32, with the same floor for flushed squares as
    `context_moments`."""
    g_r, g_c = groups
    tiny = torch.finfo(torch.float32).tiny
    q_sq, k_sq = q_NTD.square(), k_NSD.square()
    row_terms = torch.cat([_sq_weighted_col_runs(k_sq, g_r), kbar_ND2g.square()], dim=-1)  # (..., D, 4·g_r)
    col_terms = torch.cat([_sq_weighted_col_runs(q_sq, g_c), qbar_ND2g.square()], dim=-1)  # (..., D, 4·g_c)
    # Floors: a flushed square of Q (K) loses ≤ tiny times its term; a flushed square inside a term ≤ tiny times its
    # weight², against Q_td² (K_jd²).
    rows_NT4g = times_skinny(q_sq, row_terms) + tiny * (row_terms.sum(-2)[..., None, :] + q_sq.sum(-1, keepdim=True)
                                                        * _floor_weights(k_NSD.shape[-2] // g_r, g_r, q_NTD))
    cols_NS4g = times_skinny(k_sq, col_terms) + tiny * (col_terms.sum(-2)[..., None, :] + k_sq.sum(-1, keepdim=True)
                                                        * _floor_weights(q_NTD.shape[-2] // g_c, g_c, k_NSD))
    return _moment_layout(_SLACK * rows_NT4g, g_r), _moment_layout(_SLACK * cols_NS4g, g_c)


def _floor_weights(length: int, g: int, like: torch.Tensor) -> torch.Tensor:
    """(4·g,): Σ w² per M column (L and Σ j²) and 1 per R column, laid out as the moments' terms. Filled on the
    device (a tensor from a host list would be a blocking copy)."""
    w = torch.ones(2, g, 2, device=like.device, dtype=like.dtype)
    w[0, :, 0] = float(length)
    w[0, :, 1] = float(length * (length + 1) * (2 * length + 1) / 6)
    return w.flatten()


def _moment_layout(x_NV4g: torch.Tensor, g: int) -> torch.Tensor:
    """(..., V, [M (g, 2), R (g, 2)]) -> (..., V·g, 4): vector v·g + h with [M1, M2, R1, R2] side by side."""
    return x_NV4g.reshape(*x_NV4g.shape[:-1], 2, g, 2).movedim(-3, -2).flatten(-2).flatten(-3, -2)

