"""How the engine checks one product C = A·B: the exact-math context its checksums run in, the tolerance in force, and
both directions verified against input-derived references (no sync). Shared by the attention, the projections, the
tiled attention and the whole-step GEMM checks."""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch

from ..abft import (
    Bound,
    DirectionCheck,
    Tolerance,
    acc_dtype,
    checksum_weights,
    checksums_of,
    direction_bounds,
    group_count,
    group_sums_rows,
    verify_direction,
)
from ..abft.checksum import VectorSums, vector_sum
from ..kernels.fused_pass import fused_pass
from ..matmul_precision import fp32_matmul_operand_roundoff, ieee_fp32_matmul
from .context import LayerContext

Checks = dict[str, DirectionCheck]


_Exact = Callable[[tuple[int, ...], torch.Tensor, torch.Tensor], torch.Tensor]


def _dot(a_PK: torch.Tensor, b_PK: torch.Tensor, bias_P: torch.Tensor | None = None) -> torch.Tensor:
    """Row-wise dot products in the accumulation dtype: single elements of a product, recomputed exactly."""
    acc = acc_dtype(a_PK.dtype)
    out_P = (a_PK.to(acc) * b_PK.to(acc)).sum(-1)
    return out_P if bias_P is None else out_P + bias_P.to(acc)


def _exact_math(like: torch.Tensor) -> contextlib.ExitStack:
    """no_grad, autocast off and IEEE fp32 matmuls: checksums must run in the dtypes we chose (under autocast a fp32
    checksum matmul would silently run in bf16, under TF32 with 10-bit operands, and flag clean data); autograd must
    not see them."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.no_grad())
    stack.enter_context(torch.autocast(device_type=like.device.type, enabled=False))
    stack.enter_context(ieee_fp32_matmul(like.device))
    return stack


def _tolerance(ctx: LayerContext) -> Tolerance:
    cfg = ctx.config
    return Tolerance(mode=cfg.tolerance, factor=cfg.tolerance_factor)


def _walks(tol: Tolerance) -> bool:
    """Whether the bound is the calibrated one, whose random-walk model takes the operands' ∞-norms (`_verify`'s walk
    and maxes): the other bounds do not need that pass."""
    return tol.mode == "roundoff" and tol.calibrated


def _groups(tol: Tolerance, n: int) -> int:
    """Checksum groups for a vector of length n under this tolerance: grouped round-off checks only (the paper's
    absolute threshold keeps one pair per vector)."""
    return group_count(n) if tol.grouped and tol.mode == "roundoff" else 1


def _cublas_made(c: torch.Tensor) -> bool:
    """Whether cuBLAS made this product (its reduced-precision flags apply). A seam for tests that run the CUDA
    branch's bound on a CPU."""
    return c.is_cuda


def _gemm_accumulation(c: torch.Tensor) -> torch.dtype | None:
    """The precision a half-precision product may have been reduced in: its own dtype when cuBLAS is allowed
    reduced-precision reductions (PyTorch's default), else fp32 (None)."""
    if not _cublas_made(c):
        return None
    flags = torch.backends.cuda.matmul
    if c.dtype == torch.float16 and flags.allow_fp16_reduced_precision_reduction:
        return torch.float16
    if c.dtype == torch.bfloat16 and flags.allow_bf16_reduced_precision_reduction:
        return torch.bfloat16
    return None


