"""Checksums for one plain GEMM C = A·B (+ bias), the building block of whole-step protection (issue 17).

The same algebra as the attention products, for any GEMM whose operands are at hand: the row references are
A (B w) (+ b·w), the column references (wᵀA) B (+ Σw·b), both made by skinny products from the operands, never
from C. Used for nn.Linear / Conv1D forward (Y = X Wᵀ + b) and backward (dX = dY W, dW = dYᵀ X).

Legend: M rows of C, K reduction length, N columns of C, 2 a checksum pair (weights ones and 1..n).
Pure functions: tensors in, tensors out; no host-device sync here.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

import torch

from .checksum import (
    DirectionCheck,
    acc_dtype,
    checksum_weights,
    checksums_of,
    col_norms,
    group_sums_rows,
    times_skinny,
    verify_direction,
    weighted_cols,
    weighted_rows,
)
from .tolerance import RowRule, Tolerance, direction_bounds, norm_floor, row_rule

__all__ = ["DIRECTIONS", "FusedSums", "OnePass", "OperandSums", "RowVerifier", "exact_gemm_elements", "verify_gemm"]


DIRECTIONS: tuple[str, ...] = ("row", "col")


@dataclasses.dataclass(frozen=True, slots=True)
class FusedSums:
    """What one read of a matrix X (..., R, C) gave (None where not asked for). Row quantities are per run of
    S = C/g consecutive elements, in the grouped vector layout (abft/checksum.py: run h of row i is vector i·g + h;
    g = 1: one per row)."""

    right: torch.Tensor | None = None
    """(..., R·g, nr) each run times right (S, nr)"""
    left: torch.Tensor | None = None
    """(..., C, nl) Xᵀ·left"""
    row_sq: torch.Tensor | None = None
    """(..., R·g) Σ X² over each run"""
    col_sq: torch.Tensor | None = None
    """(..., C) Σ_r X_rk²"""
    right_sq: torch.Tensor | None = None
    """(..., R·g, nr2) each run, squared, times right_sq (S, nr2)"""
    left_sq: torch.Tensor | None = None
    """(..., C, nl2) (X∘X)ᵀ·left_sq"""
    row_max: torch.Tensor | None = None
    """(..., R) max_k |X_rk| (NaN where the row holds one)"""
    col_max: torch.Tensor | None = None
    """(..., C) max_r |X_rk|"""


@dataclasses.dataclass(frozen=True, slots=True)
class OperandSums:
    """The operand side of one direction's check of C = A·B, made by the caller (the whole-step Linear checks read
    each operand once per step for the forward and backward checks together, gemm.check.linear_sums). For the row
    direction: ref A (B w) (..., M, 2) for w = ones and 1..N; for the column direction: ref (wᵀA) B as (..., N, 2).
    Both: ‖A_m‖₂ (..., M) and ‖B_:,n‖₂ (..., N), as the bound takes them. The bias is not in ref (verify_gemm adds
    it)."""

    ref: torch.Tensor
    a_norm: torch.Tensor
    b_norm: torch.Tensor
    ref_norm: torch.Tensor | None = None
    """(..., 2) the norm of the vector ref dotted the operand with (‖B w‖ for the rows, ‖wᵀA‖ for the columns), for
    the bound's reference term; None: the triangle bound Σ_j w_j ‖B_j‖ (√n looser on uncorrelated columns)."""


class RowVerifier(Protocol):
    """A kernel that evaluates a factored row rule on a product's row vectors and returns the check without its rule
    (attnchecker.kernels.row_verify.verify_rows), or None for tensors it does not take."""

    def __call__(self, rule: RowRule, ref_NV2: torch.Tensor, got_NV2: torch.Tensor, sq_NV: torch.Tensor | None,
                 a_norm_NR: torch.Tensor) -> DirectionCheck | None: ...


