"""Verify and repair plain GEMMs inside the engine: ``abft.gemm`` checks, the ``abft.repair`` ladder, and the engine's
records (detections, counts, residual histogram). Shared by the whole-step Linear checks (gemm.linear) and the
attention backward (attention.backward.checked).

Legend: N leading batch dims (none for a Linear GEMM; (B, H) for attention), M, K, N rows/reduction/columns.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence

import torch

from ..abft import Tolerance, checksum_weights, repair
from ..abft.checksum import DirectionCheck
from ..abft.gemm import DIRECTIONS, OperandSums, exact_gemm_elements, verify_gemm
from ..checks.context import LayerContext
from ..checks.product import _exact_math, _tolerance
from ..checks.records import (
    _any_bad,
    _count,
    _count_trips,
    _emit,
    _emit_unplaced_trip,
    _inject,
    _record_ratio,
    _worst_ratio,
)
from ..kernels.fused_pass import fused_pass
from ..kernels.row_verify import verify_rows
from ..matmul_precision import fp32_matmul_operand_roundoff
from ..tripwire import extreme_each
from . import device

__all__ = ["Gemm", "LinearSums", "backward_sums", "check_gemms", "linear_sums", "trip_gemms"]

Gemm = tuple[str, torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"]
"""(op, C (..., M, N), A (..., M, K), B (..., K, N), bias (N,) or None): one GEMM C = A·B (+ bias) to verify in
place. A batched C (attention) is reported per (batch, head)."""


FAST_DIRECTIONS: tuple[str, ...] = ("row",)
"""What a clean check computes: one direction (it detects any single corrupted element); both, and the location, only
after it flags. Row: its checksums and bound sums are contiguous reductions of C."""


Given = tuple[str, OperandSums]
"""(direction, its operand side): a GEMM's clean check with the operand side made by the caller (``linear_sums``)."""


def check_gemms(ctx: LayerContext, gemms: list[Gemm], *, tier: str = "abft",
                given: Sequence[Given | None] | None = None, given_seconds: float = 0.0) -> int:
    """Verify every GEMM in one direction, then (one sync) run the recovery ladder, with both directions, on those
    flagged. C is repaired in place. Returns how many GEMMs it reported (flagged, not an fp16 overflow
    (``_overflowed``), and inconsistent with their operands in the full check). tier: "tripwire" for a tier-1 recovery
    (``trip_gemms``): its events say so, and its time counts as tier 1's, not as the scheduled checks'.
    given: per GEMM, the direction and operand side of its clean check already made (``linear_sums``), or None;
    given_seconds: the time that took, counted in these checks' time.
    On the Triton path (gemm/device.py: CUDA tensors, ``ATTNCHECKER_GEMM``) nothing waits for the device: the checks
    and their repairs run as kernels, their reports come at the step boundary, and this returns 0; where one of its
    kernels fails, the GEMMs it had not checked are checked here."""
    if not gemms or ctx.config.mode == "off":
        return 0
    if device.takes(*_operands(gemms)):
        try:
            device.check_gemms(ctx, gemms, tier=tier)
            return 0
        except device.KernelFailed as exc:
            gemms, given = gemms[exc.done:], given[exc.done:] if given is not None else None
    tol = _tolerance(ctx)
    pending: list[tuple[Gemm, dict[str, DirectionCheck], float]] = []
    t_call = time.perf_counter()
    # One exact-math context and one histogram update for the call: per GEMM they were a fixed cost of their own
    # (a few dozen small ops), which is what a check of a small GEMM mostly is.
    with _exact_math(gemms[0][1]):
        for i, gemm in enumerate(gemms):
            t0 = time.perf_counter()
            made = given[i] if given is not None else None
            checks = (_verify(gemm, tol, FAST_DIRECTIONS) if made is None
                      else _verify(gemm, tol, (made[0],), operand_sums=made[1]))
            pending.append((gemm, checks, time.perf_counter() - t0))
        flags = torch.stack([_any_bad(checks) for _, checks, _ in pending])
        if ctx.runtime.stats is not None:
            _record_ratio(ctx, torch.stack([_worst_ratio(checks) for _, checks, _ in pending]),
                          [gemm[0] for gemm, _, _ in pending])
    # The shared part (context, flags, histogram), split evenly between the GEMMs' check times.
    shared = (time.perf_counter() - t_call - sum(s for _, _, s in pending) + given_seconds) / len(pending)
    pending = [(gemm, checks, seconds + shared) for gemm, checks, seconds in pending]
    flagged = flags.tolist()  # sync: the one per checked call (a layer's forward, or its backward); gates the slow path
    correct = ctx.config.mode == "correct"
    reported = 0
    for (gemm, _checks, seconds), bad in zip(pending, flagged, strict=True):
        op, c, a, b, bias = gemm
        t0 = time.perf_counter()
        if bad and _overflowed(c, a, b, bias):
            bad = False
        if bad:
            with _exact_math(c):
                # Both directions from the same operands: the flagged one again (the same checksums), and the other,
                # which locates what one direction cannot (a corrupted column, a block). The bound from float64
                # norms: an fp32 norm that overflowed (values ~1e19 and up, diverged bf16 training) left the fast
                # path an undefined bound; a finite product flagged only for that is not reported, nor one whose
                # fp32 checksums overflowed (`_consistent_in_float64`).
                full = _verify(gemm, tol, DIRECTIONS, wide_norms=True)
                reports = [] if _consistent_in_float64(gemm, full, tol) else _repair(
                    c, a.detach(), b.detach(), None if bias is None else bias.detach(), full, tol, correct,
                    functools.partial(_inject, ctx, op, attempt=1))
            reported += bool(reports)
            _emit(ctx, op, reports, heads=c.dim() > 2, tier=tier)
        if tier == "abft":
            _count(ctx, op, seconds + time.perf_counter() - t0)
        else:
            _count_trips(ctx, [], seconds + time.perf_counter() - t0)
    return reported


