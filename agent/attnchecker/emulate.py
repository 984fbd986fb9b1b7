"""Emulate reduced-precision fp32 GEMMs on a CPU: see what the tolerance does under TF32 without a GPU.

`emulate_fp32_matmul("tf32")` rounds both operands of every fp32 matrix product to TF32's 10 mantissa bits (or, with
truncate=True, drops the low bits as tensor cores may), then multiplies in fp32, exactly what an Ampere+ tensor core
computes up to the accumulation order. It also sets oneDNN's fp32 matmul precision flag, so the engine sees the
precision in force as it would on a GPU, and it honours that flag per call: products run under
`matmul_precision.ieee_fp32_matmul` (the checksums) stay IEEE, as they do on a GPU.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .matmul_precision import current_fp32_precision

__all__ = ["emulate_fp32_matmul", "round_mantissa"]

_MANTISSA_BITS = {"tf32": 10, "bf16": 7}
_aten = torch.ops.aten
_PRODUCTS = {_aten.mm.default, _aten.bmm.default, _aten.addmm.default, _aten.baddbmm.default, _aten.mv.default,
             _aten.addmv.default, _aten.dot.default}
_WITH_INPUT = {_aten.addmm.default, _aten.baddbmm.default, _aten.addmv.default}


def round_mantissa(x: torch.Tensor, bits: int, *, truncate: bool = False) -> torch.Tensor:
    """fp32 x with its mantissa rounded to `bits` bits (to nearest, ties away from zero, as cvt.rna.tf32.f32), or
    truncated. INF/NaN pass through; a round-up that overflows the exponent gives INF, as in hardware."""
    if x.dtype != torch.float32:
        raise TypeError(f"round_mantissa needs float32, got {x.dtype}")
    drop = 23 - bits
    i = x.view(torch.int32)
    if not truncate:
        # Adding half an ulp of the kept mantissa to the magnitude bits, then clearing the dropped bits, rounds half
        # away from zero (sign bit untouched: the carry never reaches it for finite values below the top exponent).
        i = i + (1 << (drop - 1))
    out = (i & ~((1 << drop) - 1)).view(torch.float32)
    return torch.where(torch.isfinite(x), out, x)


class _Fp32MatmulMode(TorchDispatchMode):
    def __init__(self, truncate: bool) -> None:
        super().__init__()
        self.truncate = truncate

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _PRODUCTS:
            bits = _MANTISSA_BITS.get(current_fp32_precision("cpu"))
            if bits is not None:
                # addmm/baddbmm/addmv(input, m1, m2): the added input is not a product operand.
                first = 1 if func in _WITH_INPUT else 0
                args = tuple(round_mantissa(a, bits, truncate=self.truncate)
                             if i >= first and isinstance(a, torch.Tensor) and a.dtype == torch.float32 else a
                             for i, a in enumerate(args))
        return func(*args, **kwargs)


@contextlib.contextmanager
def emulate_fp32_matmul(precision: str = "tf32", *, truncate: bool = False) -> Iterator[None]:
    """Inside the scope, fp32 CPU matrix products run on operands rounded to `precision` ("tf32": 10 mantissa bits,
    "bf16": 7), and oneDNN's fp32 precision flag says so. Restores the flag on exit."""
    if precision not in _MANTISSA_BITS:
        raise ValueError(f"precision must be one of {sorted(_MANTISSA_BITS)}, got {precision!r}")
    flags: Any = getattr(torch.backends.mkldnn, "matmul")  # noqa: B009  (untyped in torch's stubs)
    before = flags.fp32_precision
    flags.fp32_precision = precision
    try:
        with _Fp32MatmulMode(truncate):
            yield
    finally:
        flags.fp32_precision = before