class OnePass(Protocol):
    """A kernel that computes X·right, Xᵀ·left and X's squared row and column sums (and more: FusedSums) in one read
    of X, or returns None for tensors it does not take (attnchecker.kernels.fused_pass: fp32 on the CPU)."""

    def __call__(self, x: torch.Tensor, *, right: torch.Tensor | None = None, left: torch.Tensor | None = None,
                 row_sq: bool = False, col_sq: bool = False) -> FusedSums | None: ...


def verify_gemm(
    c_MN: torch.Tensor,
    a_MK: torch.Tensor,
    b_KN: torch.Tensor,
    tol: Tolerance,
    *,
    bias_N: torch.Tensor | None = None,
    operand_roundoff: float | None = None,
    directions: tuple[str, ...] = DIRECTIONS,
    wide_norms: bool = False,
    one_pass: OnePass | None = None,
    exact_sums: bool = False,
    operand_sums: OperandSums | None = None,
    row_verifier: RowVerifier | None = None,
    ref_norms: bool = True,
    groups: int = 1,
) -> dict[str, DirectionCheck]:
    """The requested directions of C = A·B (+ bias) against references from A and B, for 2-D operands or batches of
    them (the same leading dims on all three, e.g. (B, H) for attention; bias 2-D only). The checks carry C's leading
    dims, a 2-D product getting one of size 1 ((1, M), (1, N)): the layout ``abft.repair`` expects, so a 2-D C is
    repaired as ``repair(c_MN[None], ...)``, a batched one as ``repair(c, ...)``.

    directions: ("row",) is the fast path (issue 17): one direction detects any single corrupted element (it changes
    its row's sum as much as its column's) and reads C once for the checksums, once for its bound; locating a 1-D or
    2-D pattern needs both, which the slow path computes after a flag (``gemm.check``).

    Operands may be strided views (dYᵀ); they are read once each in the accumulation dtype. operand_roundoff: an
    fp32 GEMM that rounded its operands itself (TF32, oneDNN bf16; ``tolerance.bounds``).
    wide_norms: operand norms (and so the bound) in float64. An fp32 norm overflows once a row's elements reach
    ~1e19 (its square sum passes 3.4e38); the bound is then undefined and falls back to NEAR_INF, which flags
    finite values a diverged bf16 run really computed. A copy of both operands in float64: for the slow path,
    after a flag (``gemm.check``), not for every check.
    one_pass: a kernel that reads each of C, A and B once for the row direction's sums (``OnePass``); where it
    declines (None), the eager reductions below compute the same, reading each matrix about twice.
    exact_sums: references and checksums in float64, the bound still C's dtype's (its terms for the checksums' own
    rounding are then loose, never short). For deciding whether a flagged product with huge finite values is a
    fault: fp32 checksums of values ~1e34 and up overflow (the weights 1..n multiply them), and INF − INF flags a
    product that is correct (diverged bf16 training computes such values). Copies of A, B and C in float64.
    operand_sums: the one direction's operand side already made (``OperandSums``): then only C is read here (through
    ``one_pass`` where it takes C). A and B are still passed, for the shapes (and the slow path's own check). Without
    it, a row check through ``one_pass`` makes the same from one read of B and one of A.
    row_verifier: evaluates the rule of a 2-D fp32 product checked in one direction (``RowVerifier``, with
    ``row_rule``; a column check as the rows of Cᵀ) in place of the eager bound below; its check carries no rule.
    Where it declines, the eager rule.
    ref_norms: the calibrated bound's reference term from the norms of the vectors the references dot with (‖B w‖,
    ‖wᵀA‖: direction_bounds' ``ref_norms``; operand_sums bring theirs) instead of the triangle bound Σ_j w_j ‖B_j‖,
    which is √n looser on uncorrelated columns and made a 7B projection's bound 4x its RMS (bench/gemm_rule_terms.py).
    The GEMM checks' Triton path evaluates the same rule (abft/gemm_rule.py). False: the triangle bound (a what-if).
    groups: g > 1 checks each row as g runs of N/g consecutive columns, each its own checksum pair (weights ones and
    1..N/g; abft/checksum.py's grouped layout: the check's vectors are (..., M·g), run h of row i at i·g + h), each run
    the product of A with a column block of B and bounded as that sub-product. A run's residual sums N/g output
    roundings, not N: the clean bound of a half-precision product, which its output rounding sets, drops √g. Rows
    only, computed here (not with one_pass, operand_sums or row_verifier); the GEMM checks' Triton path groups its
    rows so (gemm/device.py) and is held to this.
    """
    _check_shapes(c_MN, a_MK, b_KN, bias_N)
    if groups != 1:
        return _verify_grouped_rows(c_MN, a_MK, b_KN, tol, groups, bias_N=bias_N, operand_roundoff=operand_roundoff,
                                    directions=directions, ref_norms=ref_norms,
                                    other=(wide_norms, exact_sums, one_pass, operand_sums, row_verifier))
    if not directions or any(d not in DIRECTIONS for d in directions):
        raise ValueError(f"verify_gemm: directions must be a non-empty subset of {DIRECTIONS}, got {directions!r}")
    if operand_sums is not None and (len(directions) != 1 or wide_norms or exact_sums):
        raise ValueError("verify_gemm: operand_sums go with one direction, without wide_norms or exact_sums (the slow "
                         "path makes its own)")
    m, k = a_MK.shape[-2:]
    acc = torch.float64 if exact_sums else acc_dtype(c_MN.dtype)
    a, b = a_MK.to(acc), b_KN.to(acc)
    both = len(set(directions)) == 2
    refs: dict[str, torch.Tensor] = {}
    norms_row: torch.Tensor | None = None
    norms_col: torch.Tensor | None = None
    roundoff = tol.mode == "roundoff"
    use_abs = c_MN.dtype != acc_dtype(c_MN.dtype) and roundoff
    with_sq = roundoff and tol.calibrated
    if (operand_sums is None and one_pass is not None and directions == ("row",) and not wide_norms
            and not use_abs):
        operand_sums = _row_operands_in_one_pass(a, b, one_pass)
    if operand_sums is not None:
        refs[directions[0]] = operand_sums.ref.to(acc)
        if ref_norms and operand_sums.ref_norm is not None:
            norms_row, norms_col = ((operand_sums.ref_norm, None) if directions[0] == "row"
                                    else (None, operand_sums.ref_norm))
    elif "row" in directions:
        bw_K2 = weighted_rows(b)
        refs["row"] = times_skinny(a, bw_K2)
        norms_row = _ref_norm(bw_K2, wide_norms) if ref_norms else None
    if "col" in directions and operand_sums is None:
        wa_K2 = weighted_cols(a)
        refs["col"] = (wa_K2.mT @ b).mT
        norms_col = _ref_norm(wa_K2, wide_norms) if ref_norms else None
    bias_abs_N = None
    if bias_N is not None:
        bias = bias_N.to(acc)
        if "row" in refs:
            refs["row"] = refs["row"] + weighted_rows(bias[None])[0]
        if "col" in refs:
            # Σw from the cached weights, on the device: a host-built tensor would be a host-to-device copy.
            refs["col"] = refs["col"] + bias[:, None] * checksum_weights(m, c_MN.device, acc).sum(0)
        bias_abs_N = bias.abs()
    # Operands in a wider dtype than C (autocast's fp32 master copy): the GEMM ran on them rounded to C's dtype.
    cast_to = c_MN.dtype if (a_MK.dtype != c_MN.dtype or b_KN.dtype != c_MN.dtype) else None
    got: dict[str, torch.Tensor]
    sums: dict[str, tuple[torch.Tensor | None, torch.Tensor | None]]
    if operand_sums is not None:
        got, sums = _c_side(c_MN, directions[0], acc, one_pass, with_abs=use_abs, with_sq=with_sq)
        a_norm_M, b_norm_N = operand_sums.a_norm, operand_sums.b_norm
    elif both:
        got_rows_M2, got_cols_N2, vsums = checksums_of(c_MN.to(acc), with_abs=use_abs, with_sq=with_sq)
        got = {"row": got_rows_M2, "col": got_cols_N2}
        sums = {d: vsums.of(d) if vsums is not None else (None, None) for d in DIRECTIONS}
    else:
        c = c_MN.to(acc)
        got = {"row": weighted_rows(c)} if "row" in directions else {"col": weighted_cols(c)}
        sums = {d: _one_direction_sums(c, d, with_abs=use_abs, with_sq=with_sq) for d in got}
    if operand_sums is None:
        a_norm_M, b_norm_N = _row_norms(a), _col_norms(b)
    if wide_norms:
        a_norm_M, b_norm_N = _widened(a_norm_M, a, k, _row_norms), _widened(b_norm_N, b, k, _col_norms)
    if (row_verifier is not None and len(directions) == 1 and c_MN.dim() == 2 and acc == c_MN.dtype == torch.float32
            and not wide_norms and cast_to is None and operand_roundoff is None
            and (directions[0] == "row" or bias_abs_N is None)):
        # A column of C = A·B is a row of Cᵀ = Bᵀ·Aᵀ: the same rule with the operands' roles swapped (the bias, one
        # b_j per column, is the one term that is not symmetric).
        d = directions[0]
        mine_V, other_n = (a_norm_M, b_norm_N) if d == "row" else (b_norm_N, a_norm_M)
        sq_V = sums[d][1]
        ref_n = norms_row if d == "row" else norms_col
        rule = row_rule(other_n[None], k=k, tol=tol, bias_abs_gn=None if bias_abs_N is None else bias_abs_N[None],
                        ref_norm_g2=None if ref_n is None else ref_n[None])
        native = None if rule is None else row_verifier(rule, refs[d][None], got[d][None],
                                                         None if sq_V is None else sq_V[None], mine_V[None])
        if native is not None:
            return {d: native}
    rules = direction_bounds(tuple(got), a_norm_M, b_norm_N, k=k, out_dtype=c_MN.dtype, tol=tol,
                             bias_abs_C=bias_abs_N, use_abs=use_abs, operands_cast_to=cast_to,
                             operand_roundoff=operand_roundoff if c_MN.dtype == torch.float32 else None,
                             ref_norms=(norms_row, norms_col))
    out = {}
    for d in DIRECTIONS:
        if d in got:
            chk = verify_direction(refs[d], got[d], rules[d], *sums[d])
            out[d] = _full(chk) if c_MN.dim() > 2 else _batched(chk)
    return out


