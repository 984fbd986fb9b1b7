"""A fault injector below autograd: a TorchDispatchMode that corrupts the output of aten GEMMs (and fused attention
kernels) chosen by output shape alone, the way a hardware fault would hit whatever kernel produced those numbers.

It knows nothing of attnchecker (no op names, no hooks): a test names the shape of the product to hit, the flat
element and the value. No tests here; the test modules import it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

GEMMS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention_for_cpu",
                   "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention"})


@dataclass
class Hit:
    op: str
    shape: tuple[int, ...]
    index: int
    value: float


@dataclass
class GemmFault:
    """Corrupt the ``nth`` (0-based) GEMM output of exactly ``shape``: its flat element ``index`` becomes ``value``."""

    shape: Sequence[int]
    value: float
    index: int = 0
    nth: int = 0
    seen: int = 0
    done: bool = False


class GemmFaults(TorchDispatchMode):
    """``with GemmFaults([GemmFault((48, 192), float("inf"), index=7)]): loss = model(x)...``; ``hits`` says what was
    corrupted (a test asserts it is not empty, so it cannot pass by hitting nothing)."""

    def __init__(self, faults: list[GemmFault]) -> None:
        super().__init__()
        self.faults = faults
        self.hits: list[Hit] = []
        self.shapes: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name not in GEMMS:
            return out
        first = out[0] if isinstance(out, (tuple, list)) else out
        shape = tuple(first.shape)
        self.shapes.append((name, shape))
        for f in self.faults:
            if f.done or tuple(f.shape) != shape:
                continue
            if f.seen == f.nth:
                first.view(-1)[f.index] = f.value
                f.done = True
                self.hits.append(Hit(name, shape, f.index, f.value))
            f.seen += 1
        return out


def gemm_shapes(fn: Any) -> list[tuple[str, tuple[int, ...]]]:
    """The (aten op, output shape) of every GEMM ``fn()`` runs, in order: to pick a target for a test."""
    mode = GemmFaults([])
    with mode:
        fn()
    return mode.shapes
