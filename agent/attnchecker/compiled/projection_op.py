"""``attnchecker::projection_check``: a projection module's output verified and repaired (``check_linear``) as one
opaque op. It returns the repaired output as a new tensor (an op may not return its input, and repairing the input in
place would make it a mutated graph input); its gradient passes straight to the module's output, as the eager check's
in-place repair leaves autograd's graph as it is. In paper-faithful mode the checksums it passes to its layer's
attention (``ctx.passed``) travel in the LayerContext at run time: the attention op takes them, and it runs after this
op because its q/k/v are made from this op's output.

Legend: N leading dims flattened, T tokens, I input features, O output features."""
from __future__ import annotations

from typing import Any

import torch

from ..checks.context import LayerContext
from ..gemm.projection import check_linear
from . import registry

__all__ = ["projection_check"]


@torch.library.custom_op("attnchecker::projection_check", mutates_args=())
def _projection_check(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ctx_key: int,
                      op: str | None, names: str, sizes: list[int], weight_layout: str) -> torch.Tensor:
    ctx = registry.context(ctx_key)
    # names: the slices' op names joined by commas (a schema takes no list of strings).
    splits = tuple(zip(names.split(","), sizes, strict=True)) if sizes else None
    out = y.clone()
    with torch.no_grad(), torch.autocast(y.device.type, enabled=False):
        check_linear(x, out, weight, bias, ctx=ctx, op=op, splits=splits, weight_layout=weight_layout)
    return out


@_projection_check.register_fake
def _(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ctx_key: int,
      op: str | None, names: str, sizes: list[int], weight_layout: str) -> torch.Tensor:
    return torch.empty_like(y)


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    return (None, grad, None, None, None, None, None, None, None)


_projection_check.register_autograd(_backward)


def projection_check(ctx: LayerContext, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None, *, op: str | None, splits: tuple[tuple[str, int], ...] | None,
                     weight_layout: str) -> torch.Tensor:
    """``check_linear`` of y = x·W (+ b) (``integrations.projection_hook.check_projection``'s check) as
    ``attnchecker::projection_check``: returns the repaired y. Under autocast the operands are cast to y's dtype here,
    as the eager hook casts them."""
    if torch.is_autocast_enabled(y.device.type):
        dtype = y.dtype
        x, weight = x.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    names = ",".join(name for name, _ in splits) if splits is not None else ""
    sizes = [size for _, size in splits] if splits is not None else []
    return _projection_check(x, y, weight, bias, ctx.op_key, op, names, sizes, weight_layout)
