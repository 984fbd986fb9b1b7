"""A fault injector that is not the project's: a TorchDispatchMode below autograd that corrupts one element of one
output of an aten GEMM (mm, bmm, addmm, baddbmm) or fused-attention op, as a transient hardware fault would.

It knows nothing of attnchecker. What it hits is chosen by the op and the output's shape, among the calls made while
an attention module of the model runs (forward hooks the test puts on the modules whose class name ends in
"Attention": the attention GEMMs, not the MLP's, which nothing but the optimizer net covers).
"""
from __future__ import annotations

import math
import random
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
GEMMS = {aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default, aten.matmul.default}
FUSED = {
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_attention_math.default,
}
VALUES = ("inf", "-inf", "nan", "1e20", "bitflip")


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """Outermost modules whose class name ends in Attention (MultiheadAttention too)."""
    found: list[nn.Module] = []
    for module in model.modules():
        if type(module).__name__.endswith("Attention") and not any(
                module is not f and any(m is module for m in f.modules()) for f in found):
            found.append(module)
    return found


def _flip_exponent_msb(x: float) -> float:
    """Flip bit 30 of an fp32 value: the exponent's top bit (|x| < 2 becomes >= 2**128·|x|, or INF/NaN)."""
    (bits,) = struct.unpack("<I", struct.pack("<f", x))
    (out,) = struct.unpack("<f", struct.pack("<I", bits ^ (1 << 30)))
    return out


@dataclass
class Hit:
    op: str
    shape: tuple[int, ...]
    output: int
    index: tuple[int, ...]
    old: float
    new: float


class ShapeFaults(TorchDispatchMode):
    """Corrupt the ``target``-th eligible output (counting from 0) seen while active, with ``value``.

    Eligible: the output of a GEMM, or the attention output (output 0) of a fused-attention op, made inside an
    attention module. ``count_only``: count candidates, corrupt none.
    """

    def __init__(self, model: nn.Module, *, target: int = 0, value: str = "inf", seed: int = 0,
                 count_only: bool = False, ops: frozenset[Any] | None = None) -> None:
        super().__init__()
        if value not in VALUES:
            raise ValueError(f"value must be one of {VALUES}, got {value!r}")
        self.model, self.target, self.value, self.seed, self.count_only = model, target, value, seed, count_only
        self.ops = ops if ops is not None else GEMMS | FUSED
        """The aten ops whose outputs are candidates."""
        self.seen = 0
        self.hit: Hit | None = None
        self._depth = 0
        self._handles: list[Any] = []

    @contextmanager
    def active(self) -> Iterator[ShapeFaults]:
        for module in attention_modules(self.model):
            self._handles.append(module.register_forward_pre_hook(self._enter))
            self._handles.append(module.register_forward_hook(self._exit, always_call=True))
        try:
            with self:
                yield self
        finally:
            for h in self._handles:
                h.remove()
            self._handles.clear()

    def _enter(self, *_: Any) -> None:
        self._depth += 1

    def _exit(self, *_: Any) -> None:
        self._depth -= 1

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self._depth <= 0 or func not in self.ops:
            return out
        o = out[0] if isinstance(out, tuple) else out
        if isinstance(o, torch.Tensor) and o.is_floating_point() and o.numel() > 0:
            if self.seen == self.target and self.hit is None and not self.count_only:
                self._corrupt(func, 0, o)
            self.seen += 1
        return out

    def _corrupt(self, func: Any, i: int, o: torch.Tensor) -> None:
        rng = random.Random(self.seed)
        with torch.no_grad():
            flat = o.detach().float().reshape(-1)
            if self.value == "bitflip":
                # An element whose exponent-MSB flip lands in the extreme range (not 0, not |x| >= 2).
                ok = ((flat.abs() > 1e-30) & (flat.abs() < 2)).nonzero().view(-1)
                pos = int(ok[rng.randrange(len(ok))])
            else:
                pos = rng.randrange(flat.numel())
            index = tuple(int(j) for j in torch.unravel_index(torch.tensor(pos), o.shape))
            old = float(o[index])
            new = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan, "1e20": 1e20}.get(self.value)
            if new is None:
                new = _flip_exponent_msb(old)
            o[index] = new
        self.hit = Hit(op=str(func), shape=tuple(o.shape), output=i, index=index, old=old, new=float(o[index]))
