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

__all__ = ["NEAR_INF", "Tolerance", "bounds", "gamma"]

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


def gamma(n: int, dtype: torch.dtype) -> float:
    """Higham's γ_n for sums accumulated in `dtype`'s accumulation precision."""
    u = torch.finfo(acc_dtype(dtype)).eps / 2
    nu = n * u
    if nu >= 0.5:
        raise ValueError(f"reduction length {n} is too long for a round-off bound in {dtype}")
    return nu / (1 - nu)


def bounds(
    a_norm_NR: torch.Tensor,
    b_norm_NC: torch.Tensor,
    *,
    k: int,
    out_dtype: torch.dtype,
    tol: Tolerance,
    bias_abs_C: torch.Tensor | None = None,
    c_abs: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row bound (..., R), column bound (..., C)) on |d1| for C = A·B (+ bias).

    a_norm_NR: ‖A_i‖₂ per row of A; b_norm_NC: ‖B_j‖₂ per column of B (broadcastable batch dims); k: reduction length.
    c_abs: optional (Σ_j |C_ij| (..., R), Σ_i |C_ij| (..., C)) of C as computed. With it the output-rounding and
    checksum terms use C itself instead of the Cauchy-Schwarz estimate: worth one pass over C for bf16/fp16, whose
    output rounding (u = 2^-9 / 2^-12) dominates the bound.
    Bounds are clamped to NEAR_INF so that a corrupt operand norm (an unverified input holding 1e20) cannot hide an
    extreme residual behind an infinite bound.
    """
    n_rows, n_cols = a_norm_NR.shape[-1], b_norm_NC.shape[-1]
    if tol.mode == "extreme":
        e = torch.tensor(tol.extreme_threshold * tol.factor, device=a_norm_NR.device, dtype=a_norm_NR.dtype)
        return e.expand(a_norm_NR.shape), e.expand(b_norm_NC.shape)
    u_out = torch.finfo(out_dtype).eps / 2
    g_k = gamma(k, out_dtype)
    # (1 + 1e-2) absorbs the O(u²) cross terms of the first-order bound.
    slack = 1.01 * tol.factor
    row_NR = a_norm_NR * b_norm_NC.sum(-1, keepdim=True)
    col_NC = b_norm_NC * a_norm_NR.sum(-1, keepdim=True)
    if c_abs is None:
        row_NR = row_NR * (slack * (2 * g_k + 2 * gamma(n_cols, out_dtype) + u_out))
        col_NC = col_NC * (slack * (2 * g_k + 2 * gamma(n_rows, out_dtype) + u_out))
        if bias_abs_C is not None:
            row_NR = row_NR + slack * (2 * gamma(n_cols, out_dtype) + u_out) * bias_abs_C.sum(-1, keepdim=True)
            col_NC = col_NC + slack * (2 * gamma(n_rows, out_dtype) + u_out) * n_rows * bias_abs_C
    else:
        g_c, g_r = gamma(n_cols, out_dtype), gamma(n_rows, out_dtype)
        row_NR = row_NR * (slack * (2 * g_k + g_c)) + slack * (g_c + u_out) * c_abs[0]
        col_NC = col_NC * (slack * (2 * g_k + g_r)) + slack * (g_r + u_out) * c_abs[1]
        if bias_abs_C is not None:
            row_NR = row_NR + slack * g_c * bias_abs_C.sum(-1, keepdim=True)
            col_NC = col_NC + slack * g_r * n_rows * bias_abs_C
    return (
        torch.nan_to_num(row_NR, nan=NEAR_INF, posinf=NEAR_INF).clamp_(max=NEAR_INF),
        torch.nan_to_num(col_NC, nan=NEAR_INF, posinf=NEAR_INF).clamp_(max=NEAR_INF),
    )
