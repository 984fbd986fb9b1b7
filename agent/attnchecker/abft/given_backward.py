"""The full check of an attention backward another kernel computed (the vendor's: FlashAttention's, the CPU flash
kernel's), from its gradients dQ, dK, dV alone: the identities and their bounds, and their float64 reference. Not yet
a kernel: this is what one would test, measured on a vendor before it is built (bench/vendor_backward_residuals.py).

Our checked backward verifies the five products it computes, tile by tile. The vendor's cannot be seen, but its
gradients can be tested against the forward's stored results. With, from the inputs as stored (q, k, v, O, lse, dO),

    P_ij = exp(scale·q_i·k_j − lse_i),  dP_ij = dO_i·v_j,  δ_i = dO_i·O_i,  dS_ij = P_ij·(dP_ij − δ_i),

a correct backward satisfies, for c = e (ones) and c = w (1..D),

    V: dV_j·c = Σ_i P_ij (dO_i·c)      K: dK_j·c = scale·Σ_i dS_ij (q_i·c)      Q: dQ_i·c = scale·Σ_j dS_ij (k_j·c)

per key j (V, K: over the queries that see it, and the query heads of its group) and per query i (Q: over the keys
it sees). These are the backward's definitions, not properties of the true gradient: the vendor computes P from the
same stored lse and δ from the same stored O, so an error in either (the forward's) does not move a residual here;
the forward's check tests those. A wrong element of dV, dK or dQ moves its own row's two residuals, and d_w / d_e
places it at its column, as in the forward's identity B; a fault inside the vendor's S or dP moves every gradient
made from it.

Why a check of this shape is cheap: one pass over the (query, key) tiles recomputes S and dP (two of the backward's
five products), and every sum is a row or column sum of P or dS against one of six per-token vectors (dO·c, q·c,
k·c). Per key the sums over queries give V and K; per query the sums over keys give Q (accumulated across key tiles).

The bounds, per gradient row (u: the inputs' unit roundoff; u32 = 2⁻²⁴; t the terms summed, t_i = P_ij (dO_i·c) for V,
scale·dS_ij (q_i·c) for K and scale·dS_ij (k_j·c) for Q; X the vendor's gradient row; n the terms' count; σ the
largest score the row's tiles allow):

- the vendor rounds P (V) or dS (K, Q) to the inputs' dtype before the product, each term by at most u,
  independently: a random walk of one standard deviation u·√(Σ t²); it rounds its gradient, at most u·Σ_d |X_d c_d|;
  and where it adds each block's partial sum into its output (r times, ``GradientAccumulation``), it rounds the
  running sum r − 1 times more, each element by at most u times the running sum, which grows to X: independent
  roundings over blocks and elements, a walk of u·√(r − 1)·‖X ∘ c‖: ``tau``·u·(√(Σ t²) + Σ_d |X_d c_d| +
  √(r − 1)·‖X ∘ c‖), the forward's B where r = 1. Below the dtype's normal range a rounding is absolute, up to
  ``tiny``, half the smallest subnormal (2⁻²⁵ in fp16, where a probability of 10⁻⁸ and the gradient it makes round to
  0; negligible in bf16): ``tau``·tiny·(√n·max_i |x_i·c|·f + √r·Σ_d c_d), x_i·c the terms' per-token factor (dO_i·c,
  or q_i·c and k_j·c times |scale|) and f its scale;
- its fp32 scores and exponentials differ from exact ones, each P by a relative (1 + √D·σ)·u32 or so, and its fp32
  accumulations over n terms walk: ``kappa``·u32·(√n + √D·σ)·Σ |t|;
- K and Q only: dS's fp32 dot products dP and δ over D, each within √D·u32·‖dO_i‖(‖v_j‖ + ‖O_i‖):
  ``kappa``·u32·√D·|scale|·Σ P_ij ‖dO_i‖(‖v_j‖ + ‖O_i‖)|x·c| (x: q_i for K, k_j for Q).

Why r: the CPU flash kernel adds each block of 256 queries' share of dK and dV (of 512 keys' for dQ) into its bf16 or
fp16 output, rounding the running sum every time; emulating that reproduces its gradients bit for bit. At 32k keys
a key's sums are rounded up to 128 times, and with r = 1 clean rows came to 0.97 of their bound. Taking those
roundings at their worst, √r·Σ_d |X_d c_d|, they came to 0.16: they are a random walk over the D elements too.
FlashAttention keeps dK and dV in fp32 registers over every query block and dQ in an fp32 buffer, so r = 1 is its
model (grouped heads aside: ``key_rounds``); gpu_suite's vendor_residuals "backward" rows measure it.

``tau`` and ``kappa`` are the forward's (abft/given_forward.py): 2 and 4. What a vendor's clean rows come to against
them is measured (bench/vendor_backward_residuals.py), not assumed.

Legend: B batch, H query heads, Hk key heads, T queries, S keys, D head dim; a suffix 2: c = e, w.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .given_forward import U32, require_half_roundoff
from .tolerance import Tolerance

__all__ = ["CPU_FLASH", "FP32_ACCUMULATION", "GivenBackwardRule", "GradientAccumulation", "backward_identity_residuals",
           "given_backward_rule"]


@dataclass(frozen=True, slots=True)
class GivenBackwardRule:
    """The scalars of the three identities' bounds for one dtype and tolerance (module doc)."""

    u: float
    """The inputs' unit roundoff (P, dS and the gradients are rounded to their dtype)."""
    tau: float
    """Multiples of the rounding walk of P or dS plus the gradient's own rounding."""
    kappa: float
    """Multiples of the fp32 terms."""
    tiny: float
    """Half the dtype's smallest subnormal: a rounding's absolute error below its normal range."""


