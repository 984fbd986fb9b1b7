"""Checksums for one plain GEMM C = A·B (+ bias), the building block of whole-step protection (issue 17).

The same algebra as the attention products, for any GEMM whose operands are at hand: the row references are
A (B w) (+ b·w), the column references (wᵀA) B (+ Σw·b), both made by skinny products from the operands, never
from C. Used for nn.Linear / Conv1D forward (Y = X Wᵀ + b) and backward (dX = dY W, dW = dYᵀ X).

Legend: M rows of C, K reduction length, N columns of C, 2 a checksum pair (weights ones and 1..n).
Pure functions: tensors in, tensors out; no host-device sync here.
"""
from __future__ import annotations

import dataclasses

import torch

from .checksum import (
    DirectionCheck,
    acc_dtype,
    checksum_weights,
    checksums_of,
    col_norms,
    times_skinny,
    verify_direction,
    weighted_cols,
    weighted_rows,
)
from .tolerance import Tolerance, bounds

__all__ = ["exact_gemm_elements", "verify_gemm"]


def verify_gemm(
    c_MN: torch.Tensor,
    a_MK: torch.Tensor,
    b_KN: torch.Tensor,
    tol: Tolerance,
    *,
    bias_N: torch.Tensor | None = None,
    operand_roundoff: float | None = None,
) -> dict[str, DirectionCheck]:
    """Both directions of C = A·B (+ bias) against references from A and B, for 2-D operands or batches of them (the
    same leading dims on all three, e.g. (B, H) for attention; bias 2-D only). The checks carry C's leading dims, a
    2-D product getting one of size 1 ((1, M), (1, N)): the layout ``abft.repair`` expects, so a 2-D C is repaired as
    ``repair(c_MN[None], ...)``, a batched one as ``repair(c, ...)``.

    Operands may be strided views (dYᵀ); they are read once each in the accumulation dtype. operand_roundoff: an
    fp32 GEMM that rounded its operands itself (TF32, oneDNN bf16; ``tolerance.bounds``).
    """
    if c_MN.dim() < 2 or c_MN.dim() != a_MK.dim() or c_MN.dim() != b_KN.dim():
        raise ValueError(f"verify_gemm takes 2-D operands (or batches with equal leading dims), got C "
                         f"{tuple(c_MN.shape)}, A {tuple(a_MK.shape)}, B {tuple(b_KN.shape)}")
    m, k = a_MK.shape[-2:]
    if (b_KN.shape[-2] != k or c_MN.shape[-2:] != (m, b_KN.shape[-1])
            or not c_MN.shape[:-2] == a_MK.shape[:-2] == b_KN.shape[:-2]):
        raise ValueError(f"shapes do not form C = A·B: C {tuple(c_MN.shape)}, A {tuple(a_MK.shape)}, "
                         f"B {tuple(b_KN.shape)}")
    if bias_N is not None and c_MN.dim() != 2:
        raise ValueError("verify_gemm: a bias goes with a 2-D product only")
    acc = acc_dtype(c_MN.dtype)
    a, b = a_MK.to(acc), b_KN.to(acc)
    row_ref_M2 = times_skinny(a, weighted_rows(b))
    col_ref_N2 = (weighted_cols(a).mT @ b).mT
    bias_abs_N = None
    if bias_N is not None:
        bias = bias_N.to(acc)
        row_ref_M2 = row_ref_M2 + weighted_rows(bias[None])[0]
        # Σw from the cached weights, on the device: a host-built tensor would be a host-to-device copy.
        col_ref_N2 = col_ref_N2 + bias[:, None] * checksum_weights(m, c_MN.device, acc).sum(0)
        bias_abs_N = bias.abs()
    # Operands in a wider dtype than C (autocast's fp32 master copy): the GEMM ran on them rounded to C's dtype.
    cast_to = c_MN.dtype if (a_MK.dtype != c_MN.dtype or b_KN.dtype != c_MN.dtype) else None
    roundoff = tol.mode == "roundoff"
    use_abs = c_MN.dtype != acc and roundoff
    got_rows_M2, got_cols_N2, sums = checksums_of(c_MN, with_abs=use_abs, with_sq=roundoff and tol.calibrated)
    row_rule, col_rule = bounds(_row_norms(a), _col_norms(b), k=k, out_dtype=c_MN.dtype,
                                tol=tol, bias_abs_C=bias_abs_N, use_abs=use_abs, operands_cast_to=cast_to,
                                operand_roundoff=operand_roundoff if c_MN.dtype == torch.float32 else None)
    row_sums, col_sums = (sums.of("row"), sums.of("col")) if sums is not None else ((None, None), (None, None))
    row = verify_direction(row_ref_M2, got_rows_M2, row_rule, *row_sums)
    col = verify_direction(col_ref_N2, got_cols_N2, col_rule, *col_sums)
    if c_MN.dim() > 2:
        return {"row": _full(row), "col": _full(col)}
    return {"row": _batched(row), "col": _batched(col)}