OVERFLOW_PROBES = 64
"""Non-finite outputs of a flagged fp16 / bf16 GEMM whose exact values are computed to tell overflow from a fault."""


def _overflowed(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether a flagged half-precision product holds INF/NaN only where its exact value is past its dtype's range:
    the GEMM computed what the dtype can hold, not a fault. Mixed precision does this on purpose in fp16: GradScaler
    multiplies the loss by up to 2^24, the backward GEMMs overflow on its first steps, and it skips those steps and
    lowers the scale. Reported as faults, every such step was an "uncorrectable" event (and a crash under
    on_uncorrectable="raise"). bf16 shares fp32's range, so only diverged training gets there (the clean campaign's
    `outliers` run: a weight gradient of activations ~1e37, exact values ~1e41); the optimizer net then refuses the
    step. A fault that lands in the same GEMM on such a step goes unreported; the step's gradients are thrown away
    anyway. Probes up to OVERFLOW_PROBES of the non-finite elements, recomputed in float64 from the operands (slow
    path only)."""
    if c.dtype not in (torch.float16, torch.bfloat16):
        return False
    where = (~torch.isfinite(c)).nonzero()[:OVERFLOW_PROBES]  # sync: slow path only
    if where.shape[0] == 0:
        return False
    lead, rows, cols = where[:, :-2].unbind(-1), where[:, -2], where[:, -1]
    a_rows_PK = a.detach()[(*lead, rows)].double()
    b_cols_PK = b.detach().mT[(*lead, cols)].double()
    exact_P = (a_rows_PK * b_cols_PK).sum(-1)
    if bias is not None:
        exact_P = exact_P + bias.detach()[cols].double()
    # A non-finite exact value came in with an operand: not this GEMM's fault either (its reference is not finite).
    limit = torch.finfo(c.dtype).max
    return bool(((exact_P.abs() > limit) | ~torch.isfinite(exact_P)).all())  # sync: slow path only


def _consistent_in_float64(gemm: Gemm, full: dict[str, DirectionCheck], tol: Tolerance) -> bool:
    """Whether a product the full check flagged is consistent with its operands once its checksums are summed in
    float64 (slow path only): the flag came from the fp32 checksums themselves. Weighted by 1..n, values of ~1e34 and
    up overflow fp32, and INF − INF flags a correct product: diverged bf16 training computes such values (the clean
    campaign's `outliers` run: dX and dW of 1e34–1e37, and the attention backward's dQ/dK, reported as near-INF). A
    product holding an INF or NaN is never consistent: it goes to the recovery ladder as before."""
    c = gemm[1]
    if not any(bool(chk.bad.any()) for chk in full.values()):  # sync: slow path only
        return True
    if not bool(torch.isfinite(c).all()):  # sync: slow path only
        return False
    exact = _verify(gemm, tol, DIRECTIONS, wide_norms=True, exact_sums=True)
    return not any(bool(chk.bad.any()) for chk in exact.values())  # sync: slow path only


def trip_gemms(ctx: LayerContext, gemms: list[Gemm]) -> None:
    """Tier 1 on GEMMs whose full check is not due: one sum per output (tripwire.extreme_each); an
    output that trips gets its full check now (``check_gemms`` with tier "tripwire"), which locates and corrects or
    recomputes the fault in place. When the full check finds the output consistent with its operands, this GEMM made
    no error: a finite output is left alone (real values past 1e10, e.g. diverged training: not a fault), a
    non-finite one is reported as detected (it came in with an input, whose reference is not finite either: an
    upstream fault this GEMM cannot repair)."""
    if not gemms or ctx.config.mode == "off":
        return
    if device.takes(*_operands(gemms)):
        try:
            device.trip_gemms(ctx, gemms)
            return
        except device.KernelFailed as exc:  # the GEMMs it had not passed over get the host's tier 1
            gemms = gemms[exc.done:]
    t0 = time.perf_counter()
    tripped = extreme_each([c for _, c, *_ in gemms])  # sync: the one per call on a tier-1 step (none on CPU)
    _count_trips(ctx, [gemm[0] for gemm in gemms], time.perf_counter() - t0)
    for gemm, trip in zip(gemms, tripped, strict=True):
        if (trip and not check_gemms(ctx, [gemm], tier="tripwire") and not bool(gemm[1].isfinite().all())  # sync
                and not _overflowed(*gemm[1:])):
            _emit_unplaced_trip(ctx, gemm[0], gemm[1], action="detected")


def _operands(gemms: list[Gemm]) -> list[torch.Tensor]:
    return [t for _op, c, a, b, bias in gemms for t in (c, a, b, bias) if t is not None]


ONE_PASS_MIN = 1 << 18
"""Fewest elements (C, A and B together) of a GEMM whose check reads them through the one-pass kernel: below, the
eager BLAS calls win over its fixed cost of three calls (one thread, measured: 64³ 0.35 against 0.30 ms eagerly,
128×256×256 0.39 against 0.36; 256×256×1024 0.48 against 0.54; 1024×512×2048 1.28 against 2.55)."""


def _verify(gemm: Gemm, tol: Tolerance, directions: tuple[str, ...], *, wide_norms: bool = False,
            exact_sums: bool = False, operand_sums: OperandSums | None = None) -> dict[str, DirectionCheck]:
    _op, c, a, b, bias = gemm
    big = c.numel() + a.numel() + b.numel() >= ONE_PASS_MIN
    native = device.native_allowed()
    return verify_gemm(c, a.detach(), b.detach(), tol, bias_N=None if bias is None else bias.detach(),
                       operand_roundoff=fp32_matmul_operand_roundoff(c.device), directions=directions,
                       wide_norms=wide_norms,
                       one_pass=fused_pass if native and (big or operand_sums is not None) else None,
                       exact_sums=exact_sums, operand_sums=operand_sums, row_verifier=verify_rows if native else None)


@dataclasses.dataclass(frozen=True, slots=True)
class LinearSums:
    """What the backward checks of y = x·W_IO (+ b) need of x and W, made in the reads of them that the forward check
    makes anyway (``linear_sums``): then a step reads x and W once each for its three checks, and dy once for
    its two (dX = dy·W_OI by rows, dW by its vectors along the input features), instead of twice each. w_I: the
    checksum weights (ones, 1..I) over the input features."""

    xw_M2: torch.Tensor
    """x·w_I: the dW check's reference is dyᵀ·(x w_I)."""
    x_col_I: torch.Tensor
    """‖x_:,i‖₂, the dW check's operand norms along the input features."""
    ww_O2: torch.Tensor
    """W_OI·w_I: the dX check's reference is dy·(W_OI w_I)."""
    w_col_I: torch.Tensor
    """‖W_OI_:,i‖₂."""


