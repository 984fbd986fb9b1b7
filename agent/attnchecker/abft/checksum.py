"""Checksum encoding and verification for batched products C = A·B (EEC-ABFT, ATTNChecker §2).

Legend: N = leading batch dims (batch, heads: any number, broadcast), R = rows of C, K = reduction length,
C = columns of C; V = vectors of one direction (R for the row direction, C for the column direction).
Row direction: one checksum pair per row of C, reducing over its columns. Column direction: one pair per column,
reducing over rows. Both are stored as (..., V, 2) so the two directions share one code path.
Grouped checksums (issue 13): a long vector is split into g runs of L = n/g consecutive elements, each with its own
pair, so its clean residual sums L round-offs instead of n (σ shrinks by √g) while one error keeps its size. Vector
v = i·g + h of the row direction is C[i, h·L:(h+1)·L]; of the column direction, C[h·L:(h+1)·L, j] for v = j·g + h.
g = 1 is the plain checksum.
Pure functions: tensors in, tensors out; no host-device sync here.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

# acc_dtype is defined with the bounds (the precision model) and re-exported here; the checksums import from the
# tolerance module, never the other way round.
from .tolerance import Bound, acc_dtype

__all__ = [
    "GROUP_MIN",
    "DirectionCheck",
    "VectorSums",
    "abs_max",
    "acc_dtype",
    "checksum_weights",
    "checksums_of",
    "col_norms",
    "group_count",
    "group_sums_cols",
    "group_sums_rows",
    "spread",
    "square_times",
    "times_skinny",
    "vector_of",
    "vector_sum",
    "vector_sums",
    "verify_direction",
    "weighted_cols",
    "weighted_rows",
]


@functools.lru_cache(maxsize=256)
def checksum_weights(n: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(n, 2): column 0 all ones, column 1 = 1..n. Exact in fp32 up to n = 2^24. Cached: callers must not write it.
    Stored as a contiguous (2, n) (returned transposed), so `w.T` and `w[:, 1]` are contiguous operands."""
    w_2n = torch.empty(2, n, device=device, dtype=dtype)
    w_2n[0] = 1
    torch.arange(1, n + 1, device=device, dtype=dtype, out=w_2n[1])
    return w_2n.T


def weighted_rows(a_NRK: torch.Tensor) -> torch.Tensor:
    """(..., R, 2) = A w over the last dim, one pass over A. On CPU (one thread, measured): A @ w with the weights
    column-major (how checksum_weights stores them) beat a plain sum plus a matrix-vector product (0.35 against
    0.87 ms for attention's (4, 8, 256, 256) scores, 0.40 against 0.54 ms for a (1024, 2048) activation), and works on
    a strided view (a column slice of a fused projection, heads split out of one) without copying it."""
    if not a_NRK.is_contiguous() and a_NRK.mT.is_contiguous():
        # A transposed view (a weight's Wᵀ, dYᵀ, Kᵀ): (wᵀ Aᵀ)ᵀ, one wide product on the contiguous layout, where A @ w
        # would run on the strided one (4× slower for attention's (4, 8, 64, 256) Kᵀ).
        return weighted_cols(a_NRK.mT)
    return a_NRK @ checksum_weights(a_NRK.shape[-1], a_NRK.device, a_NRK.dtype)


def weighted_cols(a_NRK: torch.Tensor) -> torch.Tensor:
    """(..., K, 2) = (wᵀ A)ᵀ over the second-to-last dim: a (2, R) @ (R, K) product, fast as it stands."""
    w_R2 = checksum_weights(a_NRK.shape[-2], a_NRK.device, a_NRK.dtype)
    return (w_R2.T @ a_NRK).mT


GROUP_MIN = 256
"""Shortest group of a grouped checksum. Vectors shorter than 2 × this keep one pair (g = 1): tiny shapes behave
as before. At 256 a 4096-long vector gets 16 groups: its clean σ drops 4×, for 2g/n = 0.8 % more reference work."""


