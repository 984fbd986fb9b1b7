"""Tolerances on the checksum residuals (d1, d2): the paper's absolute threshold ("extreme") and a round-off bound.

The round-off bound has two parts. The rigorous one (below) holds for any data and any summation order, and grows
like u·n·(K+n) times the operand norms: at 7B shapes an error must be ~100× the RMS element to exceed it. The
calibrated one (`calibrated_*`) is a probabilistic model: rounding errors as independent, mean-zero variables of
variance ≤ u²/3 relative to the partial sum they round (Higham & Mary 2019), so the residual's variance adds up over
the K products and n summed elements instead of its magnitude; the threshold is `sigmas` standard deviations, capped by
the rigorous bound. The partial sums it scales are bounded by Cauchy-Schwarz (|s_k| ≤ ‖A_i‖‖B_j‖, any data), or, in
the directions `bounds(walk=...)` names, modelled as a random walk plus a drift: Σ_k s_k² ≈ K/2·Σ_k a_k²b_k² +
K/2·C², with Σ_k a_k²b_k² exact when the caller passes it (`moments_NR4`) or bounded by ‖a‖₂²‖b‖∞² (Hölder), for
reductions without order along K whose errors are independent across the vector (projection rows). docs/abft.md has
both models, their terms and the measurements that chose `sigmas`.

Derivation (docs/abft.md has the long form). For C = A·B (+ bias b), row i, weights w over the C columns:
  computed C_ij = fl(A_i·B_j + b_j):  |err| <= γ_K P_ij + u_out (P_ij + |b_j|),  P_ij = Σ_k |A_ik||B_kj| <= ‖A_i‖‖B_j‖
  checksum Σ_j w_j C_ij (acc dtype):  |err| <= γ_C Σ_j w_j |C_ij|
  reference A_i (B w) + b·w:          |err| <= (γ_C + γ_K) Σ_j w_j P_ij + γ_C Σ_j w_j |b_j|
so |d1| <= (2γ_K + 2γ_C + u_out)(1 + O(u)) ‖A_i‖ Σ_j ‖B_j‖ + (2γ_C + u_out) Σ_j |b_j|   (w = ones),
with γ_n = n·u_acc/(1 - n·u_acc) for any summation order. The column direction swaps the roles (reduce over R).
Only row norms of A and column norms of B are needed: no |A|·|B| product is ever formed.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "BF16_OPERAND_ROUNDOFF",
    "CALIBRATED_SIGMAS",
    "NEAR_INF",
    "TF32_OPERAND_ROUNDOFF",
    "Bound",
    "RowRule",
    "RowTerms",
    "Tolerance",
    "acc_dtype",
    "bounds",
    "direction_bounds",
    "gamma",
    "norm_floor",
    "row_rule",
    "row_terms",
]


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Checksums of half-precision data accumulate in fp32: bf16/fp16 sums of a few hundred terms lose the digits the
    residual test needs (DESIGN.md, issue 2)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


NEAR_INF = 1e10
"""|x| above this is "near-INF" (ATTNChecker's T_big): located by value, rebuilt from the checksum."""

CALIBRATED_SIGMAS = 10.0
"""Standard deviations of the modelled residual at which the calibrated tolerance flags. The model overestimates
the measured clean residual (worst measured z-score over the validation sweep, docs/abft.md); 10 is inside the 7-20×
the published V-ABFT thresholds use, and the Gaussian tail at 10σ is ~1e-23 per vector."""

TF32_OPERAND_ROUNDOFF = 2.0**-10
"""TF32 keeps 10 mantissa bits. Tensor cores may truncate fp32 operands instead of rounding them (up to one TF32 ulp,
2^-10 relative, biased), so the bound uses the truncation unit, not 2^-11."""
BF16_OPERAND_ROUNDOFF = 2.0**-8
"""bf16 keeps 7 explicit mantissa bits: unit round-off 2^-8 (round to nearest)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Tolerance:
    mode: str = "roundoff"
    """roundoff: the bounds above; extreme: the paper's absolute threshold E on |d1|."""
    factor: float = 1.0
    """Multiplies the round-off bound (both parts) or E."""
    extreme_threshold: float = 1.0
    """ATTNChecker's E."""
    near_inf: float = NEAR_INF
    fix_threshold: float = 1e3
    """|d1| above this rebuilds the element as checksum minus the healthy elements instead of adding d1 back
    (ATTNChecker's T_fix): adding a difference to a huge value keeps none of its digits."""
    calibrated: bool = True
    """roundoff only: flag at min(rigorous bound, `sigmas` × modelled std) instead of the rigorous bound alone."""
    sigmas: float = CALIBRATED_SIGMAS
    grouped: bool = True
    """roundoff only: vectors of >= 2 × GROUP_MIN elements carry one checksum pair per run of >= GROUP_MIN elements
    (abft/checksum.py), so the clean residual sums fewer round-offs; False: one pair per row and column."""

    def __post_init__(self) -> None:
        if self.mode not in ("roundoff", "extreme"):
            raise ValueError(f"tolerance.mode must be 'roundoff' or 'extreme', got {self.mode!r}")
        if not self.factor > 0:
            raise ValueError(f"tolerance.factor must be > 0, got {self.factor!r}")
        if not (self.sigmas > 0 and math.isfinite(self.sigmas)):
            raise ValueError(f"tolerance.sigmas must be a finite number > 0, got {self.sigmas!r}")


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
    """A tolerance on (|d1|, |d2|) per vector.

    Rigorous part: base + abs_coef × Σ|C| over the vector, on d1; n × that on d2 (weights ≤ n).
    Calibrated part (when `var_NV2` is set): sigmas × sqrt(var_NV2 + sq_coef_2 × ΣC²) + offset per (d1, d2), the
    smaller of the two parts wins. The Σ|C| and ΣC² parts are re-evaluated on C as it stands, so after a correction the
    bound no longer carries the faulty value (a 1e20 in a half-precision row would otherwise loosen its own
    re-verification).
    """

    base: torch.Tensor
    """(..., V)"""
    abs_coef: float = 0.0
    var_NV2: torch.Tensor | None = None
    """(..., V, 2): modelled variance of (d1, d2) from the operand norms."""
    sq_coef: tuple[float, float] = (0.0, 0.0)
    """Variance per unit of ΣC² over the vector, for (d1, d2)."""
    ref_coef: float = 0.0
    """Linear slack per unit of |reference| (|Σ_j w_j x_j|, for d1 and d2): the common-mode part of the output
    rounding (`bounds`)."""
    offset_NV: torch.Tensor | float = 0.0
    """Absolute slack added to the calibrated part (underflow, error already in a passed reference)."""
    sigmas: float = 0.0
    n: int = 1
    """Vector length (the largest d2 weight)."""
    ref_sq_coef: float = 0.0
    """Variance per unit of reference² (Σ_j w_j x_j)², for d1 and d2: the drift of partial sums whose terms share a
    sign (the ∞-norm model of `bounds`). Needs the reference, as ref_coef does."""

    def of(self, abs_sum_NV: torch.Tensor | None, sq_sum_NV: torch.Tensor | None = None) -> torch.Tensor:
        """(..., V) the tolerance on |d1| (a rule with a common-mode term needs the reference: `pair`)."""
        return self.pair(abs_sum_NV, sq_sum_NV)[0]

    def of2(self, abs_sum_NV: torch.Tensor | None, sq_sum_NV: torch.Tensor | None = None) -> torch.Tensor:
        """(..., V) the tolerance on |d2|."""
        return self.pair(abs_sum_NV, sq_sum_NV)[1]

    def pair(
        self, abs_sum_NV: torch.Tensor | None, sq_sum_NV: torch.Tensor | None, ref_NV2: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """((..., V) tolerance on |d1|, (..., V) on |d2|). ref_NV2: the reference checksums (..., V, 2). Without ΣC²
        (sq_sum_NV None), or without the reference when the rule has a common-mode term, the rule falls back to its
        rigorous part."""
        rig = self.base if abs_sum_NV is None or self.abs_coef == 0.0 else self.base + self.abs_coef * abs_sum_NV
        rig2 = rig * self.n
        needs_sq = self.sq_coef != (0.0, 0.0)
        has_ref = (self.ref_coef == 0.0 and self.ref_sq_coef == 0.0) or ref_NV2 is not None
        if self.var_NV2 is not None and has_ref and (sq_sum_NV is not None or not needs_sq):
            var1_NV, var2_NV = self.var_NV2[..., 0], self.var_NV2[..., 1]
            if needs_sq and sq_sum_NV is not None:
                # ΣC² made in C's dtype drops every square below its smallest normal: n of them at most.
                sq_NV = sq_sum_NV.to(var1_NV.dtype) + self.n * torch.finfo(sq_sum_NV.dtype).tiny
                var1_NV, var2_NV = var1_NV + self.sq_coef[0] * sq_NV, var2_NV + self.sq_coef[1] * sq_NV
            if self.ref_sq_coef != 0.0 and ref_NV2 is not None:
                drift1_NV, drift2_NV = self._drift(ref_NV2, var1_NV.dtype)
                var1_NV, var2_NV = var1_NV + drift1_NV, var2_NV + drift2_NV
            # The variance is float64 (it underflows fp32 for |C| < ~1e-15); the tolerance goes back to rig's dtype.
            # The offset is per-element absolute error (underflow: half a subnormal step each) summed over the vector;
            # d2 weighs element j by j, so it sums to (n + 1)/2 times d1's. fp16 gradients without loss scaling are
            # mostly subnormal: with d1's offset, d2 flagged clean backward GEMMs (bench/clean_campaign.py).
            off2 = self.offset_NV * ((self.n + 1) / 2)
            cal1_NV, cal2_NV = self.sigmas * var1_NV.sqrt() + self.offset_NV, self.sigmas * var2_NV.sqrt() + off2
            if self.ref_coef != 0.0 and ref_NV2 is not None:
                # Common-mode output rounding, added linearly (not as a variance): `bounds` has the model. The
                # reference side, not Σ_j w_j C_ij: a fault sits in C, so C's own sum would let it loosen its own
                # threshold (by u_out·|e|, and a 1e20 by far more than the residual it leaves after a correction);
                # the reference is made from the inputs only. A non-finite reference is never flagged anyway.
                ref_abs_NV2 = torch.nan_to_num(ref_NV2.abs().to(var1_NV.dtype), nan=0.0, posinf=0.0)
                cal1_NV = cal1_NV + self.ref_coef * ref_abs_NV2[..., 0]
                cal2_NV = cal2_NV + self.ref_coef * ref_abs_NV2[..., 1]
            rig = torch.minimum(rig, cal1_NV.to(rig.dtype))
            rig2 = torch.minimum(rig2, cal2_NV.to(rig2.dtype))
        return _clamp(rig), _clamp(rig2)

    def _drift(self, ref_NV2: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(d1, d2) drift variance ref_sq_coef × reference². A non-finite reference adds nothing (never flagged)."""
        ref_NV2 = torch.nan_to_num(ref_NV2.to(dtype), nan=0.0, posinf=0.0, neginf=0.0)
        sq_NV2 = ref_NV2.square() * self.ref_sq_coef
        return sq_NV2[..., 0], sq_NV2[..., 1]

    def sigma(self, sq_sum_NV: torch.Tensor, ref_NV2: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The modelled standard deviation of (d1, d2) per vector, before `sigmas`, the offset and the ceiling (for
        validating the model: measured |d| / sigma is a z-score). ref_NV2: the reference checksums, for a rule with a
        drift term (ref_sq_coef)."""
        if self.var_NV2 is None:
            raise ValueError("sigma() needs a calibrated bound (Tolerance(calibrated=True), mode 'roundoff')")
        if self.ref_sq_coef != 0.0 and ref_NV2 is None:
            raise ValueError("sigma() of a rule with a drift term needs the reference checksums")
        sq_NV = sq_sum_NV.to(self.var_NV2.dtype)
        var1_NV = self.var_NV2[..., 0] + self.sq_coef[0] * sq_NV
        var2_NV = self.var_NV2[..., 1] + self.sq_coef[1] * sq_NV
        if self.ref_sq_coef != 0.0 and ref_NV2 is not None:
            drift1_NV, drift2_NV = self._drift(ref_NV2, var1_NV.dtype)
            var1_NV, var2_NV = var1_NV + drift1_NV, var2_NV + drift2_NV
        return var1_NV.sqrt(), var2_NV.sqrt()

    def plus(self, extra_NV: torch.Tensor) -> Bound:
        """This bound with an absolute error (a passed reference's own round-off) added to both parts."""
        return dataclasses.replace(self, base=self.base + extra_NV, offset_NV=self.offset_NV + extra_NV)

    def grouped(self) -> Bound:
        """This bound, made with the groups as a batch dim just before the vectors ((..., g, V)), laid out as grouped
        checksum vectors (..., V·g) (v = i·g + h, abft/checksum.py)."""
        off = self.offset_NV if isinstance(self.offset_NV, float) else self.offset_NV.transpose(-2, -1).flatten(-2)
        var = None if self.var_NV2 is None else self.var_NV2.transpose(-3, -2).flatten(-3, -2)
        return dataclasses.replace(self, base=self.base.transpose(-2, -1).flatten(-2), var_NV2=var, offset_NV=off)

    def select(self, idx: Any, shape: torch.Size) -> Bound:
        """The vectors of the matrices `idx` (leading dims of `shape` (..., V))."""
        var = None if self.var_NV2 is None else self.var_NV2.expand(*shape, 2)[idx]
        off = self.offset_NV if isinstance(self.offset_NV, float) else self.offset_NV.expand(shape)[idx]
        return dataclasses.replace(self, base=self.base.expand(shape)[idx], var_NV2=var, offset_NV=off)


def _clamp(bound: torch.Tensor) -> torch.Tensor:
    """An undefined bound (an operand norm that overflowed to INF, or NaN from an INF·0) falls back to NEAR_INF, so an
    extreme residual still flags. A finite bound is kept as it is, however large: it is what the operands imply, and
    a fixed ceiling below it flagged clean products. Diverged bf16 training (bench/clean_campaign.py, `outliers`)
    makes gradients of 1e13-1e21 whose GEMMs are correct to within their own output rounding (residual / value
    ≈ 2.5e-3 < u_bf16); clamped at 1e10 they were 23,964 false positives in 10^5 checks. A fault in C is not hidden by
    this: the bound comes from the operands (and, in the Σ|C| / ΣC² terms, from C with coefficients far below 1), so a
    1e20 written into C of normal-sized operands still leaves a residual ~1e20 over a bound of ordinary size."""
    return torch.nan_to_num(bound, nan=NEAR_INF, posinf=NEAR_INF)


def norm_floor(norm: torch.Tensor, k: int) -> float:
    """The most a K-long 2-norm made in ``norm``'s dtype can miss through squares below the smallest normal."""
    return math.sqrt(k * torch.finfo(norm.dtype).tiny)


@functools.lru_cache(maxsize=256)
def _weights(n: int, power: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(n, 2): column 0 ones, column 1 = (1..n)^power. Cached: callers must not write it."""
    w_n2 = torch.ones(n, 2, device=device, dtype=dtype)
    w_n2[:, 1] = torch.arange(1, n + 1, device=device, dtype=dtype) ** power
    return w_n2


def _weighted_sq(norm_NV: torch.Tensor) -> torch.Tensor:
    """(..., 2): (Σ_v norm_v², Σ_v v² norm_v²) over the last dim, the d1/d2 sums of squared operand norms. One
    product with cached weights: a rule takes several of these, and each was five small ops (a fixed cost of every
    check)."""
    return norm_NV.square() @ _weights(norm_NV.shape[-1], 2, norm_NV.device, norm_NV.dtype)


def _weighted_sum(norm_NV: torch.Tensor) -> torch.Tensor:
    """(..., 2): (Σ_v norm_v, Σ_v v·norm_v), triangle-inequality bounds on ‖B w‖ when the caller has no better."""
    return norm_NV @ _weights(norm_NV.shape[-1], 1, norm_NV.device, norm_NV.dtype)


RANDOM_WALK = 0.5
"""Σ_k s_k² of the K partial sums s_k of a dot product whose products p_l have no common sign, per unit of
K·Σ_l p_l²: the partial sums are a random walk, E s_k² = k·mean(p²), summed over k ≈ K²/2·mean(p²) (`bounds`)."""
DRIFT = 0.5
"""Σ_k s_k² per unit of K·(final sum)²: the part of the partial sums that a common sign (or one dominant product)
drives. A constant drift gives 1/3 (Σ_k (k/K)² ≈ K/3). One dominant product p first in the order keeps every partial
sum at ≈ p: Σ_k s_k² ≈ K·p², which the walk's RANDOM_WALK·K·p² (p² ≤ Σ_l p_l²) and DRIFT·K·C² (C ≈ p) cover
together at 1/2 each (`bounds`)."""


def _calibrated_var(
    a_norm_NR: torch.Tensor,
    b_norm_NC: torch.Tensor,
    ref_norm_N2: torch.Tensor | None,
    *,
    k: int,
    u_acc: float,
    op_var: float = 0.0,
    split_var: float = 0.0,
    maxes: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
    moments_NR4: torch.Tensor | None = None,
    operand_NR4: torch.Tensor | None = None,
) -> torch.Tensor:
    """(..., R, 2) modelled variance of (d1, d2) for the row direction of C = A·B (swap the arguments for columns).

    Per row i, for weights w (1, or 1..n over the n columns j), each term is (rounding variance) × (what it scales).
    Without `maxes` (the Cauchy-Schwarz model: every partial sum ≤ ‖A_i‖‖B_j‖):
      product C_ij (K-long dot, each step's error ≤ u·|partial sum| ≤ u‖A_i‖‖B_j‖; plus operand rounding op_var and
      the half-precision split-K part split_var):       (K·u²/3 + op_var + split_var)·‖A_i‖²·Σ_j w_j²‖B_j‖²
      reference A_i·(Bw) (K-long dot):                  K·u²/3·‖A_i‖²·‖Bw‖²
      forming Bw (n-long sums per k):                   n·u²/3·‖A_i‖²·Σ_j w_j²‖B_j‖²
    With maxes = (‖A_i‖∞ (..., R), ‖B_j‖∞ (..., C), ‖Bw‖∞ (..., 2) or None), the random-walk model (`bounds`):
    Σ_k a_k²b_k² ≤ H_ij = min(‖A_i‖²‖B_j‖∞², ‖A_i‖∞²‖B_j‖²) (Hölder), and
      product:      (RANDOM_WALK·K·u²/3 + u²/3 + op_var/2)·Σ_j w_j²H_ij + split_var·‖A_i‖²·Σ_j w_j²‖B_j‖²
                    (u²/3 the rounding of each product; B's operand rounding scales Σ_k a_k²b_k²; the
                    half-precision split-K part keeps the Cauchy-Schwarz form)
      reference:    (K·u²/3·RANDOM_WALK + op_var/2)·min(‖A_i‖²‖Bw‖∞², ‖A_i‖∞²‖Bw‖²)   (op_var/2: A's operand
                    rounding, shared by all columns j: Σ_k ε_k A_ik (Bw)_k)
      forming Bw:   n·u²/3·‖A_i‖²·(RANDOM_WALK·Σ_j w_j²‖B_j‖∞² + DRIFT·‖Bw‖∞²)   (max over the K sums (Bw)_l)
    with the drift parts of the product and the reference in Bound.sq_coef / Bound.ref_sq_coef. moments_NR4: the
    exact (Σ_j w_j² Σ_k a_k²b_kj², Σ_k a_k²(Bw)_k²) per weighting (with their floors), each used where it is below
    its Hölder bound, in the product, reference and forming terms (forming: n·u²/3·(½ of the first + DRIFT × the
    second), the sum over k of A_ik² times the variance of (Bw)_k). The output-rounding
    and checksum-summation terms scale with ΣC² of the vector and live in Bound.sq_coef.
    operand_NR4 (Cauchy-Schwarz model only): [M, R] for (d1, d2) (abft/operand_moments.py): the operand term is then
    u_in²/3·(M + R), M for the operand whose rounding is independent across the vector and R for the one shared by
    it, not the Cauchy-Schwarz form, which takes every element's operand rounding as independent across the vector
    (an operand element shared by the whole vector, V_kj in a context column, is not).
    """
    a_sq_NR1 = a_norm_NR.square()[..., None]
    bsq_N2 = _weighted_sq(b_norm_NC)
    ref_sq_N2 = (_weighted_sum(b_norm_NC) if ref_norm_N2 is None else ref_norm_N2).square()
    n = b_norm_NC.shape[-1]
    u2 = u_acc**2 / 3
    if maxes is None:
        cs_b_NR2 = a_sq_NR1 * bsq_N2[..., None, :]
        cs_ref_NR2 = a_sq_NR1 * ref_sq_N2[..., None, :]
        if operand_NR4 is None:
            return cs_b_NR2 * (k * u2 + op_var + split_var + n * u2) + cs_ref_NR2 * (k * u2)
        # op_var/2 = u_in²/3 per rounding. The product, reference and forming terms keep Cauchy-Schwarz: bounding their
        # partial sums by M and R instead was tried and is not safe (docs/abft.md, "The context's operand rounding").
        moments_NR2 = operand_NR4[..., :2] + operand_NR4[..., 2:]
        return (cs_b_NR2 * (k * u2 + split_var + n * u2) + cs_ref_NR2 * (k * u2) + moments_NR2 * (op_var / 2))
    a_max_NR, b_max_NC, ref_max_N2 = maxes
    amax_sq_NR1 = a_max_NR.square()[..., None]
    bmax_N2 = _weighted_sq(b_max_NC)
    # ‖Bw‖∞ ≤ Σ_j w_j‖B_j‖∞ and ≤ ‖Bw‖₂ when the caller has no better.
    ref_max_sq_N2 = torch.minimum(_weighted_sum(b_max_NC).square(), ref_sq_N2)
    if ref_max_N2 is not None:
        ref_max_sq_N2 = torch.minimum(ref_max_N2.square(), ref_max_sq_N2)
    holder_NR2 = torch.minimum(a_sq_NR1 * bmax_N2[..., None, :], amax_sq_NR1 * bsq_N2[..., None, :])
    ref_NR2 = torch.minimum(a_sq_NR1 * ref_max_sq_N2[..., None, :], amax_sq_NR1 * ref_sq_N2[..., None, :])
    forming_NR2 = a_sq_NR1 * ((RANDOM_WALK * bmax_N2 + DRIFT * ref_max_sq_N2) * (n * u2))[..., None, :]
    if moments_NR4 is not None:
        holder_NR2 = torch.minimum(holder_NR2, moments_NR4[..., :2])
        ref_NR2 = torch.minimum(ref_NR2, moments_NR4[..., 2:])
        exact_NR2 = (RANDOM_WALK * moments_NR4[..., :2] + DRIFT * moments_NR4[..., 2:]) * (n * u2)
        forming_NR2 = torch.minimum(forming_NR2, exact_NR2)
    # Operand rounding, per operand: B_kj's is independent over j (Σ_j w_j² Σ_k a_k² b_kj² ≤ Σ_j w_j² H_ij); A_ik's is
    # shared by every column j, so it enters d as Σ_k ε_k a_ik (Bw)_k (≤ the reference's Hölder form).
    var_NR2 = holder_NR2 * (RANDOM_WALK * k * u2 + u2 + op_var / 2) + ref_NR2 * (RANDOM_WALK * k * u2 + op_var / 2)
    var_NR2 = var_NR2 + a_sq_NR1 * (bsq_N2 * split_var)[..., None, :]
    return var_NR2 + forming_NR2


def bounds(a_norm_NR: torch.Tensor, b_norm_NC: torch.Tensor, **kwargs: Any) -> tuple[Bound, Bound]:
    """(row bound over (..., R), column bound over (..., C)) on |d1| for C = A·B (+ bias): both of
    `direction_bounds`, which has the arguments."""
    rules = direction_bounds(("row", "col"), a_norm_NR, b_norm_NC, **kwargs)
    return rules["row"], rules["col"]


def direction_bounds(
    directions: tuple[str, ...],
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
    operand_roundoff: float | None = None,
    ref_norms: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    a_max_NR: torch.Tensor | None = None,
    b_max_NC: torch.Tensor | None = None,
    ref_maxes: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    walk: tuple[bool, bool] = (False, False),
    moments_NR4: torch.Tensor | None = None,
    operand_moments: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
) -> dict[str, Bound]:
    """The bound on |d1| for C = A·B (+ bias) of each direction named ("row": over (..., R), "col": over (..., C)), by
    name. A check that verifies one direction (the clean fast path) or takes its two from different groupings makes
    only what it uses: a rule is some fifty small tensor ops, a fixed cost of every check.

    a_norm_NR: ‖A_i‖₂ per row of A; b_norm_NC: ‖B_j‖₂ per column of B (broadcastable batch dims); k: reduction length.
    use_abs: the output-rounding and checksum terms use Σ|C| of C itself instead of the Cauchy-Schwarz estimate:
    worth one pass over C for bf16/fp16, whose output rounding (u = 2^-9 / 2^-12) dominates the bound.
    gemm_accumulates_in: the precision the product C itself was reduced in, when coarser than fp32 (cuBLAS with
    reduced-precision reductions allowed may split K and sum partials in fp16/bf16). An untested model (no GPU
    run yet): see docs/abft.md.
    operands_cast_to: the product ran on A and B rounded to this dtype (autocast: fp32 tensors, bf16 GEMM), while
    the references use them as given: each operand's rounding adds u·P_ij (and u·|b_j| for the bias).
    operand_roundoff: the same for an fp32 GEMM that rounds its operands itself (TF32, oneDNN bf16:
    attnchecker.matmul_precision); the references must then run in IEEE fp32 (ieee_fp32_matmul there).
    ref_norms: (‖B w‖ (..., 2), ‖wᵀA‖ (..., 2)) for w = ones and 1..n, the vectors the row (column) references are
    dotted with, for the calibrated model; None falls back to the triangle inequality (Σ_j w_j ‖B_j‖), which is
    √n looser on uncorrelated columns.
    walk: (row, column): the directions whose calibrated part takes the random-walk model (`_calibrated_var`,
    docs/abft.md): the K partial sums of a dot product as a random walk plus a drift, bounded by Hölder
    (Σ_k a_k²b_k² ≤ ‖a‖₂²‖b‖∞²) instead of Cauchy-Schwarz on every partial sum, about K/ln K less variance on
    Gaussian-like data. Its rule needs the references (`Bound.pair(..., ref_NV2)`) for the drift term. Only for vectors
    whose products' rounding errors are independent across the vector: a row of X·Wᵀ runs over the weight's distinct
    rows; a vector over tokens does not qualify, since activations with outlier channels make the rows of X nearly
    collinear and their products round alike (a whole column's errors of one sign in the clean campaign: docs/abft.md).
    The other direction keeps the Cauchy-Schwarz model, whose per-element slack absorbs that correlation.
    a_max_NR, b_max_NC: ‖A_i‖∞ per row of A, ‖B_j‖∞ per column of B, for `walk` (None: the 2-norm, ‖x‖∞ ≤ ‖x‖₂).
    ref_maxes: (‖B w‖∞, ‖wᵀA‖∞) (..., 2), the reference vectors' ∞-norms; None: the smaller of ‖Bw‖₂ and
    Σ_j w_j‖B_j‖∞.
    moments_NR4: per row (..., R, 4), as computed in fp32, for a `walk` row direction: Σ_j w_j² Σ_k A_ik² B_kj² and
    Σ_k A_ik² (Bw)_k² for w = ones and 1..n ((A∘A)·[β, (Bw)∘(Bw)], β_k = Σ_j w_j² B_kj²: one skinny product, 4
    columns): the exact second moments in place of their Hölder bounds (~2 ln K ≈ 16× lower on Gaussian-like
    columns at K = 4096). Floored here by what fp32 squares and products below the smallest normal can drop.
    operand_moments: (row (..., R, 4), column (..., C, 4)) per vector, for a direction that keeps the Cauchy-Schwarz
    model, of a product whose operands the GEMM rounded: [M, R] for (d1, d2), bounds on that rounding's error per unit
    of u_in²/3 (abft/operand_moments.py makes the context's; `_calibrated_var` has the term). The rule then adds the
    truncation mean linearly (u_in·|reference|), as the random-walk model does.
    `row_terms` factors the row rule of the fp32 case per row for the native attention pass: a change to that case
    here must be made there too (tests/agent/test_fused_attention.py holds the two to the same verdicts).
    """
    if not directions or any(d not in ("row", "col") for d in directions):
        raise ValueError(f"direction_bounds: directions must be a non-empty subset of ('row', 'col'), got "
                         f"{directions!r}")
    n_rows, n_cols = a_norm_NR.shape[-1], b_norm_NC.shape[-1]
    if tol.mode == "extreme":
        # The paper flags on d1 only: d2's bound is n × E, which only an extreme d2 exceeds.
        e = tol.extreme_threshold * tol.factor
        return {d: Bound(torch.full_like(a_norm_NR if d == "row" else b_norm_NC, e), n=n_cols if d == "row" else n_rows)
                for d in directions}
    # A norm made in fp32 (or a half dtype) drops every element below √(smallest normal) (~1e-19 in fp32): its square
    # underflows. Vanishing gradients (a saturated softmax's dS) are such values; without this floor their norms read
    # 0 and a clean product is flagged. ‖x‖ over K elements is low by at most √(K·tiny).
    a_norm_NR = a_norm_NR + norm_floor(a_norm_NR, k)
    b_norm_NC = b_norm_NC + norm_floor(b_norm_NC, k)
    ref_norms = tuple(None if r is None else r + norm_floor(r, k) for r in ref_norms)  # type: ignore[assignment]
    u_out = torch.finfo(out_dtype).eps / 2
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
    u_in = max(torch.finfo(operands_cast_to).eps / 2 if operands_cast_to is not None else 0.0, operand_roundoff or 0.0)
    # Gradual underflow: results below the smallest normal carry an absolute error (half a subnormal step) that no
    # relative term covers; it matters for fp16 (step 2^-24), not for bf16/fp32.
    eta_out, eta_acc = _underflow(out_dtype), _underflow(acc_dtype(out_dtype))
    # bf16 GEMMs may flush subnormal operands and results to zero (this machine's AVX512-BF16 CPU kernels do: a dS row
    # whose one nonzero was 8e-39 gave a dK row of 0 against an exact 1e-37, flagged in the clean campaign's diverged
    # bf16 run). A flushed a_k costs |a_k||b_k| < tiny·|b_k|: per element ≤ tiny·(‖A_i‖₁ + ‖B_j‖₁ + 1) ≤
    # tiny·(√K(‖A_i‖ + ‖B_j‖) + 1), summed over the vector. Absolute, ~1e-38 times the norms: it only ever matters
    # for vectors of values near bf16's smallest normal.
    flush = slack * torch.finfo(torch.bfloat16).tiny if torch.bfloat16 in (out_dtype, operands_cast_to) else 0.0
    rigorous: dict[str, tuple[torch.Tensor, float, torch.Tensor | float]] = {}
    for d in directions:
        # The row direction: vectors are rows i of C (length n_cols), each A_i against every B_j; the column
        # direction swaps the roles (length n_rows). Only the bias enters differently (a column holds one b_j).
        mine, other, n_vec = (a_norm_NR, b_norm_NC, n_cols) if d == "row" else (b_norm_NC, a_norm_NR, n_rows)
        g_v = gamma(n_vec, out_dtype)
        vec = mine * other.sum(-1, keepdim=True)
        if use_abs:
            vec = vec * (slack * (2 * g_k + g_v))
            coef, bias_coef = slack * (g_v + n_round * u_out), slack * (g_v + u_out)
        else:
            vec = vec * (slack * (2 * g_k + 2 * g_v + n_round * u_out))
            coef, bias_coef = 0.0, slack * (2 * g_v + u_out)
        if u_in > 0.0:
            vec = vec + slack * 2 * u_in * mine * other.sum(-1, keepdim=True)
            bias_coef = bias_coef + slack * u_in
        if bias_abs_C is not None:
            vec = vec + (bias_coef * bias_abs_C.sum(-1, keepdim=True) if d == "row"
                         else bias_coef * n_rows * bias_abs_C)
        under: torch.Tensor | float = slack * n_vec * (eta_out + (k + 2 * n_vec + 2) * eta_acc)
        if flush:
            under = under + flush * (math.sqrt(k) * (other.sum(-1, keepdim=True) + n_vec * mine) + n_vec)
        rigorous[d] = (vec + under, coef, under)
    if not tol.calibrated:
        return {d: Bound(vec, coef, n=n_cols if d == "row" else n_rows) for d, (vec, coef, _) in rigorous.items()}

    # The calibrated model (module docstring, docs/abft.md): variances, not magnitudes, add up.
    acc = acc_dtype(out_dtype)
    u_acc = torch.finfo(acc).eps / 2
    u2 = u_acc**2 / 3
    split_var = min(k, 64) * (torch.finfo(gemm_accumulates_in).eps / 2) ** 2 / 3 if gemm_accumulates_in else 0.0
    u_ops = [torch.finfo(operands_cast_to).eps / 2] if operands_cast_to is not None else []
    u_ops += [operand_roundoff] if operand_roundoff is not None else []
    # Each product a_k b_k carries both operands' rounding: 2u²/3 relative variance, ≤ Σ_k a_k²b_k² in all.
    op_var = 2 * max(u_ops) ** 2 / 3 if u_ops else 0.0
    # Output rounding (half dtypes: fp32 outputs round inside the K-long sum) and the checksum's own n-long sum, both
    # per unit of ΣC²; Σ_j j² C_ij² ≤ n² ΣC² for d2. Cauchy-Schwarz model: the checksum's partial sums are
    # ≤ ‖w∘C‖₁ ≤ √n ‖w∘C‖₂ (n² u²/3 per ΣC²). Random-walk model: RANDOM_WALK·n u²/3 per ΣC², its drift
    # DRIFT·n u²/3 per (Σ_j w_j C_ij)² ≈ reference², and the product's own drift DRIFT·K u²/3 per C_ij².
    u_out_var = n_round * u_out**2 / 3 if acc != out_dtype else 0.0
    # Variances in float64: u²·‖A_i‖²·‖B_j‖² underflows fp32 once the product's values are below ~1e-15 (vanishing
    # gradients), which would leave only the underflow offset as the tolerance. Per-vector tensors: cheap in fp64.
    f64 = torch.float64
    a64, b64 = a_norm_NR.to(f64), b_norm_NC.to(f64)
    amax64 = bmax64 = None
    if any(walk[0 if d == "row" else 1] for d in directions):
        amax64 = a64 if a_max_NR is None else a_max_NR.to(f64)
        bmax64 = b64 if b_max_NC is None else b_max_NC.to(f64)
    bias64_C = None if bias_abs_C is None else bias_abs_C.to(f64)
    z = tol.sigmas * tol.factor
    # Output rounding is not independent when a vector's values are near-equal: a context column under near-uniform
    # attention holds 64 values ~1.2475 that all round up to 1.25 in bf16, and their errors add linearly (BERT and
    # GPT-2 bf16 runs of bench/clean_campaign.py: |d1| up to 2.1× the variance-only threshold). So the rounding error
    # is modelled as err_j = δ·x_j + ε_j, |δ| ≤ u_out per rounding step, ε_j independent (the u_out_var term above):
    # Σ_j w_j err_j ≤ u_out·|Σ_j w_j x_j| + (independent part), the first term added linearly at face value (not
    # multiplied by `sigmas`: it is a worst case, not a deviation). Σ_j w_j x_j is the reference checksum itself.
    ref_coef = slack * n_round * u_out if acc != out_dtype else 0.0
    # TF32 tensor cores may truncate operands: each product's relative error then has a mean of up to u_in/2 per
    # operand (half a truncation unit), the same sign for every product, so Σ_j w_j err_ij carries a common-mode part
    # ≤ u_in·|Σ_j w_j C_ij| (added linearly, as the output rounding's). Every model takes it: the Cauchy-Schwarz
    # operand term (2u_in²/3·‖A_i‖²Σ_j w_j²‖B_j‖², ~√n·‖A_i‖‖B‖ wide) was thought to cover it, and does not where a row
    # of C shares a sign: GPT-2 and BERT output layers under truncating TF32 flagged clean rows at 1.01-1.03× their
    # threshold, 259 in 10⁵ checks (bench/clean_campaign.py --dtypes tf32-trunc).
    trunc = slack * operand_roundoff if operand_roundoff is not None else 0.0
    out: dict[str, Bound] = {}
    for d in directions:
        row = d == "row"
        walk_d = walk[0 if row else 1]
        mine64, other64, n_vec = (a64, b64, n_cols) if row else (b64, a64, n_rows)
        ref = ref_norms[0 if row else 1]
        ref64 = None if ref is None else ref.to(f64)
        maxes = None
        if walk_d:
            assert amax64 is not None and bmax64 is not None
            rmax = ref_maxes[0 if row else 1]
            maxes = (amax64 if row else bmax64, bmax64 if row else amax64, None if rmax is None else rmax.to(f64))
        mom64 = None
        if row and moments_NR4 is not None and walk_d:
            # Squares below tiny are flushed in fp32: an x_k² loses ≤ tiny times b_kj² ((Bw)_k²) summed over k, a B or
            # Bw square ≤ tiny times A_ik² (per unit weight²), and the skinny GEMM's K products ≤ tiny each; 1.01
            # covers its rounding.
            tiny = torch.finfo(torch.float32).tiny
            w2_N2 = _weighted_sq(torch.ones_like(b64))
            ref_sq_N2 = _weighted_sum(b64).square() if ref64 is None else ref64.square()
            floor_N4 = tiny * (torch.cat([_weighted_sq(b64), ref_sq_N2], -1) + k)
            per_a_N4 = torch.cat([w2_N2, torch.ones_like(w2_N2)], -1)
            mom64 = (1.01 * moments_NR4.to(f64) + floor_N4[..., None, :]
                     + tiny * a64.square()[..., None] * per_a_N4[..., None, :])
        om = operand_moments[0 if row else 1]
        om64 = None if om is None or walk_d or op_var == 0.0 else om.to(f64)
        var = _calibrated_var(mine64, other64, ref64, k=k, u_acc=u_acc, op_var=op_var, split_var=split_var,
                              maxes=maxes, moments_NR4=mom64, operand_NR4=om64)
        if bias64_C is not None:
            if row:
                # Row references add b·w (n-long sums); column references add (Σw) b_j: both rounded once more.
                var = var + (n_cols * u_acc**2 / 3) * _weighted_sq(bias64_C)[..., None, :]
            else:
                sums_C2 = torch.stack([bias64_C * n_rows, bias64_C * (n_rows * (n_rows + 1) / 2)], -1)
                var = var + (u_acc**2 / 3) * sums_C2.square()
        c_sq = u_out_var + ((RANDOM_WALK * n_vec + DRIFT * k) if walk_d else n_vec**2) * u2
        # The drift of the reference's K-long dot and of the checksum's n-long sum, per unit of reference².
        drift = DRIFT * (k + n_vec) * u2 if walk_d else 0.0
        vec, coef, under = rigorous[d]
        # The truncation mean, in no model's variance: added linearly.
        common = ref_coef + trunc
        out[d] = Bound(vec, coef, var, (c_sq, c_sq * n_vec**2), common, under, z, n_vec, drift)
    return out


@dataclass(frozen=True, slots=True)
class RowTerms:
    """The row rule of `direction_bounds` factored per row for a kernel that verifies each row where it makes its sums
    (the native attention pass, fused_attention.c: ``check_row``). For row i of group h, a its operand norm and ΣC² its
    sum of squares, with a' = a + a_floor:
      rigorous    b1 = a'·rigorous_Ng[h]·rig_coef + under,  b2 = n·b1
      calibrated  b1 = min(b1, sigmas·sqrt(a'²·var_Ng2[h, 0] + sq_coef[0]·(ΣC² + sq_pad)) + under)
                  b2 = min(b2, sigmas·sqrt(a'²·var_Ng2[h, 1] + sq_coef[1]·(ΣC² + sq_pad)) + off2)
    then NaN and +INF read NEAR_INF (`_clamp`): `Bound.pair` of that rule, term by term (tests pin the two together
    through the kernel: tests/agent/test_fused_attention.py)."""

    rigorous_Ng: torch.Tensor
    """(..., g) fp32: Σ over the group's columns of (‖B_j‖ + floor)."""
    var_Ng2: torch.Tensor | None
    """(..., g, 2) float64: the modelled variance of (d1, d2) per unit a'²; None: the rigorous rule alone."""
    a_floor: float
    rig_coef: float
    under: float
    sq_coef: tuple[float, float]
    sq_pad: float
    sigmas: float
    off2: float
    n: int
    """Columns per group (the d2 weights run 1..n)."""


def row_terms(b_norm_NgC: torch.Tensor, ref_norm_Ng2: torch.Tensor, *, k: int, tol: Tolerance) -> RowTerms:
    """`direction_bounds(("row",), ...)` of an fp32 product C = A·B accumulated in fp32, without a bias, operand
    rounding or the random-walk model, factored (`RowTerms`). b_norm_NgC: ‖B_j‖ per column of each checksum group
    (..., g, n), fp32; ref_norm_Ng2: ‖B_h w‖ per group (..., g, 2), fp32; k: the reduction length. Each line below is
    that function's for this case (its comments say why)."""
    n = b_norm_NgC.shape[-1]
    f32 = torch.float32
    if tol.mode == "extreme":
        e = tol.extreme_threshold * tol.factor
        return RowTerms(torch.zeros(b_norm_NgC.shape[:-1], dtype=f32, device=b_norm_NgC.device), None, 0.0, 0.0, e,
                        (0.0, 0.0), 0.0, 0.0, 0.0, n)
    floor = norm_floor(b_norm_NgC, k)
    b_norm_NgC = b_norm_NgC + floor
    u_out = torch.finfo(f32).eps / 2
    slack = 1.01 * tol.factor
    rig_coef = slack * (2 * gamma(k, f32) + 2 * gamma(n, f32) + u_out)
    eta = _underflow(f32)
    under = slack * n * (eta + (k + 2 * n + 2) * eta)
    rigorous_Ng = b_norm_NgC.sum(-1)
    if not tol.calibrated:
        return RowTerms(rigorous_Ng, None, floor, rig_coef, under, (0.0, 0.0), 0.0, 0.0, 0.0, n)
    u2 = (torch.finfo(f32).eps / 2) ** 2 / 3
    f64 = torch.float64
    ref64 = (ref_norm_Ng2 + norm_floor(ref_norm_Ng2, k)).to(f64)
    var_Ng2 = _weighted_sq(b_norm_NgC.to(f64)) * (k * u2 + n * u2) + ref64.square() * (k * u2)
    c_sq = n**2 * u2
    return RowTerms(rigorous_Ng, var_Ng2, floor, rig_coef, under, (c_sq, c_sq * n**2), n * torch.finfo(f32).tiny,
                    tol.sigmas * tol.factor, under * ((n + 1) / 2), n)


@dataclass(frozen=True, slots=True)
class RowRule:
    """The row rule of `direction_bounds` for an fp32 product checked by rows, as a native verifier evaluates it per
    row vector (attnchecker/row_verify.c, whose comments name each term): the other operand's per-column norms, which
    it sums per checksum group, and the rule's scalars. Shared by every matrix of a batch (the other operand is 2-D)."""

    b_norm_gn: torch.Tensor
    """(g, n) fp32: ‖B_j‖ per column of each group."""
    bias_abs_gn: torch.Tensor | None
    ref_norm_g2: torch.Tensor | None
    """(g, 2): ‖B_h w‖ per group; None: bounded by Σ_j w_j ‖B_j‖."""
    b_max_gn: torch.Tensor | None
    ref_max_g2: torch.Tensor | None
    scalars: tuple[float, ...]
    """row_verify.c's S_* layout."""
    walk: bool

    @property
    def groups(self) -> int:
        return self.b_norm_gn.shape[0]


def row_rule(
    b_norm_gn: torch.Tensor,
    *,
    k: int,
    tol: Tolerance,
    bias_abs_gn: torch.Tensor | None = None,
    ref_norm_g2: torch.Tensor | None = None,
    b_max_gn: torch.Tensor | None = None,
    ref_max_g2: torch.Tensor | None = None,
    walk: bool = False,
) -> RowRule | None:
    """`direction_bounds(("row",), ...)` of an fp32 product C = A·B (+ bias) accumulated in fp32, without operand
    rounding, for a native verifier (`RowRule`); None for what it does not cover (the paper's threshold). b_norm_gn:
    ‖B_j‖ per column of each checksum group (g, n); bias_abs_gn: |b| likewise; ref_norm_g2, ref_max_g2: ‖B_h w‖ and
    ‖B_h w‖∞ per group; b_max_gn: ‖B_j‖∞ (walk). The scalars below are that function's (and `_calibrated_var`'s) for
    this case, and row_verify.c's sums over the columns are theirs: a change there must be made here and there too
    (tests/agent/test_row_verify.py holds the two to the same verdicts)."""
    if tol.mode != "roundoff":
        return None
    scalars = _row_scalars(b_norm_gn.shape[-1], k, tol, bias_abs_gn is not None, walk)
    return RowRule(b_norm_gn, bias_abs_gn, ref_norm_g2, b_max_gn if walk else None, ref_max_g2 if walk else None,
                   scalars, walk)


@functools.lru_cache(maxsize=512)
def _row_scalars(n: int, k: int, tol: Tolerance, bias: bool, walk: bool) -> tuple[float, ...]:
    """`RowRule.scalars` (row_verify.c's S_* order): each as `direction_bounds` makes it for an fp32 product."""
    f32 = torch.float32
    u = torch.finfo(f32).eps / 2
    slack = 1.01 * tol.factor
    n_round = 2 if bias else 1
    eta = _underflow(f32)
    u2 = u**2 / 3
    return (
        math.sqrt(k * torch.finfo(f32).tiny),  # norm_floor
        slack * (2 * gamma(k, f32) + 2 * gamma(n, f32) + n_round * u),
        slack * (2 * gamma(n, f32) + u),
        slack * n * (eta + (k + 2 * n + 2) * eta),
        float(tol.calibrated),
        float(walk),
        tol.sigmas * tol.factor,
        ((RANDOM_WALK * n + DRIFT * k) if walk else n**2) * u2,
        float(n),
        float(k),
        u2,
        DRIFT * (k + n) * u2 if walk else 0.0,
        RANDOM_WALK * k * u2 + u2,
        RANDOM_WALK * k * u2,
        torch.finfo(f32).tiny,
        RANDOM_WALK,
        DRIFT,
        NEAR_INF,
    )