def linear_sums(x_MI: torch.Tensor, w_IO: torch.Tensor, *, forward: bool
                ) -> tuple[OperandSums | None, LinearSums] | None:
    """In one read of W and one of x (fused_pass): the backward checks' ``LinearSums`` and, with ``forward``, the
    forward check's row side of y = x·W_IO (x·(W_IO w_O), ‖x_m‖, ‖W_IO_:,o‖). None where the kernel declines (the
    checks then read the operands themselves), or for a GEMM below ``ONE_PASS_MIN``, where the eager calls win."""
    (m, i), o = x_MI.shape, w_IO.shape[-1]
    if m * i + i * o + m * o < ONE_PASS_MIN or not device.native_allowed():
        return None
    w_I2 = checksum_weights(i, x_MI.device, torch.float32)
    w_O2 = checksum_weights(o, x_MI.device, torch.float32) if forward else None
    x, w = x_MI.detach(), w_IO.detach()
    if w.stride(-1) == 1:
        # A Conv1D weight (I, O): W_OI·w_I from the left, ‖W_OI_:,i‖ its row norms.
        ws = fused_pass(w, right=w_O2, col_sq=forward, left=w_I2, row_sq=True)
        if ws is None:
            return None
        ww_O2, w_col_sq, bw_I2, b_sq_O = ws.left, ws.row_sq, ws.right, ws.col_sq
    else:
        # An nn.Linear weight (O, I), read as itself.
        ws = fused_pass(w.mT, left=w_O2, row_sq=forward, right=w_I2, col_sq=True)
        if ws is None:
            return None
        ww_O2, w_col_sq, bw_I2, b_sq_O = ws.right, ws.col_sq, ws.left, ws.row_sq
    if ww_O2 is None or w_col_sq is None or (forward and (bw_I2 is None or b_sq_O is None)):
        return None
    # x times [W_IO w_O | w_I] for the forward, w_I alone otherwise: x·w_I is the last two columns either way.
    xs = fused_pass(x, right=torch.cat([bw_I2, w_I2], -1) if forward and bw_I2 is not None else w_I2,
                    row_sq=forward, col_sq=True)
    if xs is None or xs.right is None or xs.col_sq is None or (forward and xs.row_sq is None):
        return None
    backward = LinearSums(xw_M2=xs.right[:, -2:], x_col_I=xs.col_sq.sqrt(), ww_O2=ww_O2, w_col_I=w_col_sq.sqrt())
    if not forward or xs.row_sq is None or b_sq_O is None or bw_I2 is None:
        return None, backward
    return OperandSums(ref=xs.right[:, :2], a_norm=xs.row_sq.sqrt(), b_norm=b_sq_O.sqrt(),
                       ref_norm=bw_I2.norm(dim=-2)), backward