def _row_norms(a_MK: torch.Tensor) -> torch.Tensor:
    """(..., M) ‖A_m‖₂. A transposed view (dYᵀ, dSᵀ) is reduced as its contiguous transpose's columns: vector_norm
    along a strided dim is ~8× slower than the GEMM it guards (measured: dW of a 8192-wide LM head)."""
    if not a_MK.is_contiguous() and a_MK.mT.is_contiguous():
        return col_norms(a_MK.mT)
    norms: torch.Tensor = torch.linalg.vector_norm(a_MK, dim=-1)
    return norms


def _col_norms(b_KN: torch.Tensor) -> torch.Tensor:
    """(..., N) ‖B_:,n‖₂; a transposed view (Vᵀ, Kᵀ) as its contiguous transpose's rows."""
    if not b_KN.is_contiguous() and b_KN.mT.is_contiguous():
        norms: torch.Tensor = torch.linalg.vector_norm(b_KN.mT, dim=-1)
        return norms
    return col_norms(b_KN)


def _full(chk: DirectionCheck) -> DirectionCheck:
    """The bound rule's base expanded to the check's shape: ``abft.repair`` indexes it per matrix."""
    return DirectionCheck(ref=chk.ref, diff=chk.diff, bound=chk.bound, bad=chk.bad,
                          rule=chk.rule.select(..., chk.bad.shape))


def _batched(chk: DirectionCheck) -> DirectionCheck:
    """A 2-D product's check with a leading batch dim of 1; every field of the bound rule kept (its vector length
    and calibrated part too: the re-verification after a repair re-evaluates it)."""
    rule = chk.rule.select(..., chk.bad.shape)
    offset = rule.offset_NV if isinstance(rule.offset_NV, float) else rule.offset_NV[None]
    rule = dataclasses.replace(rule, base=rule.base[None], offset_NV=offset,
                               var_NV2=None if rule.var_NV2 is None else rule.var_NV2[None])
    return DirectionCheck(ref=chk.ref[None], diff=chk.diff[None], bound=chk.bound[None], bad=chk.bad[None], rule=rule)


def exact_gemm_elements(
    a_MK: torch.Tensor, b_KN: torch.Tensor, rows_P: torch.Tensor, cols_P: torch.Tensor,
    bias_N: torch.Tensor | None = None,
) -> torch.Tensor:
    """(P,) C[rows, cols] of one 2-D product (a batched one: pass A[key], B[key]) recomputed as dot products in the
    accumulation dtype: a located element is replaced by its value, not by checksum arithmetic (which carries the
    whole vector's round-off)."""
    acc = acc_dtype(a_MK.dtype)
    out_P = (a_MK[rows_P].to(acc) * b_KN[:, cols_P].mT.to(acc)).sum(-1)
    return out_P if bias_N is None else out_P + bias_N[cols_P].to(acc)
