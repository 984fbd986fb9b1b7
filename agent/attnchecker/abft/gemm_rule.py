"""The row rule of ``verify_gemm``'s clean check, factored into per-call scalars for a kernel that evaluates it per row
(the Triton check pass, kernels/triton_gemm_check.py): the GPU sibling of ``row_rule`` / row_verify.c, for every
output dtype, bias, operand cast and operand rounding the whole-step GEMMs meet, not only fp32 products.

For row i of C = A·B (+ bias), n columns, reduction length k, with a = ‖A_i‖ + floor_a, b_j = ‖B_j‖ + floor_b, and
per weighting w (ones, then 1..n) the sums over the row's columns Σb = Σ_j b_j, B²_w = Σ_j w_j² b_j², the norm of the
vector the reference dots A's row with ‖B w‖ (the operand pass makes it beside the reference), bias sums Σ|β| and
β²_w = Σ_j w_j² β_j², and the row's own Σ|C| and ΣC²:

  under   = under0 + flush·(√k·(Σb + n·a) + n)
  rig1    = rig_ab·a·Σb + rig_bias·Σ|β| + under + abs_coef·Σ|C|,           rig2 = n·rig1
  var_w   = a²·(var_b·B²_w + var_ref·‖B w‖²) + var_bias·β²_w + sq_coef·n^(2·[w = 1..n])·(ΣC² + tiny_pad)
  cal_w   = sigmas·√var_w + under·(1, (n + 1)/2)_w + common·|ref_w|   (|ref| read as 0 where it is not finite)
  bound_w = min(rig_w, cal_w) where calibrated, NaN and +INF read near_inf (``tolerance._clamp``)

which is ``direction_bounds(("row",), ..., ref_norms=(‖B w‖, None))`` followed by ``Bound.pair`` for
``verify_gemm(..., ref_norms=True)``'s arguments, term by term. A row checked in g runs (``verify_gemm(groups=g)``)
takes this rule with n = N/g per run, its sums over the run's columns and ‖B_h w‖ of its block: the
line of that function each scalar comes from is named below. tests/agent/test_triton_gemm_check.py holds the kernel's
verdicts to verify_gemm's. Pure: floats in, floats out.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import torch

from .tolerance import NEAR_INF, Tolerance, _underflow, acc_dtype, gamma

__all__ = ["GemmRowRule", "gemm_row_rule"]


@dataclasses.dataclass(frozen=True, slots=True)
class GemmRowRule:
    """The scalars of the factored row rule (module docstring), and an elementwise tolerance for the repair."""

    n: int
    k: int
    floor_a: float
    floor_b: float
    rig_ab: float
    rig_bias: float
    abs_coef: float
    """0 for an fp32 output: its Σ|C| is then not read."""
    under0: float
    flush: float
    """bf16 subnormal flushing (``direction_bounds``' `flush`); 0 for other dtypes."""
    calibrated: bool
    var_b: float
    var_ref: float
    var_bias: float
    sq_coef: float
    tiny_pad: float
    common: float
    sigmas: float
    near_inf: float
    elem_ab: float
    """Per a·b_j: how far two correct computations of C_ij may lie apart (each within γ_k·‖A_i‖‖B_j‖ of the exact
    value, plus operand rounding), for telling a recomputed row that equals the old one from a repaired one."""
    elem_abs: float
    """Per |C_ij| (both computations' and the bias's): their output rounding."""

    @property
    def use_abs(self) -> bool:
        return self.abs_coef != 0.0


def gemm_row_rule(n: int, k: int, tol: Tolerance, out_dtype: torch.dtype, *, bias: bool,
                  operands_cast_to: torch.dtype | None = None, operand_roundoff: float | None = None
                  ) -> GemmRowRule:
    """The rule ``verify_gemm(c, a, b, tol, bias_N=..., operand_roundoff=..., directions=("row",))`` applies to each
    row of an (M, n) product C of reduction length k in ``out_dtype`` whose norms are fp32 (its clean check).
    operands_cast_to: C's dtype when A or B is wider (``verify_gemm``'s cast_to); operand_roundoff: an fp32 GEMM's
    own operand rounding (``fp32_matmul_operand_roundoff``), ignored for other output dtypes as verify_gemm does."""
    return _rule(n, k, tol, out_dtype, bias, operands_cast_to,
                 operand_roundoff if out_dtype == torch.float32 else None)


@functools.lru_cache(maxsize=1024)
def _rule(n: int, k: int, tol: Tolerance, out_dtype: torch.dtype, bias: bool, cast_to: torch.dtype | None,
          operand_roundoff: float | None) -> GemmRowRule:
    f32 = torch.float32
    # Norms are fp32 on the clean path: direction_bounds' norm_floor(a_norm, k), norm_floor(b_norm, k).
    floor = math.sqrt(k * torch.finfo(f32).tiny)
    u_out = torch.finfo(out_dtype).eps / 2
    slack = 1.01 * tol.factor
    n_round = 2 if bias else 1
    u_in = max(torch.finfo(cast_to).eps / 2 if cast_to is not None else 0.0, operand_roundoff or 0.0)
    g_k = gamma(k, out_dtype)
    g_v = gamma(n, out_dtype)
    if tol.mode == "extreme":
        # Bound(full_like(a, E), n=n): E on |d1|, n·E on |d2|, nothing calibrated.
        e = tol.extreme_threshold * tol.factor
        return GemmRowRule(n, k, 0.0, 0.0, 0.0, 0.0, 0.0, e, 0.0, False, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, NEAR_INF,
                           slack * 2 * (g_k + u_in), slack * n_round * u_out)
    use_abs = out_dtype != acc_dtype(out_dtype)
    # direction_bounds' rigorous part: vec = a·Σb·(...), coef, bias_coef.
    if use_abs:
        rig_ab, abs_coef, bias_coef = slack * (2 * g_k + g_v), slack * (g_v + n_round * u_out), slack * (g_v + u_out)
    else:
        rig_ab, abs_coef, bias_coef = slack * (2 * g_k + 2 * g_v + n_round * u_out), 0.0, slack * (2 * g_v + u_out)
    if u_in > 0.0:
        rig_ab += slack * 2 * u_in
        bias_coef += slack * u_in
    eta_out, eta_acc = _underflow(out_dtype), _underflow(acc_dtype(out_dtype))
    under0 = slack * n * (eta_out + (k + 2 * n + 2) * eta_acc)
    flush = slack * torch.finfo(torch.bfloat16).tiny if torch.bfloat16 in (out_dtype, cast_to) else 0.0
    rig_bias = bias_coef if bias else 0.0
    elem = (slack * 2 * (g_k + u_in), slack * n_round * u_out)
    if not tol.calibrated:
        return GemmRowRule(n, k, floor, floor, rig_ab, rig_bias, abs_coef, under0, flush, False, 0.0, 0.0, 0.0, 0.0,
                           0.0, 0.0, 0.0, NEAR_INF, *elem)
    # The calibrated part (direction_bounds after `if not tol.calibrated`, _calibrated_var's Cauchy-Schwarz branch).
    acc = acc_dtype(out_dtype)
    u_acc = torch.finfo(acc).eps / 2
    u2 = u_acc**2 / 3
    u_ops = [torch.finfo(cast_to).eps / 2] if cast_to is not None else []
    u_ops += [operand_roundoff] if operand_roundoff is not None else []
    op_var = 2 * max(u_ops) ** 2 / 3 if u_ops else 0.0
    u_out_var = n_round * u_out**2 / 3 if acc != out_dtype else 0.0
    c_sq = u_out_var + n**2 * u2
    ref_coef = slack * n_round * u_out if acc != out_dtype else 0.0
    trunc = slack * operand_roundoff if operand_roundoff is not None else 0.0
    return GemmRowRule(
        n=n, k=k, floor_a=floor, floor_b=floor, rig_ab=rig_ab, rig_bias=rig_bias, abs_coef=abs_coef, under0=under0,
        flush=flush, calibrated=True,
        var_b=k * u2 + op_var + n * u2,  # product (and its operand rounding) + forming B w
        var_ref=k * u2,  # the reference's K-long dot, per ‖B w‖² (the CPU path's verify_gemm: per (Σ_j w_j b_j)²)
        var_bias=n * u2 if bias else 0.0,
        sq_coef=c_sq,
        tiny_pad=n * torch.finfo(acc).tiny,  # Bound.pair: ΣC² made in C's (accumulation) dtype
        common=ref_coef + trunc,
        sigmas=tol.sigmas * tol.factor,
        near_inf=NEAR_INF,
        elem_ab=elem[0], elem_abs=elem[1],
    )