def backward_sums(dy_MO: torch.Tensor, sums: LinearSums, *, need_x: bool, dw_direction: str | None
                  ) -> tuple[Given | None, Given | None] | None:
    """(dX's clean check, dW's) from one read of dy: dy·(W_OI w_I) and ‖dy_m‖ for dX = dy·W_OI by rows; dyᵀ·(x w_I)
    and ‖dy_:,o‖ for dW along the input features, which are its rows for an nn.Linear weight's gradient (O, I)
    (``dw_direction`` "row": dW = dyᵀ·x) and its columns for a Conv1D one (I, O) ("col": dW = xᵀ·dy). None where
    the kernel declines."""
    need_w = dw_direction is not None
    ds = fused_pass(dy_MO.detach(), right=sums.ww_O2 if need_x else None, left=sums.xw_M2 if need_w else None,
                    row_sq=need_x, col_sq=need_w)
    if ds is None:
        return None
    dx: Given | None = None
    dw: Given | None = None
    if need_x:
        if ds.right is None or ds.row_sq is None:
            return None
        dx = ("row", OperandSums(ref=ds.right, a_norm=ds.row_sq.sqrt(), b_norm=sums.w_col_I,
                                 ref_norm=sums.ww_O2.norm(dim=-2)))
    if dw_direction is not None:
        if ds.left is None or ds.col_sq is None:
            return None
        dy_col_O = ds.col_sq.sqrt()
        # A's rows and B's columns as the GEMM is written: dyᵀ·x (A = dyᵀ) or xᵀ·dy (A = xᵀ).
        a_norm, b_norm = (dy_col_O, sums.x_col_I) if dw_direction == "row" else (sums.x_col_I, dy_col_O)
        dw = (dw_direction, OperandSums(ref=ds.left, a_norm=a_norm, b_norm=b_norm, ref_norm=sums.xw_M2.norm(dim=-2)))
    return dx, dw


def _repair(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
            checks: dict[str, DirectionCheck], tol: Tolerance, correct: bool,
            inject: Callable[[torch.Tensor], None]) -> list:
    batched = c.dim() > 2

    def recompute() -> torch.Tensor:
        # A transient fault does not repeat: the same GEMM again, then verified against the same checksums. A planned
        # persistent fault does (inject: attempt 1).
        fresh = a @ b if bias is None else torch.addmm(bias, a, b)
        inject(fresh)
        return fresh if batched else fresh[None]

    def exact(key: tuple[int, ...], rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        if batched:
            return exact_gemm_elements(a[key], b[key], rows, cols)
        return exact_gemm_elements(a, b, rows, cols, bias)

    return repair(c if batched else c[None], checks, tol, correct=correct, recompute=recompute, exact=exact)
