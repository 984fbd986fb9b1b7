"""Whole-step protection (issue 17): the checked Linear/Conv1D GEMM, forward and backward.

Under ``protect(model, scope="all")`` each Linear/Conv1D module runs, on a step where the whole-step schedule says so
(integrations/linear_layers.py wraps the modules), through ``_CheckedLinear``:

- forward:  Y = X Wᵀ + b, verified by checksums (op ``linear``), located and corrected or recomputed;
- backward: dX = dY W (op ``linear_dx``) and dW = dYᵀ X (op ``linear_dw``), each verified, corrected or recomputed
  before autograd hands them on, so a fault in the MLP or in a weight gradient never reaches the optimizer.

On the other steps (tier 1) the same three outputs get the extreme-value tripwire: one sum each, and an INF, NaN or
near-INF output gets its full check at once, which corrects it in place (``gemm.check.trip_gemms``).

Projections the attention integration already verifies in forward (q/k/v/out, GPT-2's c_attn) keep that check; here
they get only the backward checks, so no output is verified twice. The math is ``abft.gemm`` over ``abft.repair``.

Legend: M tokens (all leading dims flattened), I input features, O output features, 2 a checksum pair.
Syncs: one per checked or tier-1 forward and one per backward (the slow-path decision), more only on the slow path;
none on the Triton path (gemm/device.py), whose detections come at the step boundary.
"""
from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..checks.context import LayerContext
from ..checks.records import _inject
from . import device
from .check import Gemm, Given, LinearSums, backward_sums, check_gemms, linear_sums, trip_gemms

__all__ = ["GEMM_OPS", "SCOPES", "LinearSite", "checked_linear", "linear_layout", "overrides_forward"]

log = logging.getLogger("attnchecker")

SCOPES: tuple[str, ...] = ("attention", "all")
"""What protect() covers: the attention ops only, or also every Linear/Conv1D GEMM forward and backward."""
GEMM_OPS: tuple[str, ...] = ("linear", "linear_dx", "linear_dw")
"""Event ops of the whole-step GEMMs: the forward output, the input gradient, the weight gradient."""


def linear_layout(module: nn.Module) -> str | None:
    """``out_in`` for nn.Linear (W is (O, I)), ``in_out`` for transformers' Conv1D (W is (I, O)), else None.
    A subclass with a forward of its own is None too (``overrides_forward``)."""
    if isinstance(module, nn.Linear):
        return None if overrides_forward(module) else "out_in"
    conv1d = _conv1d_class()
    if conv1d is not None and isinstance(module, conv1d):
        return None if overrides_forward(module) else "in_out"
    return None


def overrides_forward(module: nn.Module) -> bool:
    """A Linear/Conv1D subclass whose class defines its own forward (a quantized or scaled layer, e.g. bitsandbytes'
    Linear8bitLt): the checked layer computes x Wᵀ + b itself, which would replace that forward's arithmetic, so
    such a module is left to its own forward, and listed as unprotected."""
    conv1d = _conv1d_class()
    for base in (nn.Linear, conv1d):
        if base is not None and isinstance(module, base):
            return getattr(type(module), "forward", None) is not getattr(base, "forward", None)
    return False


@functools.lru_cache(maxsize=1)
def _conv1d_class() -> type | None:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return None
    return Conv1D


@dataclass(slots=True)
class LinearSite:
    """One checked Linear/Conv1D module (integrations/linear_layers.py makes it when it wraps the module)."""

    ctx: LayerContext
    layout: str
    check_forward: bool
    """False when the attention integration's projection hook verifies this module's output already."""


def checked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, site: LinearSite, tier: str
                   ) -> torch.Tensor:
    """y = x Wᵀ + b (or x W + b for Conv1D), x (..., I), through ``_CheckedLinear`` with ``tier`` ("abft" or
    "tripwire") for the forward and both backward GEMMs."""
    # The Function works on (M, I) and returns (M, O); the view back to (..., O) is made out here, where autograd can
    # track it (a view returned from inside a Function may not be modified in place, and projection hooks repair it).
    y_MO: torch.Tensor = _CheckedLinear.apply(x.reshape(-1, x.shape[-1]), weight, bias, site, tier)
    return y_MO.view(*x.shape[:-1], y_MO.shape[-1])


