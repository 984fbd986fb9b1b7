"""Checksum encoding and verification for batched products C = A·B (EEC-ABFT, ATTNChecker §2).

Legend: N = leading batch dims (batch, heads: any number, broadcast), R = rows of C, K = reduction length,
C = columns of C; V = vectors of one direction (R for the row direction, C for the column direction).
Row direction: one checksum pair per row of C, reducing over its columns. Column direction: one pair per column,
reducing over rows. Both are stored as (..., V, 2) so the two directions share one code path.
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
    "DirectionCheck",
    "VectorSums",
    "acc_dtype",
    "checksum_weights",
    "checksums_of",
    "col_norms",
    "times_skinny",
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
    """(..., R, 2) = A w over the last dim. A plain sum and a matrix-vector product: CPU BLAS runs A @ (K, 2) (an
    output two columns wide) many times slower than either."""
    if a_NRK.dim() == 2 and not a_NRK.is_contiguous() and a_NRK.mT.is_contiguous():
        # A transposed view (a weight's Wᵀ, dYᵀ): (wᵀ Aᵀ)ᵀ, one wide product on the contiguous layout, where reshape
        # would copy all of it first (4 M elements for an 8192-wide LM head's weight).
        return weighted_cols(a_NRK.mT)
    # As one (M, K) matrix: a column slice of a fused projection is a view with a row stride (no copy); heads split
    # out of a projection cannot be folded so, and reshape copies them once (both reductions on the strided view
    # are several times slower than that copy).
    a_MK = a_NRK.reshape(-1, a_NRK.shape[-1])
    w_K2 = checksum_weights(a_MK.shape[-1], a_MK.device, a_MK.dtype)
    return torch.stack([a_MK.sum(-1), a_MK @ w_K2[:, 1]], dim=-1).view(*a_NRK.shape[:-1], 2)


def weighted_cols(a_NRK: torch.Tensor) -> torch.Tensor:
    """(..., K, 2) = (wᵀ A)ᵀ over the second-to-last dim: a (2, R) @ (R, K) product, fast as it stands."""
    w_R2 = checksum_weights(a_NRK.shape[-2], a_NRK.device, a_NRK.dtype)
    return (w_R2.T @ a_NRK).mT


def times_skinny(a_NRK: torch.Tensor, m_NKc: torch.Tensor) -> torch.Tensor:
    """(..., R, c) = A @ M for a few columns c. For a contiguous A, or a transposed view of one (dYᵀ of a weight
    gradient), computed as (Mᵀ Aᵀ)ᵀ: the transposed form maps to a wide BLAS call (2-3× faster on CPU than A @ M, no
    copy; on a transposed view A @ M ran 20× slower: 12 ms for a (2048, 1024) dYᵀ). A head view (strided, neither
    layout) is faster as A @ M."""
    if a_NRK.is_contiguous() or a_NRK.mT.is_contiguous():
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


def checksums_of(
    c_NRC: torch.Tensor, *, with_abs: bool = False, with_sq: bool = False
) -> tuple[torch.Tensor, torch.Tensor, VectorSums | None]:
    """The checksums of C as computed: (row sums (..., R, 2), column sums (..., C, 2), VectorSums or None) in the
    accumulation dtype. A half-precision C is upcast once (both directions reuse the copy); an fp32 C is read in
    place. with_abs adds (Σ_j |C_ij| (..., R), Σ_i |C_ij| (..., C)) for the tighter half-precision bound.
    with_sq adds (Σ_j C_ij² (..., R), Σ_i C_ij² (..., C)) for the calibrated bound (see vector_sums)."""
    c = c_NRC.to(acc_dtype(c_NRC.dtype))
    return weighted_rows(c), weighted_cols(c), vector_sums(c, with_abs=with_abs, with_sq=with_sq)


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


def vector_sums(c_NRC: torch.Tensor, *, with_abs: bool, with_sq: bool) -> VectorSums | None:
    """Σ|C| and/or ΣC² per row and column, in C's (accumulation) dtype; None when neither is asked for."""
    if not (with_abs or with_sq):
        return None
    abs_sums = sq_sums = None
    if with_abs:
        c_abs = c_NRC.abs()
        abs_sums = (c_abs.sum(-1), c_abs.sum(-2))
    if with_sq:
        sq_sums = _square_sums(c_NRC)
    return VectorSums(abs_sums, sq_sums)


_SQ_ROWS_PER_BLOCK = 32


def _square_sums(c_NRC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ_j C_ij² (..., R), Σ_i C_ij² (..., C)). On CPU a block of rows at a time, both directions from one squared
    block: squaring all of C allocates a copy of it and ran ~3× slower than this (12×1024×1024 fp32, measured).
    One fused pass elsewhere (a loop would be many small kernel launches on a GPU)."""
    if c_NRC.device.type != "cpu" or c_NRC.shape[-2] <= _SQ_ROWS_PER_BLOCK:
        c_sq = c_NRC.square()
        return c_sq.sum(-1), c_sq.sum(-2)
    rows_NR = torch.empty(c_NRC.shape[:-1], dtype=c_NRC.dtype, device=c_NRC.device)
    cols_NC = torch.zeros(c_NRC.shape[:-2] + c_NRC.shape[-1:], dtype=c_NRC.dtype, device=c_NRC.device)
    for i in range(0, c_NRC.shape[-2], _SQ_ROWS_PER_BLOCK):
        blk = c_NRC[..., i : i + _SQ_ROWS_PER_BLOCK, :]
        blk_sq = blk * blk
        torch.sum(blk_sq, -1, out=rows_NR[..., i : i + _SQ_ROWS_PER_BLOCK])
        cols_NC += blk_sq.sum(-2)
    return rows_NR, cols_NC


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
    rule: Bound
    """How the bound was made; re-verification after a correction re-evaluates it on the corrected C."""
    bound2: torch.Tensor | None = None
    """(..., V) the tolerance on |d2| (None: d2 is not checked)."""


def verify_direction(
    ref_NV2: torch.Tensor,
    got_NV2: torch.Tensor,
    rule: Bound,
    abs_sum_NV: torch.Tensor | None = None,
    sq_sum_NV: torch.Tensor | None = None,
) -> DirectionCheck:
    """Flag a vector when its reference is finite and d1 or d2 is non-finite or exceeds its bound.

    Both checksums flag: a pattern balanced for the plain sum (+e, -e in one row) leaves d1 ~ 0 but not d2.
    A non-finite reference means the op's *input* is already corrupt (an upstream fault): not this op's fault, and no
    checksum can repair it, so it is not flagged here (ATTNChecker's "error in INPUTS" case).
    """
    diff_NV2 = ref_NV2 - got_NV2
    d1_NV, d2_NV = diff_NV2[..., 0], diff_NV2[..., 1]
    bound_NV, bound2_NV = rule.pair(abs_sum_NV, sq_sum_NV)
    # `<=` is False for NaN, so NaN residuals flag without a separate isnan pass.
    ok_NV = (d1_NV.abs() <= bound_NV) & (d2_NV.abs() <= bound2_NV)
    bad_NV = torch.isfinite(ref_NV2[..., 0]) & ~ok_NV
    return DirectionCheck(ref=ref_NV2, diff=diff_NV2, bound=bound_NV.expand_as(d1_NV), bad=bad_NV, rule=rule,
                          bound2=bound2_NV.expand_as(d2_NV))
