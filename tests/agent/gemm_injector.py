"""Fault injectors below autograd: a TorchDispatchMode that sees every aten mm / addmm / bmm the process runs, in
forward and in backward, and corrupts one output element of one chosen call; another for the fused CPU attention
backward's outputs. Independent of attnchecker's own
injector (which only reaches the ops the engine names), so it also hits the MLP and the backward GEMMs.
No tests here; test_linear_abft.py imports it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
GEMMS = (aten.mm.default, aten.addmm.default, aten.bmm.default)
FUSED_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
FUSED_FORWARD = aten._scaled_dot_product_flash_attention_for_cpu.default


@dataclass(frozen=True)
class GemmCall:
    index: int
    op: str
    shape: tuple[int, ...]
    k: int
    """The reduction length."""
    phase: str


def _reduction(func: Any, args: tuple[Any, ...]) -> int:
    a = args[1] if func is aten.addmm.default else args[0]
    return int(a.shape[-1])


def corrupt(value: torch.Tensor, kind: str) -> torch.Tensor:
    """A 0-d tensor holding the corrupted version of ``value``."""
    if kind == "inf":
        return torch.full_like(value, float("inf"))
    if kind == "nan":
        return torch.full_like(value, float("nan"))
    if kind == "near_inf":
        return torch.full_like(value, 3e20)
    if kind == "bitflip":
        # The top exponent bit: a moderate fp32 or bf16 value becomes ~1e38 (fp16: INF or NaN), a tiny one ~1.
        if value.dtype == torch.float32:
            return (value.detach().clone().view(torch.int32) ^ (1 << 30)).view(torch.float32)
        return (value.detach().clone().reshape(1).view(torch.int16) ^ (1 << 14)).view(value.dtype).reshape(())
    raise ValueError(kind)


@dataclass
class GemmInjector(TorchDispatchMode):
    """Records every GEMM call (``calls``); corrupts element ``element`` (flat, modulo size) of call ``target``
    (``corrupt``'s kinds, or "rms": ``rms`` × the output's RMS added),
    or with ``pattern`` "row" / "col" every element of that element's row / column (a 1-D fault: the checks must
    locate it with the direction across it). ``phase`` is set by the test around backward so each call is labelled
    forward or backward."""

    target: int | None = None
    kind: str = "inf"
    element: int = 0
    pattern: str = "0d"
    rms: float = 4.0
    """kind "rms": the element gets this many times the output's RMS element added."""
    phase: str = "forward"
    calls: list[GemmCall] = field(default_factory=list)
    hit: GemmCall | None = None

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in GEMMS:
            call = GemmCall(len(self.calls), func.__name__.split(".")[0], tuple(out.shape), _reduction(func, args),
                            self.phase)
            self.calls.append(call)
            if call.index == self.target:
                flat = out.view(-1)
                i = self.element % flat.numel()
                if self.kind == "rms":
                    # Finite and small: no tripwire sees it, only the checksums can.
                    flat[i] += self.rms * out.detach().float().square().mean().sqrt()
                elif self.pattern == "0d":
                    flat[i] = corrupt(flat[i], self.kind)
                else:
                    mat = out.view(-1, out.shape[-1])
                    r, c = divmod(i, out.shape[-1])
                    r %= mat.shape[0]
                    line = mat[r] if self.pattern == "row" else mat[:, c]
                    line.copy_(torch.stack([corrupt(v, self.kind) for v in line]))
                self.hit = call
        return out


class FusedBackwardFault(TorchDispatchMode):
    """Corrupts element ``element`` of output ``which`` (0 dQ, 1 dK, 2 dV) of the ``call``-th fused CPU attention
    backward: the kernel's products never leave it, so this is the only place a fault inside it shows. head_dims:
    only the first that many of the output's head dims (a kernel run on wider, encoded operands returns more).
    ``op``: the fused op whose outputs are hit (a subclass hits another)."""

    op: Any = FUSED_BACKWARD

    def __init__(self, *, call: int, which: int, kind: str, element: int, head_dims: int | None = None,
                 into_custom_ops: bool = False) -> None:
        super().__init__()
        self.call, self.which, self.kind, self.element, self.head_dims = call, which, kind, element, head_dims
        self.into_custom_ops = into_custom_ops
        self.seen = 0
        self.hit = False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if self.into_custom_ops and func.namespace != "aten":
            # A mode is off while it handles an op, so the aten ops inside a custom op (a compiled graph's opaque
            # ops) would pass unseen: run its CPU kernel with the mode on again, as a fault in any kernel would hit.
            with self:
                return func.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), *args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        if func is self.op:
            if self.seen == self.call:
                grad = out[self.which]  # a strided view of the kernel's (B, T, H, D) buffer (lse: (B, T, H))
                if self.head_dims is not None:
                    grad = grad[..., :self.head_dims]
                idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(self.element % grad.numel()), grad.shape))
                grad[idx] = corrupt(grad[idx], self.kind)
                self.hit = True
            self.seen += 1
        return out


def is_model_gemm(call: GemmCall) -> bool:
    """A GEMM of the model (Linear/Conv1D, attention scores/context), not one of the checks' own skinny products
    (an output dim of 1 or 2) nor an outer product (RoPE's frequency table, reduction length 1)."""
    return min(call.shape[-2:]) > 2 and call.k > 1


def worst_rel(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """max over tensors of ‖g - g_ref‖ / ‖g_ref‖, the denominator floored at 1e-6 × the whole gradient's norm: a key
    projection's bias has a gradient of exactly 0 in exact arithmetic (softmax ignores a per-row shift), so its
    computed gradient (~1e-11 here) is pure round-off, and any other summation order changes all of it."""
    assert grads.keys() == ref.keys()
    floor = 1e-6 * float(torch.sqrt(sum(g.double().square().sum() for g in ref.values())))
    worst = 0.0
    for name, g in grads.items():
        if not bool(torch.isfinite(g).all()):
            return math.inf
        worst = max(worst, float((g - ref[name]).norm()) / max(float(ref[name].norm()), floor))
    return worst
