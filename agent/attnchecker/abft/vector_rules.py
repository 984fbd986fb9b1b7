"""The calibrated rules of ``tolerance.direction_bounds`` factored into scalars, for a kernel that verifies each
checksum vector where it makes the vector's sums (the Triton attention backward: kernels/triton_attention_bwd.py).

A product C = A·B accumulated in fp32, checked by rows (a column check is the row check of Cᵀ = Bᵀ·Aᵀ) with the
weights e = ones and w = 1..n over a vector of n elements, K products each. The kernel has, per vector i, ‖A_i‖, the
two checksums of C_i and their references A_i·(B w), and ΣC_i²; per matrix, what B contributes:
Σ_j ‖B_j‖, Σ_j w_j²‖B_j‖² (for e and w) and ‖B w‖ (for e and w), all over the columns j of this vector's B. With
those, ``ProductRule`` holds the scalars that turn them into direction_bounds' bound, term by term (its comments say
why each term is there): the rigorous bound, the calibrated Cauchy-Schwarz model (operand rounding under TF32
included, and the truncation mean added linearly), the floors for squares below fp32's smallest normal, and NaN/INF
read as NEAR_INF. ``product_bound`` evaluates the same formula with torch, for tests (which hold it to
direction_bounds) and the bench (bounds at realistic sizes).

``SoftmaxGradRule``: the bounds on Σ_j dS_ij, which is 0 for any consistent AP, dP and δ (attention/backward/encoded.py
derives it; the same derivation here, with dropout's 1/(1-p) and the kernel's own operand rounding), and on
Σ_j AP_ij - 1.

Legend: V vectors, C columns of a vector's B, 2 the weights (e, w).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .tolerance import NEAR_INF, Tolerance, gamma

__all__ = ["ProductRule", "SoftmaxGradRule", "product_bound", "product_rule", "product_terms", "softmax_grad_bound",
           "softmax_grad_rule"]

_F32 = torch.float32


def _underflow_f32() -> float:
    finfo = torch.finfo(_F32)
    return finfo.smallest_normal * finfo.eps / 2


@dataclass(frozen=True, slots=True)
class ProductRule:
    """direction_bounds(("row",), ...) of an fp32-accumulated C = A·B (no bias), its vectors n long, K products
    each, as scalars (``scalars`` is the kernel's order). With a' = ‖A_i‖ + floor and the B terms of ``product_terms``
    (floors included), per weighting x in (e, w):
      rigorous     r_x = (rig_coef·a'·Σ_j ‖B_j‖' + under)·(1 for e, n for w)
      calibrated   c_x = z·sqrt(a'²·(var_b·Σ_j x_j²‖B_j‖'² + var_r·‖B x‖'²) + c_sq_x·(ΣC² + sq_pad))
                         + (under for e, off2 for w) + common·|reference_x|,   c_sq_e = c_sq, c_sq_w = c_sq·n²
      bound        min(r_x, c_x) when calibrated, else r_x; NaN and +INF read NEAR_INF."""

    n: int
    k: int
    floor: float
    rig_coef: float
    under: float
    calibrated: bool
    z: float
    var_b: float
    var_r: float
    c_sq: float
    sq_pad: float
    off2: float
    common: float

    def scalars(self) -> tuple[float, ...]:
        """The kernel's order: (floor, rig_coef, under, calibrated, z, √var_b, √var_r, √c_sq, n, sq_pad, off2,
        common). Square roots: the kernel sums standard deviations scaled by their largest, so that no square of a
        small norm underflows fp32 (direction_bounds takes its variances in float64 for the same reason)."""
        return (self.floor, self.rig_coef, self.under, float(self.calibrated), self.z, math.sqrt(self.var_b),
                math.sqrt(self.var_r), math.sqrt(self.c_sq), float(self.n), self.sq_pad, self.off2, self.common)


def product_rule(n: int, k: int, tol: Tolerance, *, operand_roundoff: float | None = None) -> ProductRule:
    """The rule of vectors n long over K-long products (the reduction). operand_roundoff: the product rounded its
    fp32 operands (TF32: 2^-10; None: IEEE products, or half-precision operands, which a tensor core multiplies
    exactly). Each line is direction_bounds' for this case."""
    if tol.mode == "extreme":
        # The paper's threshold on d1, n times it on d2.
        e = tol.extreme_threshold * tol.factor
        return ProductRule(n, k, 0.0, 0.0, e, False, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    u = torch.finfo(_F32).eps / 2
    slack = 1.01 * tol.factor
    r = operand_roundoff or 0.0
    # Both γ_K (the product, the reference) and both γ_n (the checksum, forming B w); the output rounding; the
    # operands' rounding (once per operand) where the product rounds them.
    rig_coef = slack * (2 * gamma(k, _F32) + 2 * gamma(n, _F32) + u) + slack * 2 * r
    eta = _underflow_f32()
    under = slack * n * (eta + (k + 2 * n + 2) * eta)
    u2 = u**2 / 3
    op_var = 2 * r**2 / 3
    return ProductRule(
        # tolerance.norm_floor: what squares below fp32's smallest normal can take from a K-long norm.
        n=n, k=k, floor=math.sqrt(k * torch.finfo(_F32).tiny), rig_coef=rig_coef, under=under,
        calibrated=tol.calibrated, z=tol.sigmas * tol.factor,
        # The product's K-long dot (and its operand rounding), forming B w (n-long sums); the reference's K-long dot.
        var_b=k * u2 + op_var + n * u2, var_r=k * u2,
        # The checksum's own n-long sum, per unit of ΣC² (Cauchy-Schwarz model: partial sums ≤ √n‖C_i‖).
        c_sq=n**2 * u2, sq_pad=n * torch.finfo(_F32).tiny, off2=under * (n + 1) / 2,
        # The truncation mean of a TF32 tensor core, common to the whole vector: linear in |reference|.
        common=slack * r)


def product_terms(rule: ProductRule, b_norm_NC: torch.Tensor, ref_norm_N2: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What B contributes to the rule of every vector of a matrix, floors applied as direction_bounds applies them:
    (Σ_j ‖B_j‖' (...,), (Σ_j ‖B_j‖'², Σ_j j²‖B_j‖'²) (..., 2), ‖B x‖' (..., 2)). b_norm_NC: ‖B_j‖ over the n
    columns; ref_norm_N2: ‖B e‖, ‖B w‖."""
    b = b_norm_NC + rule.floor
    w = torch.arange(1, b.shape[-1] + 1, dtype=b.dtype, device=b.device)
    bsq_N2 = torch.stack([b.square().sum(-1), (b * w).square().sum(-1)], -1)
    return b.sum(-1), bsq_N2, ref_norm_N2 + rule.floor


def product_bound(rule: ProductRule, a_NV: torch.Tensor, bsum_N: torch.Tensor, bsq_N2: torch.Tensor,
                  ref_norm_N2: torch.Tensor, sq_NV: torch.Tensor, ref_NV2: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(bound on |d1|, bound on |d2|) per vector (..., V), in float64: the kernel's formula (``ProductRule``) with
    torch. a_NV: ‖A_i‖ (no floor); bsum, bsq, ref_norm: ``product_terms``; sq_NV: ΣC_i²; ref_NV2: the references."""
    f64 = torch.float64
    a = a_NV.to(f64) + rule.floor
    rig1 = rule.rig_coef * a * bsum_N.to(f64)[..., None] + rule.under
    rig2 = rig1 * rule.n
    if not rule.calibrated:
        return _clamp(rig1), _clamp(rig2)
    bsq, rn = bsq_N2.to(f64)[..., None, :], ref_norm_N2.to(f64)[..., None, :]
    sq = sq_NV.to(f64) + rule.sq_pad
    var_V2 = a[..., None].square() * (rule.var_b * bsq + rule.var_r * rn.square())
    var_V2 = var_V2 + torch.stack([rule.c_sq * sq, rule.c_sq * rule.n**2 * sq], -1)
    ref = torch.nan_to_num(ref_NV2.to(f64).abs(), nan=0.0, posinf=0.0)
    cal = rule.z * var_V2.sqrt() + torch.tensor([rule.under, rule.off2], dtype=f64) + rule.common * ref
    return _clamp(torch.minimum(rig1, cal[..., 0])), _clamp(torch.minimum(rig2, cal[..., 1]))


def _clamp(bound: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num(bound, nan=NEAR_INF, posinf=NEAR_INF)


@dataclass(frozen=True, slots=True)
class SoftmaxGradRule:
    """The bounds on a recomputed attention row's two identities: |Σ_j dS_ij| of dS = AP ⊙ (dP ⊙ Z - δ) (Z:
    dropout's keep mask scaled by 1/(1-p); ones without dropout), which is 0 for any consistent AP, dP and δ, and
    |Σ_j AP_ij - 1|, which a recompute that agrees with the forward's lse keeps near 0. With
    s_i = scale·‖q_i‖·max_j‖k_j‖ + max_j |mask_ij| (the keys a mask leaves above -200),
    ε_i = eps_coef·s_i + lse_coef·(1 + |lse_i|) (a non-finite lse: 0), ρ_i = exp(ε_i) ≥ Σ_j AP_ij of the recomputed AP,
    and G_i = g_coef·‖dO_i‖·max_j‖V_j‖·(1 + ρ_i)/(1-p), which bounds |dP_ij Z_ij - δ_i|:
      Σ_j dS_ij:   slack·(G_i·((ρ_i - 1) + ρ_i·rel) + tiny·(1 + G_i))
      Σ_j AP_ij:   slack·((ρ_i - 1) + ρ_i·rel_p)
    extreme: ``slack`` is the paper's threshold for both, the rest 0."""

    eps_coef: float
    lse_coef: float
    g_coef: float
    rel: float
    slack: float
    tiny: float
    extreme: bool
    rel_p: float

    def scalars(self) -> tuple[float, ...]:
        """The kernel's order: (eps_coef, lse_coef, g_coef, rel, slack, tiny, extreme, rel_p)."""
        return (self.eps_coef, self.lse_coef, self.g_coef, self.rel, self.slack, self.tiny, float(self.extreme),
                self.rel_p)


def softmax_grad_rule(*, t: int, s: int, d: int, dtype: torch.dtype, tol: Tolerance, u_fwd: float = 0.0,
                      u_kernel: float = 0.0, scores_dtype: torch.dtype | None = None) -> SoftmaxGradRule:
    """dtype: the inputs' (the forward rounded its output to it); scores_dtype: the dtype the forward rounded its
    scores to before the softmax (the PyTorch tile loop's half-precision products), None where it kept them in fp32
    accumulators (a fused kernel: FlashAttention, the Triton forward); u_fwd: the forward's fp32 operand rounding
    (TF32); u_kernel: this backward's own (its scores and dP under TF32). The terms are encoded.py's (``_encode`` and
    ``_ratios``): the scores' difference between the forward and this recompute (its rounding and order, the lse's
    own roundings), |dP - δ| ≤ ‖dO‖ (‖V_j‖ + ‖O_i‖), and the accumulation of the row sum; plus Z ≤ 1/(1-p), and the
    kernel's TF32 rounding of S and dP. Σ_j AP_ij reads no output of the forward but its lse: its relative term
    is the accumulation and the exponentials' rounding only."""
    if tol.mode == "extreme":
        return SoftmaxGradRule(0.0, 0.0, 0.0, 0.0, tol.extreme_threshold * tol.factor, 0.0, True, 0.0)
    u_in = torch.finfo(dtype).eps / 2
    u_acc = torch.finfo(_F32).eps / 2
    u_s = 3 * torch.finfo(scores_dtype).eps / 2 if scores_dtype is not None else 3 * u_acc + 2 * u_fwd
    n = s + t + d + 8
    accumulation = 2 * gamma(n, _F32)
    if tol.calibrated:
        accumulation = min(accumulation, tol.sigmas * u_acc * math.sqrt(n))
    return SoftmaxGradRule(
        eps_coef=u_s + 2 * u_kernel + 2 * gamma(d, _F32), lse_coef=8 * u_acc,
        g_coef=1 + 2 * u_in + gamma(s + 8, _F32),
        rel=accumulation + 3 * u_in + 2 * u_acc + 2 * u_fwd + 2 * u_kernel,
        slack=2.0 * tol.factor, tiny=torch.finfo(dtype).tiny * n, extreme=False, rel_p=accumulation + 4 * u_acc)


def softmax_grad_bound(rule: SoftmaxGradRule, *, scale: float, q_norm_V: torch.Tensor, k_max_V: torch.Tensor,
                       mask_live_V: torch.Tensor, lse_V: torch.Tensor, do_norm_V: torch.Tensor, v_max_V: torch.Tensor,
                       dropout_p: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(bound on |Σ_j dS_ij|, bound on |Σ_j AP_ij - 1|) per row with torch, float64 (the kernel's formula): k_max,
    v_max, mask_live over the keys the row reads."""
    if rule.extreme:
        full = torch.full_like(q_norm_V, rule.slack, dtype=torch.float64)
        return full, full
    f64 = torch.float64
    lse = lse_V.to(f64)
    lse_abs = torch.where(torch.isfinite(lse), lse.abs(), 0.0)
    eps = rule.eps_coef * (scale * q_norm_V.to(f64) * k_max_V.to(f64) + mask_live_V.to(f64)) + rule.lse_coef * (
        1 + lse_abs)
    rho = eps.exp()
    g = rule.g_coef * do_norm_V.to(f64) * v_max_V.to(f64) * (1 + rho) / (1 - dropout_p)
    return (rule.slack * (g * ((rho - 1) + rho * rule.rel) + rule.tiny * (1 + g)),
            rule.slack * ((rho - 1) + rho * rule.rel_p))
