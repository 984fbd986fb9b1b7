"""The full check of an attention forward another kernel computed (the vendor's fused attention: FlashAttention,
memory-efficient attention, the CPU flash kernel), from its output O and row log-sum-exp alone.

Our checked kernel verifies the two products it computes, tile by tile, as it computes them. The vendor's products
cannot be seen, but its results can be tested: with P'_ij = exp(scale·q_i·k_j − lse_i) recomputed from q, k and the
vendor's own lse, a correct forward satisfies per query row i, over the keys j it sees,

    A: a_i = Σ_j P'_ij = 1              B: a_i·(O_i·c) = Σ_j P'_ij (v_j·c)    for c = e (ones) and c = w (1..D).

B is written normalised (both sides scaled by a_i): an error δ in the vendor's lse scales every P'_ij of the row by
e^(−δ), which cancels there, so B tests O alone and A tests the lse alone. A fault in a score moves both the row's lse
and its output: A and B both see it. A fault in the output moves B; in the stored lse, A.

The bounds, per row (u: the inputs' unit roundoff; u32 = 2⁻²⁴; n: the keys the row sees; σ_i = |scale|·‖q_i‖·max_j‖k_j‖,
the largest score the row allows; D the head dim):

- B: the vendor rounds P to the inputs' dtype before P·V, each element by at most u, independently: a random walk of
  one standard deviation w2_c = √(Σ_j P'_ij² (v_j·c)²); it rounds its output, at most u·Σ_d |O_id c_d| = u·w3_c; and
  both kernels accumulate in fp32, scores and sums (walks over n keys and D products, at most σ_i per score):
  ``kappa``·(√n + √D·σ_i)·u32·a_i·max_j|v_j·c|. Bound: ``tau``·u·(w2_c + a_i·w3_c) + that.
- A: the vendor's lse is exact to fp32's roundings of its exp-sum and its scores, in the worst case (n + D·σ_i)·u32;
  measured on the CPU flash kernel up to 2.1 times that (docs/performance.md §11), hence ``kappa_a`` = 8. Plus
  ``a_floor``·u, a quarter of the inputs' roundoff: an lse error under it moves each P of the backward (which rounds
  P to the inputs' dtype) by less than its own rounding. The CPU flash kernel's fp16 rows with few keys come to 0.77
  of the bound with an eighth (its exp-sum is less exact than fp32 roundings of fp32 scores would make it).

``tau`` = 2 stands over the largest clean residual bench/vendor_residuals.py measured on the CPU flash kernel, a third
of u·(w2 + w3): six times its value. GPU vendors round alike (P to the inputs' dtype, fp32 sums, exp2), and gpu_suite's
``vendor_residuals`` section measures each; until its rows say otherwise the GPU runs these same constants. Half
precision only: fp32 calls (memory-efficient attention) keep our kernel's full check, whose bounds are exact ones.

``identity_residuals`` evaluates all of it in float64 with torch (the kernel's reference in tests, and the bench);
kernels/triton_given_check.py evaluates the same formula in fp32 per tile.

Legend: B batch, H query heads, Hk key heads, T queries, S keys, D head dim.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .tolerance import Tolerance

__all__ = ["GIVEN_DTYPES", "GivenRule", "given_rule", "identity_residuals", "require_half_roundoff"]

U32 = 2.0 ** -24
GIVEN_DTYPES = (torch.bfloat16, torch.float16)
"""The inputs a full check over the vendor's forward takes (module doc: fp32 keeps our kernel's exact bounds)."""


@dataclass(frozen=True, slots=True)
class GivenRule:
    """The scalars of both bounds for one dtype and tolerance (module doc)."""

    u: float
    """The inputs' unit roundoff (P and O are rounded to their dtype)."""
    tau: float
    """Multiples of B's one-deviation random walk of P's rounding plus O's rounding."""
    kappa: float
    """Multiples of B's fp32 accumulation walks."""
    kappa_a: float
    """Multiples of A's fp32 worst case."""
    a_floor: float
    """A's floor, in units of u."""

    def scalars(self) -> tuple[float, float, float, float]:
        """(tau·u, kappa·u32, kappa_a·u32, a_floor·u): what the kernel multiplies its per-row terms by."""
        return self.tau * self.u, self.kappa * U32, self.kappa_a * U32, self.a_floor * self.u


