"""Launchers of the GEMM checks' Triton kernels (triton_gemm_kernels.py has the kernels and what each computes): one
fused pass over each checked output, the operand passes its references come from, the tier-1 pass, and the repair
kernel that does nothing on a clean call. The GPU sibling of fused_pass.c and row_verify.c together.

On CUDA tensors the kernels run compiled; on CPU tensors only under Triton's interpreter (``TRITON_INTERPRET=1`` set
before triton is first imported), which is how the tests run them without a GPU. This module imports without
triton: ``available()`` says whether it can launch anything, ``takes(...)`` whether it takes these tensors.

No launcher syncs with the device: every outcome stays in device tensors (``Check.state`` and its summaries) until the
step boundary (gemm/device.py, checks/deferred.py). ``LAUNCHES`` counts the kernel launches, for the launch-count
test and the docs' figure.

Legend: nb = nb0·nb1 matrices (a product's leading dims, at most two: (B, H) for attention, none for a Linear GEMM),
M, N rows and columns of C, K the reduction length, R, C an operand's rows and columns.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import os
import sys
from types import ModuleType
from typing import Any

import torch

from ..abft.checksum import GROUP_MIN
from ..abft.gemm_rule import GemmRowRule

__all__ = ["LAUNCHES", "MAX_RUNS", "OUTCOMES", "SLOTS", "STATE", "STATE_SIZE", "Check", "EmulatedFault", "OperandOut",
           "RowSide", "TripGemm", "Workspace", "available", "check_pass", "fault_kind", "interpreted", "new_state",
           "operand_floats", "operand_pass", "repair_rows", "runs", "takes", "trip_pass", "trip_pass_pair"]

SLOTS = 16
"""Flagged rows per check whose summary (batch, row, column, outcome, value, residual, bound) is kept for its report;
the counts in ``state`` cover every row."""
STATE = {"flagged": 0, "worst": 1, "extreme": 2, "recompute": 3, "corrected": 4, "recomputed": 5,
         "uncorrectable": 6, "consistent": 7, "detected": 8, "upstream": 9}
"""Index of each count in a check's ``state`` (int32; "worst" holds the bits of an fp32 ratio)."""
STATE_SIZE = 16
OUTCOMES = {0: "clean", 1: "corrected", 2: "recompute", 3: "recomputed", 4: "uncorrectable", 5: "consistent",
            6: "detected", 7: "upstream"}
"""A row's outcome code (triton_gemm_kernels' constants)."""


class _Launches:
    """Kernel launches since the process started (or the last ``reset``), by kernel name."""

    def __init__(self) -> None:
        self.by_kernel: dict[str, int] = {}

    def count(self, name: str) -> None:
        self.by_kernel[name] = self.by_kernel.get(name, 0) + 1

    def reset(self) -> None:
        self.by_kernel.clear()

    @property
    def total(self) -> int:
        return sum(self.by_kernel.values())


LAUNCHES = _Launches()


def available() -> bool:
    """Whether triton can be imported here (it is not imported by this call)."""
    return importlib.util.find_spec("triton") is not None


def interpreted() -> bool:
    """Whether Triton's interpreter is on (``TRITON_INTERPRET=1``): kernels then run on CPU tensors. Triton decides
    at its first import (its standard library's functions are built then), so the variable set later is not enough."""
    if os.environ.get("TRITON_INTERPRET", "0").strip().lower() not in ("1", "true", "yes", "on"):
        return False
    return "triton" not in sys.modules or _built_for_interpreter()


@functools.lru_cache(maxsize=1)
def _built_for_interpreter() -> bool:
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.standard.argmax, InterpretedFunction)


def takes(*tensors: torch.Tensor) -> bool:
    """Whether the kernels can run on these tensors (a product's matrices and its bias): all on one CUDA device, or all
    on the CPU under the interpreter; fp32, bf16 or fp16; at most two leading dims. No pass over them, no sync."""
    if not tensors or not available():
        return False
    device = tensors[0].device
    if device.type == "cuda":
        if interpreted():
            return False
    elif device.type != "cpu" or not interpreted():
        return False
    return all(t.device == device and t.dtype in (torch.float32, torch.bfloat16, torch.float16) and 1 <= t.dim() <= 4
               for t in tensors)


