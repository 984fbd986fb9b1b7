"""Tolerances on the checksum residual |d1|: the paper's absolute threshold ("extreme") and a round-off bound.

Derivation (docs/abft.md has the long form). For C = A·B (+ bias b), row i, weights w over the C columns:
  computed C_ij = fl(A_i·B_j + b_j):  |err| <= γ_K P_ij + u_out (P_ij + |b_j|),  P_ij = Σ_k |A_ik||B_kj| <= ‖A_i‖‖B_j‖
  checksum Σ_j w_j C_ij (acc dtype):  |err| <= γ_C Σ_j w_j |C_ij|
  reference A_i (B w) + b·w:          |err| <= (γ_C + γ_K) Σ_j w_j P_ij + γ_C Σ_j w_j |b_j|
so |d1| <= (2γ_K + 2γ_C + u_out)(1 + O(u)) ‖A_i‖ Σ_j ‖B_j‖ + (2γ_C + u_out) Σ_j |b_j|   (w = ones),
with γ_n = n·u_acc/(1 - n·u_acc) for any summation order. The column direction swaps the roles (reduce over R).
Only row norms of A and column norms of B are needed: no |A|·|B| product is ever formed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .checksum import acc_dtype

__all__ = ["NEAR_INF", "Bound", "Tolerance", "bounds", "gamma"]

NEAR_INF = 1e10
"""|x| above this is "near-INF" (ATTNChecker's T_big): located by value, rebuilt from the checksum."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Tolerance:
    mode: str = "roundoff"
    """roundoff: the bound above; extreme: the paper's absolute threshold E on |d1|."""
    factor: float = 1.0
    """Multiplies the round-off bound or E."""
    extreme_threshold: float = 1.0
    """ATTNChecker's E."""
    near_inf: float = NEAR_INF
    fix_threshold: float = 1e3
    """|d1| above this rebuilds the element as checksum minus the healthy elements instead of adding d1 back
    (ATTNChecker's T_fix): adding a difference to a huge value keeps none of its digits."""

    def __post_init__(self) -> None:
        if self.mode not in ("roundoff", "extreme"):
            raise ValueError(f"tolerance.mode must be 'roundoff' or 'extreme', got {self.mode!r}")
        if not self.factor > 0:
            raise ValueError(f"tolerance.factor must be > 0, got {self.factor!r}")


def gamma(n: int, dtype: torch.dtype, *, accumulate_in: torch.dtype | None = None) -> float:
    """Higham's γ_n for sums accumulated in `dtype`'s accumulation precision (or in `accumulate_in`)."""
    u = torch.finfo(accumulate_in or acc_dtype(dtype)).eps / 2
    nu = n * u
    if nu >= 0.5:
        raise ValueError(f"reduction length {n} is too long for a round-off bound in {dtype}")
    return nu / (1 - nu)


def _underflow(dtype: torch.dtype) -> float:
    finfo = torch.finfo(dtype)
    return finfo.smallest_normal * finfo.eps / 2


@dataclass(frozen=True, slots=True)
class Bound:
    """A tolerance on |d1| per vector: base + abs_coef × Σ|C| over the vector, clamped to NEAR_INF.

    The Σ|C| part is re-evaluated on C as it stands, so after a correction the bound no longer carries the faulty
    value (a 1e20 in a half-precision row would otherwise loosen its own re-verification).
    """

    base: torch.Tensor
    """(..., V)"""
    abs_coef: float = 0.0

    def of(self, abs_sum_NV: torch.Tensor | None) -> torch.Tensor:
        bound = self.base if abs_sum_NV is None or self.abs_coef == 0.0 else self.base + self.abs_coef * abs_sum_NV
        # A corrupt operand norm (an unverified input holding 1e20) must not hide an extreme residual behind an
        # infinite bound.
        return torch.nan_to_num(bound, nan=NEAR_INF, posinf=NEAR_INF).clamp(max=NEAR_INF)


def bounds(
    a_norm_NR: torch.Tensor,
    b_norm_NC: torch.Tensor,
    *,
    k: int,
    out_dtype: torch.dtype,
    tol: Tolerance,
    bias_abs_C: torch.Tensor | None = None,
    use_abs: bool = False,
    gemm_accumulates_in: torch.dtype | None = None,
    operands_cast_to: torch.dtype | None = None,
) -> tuple[Bound, Bound]:
    """(row bound over (..., R), column bound over (..., C)) on |d1| for C = A·B (+ bias).

    a_norm_NR: ‖A_i‖₂ per row of A; b_norm_NC: ‖B_j‖₂ per column of B (broadcastable batch dims); k: reduction length.
    use_abs: the output-rounding and checksum terms use Σ|C| of C itself instead of the Cauchy-Schwarz estimate:
    worth one pass over C for bf16/fp16, whose output rounding (u = 2^-9 / 2^-12) dominates the bound.
    gemm_accumulates_in: the precision the product C itself was reduced in, when coarser than fp32 (cuBLAS with
    reduced-precision reductions allowed may split K and sum partials in fp16/bf16). An untested model (no GPU
    run yet): see docs/abft.md.
    operands_cast_to: the product ran on A and B rounded to this dtype (autocast: fp32 tensors, bf16 GEMM), while
    the references use them as given: each operand's rounding adds u·P_ij (and u·|b_j| for the bias).
    """
    n_rows, n_cols = a_norm_NR.shape[-1], b_norm_NC.shape[-1]
    if tol.mode == "extreme":
        e = tol.extreme_threshold * tol.factor
        return Bound(torch.full_like(a_norm_NR, e)), Bound(torch.full_like(b_norm_NC, e))
    u_out = torch.finfo(out_dtype).eps / 2
    g_c, g_r = gamma(n_cols, out_dtype), gamma(n_rows, out_dtype)
    # γ_K twice: once for the reference, once for the product C. A product reduced in half precision is modelled as
    # fp32 partial sums combined in at most 64 half-precision steps (split-K), not as a K-long half-precision sum.
    g_k = gamma(k, out_dtype)
    if gemm_accumulates_in is not None:
        g_k += gamma(min(k, 64), out_dtype, accumulate_in=gemm_accumulates_in) / 2
    # (1 + 1e-2) absorbs the O(u²) cross terms of the first-order bound.
    slack = 1.01 * tol.factor
    # With a bias the output may be rounded twice (the product, then the sum with b: F.linear in fp16 on CPU):
    # u_out |A_i B_j| + u_out |C_ij| <= u_out (2 P_ij + |b_j|).
    n_round = 1 if bias_abs_C is None else 2
    row_NR = a_norm_NR * b_norm_NC.sum(-1, keepdim=True)
    col_NC = b_norm_NC * a_norm_NR.sum(-1, keepdim=True)
    if use_abs:
        row_NR = row_NR * (slack * (2 * g_k + g_c))
        col_NC = col_NC * (slack * (2 * g_k + g_r))
        coef_row, coef_col = slack * (g_c + n_round * u_out), slack * (g_r + n_round * u_out)
        bias_row, bias_col = slack * (g_c + u_out), slack * (g_r + u_out)
    else:
        row_NR = row_NR * (slack * (2 * g_k + 2 * g_c + n_round * u_out))
        col_NC = col_NC * (slack * (2 * g_k + 2 * g_r + n_round * u_out))
        coef_row = coef_col = 0.0
        bias_row, bias_col = slack * (2 * g_c + u_out), slack * (2 * g_r + u_out)
    if operands_cast_to is not None:
        u_in = torch.finfo(operands_cast_to).eps / 2
        row_NR = row_NR + slack * 2 * u_in * a_norm_NR * b_norm_NC.sum(-1, keepdim=True)
        col_NC = col_NC + slack * 2 * u_in * b_norm_NC * a_norm_NR.sum(-1, keepdim=True)
        bias_row, bias_col = bias_row + slack * u_in, bias_col + slack * u_in
    if bias_abs_C is not None:
        row_NR = row_NR + bias_row * bias_abs_C.sum(-1, keepdim=True)
        col_NC = col_NC + bias_col * n_rows * bias_abs_C
    # Gradual underflow: results below the smallest normal carry an absolute error (half a subnormal step) that no
    # relative term covers; it matters for fp16 (step 2^-24), not for bf16/fp32.
    eta_out, eta_acc = _underflow(out_dtype), _underflow(acc_dtype(out_dtype))
    row_NR = row_NR + slack * n_cols * (eta_out + (k + 2 * n_cols + 2) * eta_acc)
    col_NC = col_NC + slack * n_rows * (eta_out + (k + 2 * n_rows + 2) * eta_acc)
    return Bound(row_NR, coef_row), Bound(col_NC, coef_col)
