"""The tile contract of protected attention with O(T) extra memory (flash-style, issue 12). Pure math: tensors in,
tensors out; no modules, no I/O, no host-device sync.

Legend: N leading dims (batch, heads), Tq query rows of one tile, Tk key columns of one tile, D head dim, 2 a
checksum pair (weights ones and 1..n, tile-local).

The contract a backend implements (the PyTorch loop in ``attention/backends/tiled_torch.py`` does; a fused GPU
kernel can do the same per program), for each query block i and each key block j it visits:

1. AS_ij = Q_i K_jᵀ. Its references come from the operands only: rows Q_i (K_jᵀ w) and columns K_j (Q_iᵀ w)
   (:func:`scores_refs`). The checksum identities hold per tile because a tile is itself a matrix product. A tile
   vector of >= 2·GROUP_MIN elements carries one pair per run, as on the unfused path (grouped checksums,
   abft/checksum.py): a tile spanning whole rows checks them exactly as the unfused path does.
2. Online softmax (:func:`fold_scores`): running row max m and row sum l; P̃_ij = exp(scale·AS_ij + mask - m_new)
   (unnormalised, every entry in [0, 1]).
3. CL_ij = P̃_ij V_j, referenced by P̃_ij (V_j w) and (wᵀ P̃_ij) V_j (:func:`context_refs`). ‖P̃_t‖₂ <= sqrt(Σ P̃_t)
   because 0 <= P̃ <= 1, so the round-off bound needs no extra pass over P̃.
4. Fold: O_i <- alpha·O_i + CL_ij (fp32), with alpha = exp(m_old - m_new).
5. After the last key block: out_i = O_i / l, lse_i = m + log l (+INF and 0 for a row with every key masked), which
   is exactly what the fused backward needs.

Per tile the extra memory is O(N·Tq·Tk); per call O(N·T·D) for the output, the log-sum-exp and the O(T) checksums,
independent of T·S. Verification of a tile uses only that tile's operands, so a kernel can check (and, with the
per-tile summaries of :func:`summarize`, report) each tile before folding it.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from .checksum import group_sums_cols, group_sums_rows, times_skinny

__all__ = [
    "GRAM_PASS_RATIO",
    "SUMMARY_FIELDS",
    "TILE_BUDGET",
    "TilePlan",
    "augment_v",
    "causal_offset",
    "context_refs",
    "finish",
    "fold_scores",
    "gram",
    "grams_pay",
    "scores_refs",
    "square_sums",
    "summarize",
    "tile_mask",
    "v_row_checksums",
]

TILE_BUDGET = 1 << 23
"""Elements (B·H·Tq·Tk) of one score tile: 32 MB in fp32. Up to it the keys are not blocked at all (one tile per query
block: exact softmax, no online rescaling); beyond it (long S) they are, so the extra memory stays O(budget + T). The
checked attention backward takes its blocks of query rows within it too (attention.backward.checked)."""

SUMMARY_FIELDS = ("n_bad", "first_bad", "worst_d1", "worst_bound", "worst_index")
"""What :func:`summarize` keeps per matrix and direction of a flagged tile: enough to report a fault after the tile
itself is gone (the slow path recomputes it)."""


@dataclass(frozen=True, slots=True)
class TilePlan:
    """Which tiles of a T × S attention matrix are computed. A causal (top-left aligned, as SDPA's is_causal) tile
    entirely above the diagonal is skipped: every score in it is masked. key_ranges: per query block, the [lo, hi) of
    keys any of its rows may attend (a block-sparse mask: sliding window, packed documents); the keys outside are
    skipped as the causal future is, an empty range skips the block's keys entirely."""

    t: int
    s: int
    block_q: int
    block_k: int
    is_causal: bool
    key_ranges: tuple[tuple[int, int], ...] | None = None

    def __post_init__(self) -> None:
        if self.block_q < 1 or self.block_k < 1:
            raise ValueError(f"tile sizes must be >= 1, got block_q={self.block_q}, block_k={self.block_k}")
        if self.key_ranges is not None and len(self.key_ranges) != self.n_q:
            raise ValueError(f"key_ranges has {len(self.key_ranges)} entries for {self.n_q} query blocks")

    @property
    def n_q(self) -> int:
        return -(-self.t // self.block_q)

    @property
    def n_k(self) -> int:
        return -(-self.s // self.block_k)

    def rows(self, i: int) -> tuple[int, int]:
        return i * self.block_q, min(self.t, (i + 1) * self.block_q)

    def keys(self, i: int) -> Iterator[tuple[int, int, int]]:
        """(j, c0, c1) for the key blocks query block i visits. Causal: a block reaching past the block's last row is
        cut there (its columns beyond are all masked), so a key block as wide as S costs what the causal prefix does.
        key_ranges: a block is cut to the query block's range the same way, at both ends."""
        _, r1 = self.rows(i)
        lo, hi = (0, self.s) if self.key_ranges is None else self.key_ranges[i]
        if self.is_causal:
            hi = min(hi, r1)
        for j in range(self.n_k):
            c0, c1 = max(j * self.block_k, lo), min(self.s, (j + 1) * self.block_k, hi)
            if c0 >= hi:
                break
            if c0 < c1:
                yield j, c0, c1


def tile_mask(
    attn_mask_NTS: torch.Tensor | None, r0: int, r1: int, c0: int, c1: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(blocked, additive) of an explicit mask for one tile: a bool (..., Tq, Tk) True where a bool mask says False, or
    an additive float mask slice, either None. attn_mask_NTS is already broadcast to (B, H, T, S) (a view: slicing
    it costs nothing). The causal part is not here: fold_scores masks it in place (causal_offset)."""
    if attn_mask_NTS is None:
        return None, None
    part = attn_mask_NTS[..., r0:r1, c0:c1]
    return (~part, None) if part.dtype == torch.bool else (None, part)


def causal_offset(r0: int, c0: int, c1: int, *, is_causal: bool) -> int | None:
    """r0 - c0 when the causal diagonal crosses tile (r0.., c0..c1) (some key past some row), else None."""
    return r0 - c0 if is_causal and c1 - 1 > r0 else None


def scores_weights(
    q_acc_NTqD: torch.Tensor, k_acc_NTkD: torch.Tensor, groups: tuple[int, int] = (1, 1)
) -> tuple[torch.Tensor, torch.Tensor]:
    """(K_hᵀw (..., D, 2·g_r), Q_hᵀw (..., D, 2·g_c)): the vectors the scores' row and column references dot Q and K
    with, per group and weighting (h·2 + w)."""
    return (group_sums_cols(k_acc_NTkD, groups[0]).flatten(-2), group_sums_cols(q_acc_NTqD, groups[1]).flatten(-2))


def scores_refs(
    q_acc_NTqD: torch.Tensor,
    k_acc_NTkD: torch.Tensor,
    groups: tuple[int, int] = (1, 1),
    weights: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """(row references (..., Tq·g_r, 2), column references (..., Tk·g_c, 2), ref norms) of AS_ij = Q_i K_jᵀ, in the acc
    dtype. groups (g_r, g_c): checksum groups per row (runs of keys) and per column (runs of queries), the grouped
    layout of abft/checksum.py; ref norms: (‖K_hᵀ w‖ (..., g_r, 2), ‖Q_hᵀ w‖ (..., g_c, 2)) per group ((..., 2) each
    ungrouped), what the calibrated bound dots the references with (checks.product._verify's ref_norms), as the unfused
    path passes. weights: `scores_weights` when the caller made them (made here otherwise)."""
    kbar_ND2g, qbar_ND2g = scores_weights(q_acc_NTqD, k_acc_NTkD, groups) if weights is None else weights
    rows = times_skinny(q_acc_NTqD, kbar_ND2g)  # (..., Tq, g_r·2): already vector i·g_r + h's pair
    cols = times_skinny(k_acc_NTkD, qbar_ND2g)
    return _pairs(rows), _pairs(cols), _ref_norms(kbar_ND2g, qbar_ND2g, groups)


def _pairs(refs_NV2g: torch.Tensor) -> torch.Tensor:
    """(..., V, 2·g) -> (..., V·g, 2): vector v·g + h holds group h's pair (the grouped layout)."""
    return refs_NV2g.reshape(*refs_NV2g.shape[:-2], -1, 2)


def _ref_norms(
    row_w_NK2g: torch.Tensor, col_w_NK2g: torch.Tensor, groups: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """‖·‖ over K of the row and column references' weight vectors: (..., g, 2) per group, or (..., 2) ungrouped (the
    shapes checks.product._verify takes)."""
    row, col = torch.linalg.vector_norm(row_w_NK2g, dim=-2), torch.linalg.vector_norm(col_w_NK2g, dim=-2)
    if groups == (1, 1):
        return row, col
    return row.view(*row.shape[:-1], groups[0], 2), col.view(*col.shape[:-1], groups[1], 2)


GRAM_PASS_RATIO = 16
"""GEMM multiply-adds that cost about what one element of a squaring pass over a tile costs (CPU, 1 thread, fp32:
~50 GFLOP/s in the Grams' quadratic forms against ~0.6 ns per element of the blocked pass, measured on (8, 256, 4096)
tiles with D = 128). Sets where ΣAS² from Grams pays (:func:`grams_pay`)."""


def grams_pay(tq: int, tk: int, d: int, groups: tuple[int, int]) -> bool:
    """Whether ΣAS² of a Tq × Tk scores tile is cheaper from D × D Grams ((Tq·g_r + Tk·g_c)·D² multiply-adds in the
    quadratic forms) than from a squaring pass over the tile. Small head dims (GPT-2 class, D <= 32) with long tiles:
    Grams; D = 128 (7B class) or grouped rows (one quadratic form per group): the pass, as the unfused path does."""
    g_r, g_c = groups
    return (tq * g_r + tk * g_c) * d * d <= GRAM_PASS_RATIO * tq * tk


def gram(x_acc_NTD: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """(..., g, D, D): X_hᵀ X_h per run h of T/g consecutive rows."""
    x_NgLD = x_acc_NTD.reshape(*x_acc_NTD.shape[:-2], groups, -1, x_acc_NTD.shape[-1])
    return x_NgLD.mT @ x_NgLD


def square_sums(
    q_acc_NTqD: torch.Tensor,
    k_acc_NTkD: torch.Tensor,
    gram_k_NgDD: torch.Tensor | None = None,
    gram_q_NgDD: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ_j AS_ij² (..., Tq·g_r), Σ_i AS_ij² (..., Tk·g_c)) of AS = Q Kᵀ from the operands, per checksum group (the
    grouped layout of abft/checksum.py): Σ_{j in run h} (q_i·k_j)² = q_iᵀ (K_hᵀK_h) q_i, and by columns
    k_jᵀ (Q_hᵀQ_h) k_j. O((Tq·g_r + Tk·g_c)·D²) GEMM work instead of a squaring pass over the Tq × Tk tile (the
    calibrated bound's ΣC², docs/abft.md; :func:`grams_pay` says when that is cheaper). The clean values: a fault in
    the tile cannot loosen its own bound. gram_*: (..., g, D, D) per group (:func:`gram`), made once by the caller
    and shared by the tiles that use them (None: one group, made here)."""
    gram_k = gram(k_acc_NTkD) if gram_k_NgDD is None else gram_k_NgDD
    gram_q = gram(q_acc_NTqD) if gram_q_NgDD is None else gram_q_NgDD
    return _quadratic_forms(q_acc_NTqD, gram_k), _quadratic_forms(k_acc_NTkD, gram_q)


def _quadratic_forms(x_NTD: torch.Tensor, gram_NgDD: torch.Tensor) -> torch.Tensor:
    """(..., T·g): x_tᵀ G_h x_t, vector t·g + h."""
    if gram_NgDD.shape[-3] == 1:
        return ((x_NTD @ gram_NgDD[..., 0, :, :]) * x_NTD).sum(-1).clamp_min_(0.0)
    x_N1TD = x_NTD[..., None, :, :]
    return ((x_N1TD @ gram_NgDD) * x_N1TD).sum(-1).clamp_min_(0.0).transpose(-2, -1).flatten(-2)


def context_refs(
    p_acc_NTqTk: torch.Tensor,
    v_acc_NTkD: torch.Tensor,
    vw_NTk2: torch.Tensor,
    p_sum_NTq: torch.Tensor,
    row_NTq2: torch.Tensor | None = None,
    groups: tuple[int, int] = (1, 1),
    pw_NTk2g: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """(row refs (..., Tq·g_r, 2), column refs (..., D·g_c, 2), ‖P̃_t‖₂ bound (..., Tq), ref norms) of CL_ij = P̃_ij V_j.
    vw: V_j w per feature group (..., Tk, 2·g_r) (:func:`v_row_checksums`, sliced from one pass over the whole V);
    p_sum: Σ P̃ per row, as the softmax fold computed it. row_NTq2: P̃ (V_j w) (..., Tq, 2·g_r) when the tile GEMM already
    produced it (V augmented with its checksum columns, :func:`augment_v`), else computed here (one more pass over P̃).
    groups (g_r, g_c): checksum groups per row (runs of features) and per column (runs of queries); ref norms:
    (‖V_j w‖ (..., g_r, 2), ‖wᵀP̃_h‖ (..., g_c, 2)) per group for the calibrated bound, as the unfused path passes.
    pw: wᵀP̃_h per key (..., Tk, 2·g_c) when the caller made it (one more pass over P̃ otherwise)."""
    g_c = groups[1]  # g_r is in vw's layout already
    if row_NTq2 is None:
        row_NTq2 = times_skinny(p_acc_NTqTk, vw_NTk2)
    if pw_NTk2g is None:
        pw_NTk2g = group_sums_cols(p_acc_NTqTk, g_c).flatten(-2)
    # (..., 2·g_c, D) -> (..., D, g_c, 2) -> (..., D·g_c, 2)
    col_N2gD = pw_NTk2g.mT @ v_acc_NTkD
    col_ND2 = col_N2gD.view(*col_N2gD.shape[:-2], g_c, 2, -1).movedim(-1, -3).flatten(-3, -2)
    # 0 <= P̃ <= 1 (rounded P̃ too): Σ P̃² <= Σ P̃. 1.01 covers the rounding of a half-precision P̃ and of the sum.
    p_norm_NTq = p_sum_NTq.to(p_acc_NTqTk.dtype).sqrt() * 1.01
    return _pairs(row_NTq2), col_ND2, p_norm_NTq, _ref_norms(vw_NTk2, pw_NTk2g, groups)


def fold_scores(
    s_NTqTk: torch.Tensor,
    m_NTq: torch.Tensor,
    l_NTq: torch.Tensor,
    *,
    scale: float,
    blocked: torch.Tensor | None,
    additive: torch.Tensor | None,
    causal_offset: int | None = None,
    score_mod: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One online-softmax step: (P̃ (..., Tq, Tk), alpha (..., Tq), new m, new l, Σ P̃ per row). P̃ = exp(z - m_new) with
    z = score_mod(scale·AS) + mask; alpha rescales what was folded so far. m starts at -INF and l at 0, in fp32 (fp64
    for fp64 inputs): the softmax runs in m's dtype, like SDPA's kernels for half inputs. causal_offset: r0 - c0 of a
    tile the causal diagonal crosses (key c masked past row r where c > r + offset). score_mod: an elementwise
    function of this tile's scaled scores (FlexAttention's, bound to the tile's indices), applied before the mask as
    FlexAttention applies it.

    AS is consumed: when it already has m's dtype, P̃ is written over it (every pass over a tile is memory traffic the
    fused kernel does not pay, and a fresh tile-sized tensor costs page faults on CPU)."""
    z = s_NTqTk.mul_(scale) if s_NTqTk.dtype == m_NTq.dtype else s_NTqTk.to(m_NTq.dtype).mul_(scale)
    if score_mod is not None:
        z = score_mod(z).to(m_NTq.dtype)
    if additive is not None:
        z.add_(additive)
    if blocked is not None:
        z.masked_fill_(blocked, -math.inf)
    if causal_offset is not None:
        # Only the columns right of the first row's diagonal hold masked keys: mask that slice, not the whole tile.
        tq, tk = z.shape[-2:]
        lo = max(0, causal_offset + 1)
        if lo < tk:
            future = torch.ones(tq, tk - lo, dtype=torch.bool, device=z.device).triu_(causal_offset + 1 - lo)
            z[..., lo:].masked_fill_(future, -math.inf)
    m_new = torch.maximum(m_NTq, z.amax(-1))
    # A row with every key so far masked has m = -INF; exp(-INF - -INF) is NaN, so shift by 0 there (P̃ = 0).
    m_safe = torch.where(torch.isfinite(m_new), m_new, 0.0)
    p = z.sub_(m_safe[..., None]).exp_()
    p_sum = p.sum(-1)
    alpha = torch.exp(m_NTq - m_safe)
    return p, alpha, m_new, l_NTq * alpha + p_sum, p_sum


def finish(
    o_NTqD: torch.Tensor, m_NTq: torch.Tensor, l_NTq: torch.Tensor, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (..., Tq, D) in out_dtype, row log-sum-exp (..., Tq) fp32). A row with every key masked gets out 0 (SDPA's
    safe softmax) and lse +INF (so that exp(s - lse) = 0 in the backward, as the unfused path)."""
    dead = l_NTq == 0
    out = torch.where(dead[..., None], 0.0, o_NTqD / torch.where(dead, 1.0, l_NTq)[..., None])
    lse = torch.where(dead, math.inf, m_NTq + torch.log(torch.where(dead, 1.0, l_NTq)))
    return out.to(out_dtype), lse


def summarize(bad_NV: torch.Tensor, diff_NV2: torch.Tensor, bound_NV: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """(..., 5) float: SUMMARY_FIELDS of one direction's check of a tile, per matrix. With g checksum groups per vector
    (the grouped layout, V = R·g) counts and indices are of whole rows (columns), so a bad row stays one row, not g.
    worst_*: the flagged vector with the largest |d1|/bound (a non-finite d1 counts as infinitely bad); first_bad and
    worst index -1 if none."""
    d1_NV = diff_NV2[..., 0].float()
    bound_NV = bound_NV.float()
    bad_NR = bad_NV if groups == 1 else bad_NV.view(*bad_NV.shape[:-1], -1, groups).any(-1)
    n_bad = bad_NR.sum(-1)
    any_bad = n_bad > 0
    first = torch.where(any_bad, bad_NR.to(torch.int8).argmax(-1), -1)
    ratio = torch.where(torch.isfinite(d1_NV), d1_NV.abs() / bound_NV.clamp_min(1e-30), math.inf)
    ratio = torch.where(bad_NV, ratio, -1.0)
    worst = ratio.argmax(-1, keepdim=True)
    return torch.stack([
        n_bad.float(),
        first.float(),
        d1_NV.gather(-1, worst)[..., 0],
        bound_NV.gather(-1, worst)[..., 0],
        torch.where(any_bad, worst[..., 0] // groups, -1).float(),
    ], dim=-1)


def v_row_checksums(v_acc_NSD: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """(..., S, 2·g): V w per key and run of D/g features (the grouped layout), computed once per call; each key tile
    slices its rows."""
    return group_sums_rows(v_acc_NSD, groups).flatten(-2)


def augment_v(v_NSD: torch.Tensor, vw_NS2: torch.Tensor) -> torch.Tensor | None:
    """(..., S, D + 2·g) = [V | V w] (w per feature group), so that one tile GEMM P̃_ij [V_j | V_j w] gives CL_ij and
    its row references together (one pass over P̃ instead of two); None when V is narrower than the accumulation dtype
    (a bf16 copy of V w would round the reference)."""
    if vw_NS2.dtype != v_NSD.dtype:
        return None
    return torch.cat([v_NSD, vw_NS2], dim=-1)