def require_half_roundoff(dtype: torch.dtype, tol: Tolerance, what: str) -> None:
    """Raise ValueError unless ``dtype`` and ``tol`` are what a check over a vendor's result (``what``) has bounds
    for: half-precision inputs, a round-off tolerance."""
    if dtype not in GIVEN_DTYPES:
        raise ValueError(f"a check over {what} takes bfloat16 or float16 inputs, got {dtype}")
    if tol.mode != "roundoff":
        raise ValueError(f"a check over {what} has round-off bounds only, got tolerance mode {tol.mode!r}")


def given_rule(dtype: torch.dtype, tol: Tolerance) -> GivenRule:
    """The rule for half-precision inputs under a round-off tolerance; its factor scales every term."""
    require_half_roundoff(dtype, tol, "the vendor's forward")
    u = torch.finfo(dtype).eps / 2
    f = tol.factor
    return GivenRule(u=u, tau=2.0 * f, kappa=4.0 * f, kappa_a=8.0 * f, a_floor=0.25 * f)


def identity_residuals(q_BHTD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor, out_BHTD: torch.Tensor,
                       lse_BHT: torch.Tensor, *, scale: float, is_causal: bool, rule: GivenRule,
                       rows: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Per row, in float64: ``a`` (B, H, T), A's residual ``r_a`` and bound ``b_a``; B's signed residuals
    ``d_c`` = a·(O·c) − Σ_j P'(v·c) and bounds ``b_c`` (B, H, T, 2) for c = e, w; ``flag_a``, ``flag_b`` (a NaN or
    INF anywhere flags). k, v on Hk heads dividing H (GQA); causal top-left, as SDPA's. rows: only these query rows
    (indices into T; T becomes their count), for long sequences."""
    h, hk = q_BHTD.shape[1], k_BHSD.shape[1]
    at_T = torch.arange(q_BHTD.shape[-2], device=q_BHTD.device) if rows is None else rows
    q = q_BHTD[:, :, at_T].double()
    k, v = (x.double().repeat_interleave(h // hk, dim=1) for x in (k_BHSD, v_BHSD))
    o, lse = out_BHTD[:, :, at_T].double(), lse_BHT[:, :, at_T].double()
    t, s, d = q.shape[-2], k.shape[-2], q.shape[-1]
    z_BHTS = scale * q @ k.mT
    keys = torch.ones(t, s, dtype=torch.bool, device=q.device)
    if is_causal:
        keys = torch.arange(s, device=q.device)[None, :] <= at_T[:, None]
    p_BHTS = torch.where(keys, torch.exp(z_BHTS - lse[..., None]), 0.0)
    c_D2 = torch.stack([torch.ones(d, dtype=torch.float64, device=q.device),
                        torch.arange(1, d + 1, dtype=torch.float64, device=q.device)], 1)
    vc_BHS2 = v @ c_D2
    a_BHT = p_BHTS.sum(-1)
    ref_BHT2 = p_BHTS @ vc_BHS2
    d_BHT2 = a_BHT[..., None] * (o @ c_D2) - ref_BHT2
    w2_BHT2 = ((p_BHTS.square()) @ vc_BHS2.square()).sqrt()
    w3_BHT2 = o.abs() @ c_D2
    n_T = keys.sum(-1).double()
    k_max_BH = torch.linalg.vector_norm(k, dim=-1).amax(-1)
    sigma_BHT = abs(scale) * torch.linalg.vector_norm(q, dim=-1) * k_max_BH[..., None]
    vc_max_BH2 = vc_BHS2.abs().amax(-2)
    tau_u, kappa_u32, kappa_a_u32, a_floor_u = rule.scalars()
    walk_BHT = kappa_u32 * (n_T.sqrt() + math.sqrt(d) * sigma_BHT) * a_BHT
    b_BHT2 = tau_u * (w2_BHT2 + a_BHT[..., None] * w3_BHT2) + walk_BHT[..., None] * vc_max_BH2[:, :, None, :]
    r_a_BHT = (a_BHT - 1.0).abs()
    b_a_BHT = a_floor_u + kappa_a_u32 * (n_T + d * sigma_BHT)
    flag_a = ~(r_a_BHT <= b_a_BHT)
    # An INF output makes its own bound INF (through w3): a residual past the range is never within one.
    flag_b = ~((d_BHT2.abs() <= b_BHT2) & torch.isfinite(d_BHT2)).all(-1)
    return {"a": a_BHT, "r_a": r_a_BHT, "b_a": b_a_BHT, "d_c": d_BHT2, "b_c": b_BHT2, "flag_a": flag_a,
            "flag_b": flag_b}