def _verify(
    c_NRC: torch.Tensor,
    row_ref_NR2: torch.Tensor,
    col_ref_NC2: torch.Tensor | None,
    a_norm_NR: torch.Tensor,
    b_norm_NC: torch.Tensor,
    *,
    k: int,
    tol: Tolerance,
    bias_abs_C: torch.Tensor | None = None,
    extra_row_NR: torch.Tensor | None = None,
    extra_col_NC: torch.Tensor | None = None,
    operands_cast_to: torch.dtype | None = None,
    ref_norms: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    sq_sums: tuple[torch.Tensor, torch.Tensor] | None = None,
    groups: tuple[int, int] = (1, 1),
    maxes: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    ref_maxes: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    walk: tuple[bool, bool] = (False, False),
    moments_NR4: torch.Tensor | None = None,
    directions: tuple[str, ...] = ("row", "col"),
    row_sums: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    operand_moments: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
) -> Checks:
    """Both directions of C = A·B against references derived from the inputs (no sync). extra_*: error already in
    a passed reference (paper-faithful mode), added to the bound. operands_cast_to: autocast ran the product on
    operands rounded to this dtype. ref_norms: (‖B w‖, ‖wᵀA‖) per batch (..., 2), for the calibrated bound.
    sq_sums: (Σ_j C_ij² (..., R·g_r), Σ_i C_ij² (..., C·g_c)) per checksum group from the operands
    (abft.tiled.square_sums), for a C in the accumulation dtype: the calibrated bound then needs no pass over C.
    groups: (g_r, g_c) checksum groups per row and per column (abft/checksum.py); the references and ref_norms are
    then per group: (..., R·g_r, 2), (..., C·g_c, 2), ((..., g_r, 2), (..., g_c, 2)).
    walk: the (row, column) directions that take the calibrated bound's random-walk model (tolerance.bounds), with
    maxes: (‖A_i‖∞ (..., R), ‖B_j‖∞ (..., C)) and ref_maxes: (‖B w‖∞, ‖wᵀA‖∞) shaped as ref_norms; moments_NR4:
    (Σ_j w_j² Σ_k A_ik² B_kj², Σ_k A_ik² (Bw)_k²) per row vector and weighting, laid out as the row references
    (..., R·g_r, 4), for a walk row (tolerance.bounds).
    directions: ("row",) verifies the rows only (col_ref_NC2 is then not read, and may be None): one direction
    detects any single corrupted element; locating a column or a block needs both, after a flag. row_sums: (C's
    grouped row checksums (..., R·g_r, 2), their Σ C² (..., R·g_r) or None) already made (fused_pass), for an fp32 C
    checked by rows only: then no pass over C runs here. operand_moments: (row (..., R·g_r, 4), column (..., C·g_c,
    4)), laid out as the references: the operand-rounding moments of `tolerance.direction_bounds`, for a product
    whose operands the GEMM rounded (TF32; attention's AP·V: abft/operand_moments.py)."""
    roundoff = tol.mode == "roundoff"
    use_abs = c_NRC.dtype != acc_dtype(c_NRC.dtype) and roundoff
    want_sq = roundoff and tol.calibrated
    given_sq = want_sq and sq_sums is not None and not use_abs
    # An fp32 product under TF32 (or oneDNN bf16) rounded its operands; autocast already says so for half products.
    operand_u = fp32_matmul_operand_roundoff(c_NRC.device) if c_NRC.dtype == torch.float32 else None
    rule = functools.partial(
        direction_bounds, k=k, out_dtype=c_NRC.dtype, tol=tol, use_abs=use_abs,
        gemm_accumulates_in=_gemm_accumulation(c_NRC), operands_cast_to=operands_cast_to, operand_roundoff=operand_u,
        walk=walk,
    )
    g_r, g_c = groups
    a_max, b_max = maxes
    row_rule_of = functools.partial(_row_rule, rule, a_norm_NR, b_norm_NC, bias_abs_C, ref_norms[0], maxes,
                                    ref_maxes[0], moments_NR4, g_r, operand_NR4=operand_moments[0])
    col_om = operand_moments[1]
    if directions == ("row",):
        abs_sum: torch.Tensor | None = None
        sq_sum: torch.Tensor | None
        if row_sums is not None and not use_abs:
            got_rows, sq_sum = row_sums
        else:
            # Grouped row sums and magnitude sums: contiguous reductions of C, no pass over its columns.
            c = c_NRC.to(acc_dtype(c_NRC.dtype))
            got_rows = group_sums_rows(c, g_r).flatten(-3, -2)
            abs_sum = vector_sum(c.abs(), "row", g_r) if use_abs else None
            sq_sum = (torch.linalg.vector_norm(c.unflatten(-1, (g_r, -1)), dim=-1).square().flatten(-2)
                      if want_sq else None)
        row_rule = row_rule_of(grouped=g_r > 1)
        if extra_row_NR is not None and roundoff:
            row_rule = row_rule.plus(extra_row_NR)
        return {"row": verify_direction(row_ref_NR2, got_rows, row_rule, abs_sum, sq_sum, groups=g_r)}
    both = None if use_abs else _both_in_one_pass(c_NRC, groups, with_sq=want_sq and not given_sq)
    if both is not None:
        got_rows, got_cols, sums = both
    else:
        got_rows, got_cols, sums = checksums_of(c_NRC, with_abs=use_abs, with_sq=want_sq and not given_sq,
                                                groups=groups)
    if given_sq:
        assert sq_sums is not None
        sums = VectorSums(None, sq_sums)
    if groups == (1, 1):
        rules = rule(("row", "col"), a_norm_NR, b_norm_NC, bias_abs_C=bias_abs_C, ref_norms=ref_norms,
                     a_max_NR=a_max, b_max_NC=b_max, ref_maxes=ref_maxes, moments_NR4=moments_NR4,
                     operand_moments=operand_moments)
        row_rule, col_rule = rules["row"], rules["col"]
    else:
        # Each group is the product of A with a column block of B (row groups) or of a row block of A with B (column
        # groups): the same bound on that sub-product, the groups a batch dim, then laid out as grouped vectors.
        row_rule = row_rule_of(grouped=True)
        col_rule = rule(("col",), a_norm_NR.unflatten(-1, (g_c, -1)), b_norm_NC[..., None, :], bias_abs_C=bias_abs_C,
                        ref_norms=(None, ref_norms[1]),
                        a_max_NR=None if a_max is None else a_max.unflatten(-1, (g_c, -1)),
                        b_max_NC=None if b_max is None else b_max[..., None, :],
                        ref_maxes=(None, ref_maxes[1]),
                        # (..., C·g_c, 4) -> (..., g_c, C, 4): the groups a batch dim, as the rule is made
                        operand_moments=(None, None if col_om is None
                                         else col_om.unflatten(-2, (-1, g_c)).transpose(-3, -2)))["col"].grouped()
    if extra_row_NR is not None and roundoff:
        row_rule = row_rule.plus(extra_row_NR)
    if extra_col_NC is not None and roundoff:
        col_rule = col_rule.plus(extra_col_NC)
    row_vs, col_vs = (sums.of("row"), sums.of("col")) if sums is not None else ((None, None), (None, None))
    if col_ref_NC2 is None:
        raise ValueError("_verify: both directions need the column references")
    return {
        "row": verify_direction(row_ref_NR2, got_rows, row_rule, *row_vs, groups=g_r),
        "col": verify_direction(col_ref_NC2, got_cols, col_rule, *col_vs, groups=g_c),
    }


