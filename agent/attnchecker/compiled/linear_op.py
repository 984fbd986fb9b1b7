"""``attnchecker::linear``: one Linear/Conv1D module's GEMM under ``protect(scope="all")`` as an opaque op, and
``attnchecker::linear_backward``, its checked backward (dX, dW, db through ``gemm.linear``'s Function, replayed by
``opaque.backward``). The body picks the step's tier at run time (full, tripwire, or the module's plain GEMM), as
``integrations/linear_layers.py`` does eagerly.

Legend: M tokens (leading dims flattened), I input features, O output features."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..checks.context import LayerContext
from ..gemm.linear import LinearSite, checked_linear
from ..gemm.schedule import gemm_tier
from . import opaque, registry

__all__ = ["linear"]


def _plain(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layout: str) -> torch.Tensor:
    """The module's own GEMM (nn.Linear, or transformers' Conv1D: addmm over the flattened tokens)."""
    if layout == "out_in":
        return F.linear(x, weight, bias)
    if bias is None:
        return x @ weight
    return torch.addmm(bias, x.reshape(-1, x.shape[-1]), weight).view(*x.shape[:-1], weight.shape[-1])


@torch.library.custom_op("attnchecker::linear", mutates_args=())
def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ctx_key: int, layout: str,
            check_forward: bool, grads: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
    site = LinearSite(ctx=registry.context(ctx_key), layout=layout, check_forward=check_forward)
    runtime = site.ctx.runtime
    tier = gemm_tier(runtime)

    def run(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return _plain(x, weight, bias, layout) if tier is None else checked_linear(x, weight, bias, site, tier)

    with torch.autocast(x.device.type, enabled=False):
        (y,), handle = opaque.record(run, (x, weight, bias), grads, owner=id(runtime))
    return y, handle


@_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ctx_key: int, layout: str,
      check_forward: bool, grads: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
    out_features = weight.shape[0] if layout == "out_in" else weight.shape[1]
    return x.new_empty((*x.shape[:-1], out_features)), opaque.fake_handle()


@torch.library.custom_op("attnchecker::linear_backward", mutates_args=())
def _linear_backward(handle: torch.Tensor, grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None, grads: list[bool]) -> list[torch.Tensor]:
    return opaque.backward(handle, [grad_y])


@_linear_backward.register_fake
def _(handle: torch.Tensor, grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
      grads: list[bool]) -> list[torch.Tensor]:
    return opaque.fake_grads((x, weight, bias), grads)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, weight, bias = inputs[:3]
    ctx.grads = inputs[-1]
    ctx.save_for_backward(output[1], x, weight, bias)


def _backward(ctx: Any, grad_y: torch.Tensor, _grad_handle: Any) -> tuple[torch.Tensor | None, ...]:
    handle, x, weight, bias = ctx.saved_tensors
    got = iter(_linear_backward(handle, grad_y, x, weight, bias, ctx.grads))
    inputs = [next(got) if t is not None and g and t.is_floating_point() else None
              for t, g in zip((x, weight, bias), ctx.grads, strict=True)]
    return (*inputs, None, None, None, None)


_linear.register_autograd(_backward, setup_context=_setup)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, ctx: LayerContext, layout: str,
           check_forward: bool) -> torch.Tensor:
    """The checked module GEMM as ``attnchecker::linear``: x (..., I) -> (..., O). Under autocast the operands are cast
    to its dtype here, as the eager wrapper casts them."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    grad_on = torch.is_grad_enabled()
    grads = [grad_on and t is not None and t.requires_grad for t in (x, weight, bias)]
    y, _ = _linear(x, weight, bias, ctx.op_key, layout, check_forward, grads)
    return y
