"""check_linear on a projection module's output as its module computed it (autocast too), recording the output's
storage so the attention can tell whether q/k/v reached it unchanged (``Binder.passed_matches``). Below both the
Binder (_common.py) and the PEFT LoRA hooks (peft.py), which both call it, with the types they share."""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from ..checks.context import LayerContext

__all__ = ["ContextRef", "HookOwner", "Outputs", "Splits", "check_projection"]

Splits = tuple[tuple[str, int], ...]
ContextRef = LayerContext | Callable[[], LayerContext]
"""A projection's layer: fixed, or resolved per call (a module that runs several attentions per forward)."""
Outputs = dict[tuple[int, str], tuple[int, int]]
"""(layer, op) -> (storage pointer, elements) of the projection output checked last."""


class HookOwner(Protocol):
    """What a projection hook needs of the Binder that installed it (peft.py's LoRA hooks; _common.Binder is one)."""

    _outputs: Outputs

    def fallback(self, ctx: LayerContext, reason: str, ops: str = ...) -> None: ...

    def on_close(self, fn: Callable[[], None]) -> None: ...


def check_projection(
    outputs: dict[tuple[int, str], tuple[int, int]],
    ctx: LayerContext,
    x: torch.Tensor,
    output: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    op: str | None,
    splits: Splits | None,
    names: tuple[str, ...],
    weight_layout: str,
    cast_operands: bool = True,
) -> torch.Tensor:
    """check_linear on a projection's output = x·W (+ b) as its module computed it, under autocast too; records the
    output's storage for ``Binder.passed_matches``. cast_operands=False: x and W are given wider than the output on
    purpose (the bound then covers the rounding of the operands and of the intermediate sums: peft.py)."""
    from ..attention.pipeline import check_linear

    ptr, rows = output.untyped_storage().data_ptr(), output.numel() // output.shape[-1]
    sizes = [size for _, size in splits] if splits is not None else [output.shape[-1]]
    for name, size in zip(names, sizes, strict=True):
        outputs[(ctx.layer, name)] = (ptr, rows * size)
    device_type = output.device.type
    if not torch.is_autocast_enabled(device_type):
        return check_linear(x, output, weight, bias, ctx=ctx, op=op, splits=splits, weight_layout=weight_layout)
    # Autocast computed `output` from x, W, b cast to its dtype: check against exactly those (never cast `output`:
    # the repair must land in the tensor the model goes on with), and keep the engine's own math out of autocast.
    if cast_operands:
        dtype = output.dtype
        x, weight = x.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    with torch.autocast(device_type, enabled=False):
        return check_linear(x, output, weight, bias, ctx=ctx, op=op, splits=splits, weight_layout=weight_layout)