_ONE_PASS_MIN = 1 << 18
_ONE_PASS_MIN_SQ = 1 << 16
"""Smallest C (elements) whose checksums, without / with ΣC², go through the kernel: below, the eager BLAS calls win
over its fixed cost (one thread, measured: a tiled path's (1, 8, 256, 32) context tile took 0.077 ms in the kernel,
0.046 ms eagerly; (1, 8, 256, 256) 0.18 against 0.20 ms; with ΣC², 0.087 against 0.089 ms at the smaller size)."""


def _both_in_one_pass(
    c_NRC: torch.Tensor, groups: tuple[int, int], *, with_sq: bool
) -> tuple[torch.Tensor, torch.Tensor, VectorSums | None] | None:
    """What `checksums_of` makes (grouped row and column checksums, and ΣC² per vector when with_sq), in one read of
    an fp32 C (fused_pass), or None where the kernel declines. Column groups are blocks of R/g_c consecutive rows,
    each its own batch matrix; row groups are runs of C/g_r within a row."""
    g_r, g_c = groups
    r, c = c_NRC.shape[-2:]
    lead = c_NRC.shape[:-2]
    if c_NRC.numel() < (_ONE_PASS_MIN_SQ if with_sq else _ONE_PASS_MIN):
        return None
    try:
        blocks = c_NRC.view(*lead, g_c, r // g_c, c) if g_c > 1 else c_NRC
    except RuntimeError:
        return None
    got = fused_pass(blocks, right=checksum_weights(c // g_r, c_NRC.device, torch.float32),
                     left=checksum_weights(r // g_c, c_NRC.device, torch.float32), row_sq=with_sq, col_sq=with_sq,
                     groups=g_r)
    if got is None or got.right is None or got.left is None:
        return None

    def per_column(x: torch.Tensor) -> torch.Tensor:
        # (..., g_c, C, *) -> (..., C·g_c, *): vector j·g_c + h is column j of row block h (abft/checksum.py)
        return x.transpose(len(lead), len(lead) + 1).flatten(len(lead), len(lead) + 1) if g_c > 1 else x

    rows = got.right.flatten(len(lead), len(lead) + 1) if g_c > 1 else got.right
    sums = None
    if with_sq:
        assert got.row_sq is not None and got.col_sq is not None
        sums = VectorSums(None, (got.row_sq.flatten(-2) if g_c > 1 else got.row_sq, per_column(got.col_sq)))
    return rows, per_column(got.left), sums


def operand_rounding(c_NRC: torch.Tensor, tol: Tolerance) -> bool:
    """Whether the calibrated check of an fp32 product C takes its operands' rounding moments (abft/operand_moments.py):
    the GEMM ran under an operand-rounding matmul mode (TF32, oneDNN bf16)."""
    return (c_NRC.dtype == torch.float32 and tol.mode == "roundoff" and tol.calibrated
            and fp32_matmul_operand_roundoff(c_NRC.device) is not None)


def _row_rule(
    rule: Callable[..., dict[str, Bound]],
    a_norm_NR: torch.Tensor,
    b_norm_NC: torch.Tensor,
    bias_abs_C: torch.Tensor | None,
    ref_norm: torch.Tensor | None,
    maxes: tuple[torch.Tensor | None, torch.Tensor | None],
    ref_max: torch.Tensor | None,
    moments_NR4: torch.Tensor | None,
    g_r: int,
    *,
    grouped: bool,
    operand_NR4: torch.Tensor | None = None,
) -> Bound:
    """The row direction's bound (`_verify`'s arguments, ref_norm and ref_max shaped as its groups say). Grouped:
    per group of g_r runs of columns, each group the product of A with a column block of B, bounded as that
    sub-product with the groups a batch dim, then laid out as grouped vectors."""
    a_max, b_max = maxes
    if not grouped:
        return rule(("row",), a_norm_NR, b_norm_NC, bias_abs_C=bias_abs_C, ref_norms=(ref_norm, None),
                    a_max_NR=a_max, b_max_NC=b_max, ref_maxes=(ref_max, None), moments_NR4=moments_NR4,
                    operand_moments=(operand_NR4, None))["row"]
    return rule(("row",), a_norm_NR[..., None, :], b_norm_NC.unflatten(-1, (g_r, -1)),
                bias_abs_C=None if bias_abs_C is None else bias_abs_C.unflatten(-1, (g_r, -1)),
                ref_norms=(ref_norm, None),
                a_max_NR=None if a_max is None else a_max[..., None, :],
                b_max_NC=None if b_max is None else b_max.unflatten(-1, (g_r, -1)),
                ref_maxes=(ref_max, None),
                # (..., R·g, 2) -> (..., g, R, 2): the groups a batch dim, as the rule is made
                moments_NR4=None if moments_NR4 is None
                else moments_NR4.unflatten(-2, (-1, g_r)).transpose(-3, -2),
                operand_moments=(None if operand_NR4 is None
                                 else operand_NR4.unflatten(-2, (-1, g_r)).transpose(-3, -2), None))["row"].grouped()