@dataclass(frozen=True, slots=True)
class GradientAccumulation:
    """How a vendor's backward adds its sums into its half-precision gradients: each block of ``query_block`` queries'
    share of dK and dV, and of ``key_block`` keys' share of dQ, is rounded into the output as it is added. None: the
    sum stays in fp32 to its end and is rounded once."""

    query_block: int | None
    key_block: int | None

    def key_rounds(self, t: int, keys_S: torch.Tensor, is_causal: bool, group: int = 1) -> torch.Tensor:
        """(S',) float64: how many times each key's dK and dV are rounded, over t queries of each of the ``group``
        query heads that share its key head (causal: the blocks that hold a query at or after the key; a block of
        queries that cannot see it adds an exact 0). Grouped heads: each head's share is rounded (the CPU kernel adds
        them into one output; FlashAttention returns them per head, summed after), and their sum once more."""
        if self.query_block is None:
            blocks = torch.ones(len(keys_S), dtype=torch.float64, device=keys_S.device)
        else:
            first = (torch.div(keys_S, self.query_block, rounding_mode="floor") if is_causal
                     else torch.zeros_like(keys_S))
            blocks = (-(-t // self.query_block) - first).clamp(min=1).double()
        return group * blocks + (1.0 if group > 1 else 0.0)

    def query_rounds(self, s: int, rows_T: torch.Tensor, is_causal: bool) -> torch.Tensor:
        """(T',) float64: how many times each query's dQ is rounded, over s keys (causal: the blocks up to its own)."""
        if self.key_block is None:
            return torch.ones(len(rows_T), dtype=torch.float64, device=rows_T.device)
        if not is_causal:
            return torch.full((len(rows_T),), float(-(-s // self.key_block)), dtype=torch.float64,
                              device=rows_T.device)
        return (torch.div(rows_T.clamp(max=max(s - 1, 0)), self.key_block, rounding_mode="floor") + 1).double()


FP32_ACCUMULATION = GradientAccumulation(query_block=None, key_block=None)
"""A backward that accumulates each gradient row in fp32 to its end (FlashAttention, by its design)."""


def CPU_FLASH(t: int) -> GradientAccumulation:  # noqa: N802 - a vendor's name, read beside FP32_ACCUMULATION
    """The CPU flash backward at t queries: its query blocks are 256 from 768 queries, 64 from 192 and 32 below
    (the block sizes it dispatches on, aten/src/ATen/native/cpu/FlashAttentionKernel.cpp); its key blocks 512."""
    return GradientAccumulation(query_block=256 if t >= 768 else 64 if t >= 192 else 32, key_block=512)


def given_backward_rule(dtype: torch.dtype, tol: Tolerance) -> GivenBackwardRule:
    """The rule for half-precision inputs under a round-off tolerance; its factor scales every term."""
    require_half_roundoff(dtype, tol, "the vendor's backward")
    info = torch.finfo(dtype)
    return GivenBackwardRule(u=info.eps / 2, tau=2.0 * tol.factor, kappa=4.0 * tol.factor,
                             tiny=info.smallest_normal * info.eps / 2)


def _weights(d: int, like: torch.Tensor) -> torch.Tensor:
    """(D, 2) float64: c = e and c = w = 1..D."""
    return torch.stack([torch.ones(d, dtype=torch.float64, device=like.device),
                        torch.arange(1, d + 1, dtype=torch.float64, device=like.device)], 1)


def _group_sum(x_BH: torch.Tensor, hk: int) -> torch.Tensor:
    """Sum a (B, H, ...) tensor over each key head's group of H // hk query heads: (B, Hk, ...)."""
    b, h = x_BH.shape[:2]
    return x_BH.reshape(b, hk, h // hk, *x_BH.shape[2:]).sum(2)


def _check(residual: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """A row flags where either weighting's residual is not within its bound (NaN and INF included)."""
    return ~((residual.abs() <= bound) & torch.isfinite(residual)).all(-1)


def backward_identity_residuals(
    q_BHTD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor, out_BHTD: torch.Tensor, lse_BHT: torch.Tensor,
    dout_BHTD: torch.Tensor, dq_BHTD: torch.Tensor, dk_BHSD: torch.Tensor, dv_BHSD: torch.Tensor, *, scale: float,
    is_causal: bool, rule: GivenBackwardRule, accumulation: GradientAccumulation, rows: torch.Tensor | None = None,
    keys: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The three identities in float64 with torch. Per key (B, Hk, S, 2): ``d_v``, ``b_v``, ``d_k``, ``b_k`` (signed
    residual = the vendor's side − the recomputed one, and bound, for c = e, w), ``flag_v``, ``flag_k`` (B, Hk, S);
    per query (B, H, T, 2): ``d_q``, ``b_q``, ``flag_q`` (B, H, T). k, v, dk, dv on Hk heads dividing H (GQA: their
    rows sum over the group's query heads); causal top-left, as SDPA's; lse the one the backward read. rows, keys:
    only these queries (Q) and keys (V, K), for long sequences (T or S becomes their count). accumulation: how the
    vendor rounds its gradient sums (``CPU_FLASH(t)``, ``FP32_ACCUMULATION``)."""
    h, hk = q_BHTD.shape[1], k_BHSD.shape[1]
    t, s, d = q_BHTD.shape[-2], k_BHSD.shape[-2], q_BHTD.shape[-1]
    c_D2 = _weights(d, q_BHTD)
    q, o, do = (x.double() for x in (q_BHTD, out_BHTD, dout_BHTD))
    k, v = (x.double().repeat_interleave(h // hk, dim=1) for x in (k_BHSD, v_BHSD))
    lse = lse_BHT.double()
    delta_BHT = (do * o).sum(-1)
    do_norm_BHT = torch.linalg.vector_norm(do, dim=-1)
    o_norm_BHT = torch.linalg.vector_norm(o, dim=-1)
    v_norm_BHS = torch.linalg.vector_norm(v, dim=-1)
    q_norm_BHT = torch.linalg.vector_norm(q, dim=-1)
    k_norm_BHS = torch.linalg.vector_norm(k, dim=-1)
    sigma = abs(scale) * float(q_norm_BHT.amax()) * float(k_norm_BHS.amax()) if q.numel() and k.numel() else 0.0
    tau_u, kappa_u32, tau_tiny = rule.tau * rule.u, rule.kappa * U32, rule.tau * rule.tiny
    fp32_rel = math.sqrt(d) * sigma
    # The gradient's own underflow, per element and rounding: Σ_d c_d for c = e, w.
    underflow_2 = tau_tiny * c_D2.sum(0)

    def probs(at_T: torch.Tensor, at_S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """P, dS and the causal mask (B, H, len(at_T), len(at_S)) at these queries and keys."""
        live = torch.ones(len(at_T), len(at_S), dtype=torch.bool, device=q.device)
        if is_causal:
            live = at_S[None, :] <= at_T[:, None]
        z = scale * q[:, :, at_T] @ k[:, :, at_S].mT
        p = torch.where(live, torch.exp(z - lse[:, :, at_T, None]), 0.0)
        dp = do[:, :, at_T] @ v[:, :, at_S].mT
        return p, p * (dp - delta_BHT[:, :, at_T, None]), live

    all_T = torch.arange(t, device=q.device)
    all_S = torch.arange(s, device=q.device)
    at_S = all_S if keys is None else keys
    at_T = all_T if rows is None else rows

    # V and K, per key: sums over every query (and the group's heads).
    p_BHTS, ds_BHTS, live_TS = probs(all_T, at_S)
    doc_BHT2, qc_BHT2 = do @ c_D2, q @ c_D2
    n_S = live_TS.sum(0).double()
    walk_S = kappa_u32 * (n_S.sqrt() + fp32_rel)
    rounds_S1 = accumulation.key_rounds(t, at_S, is_causal, h // hk)[:, None]
    partial_S1 = (rounds_S1 - 1).sqrt()
    out: dict[str, torch.Tensor] = {}
    for name, f, terms_coef, x_BHT2, grad in (("v", 1.0, p_BHTS, doc_BHT2, dv_BHSD),
                                              ("k", scale, scale * ds_BHTS, qc_BHT2, dk_BHSD)):
        ref = _group_sum(terms_coef.mT @ x_BHT2, hk)  # (B, Hk, S', 2)
        walk2 = _group_sum(terms_coef.square().mT @ x_BHT2.square(), hk).sqrt()
        abs_sum = _group_sum(terms_coef.abs().mT @ x_BHT2.abs(), hk)
        g = grad[:, :, at_S].double()
        got = g @ c_D2
        # Each term rounded below the normal range: √n terms' walk, at most the head group's largest |x·c| each.
        x_max_BHk2 = x_BHT2.abs().amax(-2).reshape(x_BHT2.shape[0], hk, h // hk, 2).amax(2)
        underflow = tau_tiny * abs(f) * ((h // hk) * n_S).sqrt()[:, None] * x_max_BHk2[:, :, None, :]
        bound = (tau_u * (walk2 + g.abs() @ c_D2 + partial_S1 * (g.square() @ c_D2.square()).sqrt())
                 + walk_S[:, None] * abs_sum + underflow + rounds_S1.sqrt() * underflow_2)
        if name == "k":
            # dP and δ in fp32 over D: each dS_ij within √D·u32·P_ij·‖dO_i‖(‖v_j‖ + ‖O_i‖).
            w_BHTS = p_BHTS * do_norm_BHT[..., None] * (v_norm_BHS[:, :, None, at_S] + o_norm_BHT[..., None])
            bound = bound + kappa_u32 * math.sqrt(d) * abs(scale) * _group_sum(w_BHTS.mT @ x_BHT2.abs(), hk)
        out[f"d_{name}"], out[f"b_{name}"] = got - ref, bound
        out[f"flag_{name}"] = _check(got - ref, bound)

    # Q, per query: sums over the keys it sees.
    p_BHTS, ds_BHTS, live_TS = probs(at_T, all_S)
    kc_BHS2 = k @ c_D2
    terms = scale * ds_BHTS
    ref = terms @ kc_BHS2
    walk2 = (terms.square() @ kc_BHS2.square()).sqrt()
    abs_sum = terms.abs() @ kc_BHS2.abs()
    g = dq_BHTD[:, :, at_T].double()
    got = g @ c_D2
    n_T = live_TS.sum(1).double()
    w_BHTS = p_BHTS * do_norm_BHT[:, :, at_T, None] * (v_norm_BHS[:, :, None, :] + o_norm_BHT[:, :, at_T, None])
    underflow = tau_tiny * abs(scale) * n_T.sqrt()[:, None] * kc_BHS2.abs().amax(-2)[:, :, None, :]
    rounds_T1 = accumulation.query_rounds(s, at_T, is_causal)[:, None]
    bound = (tau_u * (walk2 + g.abs() @ c_D2 + (rounds_T1 - 1).sqrt() * (g.square() @ c_D2.square()).sqrt())
             + (kappa_u32 * (n_T.sqrt() + fp32_rel))[:, None] * abs_sum
             + kappa_u32 * math.sqrt(d) * abs(scale) * (w_BHTS @ kc_BHS2.abs()) + underflow
             + rounds_T1.sqrt() * underflow_2)
    out["d_q"], out["b_q"], out["flag_q"] = got - ref, bound, _check(got - ref, bound)
    return out