def group_count(n: int) -> int:
    """Groups g for a vector of length n: the most that divide n into runs of at least GROUP_MIN elements."""
    for g in range(n // GROUP_MIN, 1, -1):
        if n % g == 0:
            return g
    return 1


def group_sums_rows(x_NRC: torch.Tensor, groups: int) -> torch.Tensor:
    """(..., R, g, 2): weighted sums (1, 1..L) of each run of L = C/g consecutive elements of each row."""
    if groups == 1:
        return weighted_rows(x_NRC)[..., None, :]
    return weighted_rows(x_NRC.reshape(*x_NRC.shape[:-1], groups, -1))


def group_sums_cols(x_NRC: torch.Tensor, groups: int) -> torch.Tensor:
    """(..., C, g, 2): weighted sums (1, 1..L) of each run of L = R/g consecutive rows of each column."""
    if groups == 1:
        return weighted_cols(x_NRC)[..., None, :]
    return weighted_cols(x_NRC.reshape(*x_NRC.shape[:-2], groups, -1, x_NRC.shape[-1])).transpose(-3, -2)


def vector_of(direction: str, groups: int, n: int, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """The vector index of elements (rows, cols) in one direction's grouped layout (n: that direction's length)."""
    length = n // groups
    if direction == "row":
        return rows * groups + cols // length
    return cols * groups + rows // length


def spread(values_MV: torch.Tensor, direction: str, groups: int, shape_RC: tuple[int, int]) -> torch.Tensor:
    """(..., R, C): each element gets the value of its vector in `direction`."""
    r, c = shape_RC
    lead = values_MV.shape[:-1]
    if direction == "row":
        return values_MV.view(*lead, r, groups, 1).expand(*lead, r, groups, c // groups).reshape(*lead, r, c)
    per_CR = values_MV.view(*lead, c, groups, 1).expand(*lead, c, groups, r // groups).reshape(*lead, c, r)
    return per_CR.transpose(-2, -1)


def vector_sum(values_MRC: torch.Tensor, direction: str, groups: int) -> torch.Tensor:
    """(..., V): the sum of `values` over each vector's elements in `direction` (inverse layout of `spread`)."""
    if direction == "row":
        return values_MRC.reshape(*values_MRC.shape[:-1], groups, -1).sum(-1).flatten(-2)
    # Sum runs of rows in place, then transpose the small (..., g, C) result: transposing C first copies all of it.
    per_gC = values_MRC.reshape(*values_MRC.shape[:-2], groups, -1, values_MRC.shape[-1]).sum(-2)
    return per_gC.transpose(-2, -1).flatten(-2)


_SKINNY_COLUMN_MAJOR = 8
"""Widest M that times_skinny multiplies column-major (at 32 columns it was no faster)."""


def times_skinny(a_NRK: torch.Tensor, m_NKc: torch.Tensor) -> torch.Tensor:
    """(..., R, c) = A @ M for a few columns c. On CPU (one thread, measured): a transposed view of a contiguous
    matrix (dYᵀ of a weight gradient, Pᵀ) as (Mᵀ Aᵀ)ᵀ, a wide BLAS call on the contiguous layout (A @ M on the view
    ran 20-40× slower: 12 ms for a (2048, 1024) dYᵀ); any other A, for c ≤ 8, as A @ M with M column-major, which
    streams A once (2-4× faster than (Mᵀ Aᵀ)ᵀ: 0.37 against 1.45 ms for attention's (4, 8, 256, 256) probabilities,
    0.40 against 1.09 ms for a (1024, 2048) activation); wider M as before."""
    if not a_NRK.is_contiguous() and a_NRK.mT.is_contiguous():
        return (m_NKc.mT @ a_NRK.mT).mT
    if m_NKc.shape[-1] <= _SKINNY_COLUMN_MAJOR:
        return a_NRK @ m_NKc.mT.contiguous().mT
    if a_NRK.is_contiguous():
        return (m_NKc.mT @ a_NRK.mT).mT
    return a_NRK @ m_NKc


# Rows per block of the column reductions on CPU: about 2^18 elements, a block that stays in cache.
_BLOCK_ELEMENTS = 1 << 18


def col_norms(a_NRK: torch.Tensor) -> torch.Tensor:
    """(..., K): ‖A_:,k‖₂ over the rows. Square-sum-root: vector_norm over dim -2 of a strided view is ~10× slower.
    On CPU a block of rows at a time: squaring all of a wide A allocates a copy of it, which cost 34 ms for a
    (1024, 8192) gradient against 4 ms blocked (one thread, measured)."""
    rows = a_NRK.shape[-2]
    # A batch (attention's (B, H, T, S) probabilities) is blocked along its rows too, every matrix at once.
    step = max(1, _BLOCK_ELEMENTS * rows // max(1, a_NRK.numel()))
    if a_NRK.device.type != "cpu" or rows <= step:
        return a_NRK.square().sum(-2).sqrt()
    sq_NK = torch.zeros(a_NRK.shape[:-2] + a_NRK.shape[-1:], dtype=a_NRK.dtype, device=a_NRK.device)
    for i in range(0, rows, step):
        blk = a_NRK[..., i : i + step, :]
        sq_NK += (blk * blk).sum(-2)
    return sq_NK.sqrt()


def square_times(a_NRK: torch.Tensor, m_Kc: torch.Tensor) -> torch.Tensor:
    """(..., R, c) = (A∘A) @ M for a few columns c. On CPU a block of rows at a time, as col_norms: squaring all of a
    (4096, 4096) X allocated a 64 MB copy and cost 56 ms (one thread, measured), more than the product."""
    rows = a_NRK.shape[-2]
    step = max(1, _BLOCK_ELEMENTS * rows // max(1, a_NRK.numel()))
    if a_NRK.device.type != "cpu" or rows <= step:
        return a_NRK.square() @ m_Kc
    out_NRc = torch.empty(*a_NRK.shape[:-1], m_Kc.shape[-1], dtype=a_NRK.dtype, device=a_NRK.device)
    for i in range(0, rows, step):
        blk = a_NRK[..., i : i + step, :]
        out_NRc[..., i : i + step, :] = (blk * blk) @ m_Kc
    return out_NRc


def abs_max(x: torch.Tensor, dim: int) -> torch.Tensor:
    """max |x| along dim (the ∞-norm the calibrated bound's random-walk model takes, tolerance.bounds) as
    max(amax, -amin): two vectorised reductions, without the copy x.abs() would allocate. On CPU (one thread, a
    (4096, 4096) fp32 x, measured): 3.6 ms, against 34 ms for torch.aminmax (one pass, not vectorised) and 31 ms for
    x.abs().amax()."""
    return torch.maximum(x.amax(dim), -x.amin(dim))


def checksums_of(
    c_NRC: torch.Tensor, *, with_abs: bool = False, with_sq: bool = False, groups: tuple[int, int] = (1, 1)
) -> tuple[torch.Tensor, torch.Tensor, VectorSums | None]:
    """The checksums of C as computed: (row sums (..., R, 2), column sums (..., C, 2), VectorSums or None) in the
    accumulation dtype. A half-precision C is upcast once (both directions reuse the copy); an fp32 C is read in
    place. with_abs adds (Σ_j |C_ij| (..., R), Σ_i |C_ij| (..., C)) for the tighter half-precision bound.
    with_sq adds (Σ_j C_ij² (..., R), Σ_i C_ij² (..., C)) for the calibrated bound (see vector_sums).
    groups: (row groups g_r, column groups g_c); then the row sums are (..., R·g_r, 2), the column sums (..., C·g_c, 2)
    and the magnitude sums per group likewise (module docstring)."""
    c = c_NRC.to(acc_dtype(c_NRC.dtype))
    sums = vector_sums(c, with_abs=with_abs, with_sq=with_sq, groups=groups)
    if groups == (1, 1):
        return weighted_rows(c), weighted_cols(c), sums
    return group_sums_rows(c, groups[0]).flatten(-3, -2), group_sums_cols(c, groups[1]).flatten(-3, -2), sums


@dataclass(frozen=True, slots=True)
class VectorSums:
    """Per-vector magnitude sums of C as it stands, per direction: what a Bound re-evaluates on."""

    abs_sum: tuple[torch.Tensor, torch.Tensor] | None
    """(Σ_j |C_ij| (..., R), Σ_i |C_ij| (..., C))"""
    sq_sum: tuple[torch.Tensor, torch.Tensor] | None
    """(Σ_j C_ij² (..., R), Σ_i C_ij² (..., C))"""

    def of(self, direction: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        i = 0 if direction == "row" else 1
        return (None if self.abs_sum is None else self.abs_sum[i], None if self.sq_sum is None else self.sq_sum[i])


def vector_sums(
    c_NRC: torch.Tensor, *, with_abs: bool, with_sq: bool, groups: tuple[int, int] = (1, 1)
) -> VectorSums | None:
    """Σ|C| and/or ΣC² per row and column vector (per group), in C's (accumulation) dtype; None when neither is
    asked for."""
    if not (with_abs or with_sq):
        return None
    abs_sums = sq_sums = None
    if with_abs:
        c_abs = c_NRC.abs()
        if groups == (1, 1):
            abs_sums = (c_abs.sum(-1), c_abs.sum(-2))
        else:
            abs_sums = (vector_sum(c_abs, "row", groups[0]), vector_sum(c_abs, "col", groups[1]))
    if with_sq:
        sq_sums = _square_sums(c_NRC, groups)
    return VectorSums(abs_sums, sq_sums)


_SQ_ROWS_PER_BLOCK = 32


def _square_sums(c_NRC: torch.Tensor, groups: tuple[int, int] = (1, 1)) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ_j C_ij² (..., R·g_r), Σ_i C_ij² (..., C·g_c)), per group. On CPU a block of rows at a time, both directions
    from one squared block: squaring all of C allocates a copy of it and ran ~3× slower than this (12×1024×1024
    fp32, measured). One fused pass elsewhere (a loop would be many small kernel launches on a GPU), and for a C that
    fits in cache (a tiled path's 256 × D context tile: the loop cost ~80 small ops per tile there)."""
    g_r, g_c = groups
    r, c = c_NRC.shape[-2:]
    if c_NRC.device.type != "cpu" or r <= _SQ_ROWS_PER_BLOCK or c_NRC.numel() <= _BLOCK_ELEMENTS:
        c_sq = c_NRC.square()
        return vector_sum(c_sq, "row", g_r), vector_sum(c_sq, "col", g_c)
    rows_NRg = torch.empty((*c_NRC.shape[:-1], g_r), dtype=c_NRC.dtype, device=c_NRC.device)
    cols_NgC = torch.zeros((*c_NRC.shape[:-2], g_c, c), dtype=c_NRC.dtype, device=c_NRC.device)
    per_group = r // g_c
    # Blocks never straddle a row group, so each adds to one group's column sums.
    for h in range(g_c):
        end = (h + 1) * per_group
        for i in range(h * per_group, end, _SQ_ROWS_PER_BLOCK):
            blk = c_NRC[..., i : min(i + _SQ_ROWS_PER_BLOCK, end), :]
            blk_sq = blk * blk
            torch.sum(blk_sq.view(*blk_sq.shape[:-1], g_r, -1), -1, out=rows_NRg[..., i : i + blk.shape[-2], :])
            cols_NgC[..., h, :] += blk_sq.sum(-2)
    return rows_NRg.flatten(-2), cols_NgC.transpose(-2, -1).flatten(-2)


@dataclass(frozen=True, slots=True)
class DirectionCheck:
    """One direction's verification of C, all device tensors. V vectors of one direction, batched over N."""

    ref: torch.Tensor
    """(..., V, 2) the reference checksums (from the inputs, or passed from an earlier op)."""
    diff: torch.Tensor
    """(..., V, 2) ref - checksum of C as computed: (d1, d2)."""
    bound: torch.Tensor
    """(..., V) the tolerance on |d1|."""
    bad: torch.Tensor
    """(..., V) bool: the vector is flagged."""
    rule: Bound | None
    """How the bound was made; re-verification after a correction re-evaluates it on the corrected C. None: a clean
    check's verdict made natively (attnchecker/row_verify.py), which a repair cannot re-evaluate: a flagged product
    is checked again, with rules, before its repair."""
    bound2: torch.Tensor | None = None
    """(..., V) the tolerance on |d2| (None: d2 is not checked)."""
    groups: int = 1
    """Checksum groups per vector of this direction (module docstring: the vector layout)."""
    worst: torch.Tensor | None = None
    """() fp32, where the check's maker computed it: the largest residual/bound ratio of its unflagged vectors (the
    larger of d1's and d2's; NaN if one is NaN), as the margin histogram reads it. None: computed from the fields."""
    flagged: torch.Tensor | None = None
    """() bool, where the check's maker computed it: ``bad.any()``."""


def verify_direction(
    ref_NV2: torch.Tensor,
    got_NV2: torch.Tensor,
    rule: Bound,
    abs_sum_NV: torch.Tensor | None = None,
    sq_sum_NV: torch.Tensor | None = None,
    *,
    groups: int = 1,
) -> DirectionCheck:
    """Flag a vector when its reference is finite and d1 or d2 is non-finite or exceeds its bound.

    Both checksums flag: a pattern balanced for the plain sum (+e, -e in one row) leaves d1 ~ 0 but not d2.
    A non-finite reference means the op's *input* is already corrupt (an upstream fault): not this op's fault, and no
    checksum can repair it, so it is not flagged here (ATTNChecker's "error in INPUTS" case).
    """
    diff_NV2 = ref_NV2 - got_NV2
    d1_NV, d2_NV = diff_NV2[..., 0], diff_NV2[..., 1]
    bound_NV, bound2_NV = rule.pair(abs_sum_NV, sq_sum_NV, ref_NV2)
    # `<=` is False for NaN, so NaN residuals flag without a separate isnan pass.
    ok_NV = (d1_NV.abs() <= bound_NV) & (d2_NV.abs() <= bound2_NV)
    bad_NV = torch.isfinite(ref_NV2[..., 0]) & ~ok_NV
    return DirectionCheck(ref=ref_NV2, diff=diff_NV2, bound=bound_NV.expand_as(d1_NV), bad=bad_NV, rule=rule,
                          bound2=bound2_NV.expand_as(d2_NV), groups=groups)
