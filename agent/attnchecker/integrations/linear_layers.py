"""protect(scope="all"): every nn.Linear / transformers Conv1D module's forward replaced (on the instance, undone by
``Guard.close()``) by one that runs the layer through the checked GEMM of ``gemm/linear.py`` on the steps the
whole-step schedule says (``gemm/schedule.py``): tier "abft" on a due step, the tripwire on the others, and the module's
own forward where both are off."""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import compiled
from ..gemm.linear import GEMM_OPS, LinearSite, checked_linear, linear_layout, overrides_forward
from ..gemm.schedule import _WHOLE_STEP, gemm_tier
from ._common import Binder, _projection_hook

__all__ = ["attach"]

log = logging.getLogger("attnchecker")


def attach(binder: Binder, model: nn.Module) -> int:
    """Wrap every Linear/Conv1D module of ``model``; returns how many. Run after the attention integrations, so their
    projection hooks are in place and the forward check is not doubled."""
    count = 0
    key = id(binder.runtime)
    _WHOLE_STEP.add(key)
    binder.on_close(lambda: _WHOLE_STEP.discard(key))
    custom: list[str] = []
    for name, module in model.named_modules():
        layout = linear_layout(module)
        if layout is None:
            if overrides_forward(module):
                binder.add_unprotected(name, GEMM_OPS, f"{type(module).__name__} has its own forward")
                custom.append(name)
            continue
        hooked = any(getattr(h, "func", None) is _projection_hook for h in module._forward_hooks.values())
        ctx = binder.new_context()
        site = LinearSite(ctx=ctx, layout=layout, check_forward=not hooked)
        _wrap_forward(binder, module, site)
        ops = GEMM_OPS if site.check_forward else GEMM_OPS[1:]
        binder.add_site(ctx, name, "linear", ops)
        count += 1
    if custom:
        log.warning("attnchecker: scope=\"all\" leaves %d Linear/Conv1D subclass(es) with a forward of their own "
                    "unchecked (Guard.coverage): %s", len(custom), ", ".join(custom[:8]) + (" ..." if len(custom) > 8
                                                                                          else ""))
    return count


def _wrap_forward(binder: Binder, module: nn.Module, site: LinearSite) -> None:
    own = vars(module).get("forward")
    original = module.forward
    module.forward = functools.partial(_forward, site, module, original)  # type: ignore[method-assign]

    def undo() -> None:
        if own is None:
            del module.forward
        else:
            module.forward = own  # type: ignore[method-assign]

    binder.on_close(undo)


def _forward(site: LinearSite, module: nn.Module, original: Callable[..., torch.Tensor], *args: Any, **kwargs: Any
             ) -> torch.Tensor:
    if torch.compiler.is_compiling():
        # Traced: one attnchecker::linear op, whose body picks the step's tier when it runs (no recompile per step).
        x = args[0] if args else next(iter(kwargs.values()))
        return compiled.linear(x, module.weight, module.bias, ctx=site.ctx,  # type: ignore[arg-type]
                               layout=site.layout, check_forward=site.check_forward)
    return _forward_eagerly(site, module, original, *args, **kwargs)


@torch.compiler.disable
def _forward_eagerly(site: LinearSite, module: nn.Module, original: Callable[..., torch.Tensor], *args: Any,
                     **kwargs: Any) -> torch.Tensor:
    tier = gemm_tier(site.ctx.runtime)
    if tier is None:
        return original(*args, **kwargs)
    x = args[0] if args else next(iter(kwargs.values()))
    weight: torch.Tensor = module.weight  # type: ignore[assignment]  # nn.Linear / Conv1D parameters
    bias: torch.Tensor | None = module.bias  # type: ignore[assignment]
    return checked_call(x, weight, bias, site, tier)


def checked_call(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, site: LinearSite, tier: str
                 ) -> torch.Tensor:
    """``checked_linear`` as the GEMM it replaces runs under autocast, if autocast is on."""
    device_type = x.device.type
    if not torch.is_autocast_enabled(device_type):
        return checked_linear(x, weight, bias, site, tier)
    # Autocast would cast the operands of the GEMM it replaces: do the same outside, then check in that dtype, with
    # the engine's own fp32 checksum products out of autocast's reach.
    dtype = torch.get_autocast_dtype(device_type)
    x, weight = x.to(dtype), weight.to(dtype)
    bias = bias.to(dtype) if bias is not None else None
    with torch.autocast(device_type, enabled=False):
        return checked_linear(x, weight, bias, site, tier)