class _CheckedLinear(torch.autograd.Function):
    """y = x Wᵀ + b (or x W + b for Conv1D), x (M, I), with the forward output and both backward GEMMs verified and
    repaired (tier "abft"), or given the tripwire (tier "tripwire"): the step's tier is the forward's, so a layer's
    backward is checked the way its forward was."""

    @staticmethod
    def forward(ctx: Any, x_MI: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, site: LinearSite,
                tier: str) -> torch.Tensor:
        w_IO = weight.T if site.layout == "out_in" else weight
        # The same aten call the unprotected module makes (addmm with a bias), so a clean step is bitwise the same.
        y_MO = F.linear(x_MI, weight, bias) if site.layout == "out_in" else (
            x_MI @ weight if bias is None else torch.addmm(bias, x_MI, weight))
        if site.check_forward:
            _inject(site.ctx, "linear", y_MO)
        check = check_gemms if tier == "abft" else trip_gemms
        sums: LinearSums | None = None
        # On CUDA (or under Triton's interpreter when asked for), the checks run as Triton kernels that never wait for
        # the GPU (gemm/device.py); otherwise as below, with one sync per checked call.
        ctx.on_device, ctx.sides = device.takes(x_MI, weight, y_MO), None
        if ctx.on_device:
            try:
                ctx.sides = device.linear_forward(site.ctx, tier, y_MO, x_MI, weight, bias, site.layout,
                                                  check_forward=site.check_forward)
            except device.KernelFailed:  # nothing checked: this forward and its backward on the CPU path below
                ctx.on_device = False
        if site.check_forward and not ctx.on_device:
            if tier == "abft":
                # One read of x and of W for this check and the backward's two (gemm.check.linear_sums).
                t0 = time.perf_counter()
                made = linear_sums(x_MI, w_IO, forward=True)
                given = None
                if made is not None and made[0] is not None:
                    given, sums = [("row", made[0])], made[1]
                check_gemms(site.ctx, [("linear", y_MO, x_MI, w_IO, bias)], given=given,
                            given_seconds=time.perf_counter() - t0)
            else:
                check(site.ctx, [("linear", y_MO, x_MI, w_IO, bias)])
        ctx.save_for_backward(x_MI, weight, bias)
        ctx.site, ctx.check, ctx.sums, ctx.tier = site, check, sums, tier
        return y_MO

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_MI, weight, bias = ctx.saved_tensors
        site: LinearSite = ctx.site
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dy_MO = grad_y.contiguous()
        w_OI = weight if site.layout == "out_in" else weight.T
        todo: list[Gemm] = []
        dx_MI = dw = None
        if need_x:
            dx_MI = dy_MO.mm(w_OI)
            _inject(site.ctx, "linear_dx", dx_MI)
            todo.append(("linear_dx", dx_MI, dy_MO, w_OI, None))
        if need_w:
            # The orientation autograd itself uses per layout: W's gradient in W's own shape, no transpose copy.
            if site.layout == "out_in":
                dw = dy_MO.t().mm(x_MI)
                todo.append(("linear_dw", dw, dy_MO.t(), x_MI, None))
            else:
                dw = x_MI.t().mm(dy_MO)
                todo.append(("linear_dw", dw, x_MI.t(), dy_MO, None))
            _inject(site.ctx, "linear_dw", dw)
        if ctx.on_device:
            try:
                device.linear_backward(site.ctx, ctx.tier, dy_MO, x_MI, weight, site.layout, dx_MI, dw, ctx.sides)
            except device.KernelFailed as exc:  # the GEMMs it had not checked, on the CPU path
                ctx.check(site.ctx, todo[exc.done:])
        elif ctx.check is check_gemms and todo:
            t0 = time.perf_counter()
            given = _backward_given(ctx.sums, x_MI, weight, dy_MO, site.layout, need_x=dx_MI is not None,
                                    need_w=dw is not None)
            check_gemms(site.ctx, todo, given=given, given_seconds=time.perf_counter() - t0)
        else:
            ctx.check(site.ctx, todo)
        db = dy_MO.sum(0) if need_b and bias is not None else None
        return dx_MI, dw, db, None, None


def _backward_given(sums: LinearSums | None, x_MI: torch.Tensor, weight: torch.Tensor, dy_MO: torch.Tensor,
                    layout: str, *, need_x: bool, need_w: bool) -> list[Given | None] | None:
    """The backward checks' operand sides (dX, then dW, as the backward lists them) from one read of dy, with the
    forward's sums of x and W, or with them made now (a module whose forward the projection hook checked). None where
    the kernel declines: the checks then read their operands themselves."""
    if sums is None:
        made = linear_sums(x_MI, weight.T if layout == "out_in" else weight, forward=False)
        if made is None:
            return None
        sums = made[1]
    # dW = dyᵀ·x (O, I) for nn.Linear, checked by rows; xᵀ·dy (I, O) for Conv1D, by columns: along I both times.
    got = backward_sums(dy_MO, sums, need_x=need_x, dw_direction=("row" if layout == "out_in" else "col")
                        if need_w else None)
    if got is None:
        return None
    return [g for g, needed in zip(got, (need_x, need_w), strict=True) if needed]
