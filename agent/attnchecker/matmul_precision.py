"""Which precision an fp32 GEMM really runs in (TF32, oneDNN bf16), and a scope that forces IEEE fp32 for the checksums.

Reads and writes only PyTorch's per-backend `fp32_precision` flags: they reflect every way of turning TF32 on
(`allow_tf32 = True`, `set_float32_matmul_precision("high")`, the flags themselves), and PyTorch raises on reading the
legacy getters (`allow_tf32`, `get_float32_matmul_precision()`) once a program has mixed the two APIs.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

from .abft.tolerance import BF16_OPERAND_ROUNDOFF, TF32_OPERAND_ROUNDOFF

__all__ = ["current_fp32_precision", "fp32_matmul_operand_roundoff", "full_precision_reductions", "ieee_fp32_matmul"]

_ROUNDOFF = {"tf32": TF32_OPERAND_ROUNDOFF, "bf16": BF16_OPERAND_ROUNDOFF}
# Per thread and device kind: the precision in force outside the innermost ieee_fp32_matmul scope, i.e. the one the
# model's own GEMMs ran in. The checks run inside that scope and must still bound with it.
_outer = threading.local()


def _matmul_flags(kind: str) -> Any:
    if kind == "cuda":
        return torch.backends.cuda.matmul
    if kind == "cpu":
        return getattr(torch.backends.mkldnn, "matmul", None)
    return None


def current_fp32_precision(kind: str) -> str:
    """"ieee", "tf32" or "bf16": what an fp32 matmul on this device kind runs in right now (inside an
    ieee_fp32_matmul scope: "ieee")."""
    return _precision(kind)


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
    """The relative rounding an fp32 GEMM on `device` applies to its operands, or None for IEEE fp32 products. Inside
    ieee_fp32_matmul: the precision in force outside it (the model's GEMMs), which is what the checks bound.

    CUDA: TF32 when torch.backends.cuda.matmul.fp32_precision is "tf32" (allow_tf32 = True, or
    set_float32_matmul_precision("high"/"medium")). CPU: oneDNN's fp32 matmul mode (mkldnn.matmul.fp32_precision:
    "tf32" for "high", "bf16" for "medium"), which PyTorch honours only on CPUs with the matching instructions; we
    bound as if it were, since a looser bound costs sensitivity, never a false alarm. cudnn.allow_tf32 governs
    convolutions, not the matmuls checked here.
    """
    kind = torch.device(device).type
    stashed = getattr(_outer, kind, None)
    return _ROUNDOFF.get(stashed if stashed is not None else _precision(kind))


@contextlib.contextmanager
def ieee_fp32_matmul(device: torch.device | str) -> Iterator[None]:
    """fp32 matmuls on `device` in IEEE precision inside the scope: the checksum references are skinny products whose
    own TF32 rounding (2^-10 of ‖A_i‖‖Bw‖) would swamp every fault the tolerance is meant to see. Restores the
    flag on exit. Process-wide while it lasts, like every PyTorch precision flag."""
    kind = torch.device(device).type
    flags = _matmul_flags(kind)
    prec = getattr(flags, "fp32_precision", None) if flags is not None else None
    if prec is None or _precision(kind) == "ieee" or getattr(_outer, kind, None) is not None:
        yield
        return
    setattr(_outer, kind, _precision(kind))
    flags.fp32_precision = "ieee"
    try:
        yield
    finally:
        flags.fp32_precision = prec
        setattr(_outer, kind, None)


@contextlib.contextmanager
def full_precision_reductions() -> Iterator[None]:
    """cuBLAS's half-precision GEMMs reduce in fp32 inside the scope (PyTorch's default lets them reduce partial sums
    in fp16 / bf16): for the products the engine makes itself (the tiled attention's tiles), whose rounding the bound
    then models as fp32 accumulation (checks.product._gemm_accumulation reads the same flags) instead of a half
    precision one that hides a 40x error under its own round-off. Process-wide while it lasts, like every PyTorch
    precision flag; restored on exit."""
    flags = torch.backends.cuda.matmul
    before = (flags.allow_fp16_reduced_precision_reduction, flags.allow_bf16_reduced_precision_reduction)
    flags.allow_fp16_reduced_precision_reduction = False
    flags.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        flags.allow_fp16_reduced_precision_reduction, flags.allow_bf16_reduced_precision_reduction = before
