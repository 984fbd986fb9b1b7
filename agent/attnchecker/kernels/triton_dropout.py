"""Attention dropout's keep mask as a counter-based function, so that a backward regenerates the forward's mask
instead of storing it (B·H·T·S bits) or falling back to the unfused path.

    keep(n, i, j) = tl.rand(seed, (n·T + i)·S + j) >= p,   kept values scaled by 1 / (1 - p)

n = batch·H + query head, i the query row, j the key, T and S the call's query and key counts. ``tl.rand`` is Philox
(counter-based): the same (seed, offset) gives the same number in any program, tile order or launch, so a kernel that
tiles the scores differently from the one that drew the mask gets the same mask. The offset is taken in int64: at
B·H = 96 and T = S = 8192 it passes 2^32, and Philox takes 64-bit counters (below 2^32 they give what 32-bit ones
give). Every Triton kernel of the checked attention, forward and backward, draws its mask through ``keep``.

Imports without triton: ``available()`` says whether the kernels can run.
"""
from __future__ import annotations

from typing import Any

import torch

from .triton_common import cdiv, device_function, triton

if triton is not None:
    import triton.language as tl

__all__ = ["available", "keep_mask"]


def available() -> bool:
    return triton is not None


if triton is not None:

    @device_function
    def keep(seed, n, t, s, rows, cols, p):
        """(len(rows), len(cols)) bool: which of AP[n, rows, cols] dropout keeps. rows (R, 1), cols (1, C) int."""
        offsets = (n.to(tl.int64) * t + rows.to(tl.int64)) * s + cols.to(tl.int64)
        return tl.rand(seed, offsets) >= p

    @device_function
    def keep_scale(seed, n, t, s, rows, cols, p, inv_keep):
        """(len(rows), len(cols)) fp32: inv_keep where ``keep`` keeps, 0 where it drops, with no boolean tile.
        A kernel that multiplies by it rather than selecting with ``keep`` compiles where a select does not: Triton
        3.9 hoists the P̃ operand's layout conversion through the select into the mask, and a 1-bit tile cannot go
        through shared memory (the checked attention's repair kernel, sm_90). r >= p exactly when ceil(p - r) <= 0:
        r and p lie in [0, 1), so p - r lies in (-1, 1) and is 0 only when r == p (a difference of two floats rounds
        to 0 only when they are equal)."""
        offsets = (n.to(tl.int64) * t + rows.to(tl.int64)) * s + cols.to(tl.int64)
        return (1.0 - tl.math.ceil(p - tl.rand(seed, offsets))) * inv_keep

    @triton.jit
    def _keep_mask_kernel(out_ptr, seed, t, s, p, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr):
        n = tl.program_id(2)
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]
        cols = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)[None, :]
        kept = keep(seed, n, t, s, rows, cols, p)
        tl.store(out_ptr + (n.to(tl.int64) * t + rows) * s + cols, kept.to(tl.int8), mask=(rows < t) & (cols < s))


def keep_mask(seed: int, shape: tuple[int, int, int, int], p: float, device: torch.device | str) -> torch.Tensor:
    """(B, H, T, S) bool: the keep mask the kernels draw for a call of this shape, seed and dropout probability (for
    a reference computation, and for the unfused path to replay a Triton forward's dropout). One launch."""
    if triton is None:
        raise RuntimeError("attnchecker's dropout mask needs triton (pip install triton)")
    b, h, t, s = shape
    out = torch.empty((b, h, t, s), dtype=torch.int8, device=device)
    block_t, block_s = 16, 64
    grid: Any = (cdiv(t, block_t), cdiv(s, block_s), b * h)
    _keep_mask_kernel[grid](out, seed, t, s, p, BLOCK_T=block_t, BLOCK_S=block_s)
    return out.bool()
