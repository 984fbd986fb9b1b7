"""protect(scope="all"): the expert banks of Hugging Face transformers' mixture-of-experts models (Mixtral, Qwen3-MoE,
DeepSeek-V3, gpt-oss, ...: the classes transformers decorates with ``use_experts_implementation``). Their experts'
weights are 3-D parameters (E, O, I) or (E, I, O), not Linear layers, so the Linear wrapping of ``linear_layers``
does not reach them, and in a MoE model they hold most of a step's GEMM FLOPs.

On a step the whole-step schedule checks (``gemm/schedule.py``: in full, or by tier 1), the bank's forward is its
class's own eager loop (the function ``use_experts_implementation`` wraps, which the interface dispatches to under
``experts_implementation="eager"``), run under a ``TorchFunctionMode`` that sends each expert's GEMM, ``F.linear(x,
W[e])`` or ``x @ W[e]``, through the checked GEMM of ``gemm/linear.py``: its output and, in backward, dX and dW
(whose gradient autograd adds into the 3-D parameter's slice e) verified and repaired, or given the tripwire, as a
Linear layer's. On the other steps, the bank's forward as the model set it (its grouped or batched GEMM where the
config asks for one). One layer per bank: its detections name the bank, not the expert.

Not checked: a bank whose forward is not such an eager loop of ``F.linear`` or ``@`` over 2-D weights (the claims
check then lists its ops unprotected after the first step they were due), and the router's GEMM (a Parameter of its
own, F.linear in the router's forward: a few columns per token). Traced by torch.compile, the bank is a graph break
(its eager loop is data-dependent already: which experts a batch hits)."""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..gemm.linear import GEMM_OPS, LinearSite
from ..gemm.schedule import gemm_tier
from ._common import Binder
from .linear_layers import checked_call

__all__ = ["attach", "eager_forward"]

PATH = "experts"


def eager_forward(module: nn.Module) -> Callable[..., torch.Tensor] | None:
    """The eager loop of a transformers experts bank (the function ``use_experts_implementation`` wrapped, kept by
    functools.wraps), or None for any other module."""
    inner = getattr(type(module).forward, "__wrapped__", None)
    if not callable(inner) or not hasattr(module, "has_gate") or not hasattr(module, "is_transposed"):
        return None
    if not any(p.dim() == 3 for p in module.parameters(recurse=False)):
        return None
    return inner  # type: ignore[no-any-return]


def attach(binder: Binder, model: nn.Module) -> int:
    """Wrap every experts bank of ``model`` (undone by ``Guard.close()``); returns how many."""
    count = 0
    for name, module in model.named_modules():
        eager = eager_forward(module)
        if eager is None:
            continue
        ctx = binder.new_context()
        # Each GEMM of the bank in the layout it is written in: F.linear(x, W[e]) (W[e] is (O, I)), or x @ W[e]
        # (transposed banks, W[e] is (I, O)).
        sites = {layout: LinearSite(ctx=ctx, layout=layout, check_forward=True) for layout in ("out_in", "in_out")}
        own = vars(module).get("forward")
        original = module.forward
        module.forward = functools.partial(_forward, sites, module, original, eager)  # type: ignore[method-assign]
        binder.on_close(functools.partial(_restore, module, own))
        binder.add_site(ctx, name, PATH, GEMM_OPS)
        count += 1
    return count


def _restore(module: nn.Module, own: Any) -> None:
    if own is None:
        del module.forward
    else:
        module.forward = own  # type: ignore[method-assign]


@torch.compiler.disable
def _forward(sites: dict[str, LinearSite], module: nn.Module, original: Callable[..., torch.Tensor],
             eager: Callable[..., torch.Tensor], *args: Any, **kwargs: Any) -> torch.Tensor:
    tier = gemm_tier(sites["out_in"].ctx.runtime)
    if tier is None:
        return original(*args, **kwargs)
    with _ExpertGemms(sites, tier):
        return eager(module, *args, **kwargs)


class _ExpertGemms(TorchFunctionMode):
    """Active while a bank's eager loop runs: an expert's GEMM (a 2-D weight, a 2-D input of tokens) goes through
    the checked GEMM; every other function runs as called. A mode is off while it handles a call, so the checked
    GEMM's own products are not routed again."""

    def __init__(self, sites: dict[str, LinearSite], tier: str) -> None:
        super().__init__()
        self.sites, self.tier = sites, tier

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear and len(args) >= 2:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if _expert_gemm(x, weight) and set(kwargs) <= {"bias"}:
                return checked_call(x, weight, bias, self.sites["out_in"], self.tier)
        elif func in _MATMULS and len(args) == 2 and not kwargs:
            x, weight = args
            if _expert_gemm(x, weight):
                return checked_call(x, weight, None, self.sites["in_out"], self.tier)
        return func(*args, **kwargs)


_MATMULS = frozenset({torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__})
"""``x @ w`` reaches a TorchFunctionMode as Tensor.matmul; torch.matmul and Tensor.__matmul__ as themselves."""


def _expert_gemm(x: Any, weight: Any) -> bool:
    """(N, I) tokens times a 2-D weight, both floating tensors."""
    return (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor) and x.dim() == 2 and weight.dim() == 2
            and x.is_floating_point() and weight.is_floating_point())
