"""The backward GEMMs of the unfused attention, verified under protect(scope="all") (issue 17).

Where the fused CPU backward cannot stand in for autograd (attention dropout: it cannot replay our keep-mask;
``return_probs``; a mask that requires grad; off the CPU), autograd differentiates the unfused graph. Its GEMMs are
the gradients of the two forward products:

  AS = Q·Kᵀ   dQ = dAS·K      (op ``grad_q``)    dK = dASᵀ·Q       (op ``grad_k``)
  CL = AP·V   dAP = dCL·Vᵀ    (op ``grad_probs``) dV = APᵀ·dCL     (op ``grad_v``)

with AP the probabilities after dropout and dAS the gradient at the raw scores (softmax, scale, mask and dropout are
elementwise, not GEMMs: attention._SoftmaxDropout's backward). ``scores_product`` and ``context_product`` make the
forward products as before (the same aten call) through an autograd Function whose backward computes these GEMMs
itself and hands them to ``gemm.check``, as a checked Linear layer does: on a step the whole-step checks are due,
checksums in one direction, then location and correction or recomputation (``check_gemms``); on the others, tier 1
(``trip_gemms``). The tier is the forward's, so a layer's backward is checked the way its forward step was. Not due
and no tripwire, or no gradient wanted: the plain product, as before.

Legend: B batch, H heads (K/V expanded to H), T query tokens, S key tokens, D head dim.
Syncs: one per checked or tier-1 product's backward (gemm.check's), more only on the slow path.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...checks.context import LayerContext
from ...checks.records import _inject
from ...gemm.check import check_gemms, trip_gemms
from ...gemm.schedule import whole_step_due, whole_step_trips

__all__ = ["context_product", "scores_product"]


@dataclass(frozen=True, slots=True)
class _Site:
    layer: LayerContext
    tier: str
    """"abft" (check_gemms) or "tripwire" (trip_gemms), decided at the forward."""
    product: str
    """"scores" (A·Bᵀ of Q and K) or "context" (A·B of AP and V)."""


def _site(layer: LayerContext | None, product: str, *operands: torch.Tensor) -> _Site | None:
    """Where this product's backward is checked, or None for the plain product (not under scope="all", nothing due,
    or no gradient to check)."""
    if layer is None or not torch.is_grad_enabled() or not any(x.requires_grad for x in operands):
        return None
    if whole_step_due(layer.runtime):
        return _Site(layer, "abft", product)
    if whole_step_trips(layer.runtime):
        return _Site(layer, "tripwire", product)
    return None


def scores_product(q_BHTD: torch.Tensor, k_BHSD: torch.Tensor, layer: LayerContext | None) -> torch.Tensor:
    """AS = Q·Kᵀ (B, H, T, S), its backward's dQ and dK checked where ``_site`` says so."""
    site = _site(layer, "scores", q_BHTD, k_BHSD)
    if site is None:
        return q_BHTD @ k_BHSD.transpose(-2, -1)
    out: torch.Tensor = _CheckedProduct.apply(q_BHTD, k_BHSD, site)
    return out


def context_product(p_BHTS: torch.Tensor, v_BHSD: torch.Tensor, layer: LayerContext | None) -> torch.Tensor:
    """CL = AP·V (B, H, T, D), its backward's dAP and dV checked where ``_site`` says so."""
    site = _site(layer, "context", p_BHTS, v_BHSD)
    if site is None:
        return p_BHTS @ v_BHSD
    out: torch.Tensor = _CheckedProduct.apply(p_BHTS, v_BHSD, site)
    return out


Gemm = tuple[str, torch.Tensor, torch.Tensor, torch.Tensor, None]


def _scores_grads(q: torch.Tensor, k: torch.Tensor, ds: torch.Tensor, need: tuple[bool, bool]
                  ) -> tuple[list[Gemm], torch.Tensor | None, torch.Tensor | None]:
    """dQ = dAS·K and dK = dASᵀ·Q (in K's own layout (S, D), located as the fused backward's dK is)."""
    gemms: list[Gemm] = []
    dq = dk = None
    if need[0]:
        dq = ds @ k
        gemms.append(("grad_q", dq, ds, k, None))
    if need[1]:
        dk = ds.transpose(-2, -1) @ q
        gemms.append(("grad_k", dk, ds.transpose(-2, -1), q, None))
    return gemms, dq, dk


def _context_grads(p: torch.Tensor, v: torch.Tensor, dcl: torch.Tensor, need: tuple[bool, bool]
                   ) -> tuple[list[Gemm], torch.Tensor | None, torch.Tensor | None]:
    """dAP = dCL·Vᵀ and dV = APᵀ·dCL."""
    gemms: list[Gemm] = []
    dp = dv = None
    if need[0]:
        dp = dcl @ v.transpose(-2, -1)
        gemms.append(("grad_probs", dp, dcl, v.transpose(-2, -1), None))
    if need[1]:
        dv = p.transpose(-2, -1) @ dcl
        gemms.append(("grad_v", dv, p.transpose(-2, -1), dcl, None))
    return gemms, dp, dv


class _CheckedProduct(torch.autograd.Function):
    """One forward product of the unfused attention (the same aten call as the plain one), whose backward makes its
    two GEMMs itself and checks them (the site's tier) before autograd hands them on."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, site: _Site) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        ctx.site = site
        return a @ b.transpose(-2, -1) if site.product == "scores" else a @ b

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        a, b = ctx.saved_tensors
        site: _Site = ctx.site
        grads = _scores_grads if site.product == "scores" else _context_grads
        gemms, da, db = grads(a, b, grad.contiguous(), ctx.needs_input_grad[:2])
        for op, out, *_ in gemms:
            _inject(site.layer, op, out)  # attnchecker.inject's plan, right after the product (no scores_bwd here)
        if gemms:
            (check_gemms if site.tier == "abft" else trip_gemms)(site.layer, list(gemms))
        return da, db, None
