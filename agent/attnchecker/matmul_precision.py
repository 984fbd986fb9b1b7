"""Which precision an fp32 GEMM really runs in (TF32, oneDNN bf16), and a scope that forces IEEE fp32 for the checksums.

Reads and writes only PyTorch's per-backend `fp32_precision` flags: they reflect every way of turning TF32 on
(`allow_tf32 = True`, `set_float32_matmul_precision("high")`, the flags themselves), and PyTorch raises on reading the
legacy getters (`allow_tf32`, `get_float32_matmul_precision()`) once a program has mixed the two APIs.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from .abft.tolerance import BF16_OPERAND_ROUNDOFF, TF32_OPERAND_ROUNDOFF

__all__ = ["fp32_matmul_operand_roundoff", "ieee_fp32_matmul"]

_ROUNDOFF = {"tf32": TF32_OPERAND_ROUNDOFF, "bf16": BF16_OPERAND_ROUNDOFF}


def _matmul_flags(kind: str) -> object | None:
    if kind == "cuda":
        return torch.backends.cuda.matmul
    if kind == "cpu":
        return getattr(torch.backends.mkldnn, "matmul", None)
    return None


def _precision(kind: str) -> str:
    flags = _matmul_flags(kind)
    if flags is None:
        return "ieee"
    prec = getattr(flags, "fp32_precision", None)
    if prec is None and kind == "cuda":  # a PyTorch without the per-backend flags
        return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
    if prec == "none":  # not set for this backend: the process-wide default decides
        prec = getattr(torch.backends, "fp32_precision", "ieee")
    return "ieee" if prec in (None, "none") else str(prec)


def fp32_matmul_operand_roundoff(device: torch.device | str) -> float | None:
    """The relative rounding an fp32 GEMM on `device` applies to its operands, or None for IEEE fp32 products.

    CUDA: TF32 when torch.backends.cuda.matmul.fp32_precision is "tf32" (allow_tf32 = True, or
    set_float32_matmul_precision("high"/"medium")). CPU: oneDNN's fp32 matmul mode (mkldnn.matmul.fp32_precision:
    "tf32" for "high", "bf16" for "medium"), which PyTorch honours only on CPUs with the matching instructions; we
    bound as if it were, since a looser bound costs sensitivity, never a false alarm. cudnn.allow_tf32 governs
    convolutions, not the matmuls checked here.
    """
    return _ROUNDOFF.get(_precision(torch.device(device).type))


@contextlib.contextmanager
def ieee_fp32_matmul(device: torch.device | str) -> Iterator[None]:
    """fp32 matmuls on `device` in IEEE precision inside the scope: the checksum references are skinny products whose
    own TF32 rounding (2^-10 of ‖A_i‖‖Bw‖) would swamp every fault the tolerance is meant to see. Restores the
    flag on exit. Process-wide while it lasts, like every PyTorch precision flag."""
    kind = torch.device(device).type
    flags = _matmul_flags(kind)
    prec = getattr(flags, "fp32_precision", None) if flags is not None else None
    if prec is None or _precision(kind) == "ieee":
        yield
        return
    flags.fp32_precision = "ieee"  # type: ignore[union-attr]
    try:
        yield
    finally:
        flags.fp32_precision = prec  # type: ignore[union-attr]