def _verify_grouped_rows(
    c_MN: torch.Tensor, a_MK: torch.Tensor, b_KN: torch.Tensor, tol: Tolerance, groups: int, *,
    bias_N: torch.Tensor | None, operand_roundoff: float | None, directions: tuple[str, ...], ref_norms: bool,
    other: tuple[object, ...],
) -> dict[str, DirectionCheck]:
    """verify_gemm's row check with ``groups`` checksum runs per row (its docstring): references A·(B_h w) per column
    block B_h of B, C's run sums, and the rule of each block's sub-product with the groups a batch dim, laid out as
    grouped vectors (``Bound.grouped``)."""
    n = c_MN.shape[-1]
    if directions != ("row",) or groups < 1 or n % groups:
        raise ValueError(f"verify_gemm: groups={groups} checks rows only (directions=('row',)) in runs that divide "
                         f"the row's {n} columns")
    if any(o not in (None, False) for o in other):
        raise ValueError("verify_gemm: grouped rows are computed eagerly: pass no wide_norms, exact_sums, one_pass, "
                         "operand_sums or row_verifier with groups")
    k = a_MK.shape[-1]
    acc = acc_dtype(c_MN.dtype)
    a, b, c = a_MK.to(acc), b_KN.to(acc), c_MN.to(acc)
    roundoff = tol.mode == "roundoff"
    use_abs = c_MN.dtype != acc and roundoff
    with_sq = roundoff and tol.calibrated
    bw_Kg2 = group_sums_rows(b, groups)
    ref_Mg2 = _runs(times_skinny(a, bw_Kg2.flatten(-2)), groups)
    bias_abs_gL = None
    if bias_N is not None:
        ref_Mg2 = ref_Mg2 + group_sums_rows(bias_N.to(acc)[None], groups)[0]
        bias_abs_gL = _runs(bias_N.to(acc).abs(), groups)
    c_MgL = _runs(c, groups)
    abs_V = c_MgL.abs().sum(-1).flatten(-2) if use_abs else None
    sq_V = torch.linalg.vector_norm(c_MgL, dim=-1).square().flatten(-2) if with_sq else None
    cast_to = c_MN.dtype if (a_MK.dtype != c_MN.dtype or b_KN.dtype != c_MN.dtype) else None
    # Per block: ‖B_h w‖ (..., g, 2) and ‖B_j‖ (..., g, N/g); A's row norms shared by the blocks.
    ref_norm_g2 = _runs(_ref_norm(bw_Kg2.flatten(-2), False), groups) if ref_norms else None
    rule = direction_bounds(("row",), _row_norms(a)[..., None, :], _runs(_col_norms(b), groups), k=k,
                            out_dtype=c_MN.dtype, tol=tol, bias_abs_C=bias_abs_gL, use_abs=use_abs,
                            operands_cast_to=cast_to,
                            operand_roundoff=operand_roundoff if c_MN.dtype == torch.float32 else None,
                            ref_norms=(ref_norm_g2, None))["row"].grouped()
    chk = verify_direction(ref_Mg2.flatten(-3, -2), group_sums_rows(c, groups).flatten(-3, -2), rule, abs_V, sq_V,
                           groups=groups)
    return {"row": _full(chk) if c_MN.dim() > 2 else _batched(chk)}