@functools.lru_cache(maxsize=1)
def _kernels() -> ModuleType:
    from . import triton_gemm_kernels

    return triton_gemm_kernels


@dataclasses.dataclass(frozen=True, slots=True)
class _Blocks:
    rows: int
    cols: int
    k: int
    recompute_cols: int
    recompute_k: int
    """The tier-1 pass's recompute tiles (its tl.dot's N and K): on a GPU smaller than the repair kernel's, since the
    registers of the rarely taken recompute would otherwise set those of the scan every call runs (sm_90, offline,
    32 × 128 scan tiles on 4 warps: 168 registers in bf16 and 242 in fp32 with 16 × 16, against 255 and 60 B / 1.3 KB
    spilled with 128 × 32)."""
    operand_rows: int
    operand_cols: int
    operand_cols_fp32: int
    """The operand pass's tiles (fp32 X: the last's columns). Each program reads its factors' rows for every tile of
    X it reads (and, with runs, makes their weights), so more rows a program share that work: on sm_90
    (bench/triton_gemm_resources.py, a Llama-7B projection's three passes, 4 warps) bf16 64 × 64 tiles issue 0.63 to
    0.81 warp instructions an element, 32 × 128 tiles 1.18 to 1.65, 128 × 64 spill; fp32, whose products stay on the
    FMA units, 1.83 to 1.95 on 64 × 32 tiles without spilling, where 64 × 64 spill."""

    def operand_tiles(self, dtype: torch.dtype) -> tuple[int, int]:
        return self.operand_rows, self.operand_cols_fp32 if dtype == torch.float32 else self.operand_cols


def _compiled(device: torch.device) -> bool:
    """Whether launches on this device run compiled (CUDA) rather than under Triton's interpreter: the launchers'
    tiles, products and roundings follow it (bench/triton_gemm_resources.py sets it to capture a GPU's launches)."""
    return device.type == "cuda"


# On a GPU: tiles a program streams through registers (the check pass is memory-bound; 32 rows × 128 columns of bf16
# is 8 KB a step). Under the interpreter each op is a numpy call, whatever its size: big tiles, few ops.
_GPU_BLOCKS = _Blocks(32, 128, 32, 16, 16, 64, 64, 32)
_INTERPRETER_BLOCKS = _Blocks(64, 256, 64, 256, 64, 64, 256, 256)


def _blocks(device: torch.device) -> _Blocks:
    return _GPU_BLOCKS if _compiled(device) else _INTERPRETER_BLOCKS


def _lead(t: torch.Tensor) -> tuple[int, int, int, int]:
    """(nb0, nb1, stride0, stride1) of t's leading dims (none, one or two)."""
    if t.dim() == 2:
        return 1, 1, 0, 0
    if t.dim() == 3:
        return t.shape[0], 1, t.stride(0), 0
    return t.shape[0], t.shape[1], t.stride(0), t.stride(1)


class Workspace:
    """One zero-filled fp32 buffer (a memset here, or the caller's zeroed slice) carved into the outputs the kernels
    accumulate into with atomics: operand passes' column sums and checks' ``state``. Sized by the caller
    (``operand_floats``, ``STATE_SIZE``)."""

    def __init__(self, device: torch.device, floats: int, *, zeroed: torch.Tensor | None = None) -> None:
        """zeroed: (floats,) fp32 zeros the caller has (a slice of its step's arena, checks/zeroed.py) in place of
        the memset here."""
        if zeroed is not None and (zeroed.numel() < floats or zeroed.dtype != torch.float32):
            raise ValueError(f"Workspace: zeroed holds {zeroed.numel()} {zeroed.dtype} elements, {floats} float32 "
                             f"asked")
        self.buf = zeroed if zeroed is not None else torch.zeros(max(floats, 1), device=device, dtype=torch.float32)
        self.used = 0

    def take(self, n: int) -> torch.Tensor:
        if self.used + n > self.buf.numel():
            raise ValueError(f"Workspace: {n} more floats asked of {self.buf.numel() - self.used} left (sized short)")
        out = self.buf[self.used : self.used + n]
        self.used += n
        return out


