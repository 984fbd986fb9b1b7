"""Device functions both attention forward passes share: the checked kernel (triton_attention.py) and the full
check over a forward another kernel computed (triton_given_check.py). A program's place among the query blocks, a
block's rows of a (B, H, T, D) tensor, a tile as a tl.dot operand, and a block's two records (scores, context) with
the call's status.

``@triton.jit`` functions, inlined where a kernel calls them; importable without triton (they then do not exist).
"""
from __future__ import annotations

from typing import Any

from . import triton_checks as tc
from .triton_common import device_function, triton

if triton is not None:
    import triton.language as tl

__all__: list[str] = []

if triton is not None:
    _jit: Any = device_function
    F32_MAX: Any = tl.constexpr(3.4028234663852886e38)

    @_jit
    def operand(x, DOT: tl.constexpr):
        """A tile as a tl.dot operand (triton_attention.dot_mode)."""
        if DOT == 2:
            return x.to(tl.float32)
        if DOT == 3:
            bits = x.to(tl.int32, bitcast=True) & -8192  # keep 10 mantissa bits (0xFFFFE000), as TF32 truncates
            return tl.where(tl.abs(x) <= F32_MAX, bits.to(tl.float32, bitcast=True), x)
        return x

    @_jit
    def dot(a, b, DOT: tl.constexpr):
        if DOT == 1:
            return tl.dot(a, b, input_precision="tf32")
        return tl.dot(a, b, input_precision="ieee")

    @_jit
    def query_block(pid_m, pid_n, H, GROUP, T, D, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        """A program's place: (batch, query head, its key head, its query rows, the head dim's columns, which rows
        and columns exist), program (pid_m, pid_n) being query block pid_m of matrix n = batch·H + head."""
        h = pid_n % H
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        return pid_n // H, h, h // GROUP, offs_m, offs_d, offs_m < T, offs_d < D

    @_jit
    def rows(X, b, h, offs_m, offs_d, sb, sh, st, sd, row_ok, d_ok):
        """A block's rows of a (B, H, T, D) tensor at any strides, 0 outside it."""
        return tl.load(X + b.to(tl.int64) * sb + h.to(tl.int64) * sh + offs_m[:, None] * st + offs_d[None, :] * sd,
                       mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    @_jit
    def publish(rec_at, rec_s, rec_c, Status):
        """A block's two records (scores, context) stored, and the call's flag per op raised where one flagged."""
        fi = tl.arange(0, 16)
        tl.store(rec_at + fi, rec_s)
        tl.store(rec_at + 16 + fi, rec_c)
        if tc.pick(rec_s, 0) != 0.0:
            tl.atomic_max(Status, 1.0)
        if tc.pick(rec_c, 0) != 0.0:
            tl.atomic_max(Status + 1, 1.0)