def _runs(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(..., g, n/g): x's last dim split into g runs."""
    return x.reshape(*x.shape[:-1], groups, x.shape[-1] // groups)


def _row_operands_in_one_pass(a_MK: torch.Tensor, b_KN: torch.Tensor, one_pass: OnePass) -> OperandSums | None:
    """The row direction's operand side (A (B w), ‖A_m‖, ‖B_:,n‖) in one read of B and one of A (``one_pass``), or
    None where the kernel declines either."""
    bw_K2, b_sq_N = _times(one_pass, b_KN, checksum_weights(b_KN.shape[-1], b_KN.device, b_KN.dtype), "col")
    if bw_K2 is None or b_sq_N is None:
        return None
    ref_M2, a_sq_M = _times(one_pass, a_MK, bw_K2, "row")
    if ref_M2 is None or a_sq_M is None:
        return None
    return OperandSums(ref=ref_M2, a_norm=a_sq_M.sqrt(), b_norm=b_sq_N.sqrt(), ref_norm=bw_K2.norm(dim=-2))


def _c_side(
    c_MN: torch.Tensor, direction: str, acc: torch.dtype, one_pass: OnePass | None, *, with_abs: bool, with_sq: bool
) -> tuple[dict[str, torch.Tensor], dict[str, tuple[torch.Tensor | None, torch.Tensor | None]]]:
    """C's side of one direction: its checksums (..., V, 2) and (Σ|C|, ΣC²) per vector, in one read of C through
    ``one_pass`` where it takes C (a column check reads C's transpose by rows), else eagerly."""
    if one_pass is not None and not with_abs and c_MN.dtype == acc:
        x = c_MN if direction == "row" else c_MN.mT
        got, sq = _times(one_pass, x, checksum_weights(x.shape[-1], c_MN.device, acc), "row" if with_sq else None)
        if got is not None and (sq is not None or not with_sq):
            return {direction: got}, {direction: (None, sq)}
    c = c_MN.to(acc)
    got = weighted_rows(c) if direction == "row" else weighted_cols(c)
    return {direction: got}, {direction: _one_direction_sums(c, direction, with_abs=with_abs, with_sq=with_sq)}


def _times(one_pass: OnePass, x_RC: torch.Tensor, v_Cc: torch.Tensor, squares: str | None
           ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(X·v (..., R, c), X's squared sums along ``squares``: "row" (..., R) or "col" (..., C)), in one read of X; a
    transposed view is read as its contiguous base, whose left product and other-axis sums give the same. (None,
    None) where the kernel declines."""
    if x_RC.stride(-1) == 1:
        got = one_pass(x_RC, right=v_Cc, row_sq=squares == "row", col_sq=squares == "col")
        return (None, None) if got is None else (got.right, got.row_sq if squares == "row" else got.col_sq)
    got = one_pass(x_RC.mT, left=v_Cc, row_sq=squares == "col", col_sq=squares == "row")
    return (None, None) if got is None else (got.left, got.col_sq if squares == "row" else got.row_sq)


def _check_shapes(c_MN: torch.Tensor, a_MK: torch.Tensor, b_KN: torch.Tensor, bias_N: torch.Tensor | None) -> None:
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


def _one_direction_sums(
    c_MN: torch.Tensor, direction: str, *, with_abs: bool, with_sq: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(Σ|C|, ΣC²) per vector of one direction (None where not asked for): the same sums ``checksums_of`` makes for
    both, without the pass over the other direction (a column reduction of a row-major C is the slow one)."""
    abs_sum = sq_sum = None
    if direction == "row":
        if with_abs:
            abs_sum = c_MN.abs().sum(-1)
        if with_sq:
            sq_sum = torch.linalg.vector_norm(c_MN, dim=-1).square()
        return abs_sum, sq_sum
    if with_abs:
        abs_sum = c_MN.abs().sum(-2)
    if with_sq:
        sq_sum = col_norms(c_MN).square()
    return abs_sum, sq_sum


def _ref_norm(v_K2: torch.Tensor, wide: bool) -> torch.Tensor:
    """(..., 2) ‖v‖ per weighting of the vector a reference dotted its operand with; float64 with ``wide`` (its fp32
    square sum overflows where the operand norms do: ``_widened``)."""
    norm_2: torch.Tensor = torch.linalg.vector_norm(v_K2.double() if wide else v_K2, dim=-2)
    return norm_2


def _widened(norm_V: torch.Tensor, x: torch.Tensor, k: int, norms: Callable[[torch.Tensor], torch.Tensor]
             ) -> torch.Tensor:
    """(..., V) float64: the fp32 norms where finite, float64 norms of x where they overflowed; both with the fp32
    norm's underflow floor, which `bounds` would add to an fp32 norm (not to a float64 one) and which the bounds of
    products of tiny values rely on (a float64 norm without it flagged clean vanishing gradients of a diverged run)."""
    wide_V = torch.where(torch.isfinite(norm_V), norm_V.double(), norms(x.double()))
    return wide_V + norm_floor(norm_V, k)


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
    """The bound rule's base expanded to the check's shape: ``abft.repair`` indexes it per matrix. d2's bound is
    kept: the margin histogram takes the larger of the two ratios (records._worst_ratio)."""
    return DirectionCheck(ref=chk.ref, diff=chk.diff, bound=chk.bound, bad=chk.bad,
                          rule=None if chk.rule is None else chk.rule.select(..., chk.bad.shape), bound2=chk.bound2,
                          groups=chk.groups)


def _batched(chk: DirectionCheck) -> DirectionCheck:
    """A 2-D product's check with a leading batch dim of 1; every field of the bound rule kept (its vector length
    and calibrated part too: the re-verification after a repair re-evaluates it)."""
    rule = None if chk.rule is None else chk.rule.select(..., chk.bad.shape)
    if rule is not None:
        offset = rule.offset_NV if isinstance(rule.offset_NV, float) else rule.offset_NV[None]
        rule = dataclasses.replace(rule, base=rule.base[None], offset_NV=offset,
                                   var_NV2=None if rule.var_NV2 is None else rule.var_NV2[None])
    return DirectionCheck(ref=chk.ref[None], diff=chk.diff[None], bound=chk.bound[None], bad=chk.bad[None], rule=rule,
                          bound2=None if chk.bound2 is None else chk.bound2[None], groups=chk.groups)


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
