"""The bound of `tolerance.direction_bounds` for one direction of an fp32 tile product C = A·B accumulated in fp32 (no
bias), factored per checksum vector for a kernel that evaluates it where it makes its sums: the Triton attention
kernel (kernels/triton_attention.py) checks each (query block × key block) tile of AS = Q·Kᵀ and CL = P̃·V in
registers. The kernel takes the scalars (`TileTerms`, made here from the Tolerance) and makes the per-vector
quantities from the tiles; `TileTerms.pair` is the same evaluation in torch, which tests hold to `direction_bounds`
(and the kernel to both).

For vector v of n elements with operand norm a (a' = a + floor), the other operand's norms b_j (b'_j = b_j + floor,
j = 1..n), the norms r_w of the weight vectors its reference dots A_v with (r'_w = r_w + floor; w = ones, 1..n), its
ΣC² and its reference (ref_1, ref_2):

    rigorous:    b_1 = a'·Σ_j b'_j·rig_coef + under,   b_2 = n·b_1
    calibrated:  var_w = a'²·(Σ_j w_j² b'_j²·c_b + r'_w²·c_r) + mom·(M_w + R_w) + c_sq·n^(2(w-1))·(ΣC² + n·tiny)
                 b_1 = min(b_1, z·sqrt(var_1) + under + trunc·|ref_1|)
                 b_2 = min(b_2, z·sqrt(var_2) + off2 + trunc·|ref_2|)

then NaN and +INF read NEAR_INF (`tolerance._clamp`). (M_w, R_w) are the operand-rounding moments of
abft/operand_moments.py for a product whose GEMM rounded its operands (TF32; mom = u_in²/3), 0 otherwise. The paper's
threshold E is the rigorous form with rig_coef = 0 and under = E.

Why fp32 for every dtype: the kernel's tile GEMMs accumulate in fp32 and keep their output in fp32 (bf16 and fp16
operands are exact there, and P̃ is rounded to V's dtype before the GEMM and its reference alike), so each tile is an
fp32 product of exact operands, with the fp32 rule. Pure: floats and tensors in, floats and tensors out.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .tolerance import NEAR_INF, Tolerance, _underflow, _weighted_sq, gamma

__all__ = ["TileTerms", "tile_terms"]

_F32 = torch.float32


@dataclass(frozen=True, slots=True)
class TileTerms:
    """The scalars of one direction's rule for vectors of n elements over a reduction of k (module docstring)."""

    floor: float
    """norm_floor: what a k-long fp32 2-norm can miss through squares below the smallest normal."""
    rig_coef: float
    under: float
    c_b: float
    c_r: float
    c_sq: float
    off2: float
    n: int
    calibrated: bool
    z: float
    """sigmas × factor."""
    trunc: float
    """The truncation mean of a TF32 GEMM per unit of |reference| (0 without operand rounding)."""
    mom: float
    """u_in²/3 per unit of (M + R), the operand-rounding moments (0 without operand rounding, or without moments)."""
    tiny: float

    def as_tuple(self) -> tuple[float, ...]:
        """What the kernel takes, in its order (kernels/triton_checks.py `bound`): the fields, then √c_b, √c_r, √c_sq
        and √mom, with which the kernel makes the variance's terms as norms in fp32 rather than squares in fp64."""
        return (self.floor, self.rig_coef, self.under, self.c_b, self.c_r, self.c_sq, self.off2, float(self.n),
                self.z, self.trunc, self.mom, self.tiny, math.sqrt(self.c_b), math.sqrt(self.c_r),
                math.sqrt(self.c_sq), math.sqrt(self.mom))

    def pair(
        self,
        a_V: torch.Tensor,
        b_norm_N: torch.Tensor,
        ref_norm_2: torch.Tensor,
        sq_V: torch.Tensor,
        ref_V2: torch.Tensor,
        moments_V4: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """((V,) bound on |d1|, (V,) on |d2|) of V vectors of this direction: a_V their operand norms, b_norm_N the
        other operand's n norms, ref_norm_2 (‖B e‖, ‖B w‖), sq_V their ΣC², ref_V2 their references, moments_V4
        [M_1, M_2, R_1, R_2] (operand_moments' layout) or None. The kernel's evaluation, in torch."""
        f64 = torch.float64
        a = a_V.to(_F32) + self.floor
        b = b_norm_N.to(_F32) + self.floor
        rig1 = a * b.sum() * self.rig_coef + self.under
        rig2 = rig1 * self.n
        if self.calibrated:
            a64, b64 = a.to(f64), b.to(f64)
            r64 = (ref_norm_2.to(_F32) + self.floor).to(f64)
            bsq = _weighted_sq(b64)
            sq = sq_V.to(f64) + self.n * self.tiny
            var1 = a64.square() * (bsq[0] * self.c_b + r64[0].square() * self.c_r) + self.c_sq * sq
            var2 = a64.square() * (bsq[1] * self.c_b + r64[1].square() * self.c_r) + self.c_sq * self.n**2 * sq
            if moments_V4 is not None and self.mom:
                m64 = moments_V4.to(f64)
                var1 = var1 + self.mom * (m64[..., 0] + m64[..., 2])
                var2 = var2 + self.mom * (m64[..., 1] + m64[..., 3])
            ref_abs = torch.nan_to_num(ref_V2.to(f64).abs(), nan=0.0, posinf=0.0)
            cal1 = self.z * var1.sqrt() + self.under + self.trunc * ref_abs[..., 0]
            cal2 = self.z * var2.sqrt() + self.off2 + self.trunc * ref_abs[..., 1]
            rig1 = torch.minimum(rig1, cal1.to(_F32))
            rig2 = torch.minimum(rig2, cal2.to(_F32))
        return (torch.nan_to_num(rig1, nan=NEAR_INF, posinf=NEAR_INF),
                torch.nan_to_num(rig2, nan=NEAR_INF, posinf=NEAR_INF))


def tile_terms(n: int, k: int, tol: Tolerance, *, operand_roundoff: float | None = None,
               moments: bool = True) -> TileTerms:
    """`direction_bounds` of one direction of an fp32 product accumulated in fp32, vectors of n elements, reduction
    length k, no bias, factored (`TileTerms`). operand_roundoff: the GEMM rounds its operands (TF32, u_in);
    moments: the caller passes their moments (M, R) per vector (abft/operand_moments.py), else the Cauchy-Schwarz
    operand term. Each line is that function's for this case (its comments say why)."""
    tiny = torch.finfo(_F32).tiny
    if tol.mode == "extreme":
        return TileTerms(0.0, 0.0, tol.extreme_threshold * tol.factor, 0.0, 0.0, 0.0, 0.0, n, False, 0.0, 0.0, 0.0,
                         tiny)
    u = torch.finfo(_F32).eps / 2
    u_in = operand_roundoff or 0.0
    slack = 1.01 * tol.factor
    floor = math.sqrt(k * tiny)
    rig_coef = slack * (2 * gamma(k, _F32) + 2 * gamma(n, _F32) + u) + slack * 2 * u_in
    eta = _underflow(_F32)
    under = slack * n * (eta + (k + 2 * n + 2) * eta)
    u2 = u**2 / 3
    op_var = 2 * u_in**2 / 3
    with_moments = moments and u_in > 0.0
    return TileTerms(
        floor=floor, rig_coef=rig_coef, under=under,
        c_b=k * u2 + n * u2 + (0.0 if with_moments else op_var), c_r=k * u2, c_sq=n**2 * u2,
        off2=under * ((n + 1) / 2), n=n, calibrated=tol.calibrated, z=tol.sigmas * tol.factor,
        trunc=slack * u_in, mom=op_var / 2 if with_moments else 0.0, tiny=tiny,
    )