def operand_floats(x: torch.Tensor, *, right: int = 0, left: int = 0, left_w: int = 0, col_sq: bool = False) -> int:
    """The zeroed floats ``operand_pass`` takes from its workspace for these outputs: right, left the widths of the
    factors given (0: none; their squared norms are kept there too), left_w the runs of Xᵀ·w (0: not asked)."""
    nb0, nb1, _, _ = _lead(x)
    nb = nb0 * nb1
    return nb * (x.shape[-1] * (left + 2 * left_w + col_sq) + right + left)


MAX_RUNS = 8
"""Most checksum runs per row on this path (``runs``): the operand pass makes a reference per run and weighting as a
tl.dot against a factor 2·runs wide, padded to JP = 16 columns. For bf16 and fp16 operands those are tensor-core
products (the factors in TF32 parts, kernels' _dot_exact), whose width costs next to nothing; for fp32 ones they stay
16 multiply-adds per element and factor on the FMA units, which at an H100's ~3.3·10¹³ fp32 rate reads 2·10¹² fp32
elements a second, about its memory's rate (data-sheet arithmetic, not timed)."""


@functools.lru_cache(maxsize=256)
def runs(n: int) -> int:
    """Checksum runs for a row of n columns on this path: abft/checksum.py's group_count (runs of ≥ GROUP_MIN
    columns), capped at MAX_RUNS: the most runs ≤ MAX_RUNS that divide n into runs of at least GROUP_MIN."""
    for g in range(min(MAX_RUNS, n // GROUP_MIN), 1, -1):
        if n % g == 0:
            return g
    return 1


WHOLE_RUN = 2048
"""Runs of at most this many columns (or rows) have checksum weights 1..run exact in TF32 (11 significant bits): the
grouped operand pass's tensor-core form takes them as they are, longer runs as three parts (kernels' _dot_exact)."""


def _jp(*widths: int) -> int:
    """The grouped operand pass's padded factor width (tl.dot takes 16 and up), or 0 for the 2-wide form."""
    if max(widths) <= 2:
        return 0
    return max(16, triton_next_pow2(max(widths)))


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclasses.dataclass(frozen=True, slots=True)
class OperandOut:
    """What one read of X (.., R, C) gave, dense with the leading dims flattened to nb (None where not asked for)."""

    xv: torch.Tensor | None = None
    """(nb, R, J) X·V"""
    xw: torch.Tensor | None = None
    """(nb, R, 2·runs) X·[1, 1..C/runs] per run of columns (2: one run)"""
    rsq: torch.Tensor | None = None
    """(nb, R) ΣX² per row"""
    lx: torch.Tensor | None = None
    """(nb, C, J) Xᵀ·L"""
    wx: torch.Tensor | None = None
    """(nb, C, 2·runs) Xᵀ·[1, 1..R/runs] per run of rows"""
    csq: torch.Tensor | None = None
    """(nb, C) ΣX² per column"""
    vsq: torch.Tensor | None = None
    """(nb, J) ‖V‖² per column of V (right's), for the rule of the check xv is the reference of"""
    lsq: torch.Tensor | None = None
    """(nb, J) ‖L‖² per column of L (left's)"""


def _factor(f: torch.Tensor | None, lead: tuple[int, int], like: torch.Tensor
            ) -> tuple[torch.Tensor, int, int, int, int]:
    """A (.., L, J) factor as (tensor, batch strides, element strides); a 2-D one is shared by the batch (strides 0),
    a (nb, L, 2) one is split into the (nb0, nb1) leading dims."""
    if f is None:
        return like, 0, 0, 0, 0
    if f.dim() == 2:
        return f, 0, 0, f.stride(0), f.stride(1)
    nb0, nb1 = lead
    if f.shape[0] != nb0 * nb1:
        raise ValueError(f"operand_pass: a factor of {f.shape[0]} matrices for {nb0 * nb1}")
    return f, f.stride(0) * nb1, f.stride(0), f.stride(1), f.stride(2)


def operand_pass(x: torch.Tensor, ws: Workspace, *, right: torch.Tensor | None = None, right_w: int = 0,
                 left: torch.Tensor | None = None, left_w: int = 0, row_sq: bool = False, col_sq: bool = False,
                 cast: torch.dtype | None = None) -> OperandOut:
    """One read of X (R, C) or (.., R, C), any strides: X·right for right (C, J) or (nb, C, J), X·w per run of
    C/right_w columns (right_w runs; 0: not asked), Xᵀ·left for left (R, J) or (nb, R, J), Xᵀ·w per run of R/left_w
    rows, and the squared row and column sums, in fp32; with right or left, its squared norms per column (the
    reference's ‖B w‖² a row rule takes). A factor wider than 2 or more than one run: the grouped form (JP > 0).
    cast (bf16, fp16): an fp32 X that its GEMM rounds to that dtype (autocast) enters the products rounded so, the
    squared sums as given. No sync."""
    k = _kernels()
    nb0, nb1, s0, s1 = _lead(x)
    nb = nb0 * nb1
    rows, cols = x.shape[-2:]
    dev = x.device
    jv = right.shape[-1] if right is not None else 0
    jl = left.shape[-1] if left is not None else 0
    if (right_w and cols % right_w) or (left_w and rows % left_w):
        raise ValueError(f"operand_pass: right_w={right_w} runs must divide its {cols} columns and left_w={left_w} "
                         f"its {rows} rows")
    new = functools.partial(torch.empty, device=dev, dtype=torch.float32)
    xv = new(nb, rows, jv) if right is not None else None
    xw = new(nb, rows, 2 * right_w) if right_w else None
    rsq = new(nb, rows) if row_sq else None
    lx = ws.take(nb * cols * jl).view(nb, cols, jl) if left is not None else None
    wx = ws.take(nb * cols * 2 * left_w).view(nb, cols, 2 * left_w) if left_w else None
    csq = ws.take(nb * cols).view(nb, cols) if col_sq else None
    vsq = ws.take(nb * jv).view(nb, jv) if right is not None else None
    lsq = ws.take(nb * jl).view(nb, jl) if left is not None else None
    vt, sv0, sv1, svk, svj = _factor(right, (nb0, nb1), x)
    lt, sl0, sl1, slr, slj = _factor(left, (nb0, nb1), x)
    blk = _blocks(dev)
    dummy = ws.buf
    # An fp32 operand rounded to half precision by its GEMM is, rounded, exact in TF32: the tensor-core form takes it.
    cast_code = _cast_code(cast, x)
    br, bc = blk.operand_tiles(torch.bfloat16 if cast_code else x.dtype)
    grid = (triton_cdiv(rows, br), nb)
    k.operand_pass[grid](
        x, rows, cols, nb1, s0, s1, x.stride(-2), x.stride(-1),
        vt, sv0, sv1, svk, svj, lt, sl0, sl1, slr, slj,
        xv if xv is not None else dummy, xw if xw is not None else dummy, rsq if rsq is not None else dummy,
        lx if lx is not None else dummy, wx if wx is not None else dummy, csq if csq is not None else dummy,
        vsq if vsq is not None else dummy, lsq if lsq is not None else dummy,
        jv, jl, cols // (right_w or 1), rows // (left_w or 1), 2 * right_w, 2 * left_w,
        RIGHT_V=right is not None, RIGHT_W=bool(right_w), LEFT_L=left is not None, LEFT_W=bool(left_w),
        ROW_SQ=row_sq, COL_SQ=col_sq, BR=br, BC=bc,
        JP=0 if jv <= 2 and jl <= 2 and right_w <= 1 and left_w <= 1 else _jp(jv, jl, 2 * right_w, 2 * left_w),
        TC=x.dtype in (torch.bfloat16, torch.float16) or cast_code > 0, CAST=cast_code,
        WHOLE_W=max(cols // right_w if right_w else 0, rows // left_w if left_w else 0) <= WHOLE_RUN,
    )
    LAUNCHES.count("operand_pass")
    return OperandOut(xv=xv, xw=xw, rsq=rsq, lx=lx, wx=wx, csq=csq, vsq=vsq, lsq=lsq)


_CAST = {torch.bfloat16: 1, torch.float16: 2}
"""operand_pass's CAST code of the dtype a GEMM rounds an fp32 operand to."""


def _cast_code(cast: torch.dtype | None, x: torch.Tensor) -> int:
    """operand_pass's CAST for an operand x its GEMM rounds to ``cast``: 0 none (x is not fp32, or no cast), 1 bf16,
    2 fp16, 3 bf16 rounded on the integer bits (CPU tensors: Triton's interpreter converts to bf16 by truncation)."""
    code = _CAST.get(cast, 0) if cast is not None and x.dtype == torch.float32 else 0
    return 3 if code == 1 and not _compiled(x.device) else code


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True, slots=True)
class RowSide:
    """The operand side of C = A·B's row check, as the operand passes make it (fp32, dense, squares not norms: a
    square sum added up across programs can be rooted only by its reader, the check pass)."""

    ref: torch.Tensor
    """(nb, M, 2·runs) A·(B_h w) per run h of N/runs columns, w = ones and 1..N/runs; the bias is added by the check
    pass."""
    a_sq: torch.Tensor
    """(nb, M) ‖A_i‖²"""
    b_sq: torch.Tensor
    """(nb, N) or (N,) ‖B_j‖² (one row shared by the batch)."""
    ref_sq: torch.Tensor
    """(nb, 2·runs) ‖B_h w‖² per run and weighting: the vector the reference dotted A's rows with (its rounding
    term's norm, where the triangle bound Σ_j w_j ‖B_j‖ is √N looser on uncorrelated columns: 30x at a 7B
    projection)."""
    runs: int = 1
    """Checksum runs per row (``runs``): each run of N/runs columns is checked on its own."""


@dataclasses.dataclass(frozen=True, slots=True)
class EmulatedFault:
    """A planned fault (attnchecker.inject) that a recomputation inside the repair kernel meets, where a torch op's
    output would have been hit (attempt 1): rows [row0, row1) × cols [col0, col1) of matrix ``batch`` of C as the
    check sees it. kind: 0 set to value, 1 add value, 2 flip the exponent bit inject.bitflip flips."""

    batch: int
    row0: int
    row1: int
    col0: int
    col1: int
    kind: int
    value: float


@dataclasses.dataclass(slots=True)
class Check:
    """One product's check on the device: its counts (``state``, int32 (STATE_SIZE,): ``STATE``), each row's outcome
    (``code``, (nb, M) int32), and the first SLOTS flagged rows' summaries (``slot_i`` (SLOTS, 4) int32: batch, row,
    column, outcome; ``slot_f`` (SLOTS, 4) fp32: value, d1, bound, -). ``args`` keeps what the repair kernel needs
    (dropped once it ran)."""

    state: torch.Tensor
    code: torch.Tensor
    slot: torch.Tensor
    slot_i: torch.Tensor
    slot_f: torch.Tensor
    lead: tuple[int, int]
    args: dict[str, Any] | None


def _rule_args(rule: GemmRowRule) -> tuple[float, ...]:
    return (rule.floor_a, rule.floor_b, rule.rig_ab, rule.rig_bias, rule.abs_coef, rule.under0, rule.flush,
            rule.var_b, rule.var_ref, rule.var_bias, rule.sq_coef, rule.tiny_pad, rule.common, rule.sigmas,
            rule.near_inf, math.sqrt(rule.k))


def _side_args(side: RowSide, lead: tuple[int, int]) -> tuple[Any, ...]:
    """The kernels' (pointer, batch strides, element strides) of a RowSide, its (nb, ...) outputs split into the
    (nb0, nb1) leading dims; a b_sq of one row is shared by the batch (batch strides 0)."""
    nb1 = lead[1]
    ref, a_sq, b_sq, ref_sq = side.ref, side.a_sq, side.b_sq, side.ref_sq
    sb0, sb1 = ((b_sq.stride(0) * nb1, b_sq.stride(0)) if b_sq.dim() == 2 and b_sq.shape[0] > 1 else (0, 0))
    return (ref, ref.stride(0) * nb1, ref.stride(0), ref.stride(-2), ref.stride(-1),
            a_sq, a_sq.stride(0) * nb1, a_sq.stride(0), a_sq.stride(-1), b_sq, sb0, sb1, b_sq.stride(-1),
            ref_sq, ref_sq.stride(0) * nb1, ref_sq.stride(0))


def check_pass(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, side: RowSide,
               rule: GemmRowRule, ws: Workspace, *, correct: bool) -> Check:
    """The row check of C = A·B (+ bias) (M, N) or (.., M, N), C any strides (a column check is the row check of the
    transposed view), A (.., M, K) and B (.., K, N) for recomputing located elements, against ``side`` under
    ``rule``: one read of C, located single errors corrected in place (``correct``) within the same launch, rows that
    need recomputing marked for ``repair_rows``. No sync."""
    k = _kernels()
    nb0, nb1, sc0, sc1 = _lead(c)
    nb = nb0 * nb1
    m, n = c.shape[-2:]
    dev = c.device
    state, code, slot, slot_i, slot_f = _outcomes(ws, nb * m, dev)
    a_args, b_args = _operand_args(a, b)
    blk = _blocks(dev)
    flags = {"CORRECT": correct, "USE_ABS": rule.use_abs, "HAS_BIAS": bias is not None,
             "CALIBRATED": rule.calibrated, "FLUSH": rule.flush != 0.0}
    bias_t = bias if bias is not None else state
    c_args = (c, m, n, nb1, sc0, sc1, c.stride(-2), c.stride(-1))
    if n % side.runs or side.ref.shape[-1] != 2 * side.runs or side.ref_sq.shape[-1] != 2 * side.runs:
        raise ValueError(f"check_pass: {side.runs} runs of a {n}-column row need references (.., {m}, "
                         f"{2 * side.runs}) and their norms (.., {2 * side.runs}); got {tuple(side.ref.shape)}, "
                         f"{tuple(side.ref_sq.shape)}")
    side_args = _side_args(side, (nb0, nb1))
    runs_args = (side.runs, n // side.runs)
    k.check_pass[(triton_cdiv(m, blk.rows), nb)](
        *c_args, *side_args, bias_t, *a_args, *b_args, state, code, slot, slot_i, slot_f, SLOTS,
        *_rule_args(rule), *runs_args, BM=blk.rows, BN=blk.cols, BK=blk.k, **flags,
    )
    LAUNCHES.count("check_pass")
    args = {"c": c_args, "side": side_args, "bias": bias_t, "a": a_args, "b": b_args, "rule": rule, "flags": flags,
            "grid": (triton_cdiv(m, blk.rows), nb), "blk": blk, "runs": runs_args}
    return Check(state=state, code=code, slot=slot, slot_i=slot_i, slot_f=slot_f, lead=(nb0, nb1), args=args)


def _operand_args(a: torch.Tensor, b: torch.Tensor) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """The kernels' (pointer, batch strides, element strides) of A (.., M, K) and B (.., K, N), B's with K, for
    recomputing elements and rows of C = A·B."""
    _, _, sa0, sa1 = _lead(a)
    _, _, sb0, sb1 = _lead(b)
    return (a, sa0, sa1, a.stride(-2), a.stride(-1)), (b, sb0, sb1, b.stride(-2), b.stride(-1), a.shape[-1])


def _outcomes(ws: Workspace, rows: int, dev: torch.device) -> tuple[torch.Tensor, ...]:
    """A check's outcome buffers (``Check``): its zeroed state from the workspace, and per row and per slot what the
    kernels write before anything reads them (no memset), carved from one allocation (four cost a tier-1 call a tenth
    of its host time): code (rows,), slot (rows,), slot_i (SLOTS, 4) int32 and slot_f (SLOTS, 4) fp32."""
    # Each part at a multiple of 16 bytes, as an allocation of its own would be: Triton specialises its kernels on
    # their pointers' 16-byte alignment.
    part = -(-rows // 4) * 4
    buf = torch.empty(2 * part + 8 * SLOTS, device=dev, dtype=torch.int32)
    slots = buf[2 * part :].view(2, SLOTS, 4)
    return new_state(ws), buf[:rows], buf[part : part + rows], slots[0], slots[1].view(torch.float32)


def new_state(ws: Workspace) -> torch.Tensor:
    """A check's counts, (STATE_SIZE,) int32 zeros from the workspace."""
    return ws.take(STATE_SIZE).view(torch.int32)


def trip_pass(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, rule: GemmRowRule,
              ws: Workspace, *, correct: bool, faults: tuple[EmulatedFault, ...] = ()) -> Check:
    """Tier 1 of C = A·B (+ bias) in one launch: the count of C's INF, NaN and |x| > rule.near_inf elements into the
    returned Check's state (STATE["extreme"]), and in the programs whose rows hold one, those rows recomputed there
    (no references: the recomputation judged by what the operands allow); one read of C, more only of the tripped
    rows. faults: planned faults the recomputation meets (as ``repair_rows``'). No sync."""
    k = _kernels()
    blk = _blocks(c.device)
    args, consts, chk, _ = _trip_args(TripGemm(c, a, b, bias, rule, faults), ws)
    nb0, nb1 = chk.lead
    # trip_pass's arguments: the GEMM's, then SLOTS before its last three (fault table, near_inf, c_max).
    k.trip_pass[(triton_cdiv(c.shape[-2], blk.rows), nb0 * nb1)](
        *args[:-3], SLOTS, *args[-3:], CORRECT=correct, **consts, BM=blk.rows, BN=blk.cols, BK=blk.recompute_k,
        RBN=blk.recompute_cols)
    LAUNCHES.count("trip_pass")
    return chk


@dataclasses.dataclass(frozen=True)
class TripGemm:
    """One GEMM C = A·B (+ bias) for a tier-1 pass: its rule (for near_inf) and the planned faults its recompute
    meets."""

    c: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    bias: torch.Tensor | None
    rule: GemmRowRule
    faults: tuple[EmulatedFault, ...] = ()


def _trip_args(g: TripGemm, ws: Workspace) -> tuple[tuple[Any, ...], dict[str, Any], Check, int]:
    """A tier-1 pass's arguments for one GEMM (``trip_pass``'s, SLOTS aside), its per-GEMM constexprs, its Check and
    its programs."""
    nb0, nb1, sc0, sc1 = _lead(g.c)
    m, n = g.c.shape[-2:]
    state, code, slot, slot_i, slot_f = _outcomes(ws, nb0 * nb1 * m, g.c.device)
    a_args, b_args = _operand_args(g.a, g.b)
    args = (g.c, m, n, nb1, sc0, sc1, g.c.stride(-2), g.c.stride(-1), g.bias if g.bias is not None else state,
            *a_args, *b_args, state, code, slot, slot_i, slot_f, _fault_table(g.faults, g.c.device, state),
            g.rule.near_inf, torch.finfo(g.c.dtype).max)
    consts = {"HAS_BIAS": g.bias is not None, "NF": len(g.faults), **_dot_flags(g.c, g.a, g.b)}
    chk = Check(state=state, code=code, slot=slot, slot_i=slot_i, slot_f=slot_f, lead=(nb0, nb1), args=None)
    return args, consts, chk, triton_cdiv(m, _blocks(g.c.device).rows) * nb0 * nb1


def trip_pass_pair(first: TripGemm, second: TripGemm, ws: Workspace, *, correct: bool) -> tuple[Check, Check]:
    """``trip_pass`` of two GEMMs in one launch (a Linear's dX and dW): the same programs, the same outcomes, one
    launch fewer. No sync."""
    k = _kernels()
    blk = _blocks(first.c.device)
    args1, consts1, chk1, programs1 = _trip_args(first, ws)
    args2, consts2, chk2, programs2 = _trip_args(second, ws)
    k.trip_pass_pair[(programs1 + programs2,)](
        *args1, *args2, SLOTS, programs1, CORRECT=correct, **consts1, **{_SECOND[c]: v for c, v in consts2.items()},
        BM=blk.rows, BN=blk.cols, BK=blk.recompute_k, RBN=blk.recompute_cols)
    LAUNCHES.count("trip_pass_pair")
    return chk1, chk2


_SECOND = {"HAS_BIAS": "HAS_BIAS2", "NF": "NF2", "DOT_FP32": "DOT_FP32_2", "IEEE": "IEEE2", "IS_F32": "IS_F32_2"}
"""trip_pass_pair's names of the second GEMM's constexprs."""


def _fault_table(faults: tuple[EmulatedFault, ...], device: torch.device, empty: torch.Tensor) -> torch.Tensor:
    """The planned faults' table as the kernels read it, copied without a sync (host_table); ``empty`` stands in for
    none."""
    if not faults:
        return empty
    from .triton_common import host_table  # with the kernels: this module imports no triton until they are used

    return host_table([[f.batch, f.row0, f.row1, f.col0, f.col1, f.kind, f.value, 0.0] for f in faults],
                      torch.float32, device)


def _dot_flags(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> dict[str, bool]:
    """How a recomputation's tl.dot runs: the interpreter's takes fp32 and fp16, not bf16, so products there are in
    fp32, as the GPU accumulates them; IEEE fp32 for fp32 operands."""
    dot_fp32 = not _compiled(c.device) or a.dtype != b.dtype
    return {"DOT_FP32": dot_fp32, "IEEE": dot_fp32 or a.dtype == torch.float32, "IS_F32": c.dtype == torch.float32}


_KINDS = {"inf": (0, math.inf), "neg_inf": (0, -math.inf), "nan": (0, math.nan), "add": (1, 1.0), "bitflip": (2, 0.0)}


def fault_kind(kind: str, value: float | None) -> tuple[int, float]:
    """(kernel kind, value) of an attnchecker.inject fault kind (near_inf: its value, 1e20 by default)."""
    if kind == "near_inf":
        return 0, 1e20 if value is None else value
    code, default = _KINDS[kind]
    return code, default if value is None or kind != "add" else value


def repair_rows(check: Check, faults: tuple[EmulatedFault, ...] = ()) -> None:
    """Recompute, re-verify and write back the rows ``check`` marked; every program returns at once when there are
    none (a clean call: one launch that reads one int). faults: planned faults its recomputation meets (tests, the
    demo); their table is copied to the device without a sync (host_table). No sync anywhere."""
    args = check.args
    if args is None:
        raise ValueError("repair_rows: this check's repair already ran")
    k = _kernels()
    c = args["c"][0]
    rule: GemmRowRule = args["rule"]
    blk: _Blocks = args["blk"]
    k.repair_rows[args["grid"]](
        *args["c"], *args["side"], args["bias"], *args["a"], *args["b"], check.state, check.code, check.slot,
        check.slot_i, SLOTS, _fault_table(faults, c.device, check.state), *_rule_args(rule), rule.elem_ab,
        rule.elem_abs, torch.finfo(c.dtype).max, *args["runs"], NF=len(faults), BM=blk.rows, BN=blk.cols, BK=blk.k,
        **_dot_flags(c, args["a"][0], args["b"][0]), **args["flags"],
    )
    LAUNCHES.count("repair_rows")
    check.args = None
