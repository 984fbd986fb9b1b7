"""The GPU path of the whole-step GEMM checks (issue 32): one fused Triton pass per checked output, its references from
one operand pass per operand side, tier 1 as a mode of the same pass, repair on the device, and the outcome kept on the
device until the step boundary (checks/deferred.py). No host-device sync on the way; the kernels and their launchers
are kernels/triton_gemm_kernels.py and kernels/triton_gemm_check.py.

Which path a GEMM check takes is ``ATTNCHECKER_GEMM``'s:
- auto (default): this one for CUDA tensors where triton is installed; the CPU path (gemm/check.py, with its native
  one-pass kernels) for CPU tensors;
- triton: the same, and CPU tensors too under Triton's interpreter (``TRITON_INTERPRET=1``): how the tests run it;
- torch: every check as PyTorch ops (gemm/check.py without the native kernels), with its sync per check: the escape
  hatch, and what a dispatch-mode injector sees op by op.

Launches (counted under the interpreter by tests/agent/test_triton_gemm_check.py): a checked GEMM's own are the check
pass and the repair kernel, which returns at once on a clean call; each operand matrix is read once a step by an operand
pass (a Linear's W and x in its forward, dY in its backward, for its three checks); each phase takes one zeroed
workspace for the kernels' atomics, a slice of the guard's arena (checks/zeroed.py: one memset a 1 MiB chunk, not one a
call). A Linear's three GEMMs: 9 launches in all. A tier-1 GEMM: the tier-1 pass alone, which recomputes the rows
holding an extreme element in the program that found them, two GEMMs of a call to a launch (``trip_pass_pair``: a
Linear's dX and dW): a tier-1 Linear is 2 launches; a fused projection's output is one GEMM, whatever its slices
(``trip_columns``).

Host time: on a small model a GPU step is launch-bound, and every tier-1 call (each Linear output, every step) spends
host time before its one launch. No torch product runs on this path (its sums are the kernels'), so autocast and the
fp32 matmul precision flags do not reach it: its calls enter no_grad alone, not ``checks.product._exact_math``, whose
three contexts were a quarter of a tier-1 call's host time (bench/host_ops.py times a call with the launches left
out).

What it does not do: the check of a product with more than two leading dims, or of a dtype other than fp32, bf16 and
fp16, declines to the CPU path's torch ops (``takes``); the in-kernel recomputation is not recorded in
``Injector.injected`` (its original value is never read back: that would be a sync).

A kernel that fails at run time (a configuration the GPU's Triton cannot compile: the interpreter the tests run under
never compiles one, bench/triton_compile_matrix.py compiles them offline; or a launch that raises) turns this path off
for the process: ``KernelFailed`` tells the caller which of the call's GEMMs were checked already, the caller checks
the rest on the CPU path's torch ops (gemm/check.py), and ``takes`` declines every later call. Training goes on,
checked, at the CPU path's cost (a host sync per checked call). An out-of-memory error is raised as it is.

Legend: M tokens, I input features, O output features; nb matrices of a batched product; 2 a checksum pair.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os

import torch

from ..abft import Tolerance
from ..abft.gemm_rule import GemmRowRule, gemm_row_rule
from ..abft.repair import MatrixReport
from ..checks.context import LayerContext
from ..checks.deferred import defer
from ..checks.device_time import Clock
from ..checks.product import _tolerance
from ..checks.records import _count, _count_trips
from ..kernels import triton_gemm_check as tg
from ..matmul_precision import fp32_matmul_operand_roundoff

__all__ = ["GEMM_ENV", "MODES", "DeviceGemm", "KernelFailed", "LinearSides", "check_gemms", "check_product", "failed",
           "linear_backward", "linear_forward", "native_allowed", "requested", "runs", "takes", "trip_columns",
           "trip_gemms", "trip_product"]

log = logging.getLogger("attnchecker")

GEMM_ENV = "ATTNCHECKER_GEMM"
MODES: tuple[str, ...] = ("auto", "triton", "torch")


def requested() -> str:
    """ATTNCHECKER_GEMM: auto, triton or torch. Raises ValueError on anything else."""
    mode = os.environ.get(GEMM_ENV, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"{GEMM_ENV}={mode!r}: use auto, triton (the Triton checks; CPU tensors under "
                         f"TRITON_INTERPRET=1) or torch (every GEMM check as PyTorch ops)")
    return mode


_failed: list[str] = []
"""Why this path is off for the process, once one of its kernels failed at run time (module docstring)."""


class KernelFailed(RuntimeError):
    """A kernel of this path failed during a call. The call's first ``done`` GEMMs were checked and their outcomes
    deferred; nothing was deferred or counted for the rest, which the caller checks on the CPU path."""

    def __init__(self, reason: str, done: int) -> None:
        super().__init__(reason)
        self.done = done


def failed() -> str | None:
    """Why this path is off for the process (a kernel failed at run time), or None while it runs."""
    return _failed[0] if _failed else None


def _failure(exc: Exception, done: int) -> KernelFailed:
    """Turns the path off for the process (``_failed``), logs why once, and says how far the call got."""
    if not _failed:
        _failed.append(f"a GEMM check's Triton kernel failed here once ({type(exc).__name__}: {str(exc)[:200]})")
        log.error("attnchecker: a Triton kernel of the GEMM checks failed; the GEMM checks run as PyTorch ops, with a "
                  "host sync per checked call, for the rest of this process: %s", exc, exc_info=exc)
    return KernelFailed(_failed[0], done)


class _Launches:
    """The kernel launches of one call, as a context: ``done`` counts its GEMMs checked and deferred so far, and an
    exception from a launch leaves as ``KernelFailed`` (out of memory, and a KernelFailed from within, as they are)."""

    def __init__(self) -> None:
        self.done = 0

    def __enter__(self) -> _Launches:
        if _failed:  # a call ``takes`` accepted before the failure: its backward, for one
            raise KernelFailed(_failed[0], 0)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if isinstance(exc, Exception) and not isinstance(exc, (torch.OutOfMemoryError, KernelFailed)):
            raise _failure(exc, self.done) from exc


def native_allowed() -> bool:
    """Whether the CPU path may read through its native kernels (not under ATTNCHECKER_GEMM=torch)."""
    return requested() != "torch"


_warned: set[str] = set()


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        log.warning("attnchecker: %s", reason)


def takes(*tensors: torch.Tensor) -> bool:
    """Whether these tensors' GEMM checks take this path (module docstring). No sync, no pass over them."""
    mode = requested()
    if mode == "torch" or not tensors or _failed:
        return False
    device = tensors[0].device
    if device.type == "cuda" or mode == "triton":
        if tg.takes(*tensors):
            return True
        if not tg.available():
            _warn_once(f"the GEMM checks on {device.type} run as PyTorch ops, with a host sync each: triton is not "
                       "installed (pip install triton)")
        elif device.type == "cpu" and not tg.interpreted():
            _warn_once(f"{GEMM_ENV}=triton takes CPU tensors only under Triton's interpreter: set TRITON_INTERPRET=1 "
                       "before triton is first imported (importing attnchecker imports it); the GEMM checks run on "
                       "the CPU path")
        else:
            _warn_once(f"a GEMM check the Triton path cannot take ({', '.join(str(t.dtype) for t in tensors)}, "
                       f"dims {', '.join(str(t.dim()) for t in tensors)}) runs as PyTorch ops")
    return False


@dataclasses.dataclass(frozen=True, slots=True)
class DeviceGemm:
    """One GEMM C = A·B (+ bias) to check by rows, in place. C (.., M, N) any strides; A (.., M, K), B (.., K, N)."""

    op: str
    c: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    bias: torch.Tensor | None = None
    transposed: bool = False
    """C is the transpose of the op's output (a Conv1D weight gradient, checked along its input features): its
    reports and planned faults swap rows and columns."""
    parts: tuple[tuple[str, int], ...] = ()
    """C's columns by op where one output holds several ops' (a fused projection's q, k, v: (op, width) in column
    order, tier 1 only): its reports and planned faults go by the op whose columns they lie in. Empty: all of C is
    ``op``'s."""
    tokens: int = 0
    """Where C (M, S) is an output whose leading dims were flattened into its rows (a projection's (N, T, S) output,
    T = tokens): planned faults are located on that shape, as the host's recompute of it meets them, then placed on
    C's rows (n·T + t), and reports name sequence n's row t, as the host's check of it does. 0: C's own shape."""

    def ops(self) -> tuple[str, ...]:
        return tuple(op for op, _ in self.parts) if self.parts else (self.op,)

    def columns(self) -> tuple[tuple[str, int, int], ...]:
        """(op, first column, end column) of each op's part of C."""
        if not self.parts:
            return ((self.op, 0, self.c.shape[-1]),)
        out, at = [], 0
        for op, width in self.parts:
            out.append((op, at, at + width))
            at += width
        return tuple(out)


def check_gemms(ctx: LayerContext, gemms: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor,
                                                     torch.Tensor | None]], *, tier: str = "abft", tokens: int = 0
                ) -> None:
    """gemm.check.check_gemms on this path: each GEMM's operand passes, check pass and repair kernel; its reports at
    the step boundary. tokens: ``DeviceGemm.tokens``. No sync."""
    if not gemms or ctx.config.mode == "off":
        return
    todo = [DeviceGemm(op, c, a, b, bias, tokens=tokens) for op, c, a, b, bias in gemms]
    tol = _tolerance(ctx)
    clock, call = Clock(todo[0].c.device, full=tier == "abft"), _Launches()
    try:
        with call, torch.no_grad():
            ws = _workspace(ctx, todo[0].c.device, sum(_side_floats(g, tol) + tg.STATE_SIZE for g in todo))
            for g, side in zip(todo, _row_sides(todo, ws, tol), strict=True):
                _check(ctx, g, side, ws, tol, tier=tier)
                call.done += 1
    finally:
        if call.done:  # the GEMMs checked before a failure are counted; the CPU path counts the rest
            _counted(ctx, [g.op for g in todo[:call.done]], tier, clock)


def trip_gemms(ctx: LayerContext, gemms: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor,
                                                    torch.Tensor | None]], *, tokens: int = 0) -> None:
    """gemm.check.trip_gemms on this path: the tier-1 pass over each output, and the recompute of the rows it marked
    (``_trip``). tokens: ``DeviceGemm.tokens``. No sync."""
    if not gemms or ctx.config.mode == "off":
        return
    _trip(ctx, [DeviceGemm(op, c, a, b, bias, tokens=tokens) for op, c, a, b, bias in gemms])


def trip_columns(ctx: LayerContext, parts: tuple[tuple[str, int], ...], c: torch.Tensor, a: torch.Tensor,
                 b: torch.Tensor, bias: torch.Tensor | None, *, tokens: int = 0) -> None:
    """Tier 1 of one product whose columns are several ops' outputs, ``parts`` (op, width) in column order (a fused
    projection: GPT-2's c_attn, y = x·[W_q W_k W_v]): one tier-1 pass over all of C, one launch and its host work,
    where three parts as GEMMs of their own took two launches (``trip_pass_pair``, ``trip_pass``) and the host work of
    three. A tripped row is recomputed whole, all parts; it is reported under the op whose columns hold its first
    extreme element (a row with extreme elements in two parts is one report). tokens: ``DeviceGemm.tokens``. No
    sync."""
    if sum(width for _, width in parts) != c.shape[-1] or len(parts) < 1:
        raise ValueError(f"trip_columns: parts {parts} must cover C's {c.shape[-1]} columns")
    if ctx.config.mode == "off":
        return
    _trip(ctx, [DeviceGemm(parts[0][0], c, a, b, bias, parts=parts, tokens=tokens)])


def _trip(ctx: LayerContext, todo: list[DeviceGemm]) -> None:
    """Per GEMM the tier-1 pass, which finds the rows holding an extreme element and recomputes them in the program
    that found them, two GEMMs a launch (a Linear's dX and dW), no memset (the arena's).
    A tripped row is recomputed rather than checked by its checksums: that needs no operand pass on the steps where
    nothing trips, and recomputing gives the exact row whatever the fault. Counted as tier 1 of the GEMMs done, on
    the host's clock."""
    tol = _tolerance(ctx)
    correct = ctx.config.mode == "correct"
    clock, call = Clock(todo[0].c.device, full=False), _Launches()
    try:
        with call, torch.no_grad():
            ws = _workspace(ctx, todo[0].c.device, len(todo) * tg.STATE_SIZE)
            while call.done < len(todo):
                group = todo[call.done : call.done + 2]
                chks: tuple[tg.Check, ...]
                if len(group) == 2:
                    first, second = (tg.TripGemm(g.c, g.a, g.b, g.bias, _rule(g, tol, 1), _planned(ctx, g))
                                     for g in group)
                    chks = tg.trip_pass_pair(first, second, ws, correct=correct)
                else:
                    chks = (_trip_launch(group[0], ws, tol, correct=correct, faults=_planned(ctx, group[0])),)
                for g, chk in zip(group, chks, strict=True):
                    _defer(ctx, g, chk, tier="tripwire")
                call.done += len(group)
    finally:
        _count_trips(ctx, [op for g in todo[:call.done] for op in g.ops()], clock.seconds(ctx))


def _workspace(ctx: LayerContext, device: torch.device, floats: int) -> tg.Workspace:
    """A call's zeroed workspace, a slice of the guard's arena (checks/zeroed.py): no memset of its own."""
    return tg.Workspace(device, floats, zeroed=ctx.runtime.zeroed.take(device, floats))


def runs(n: int, tol: Tolerance) -> int:
    """Checksum runs per row of n columns under ``tol`` on this path (kernels/triton_gemm_check.runs): grouped
    round-off checks only, as the CPU's grouped checks (checks.product._groups); the paper's threshold keeps one."""
    return tg.runs(n) if tol.grouped and tol.mode == "roundoff" else 1


def _side_floats(g: DeviceGemm, tol: Tolerance) -> int:
    return tg.operand_floats(g.b, col_sq=True) + tg.operand_floats(g.a, right=2 * runs(g.c.shape[-1], tol))


HALF = (torch.bfloat16, torch.float16)


def _cast_of(g: DeviceGemm) -> torch.dtype | None:
    """The half dtype this GEMM rounds an fp32 operand to (C is bf16 or fp16, an operand is not), which its operand
    passes round to in their products (operand_pass's ``cast``), else None."""
    return _casts(g.c.dtype, g.a, g.b)


def _casts(out: torch.dtype, *operands: torch.Tensor) -> torch.dtype | None:
    return out if out in HALF and any(t.dtype != out for t in operands) else None


SHARED_WIDTH = 32
"""The widest factor one read of a shared A takes for several GEMMs' references (``_row_sides``): GPT-2's three
slices of 3 to 5 runs (768 to 1,600 features), two of 8. Compiled for sm_90, the pass with a 32-wide factor takes 255
registers and 8 B of stack in bf16 and fp16 (bench/triton_compile_matrix.py on the fused-projection test)."""


def _row_sides(todo: list[DeviceGemm], ws: tg.Workspace, tol: Tolerance) -> list[tg.RowSide]:
    """The GEMMs' row references and norms: per GEMM one read of B (B_h w per run h, ‖B_j‖²), and one read of A
    (A·(B_h w), ‖A_i‖²) for each A, shared by the GEMMs of one A (the slices of a fused projection, GPT-2's c_attn:
    y_s = x·W_s) where A is bf16 or fp16 or rounded to it (the pass's products on the tensor cores, whose width costs
    next to nothing) and their factors together are at most SHARED_WIDTH wide: x·[B_1 w, B_2 w, ..] in one operand
    pass instead of one per slice."""
    n_runs = [runs(g.c.shape[-1], tol) for g in todo]
    chunks: list[list[int]] = []
    open_chunk: dict[tuple[object, ...], list[int]] = {}
    for i, g in enumerate(todo):
        shares = g.a.dtype in HALF or _cast_of(g) is not None
        key = (g.a.data_ptr(), tuple(g.a.shape), g.a.stride(), g.a.dtype) if shares else (i,)
        chunk = open_chunk.get(key)
        if chunk is None or sum(2 * n_runs[j] for j in chunk) + 2 * n_runs[i] > SHARED_WIDTH:
            chunk = open_chunk[key] = []
            chunks.append(chunk)
        chunk.append(i)
    sides: list[tg.RowSide | None] = [None] * len(todo)
    for chunk in chunks:
        b_outs = [tg.operand_pass(todo[i].b, ws, right_w=n_runs[i], col_sq=True, cast=_cast_of(todo[i]))
                  for i in chunk]
        factors = [bo.xw for bo in b_outs if bo.xw is not None]
        b_sqs = [bo.csq for bo in b_outs if bo.csq is not None]
        assert len(factors) == len(b_sqs) == len(chunk)
        ao = tg.operand_pass(todo[chunk[0]].a, ws, right=factors[0] if len(chunk) == 1 else torch.cat(factors, -1),
                             row_sq=True, cast=_cast_of(todo[chunk[0]]))
        assert ao.xv is not None and ao.rsq is not None and ao.vsq is not None
        at = 0
        for i, b_sq in zip(chunk, b_sqs, strict=True):
            width = 2 * n_runs[i]
            sides[i] = tg.RowSide(ref=ao.xv[..., at : at + width], a_sq=ao.rsq, b_sq=b_sq,
                                  ref_sq=ao.vsq[..., at : at + width], runs=n_runs[i])
            at += width
    return [side for side in sides if side is not None]


def check_product(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, tol: Tolerance, *,
                  correct: bool = True) -> tg.Check:
    """One product's row check on this path outside a guard (tests, bench/): its operand passes, check pass and
    repair kernel, the outcome left in the returned Check's device tensors (``Check.code`` per row). No sync."""
    g = DeviceGemm("product", c, a, b, bias)
    ws = tg.Workspace(c.device, _side_floats(g, tol) + tg.STATE_SIZE)
    with torch.no_grad():
        (side,) = _row_sides([g], ws, tol)
        chk = _launch(g, side, ws, tol, correct=correct)
    return chk


def trip_product(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, tol: Tolerance, *,
                 correct: bool = True) -> tg.Check:
    """One product's tier 1 on this path outside a guard (bench/): the tier-1 pass, which recomputes the rows holding
    an extreme element (none on clean data). No sync."""
    g = DeviceGemm("product", c, a, b, bias)
    ws = tg.Workspace(c.device, tg.STATE_SIZE)
    with torch.no_grad():
        return _trip_launch(g, ws, tol, correct=correct)


def _trip_launch(g: DeviceGemm, ws: tg.Workspace, tol: Tolerance, *, correct: bool,
                 faults: tuple[tg.EmulatedFault, ...] = ()) -> tg.Check:
    """The tier-1 pass of one GEMM under ``tol``, which recomputes the rows holding an extreme element itself."""
    return tg.trip_pass(g.c, g.a, g.b, g.bias, _rule(g, tol, 1), ws, correct=correct, faults=faults)


def _launch(g: DeviceGemm, side: tg.RowSide, ws: tg.Workspace, tol: Tolerance, *, correct: bool,
            faults: tuple[tg.EmulatedFault, ...] = ()) -> tg.Check:
    """The check pass and the repair kernel of one GEMM under ``tol`` (verify_gemm's rule for it, per run)."""
    chk = tg.check_pass(g.c, g.a, g.b, g.bias, side, _rule(g, tol, side.runs), ws, correct=correct)
    tg.repair_rows(chk, faults=faults)
    return chk


def _rule(g: DeviceGemm, tol: Tolerance, n_runs: int) -> GemmRowRule:
    """verify_gemm's row rule for this GEMM, of each run of its rows' n_runs (``verify_gemm(groups=n_runs)``: each
    run the sub-product of A with a block of B's columns); the fp32 GEMMs' operand rounding asked of the flags only
    for an fp32 output, the one the rule reads it for (a lookup of the flags is a tenth of a tier-1 call's host
    time)."""
    cast = g.c.dtype if (g.a.dtype != g.c.dtype or g.b.dtype != g.c.dtype) else None
    roundoff = fp32_matmul_operand_roundoff(g.c.device) if g.c.dtype == torch.float32 else None
    return gemm_row_rule(g.c.shape[-1] // n_runs, g.a.shape[-1], tol, g.c.dtype, bias=g.bias is not None,
                         operands_cast_to=cast, operand_roundoff=roundoff)


def _check(ctx: LayerContext, g: DeviceGemm, side: tg.RowSide, ws: tg.Workspace, tol: Tolerance, *, tier: str
           ) -> None:
    """One GEMM's check pass and repair kernel under the call's ``tol``, its outcome deferred to the step boundary."""
    chk = _launch(g, side, ws, tol, correct=ctx.config.mode == "correct", faults=_planned(ctx, g))
    _defer(ctx, g, chk, tier=tier)


def _defer(ctx: LayerContext, g: DeviceGemm, chk: tg.Check, *, tier: str) -> None:
    """A check's outcome to the step boundary: its flag now, its reports built there if it flagged."""
    summary = (chk.state, chk.slot_i, chk.slot_f)
    worst = tg.STATE["worst"]
    flagged = chk.state[tg.STATE["flagged"]]
    if g.parts:
        # One record an op, each with the reports of its own columns, all on the one flag.
        for op, start, end in g.columns():
            defer(ctx, op, flagged, functools.partial(_reports, summary, chk.lead, g.c.dim(), g.transposed, tier,
                                                      (start, end), g.tokens),
                  tier=tier, heads=g.c.dim() > 2)
        return
    # Only a full check's worst clean ratio goes into the histogram of full checks' margins: a tier-1 pass has no
    # references, and a trip's recompute is not a check of the step's values.
    defer(ctx, g.op, flagged, functools.partial(_reports, summary, chk.lead, g.c.dim(), g.transposed, tier, None,
                                                g.tokens),
          tier=tier, heads=g.c.dim() > 2,
          ratio=chk.state[worst : worst + 1].view(torch.float32) if tier == "abft" else None)


def _counted(ctx: LayerContext, ops: list[str], tier: str, clock: Clock) -> None:
    """Check counts and their time, as gemm.check counts them: on CUDA the kernels' device time, added at the step
    boundary (checks/device_time.py)."""
    if tier == "abft":
        seconds = clock.seconds(ctx, ops)
        for op in ops:
            _count(ctx, op, seconds / len(ops))
    else:
        _count_trips(ctx, [], clock.seconds(ctx))


def _planned(ctx: LayerContext, g: DeviceGemm) -> tuple[tg.EmulatedFault, ...]:
    """The planned faults (attnchecker.inject) a recomputation of this op meets (attempt 1: persistent ones), placed on
    C as the kernel sees it (an op's part of C: at its columns). Host-side lookups only, none when nothing is
    planned."""
    injector = ctx.runtime.injector
    if injector is None:
        return ()
    faults = []
    for op, start, end in g.columns():
        if not injector.fires(op=op, layer=ctx.layer, step=ctx.step):
            continue
        c = g.c[..., start:end] if g.parts else g.c
        shape = tuple((c.mT if g.transposed else c).shape)
        if g.tokens:
            shape = (shape[0] // g.tokens, g.tokens, shape[1])
        nb1 = c.shape[1] if c.dim() == 4 else 1
        for hit in injector.resolve(op=op, layer=ctx.layer, step=ctx.step, shape=shape, attempt=1):
            batch = (hit.lead[0] * nb1 + hit.lead[1]) if len(hit.lead) == 2 else (hit.lead[0] if hit.lead else 0)
            rows, cols = (min(hit.rows), max(hit.rows) + 1), (start + min(hit.cols), start + max(hit.cols) + 1)
            if g.tokens:  # the sequence's rows of C
                batch, rows = 0, (batch * g.tokens + rows[0], batch * g.tokens + rows[1])
            if g.transposed:
                rows, cols = cols, rows
            kind, value = tg.fault_kind(hit.fault.kind, hit.fault.value)
            faults.append(tg.EmulatedFault(batch, *rows, *cols, kind, value))
    return tuple(faults)


def _reports(summary: tuple[torch.Tensor, torch.Tensor, torch.Tensor], lead: tuple[int, int], dims: int,
             transposed: bool, tier: str, columns: tuple[int, int] | None = None, tokens: int = 0
             ) -> list[MatrixReport]:
    """The reports of one flagged check, read back at the drain (after its sync), one per flagged matrix: from the
    first SLOTS flagged rows' summaries and the counts over all of them. columns: (start, end) of an op's part of C
    (``DeviceGemm.parts``): only the rows whose first flagged element lies there, their columns counted from start.
    tokens: C's rows are sequences of that many (``DeviceGemm.tokens``): one report a flagged sequence."""
    state_t, slot_i_t, slot_f_t = summary
    state = state_t.tolist()  # sync: the drain's, for a flagged record only
    n = min(state[tg.STATE["flagged"]], tg.SLOTS)
    slot_i, slot_f = slot_i_t[:n].tolist(), slot_f_t[:n].tolist()  # sync: the drain's, flagged record only
    by_matrix: dict[int, list[tuple[list[int], list[float]]]] = {}
    for si, sf in zip(slot_i, slot_f, strict=True):
        if columns is not None:
            if not columns[0] <= si[2] < columns[1]:
                continue
            si = [si[0], si[1], si[2] - columns[0], *si[3:]]
        if tokens:
            si = [si[1] // tokens, si[1] % tokens, *si[2:]]
        by_matrix.setdefault(si[0], []).append((si, sf))
    overflowed = state[tg.STATE["flagged"]] > tg.SLOTS
    reports = []
    for batch, entries in sorted(by_matrix.items()):
        rep = _matrix_report(batch, entries, state if overflowed else None, lead, dims, transposed, tier)
        if rep is not None:
            reports.append(rep)
    return reports


_ACTION = {1: "corrected", 2: "uncorrectable", 3: "recomputed", 4: "uncorrectable", 6: "detected", 7: "detected"}
"""A row outcome's report action (2: marked for recomputation and never recomputed; 5, consistent: no report)."""


def _matrix_report(batch: int, entries: list[tuple[list[int], list[float]]], counts: list[int] | None,
                   lead: tuple[int, int], dims: int, transposed: bool, tier: str) -> MatrixReport | None:
    """One matrix's report: its action the worst of its rows' (uncorrectable, recomputed, corrected; detected in
    detect mode, and for an output whose non-finite values came in with an input on a tier-1 trip), its pattern from
    where they lie (a recomputed row counts as a whole row), its value the most extreme found (NaN, INF, then the
    largest), its residual and bound the worst ratio's. counts: the check's totals when its rows outnumbered the
    slots."""
    kept = [(si, sf) for si, sf in entries if si[3] in _ACTION and (si[3] != 7 or tier == "tripwire")]
    if not kept:
        return None
    actions = {_ACTION[si[3]] for si, _ in kept}
    if counts is not None:
        actions |= {name for key, name in (("uncorrectable", "uncorrectable"), ("recomputed", "recomputed"),
                                           ("corrected", "corrected")) if counts[tg.STATE[key]] > 0}
    action = next(a for a in ("uncorrectable", "recomputed", "detected", "corrected") if a in actions)
    rows = sorted({si[1] for si, _ in kept})
    whole = any(si[3] in (2, 3, 4) for si, _ in kept)
    cols = sorted({si[2] for si, _ in kept})
    row: int | None
    col: int | None
    if whole:
        pattern, row, col = ("1d" if len(rows) == 1 else "2d"), rows[0], None
    elif len(rows) >= 2 and len(cols) >= 2:
        pattern, row, col = "2d", rows[0], cols[0]
    else:
        pattern = "0d" if len(rows) == 1 and len(cols) == 1 else "1d"
        row, col = rows[0] if len(rows) == 1 else None, cols[0] if len(cols) == 1 else None
    if transposed:
        row, col = col, row
    values = [sf[0] for _, sf in kept]
    # NaN first, then INF, then the largest magnitude (abft.repair._worst_value's order).
    value = max(values, key=lambda v: (math.isnan(v), math.isinf(v), 0.0 if math.isnan(v) else abs(v)))
    worst = max(kept, key=lambda e: abs(e[1][1]) / max(e[1][2], 1e-30) if math.isfinite(e[1][1]) else math.inf)
    residual = abs(worst[1][1]) if math.isfinite(worst[1][1]) else None
    index = (batch // lead[1], batch % lead[1]) if dims == 4 else (batch,)
    return MatrixReport(index=index, pattern=pattern, row=row, col=col, value=value, residual=residual,
                        bound=worst[1][2], action=action)


@dataclasses.dataclass(frozen=True, slots=True)
class LinearSides:
    """What a Linear's forward read of W and x leaves for its backward's checks: dX = dY·W_OI by rows needs
    dY·(W_OI w_I) and ‖W_OI[:, i]‖²; dW (as dYᵀ·x (O, I)) by rows needs dYᵀ·(x w_I) and ‖x[:, i]‖²."""

    ww_O2: torch.Tensor
    """(1, O, 2·runs_I) W_OI·w_I per run of the input features (both backward checks' rows are I long)"""
    w_col_sq_I: torch.Tensor
    """(1, I) ‖W_OI[:, i]‖²"""
    xw_M2: torch.Tensor
    """(1, M, 2·runs_I) x·w_I per run"""
    x_col_sq_I: torch.Tensor
    """(1, I) ‖x[:, i]‖²"""
    runs_I: int = 1
    """The backward checks' runs per row (``runs`` of I)."""


def _weight_pass(weight: torch.Tensor, layout: str, ws: tg.Workspace, *, runs_o: int, runs_i: int,
                 cast: torch.dtype | None = None
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """One read of the weight as stored: (W_IO·w_O per run of O (1, I, 2·runs_o) and ‖W_IO[:, o]‖² (1, O) for the
    forward check (runs_o > 0), else None; W_OI·w_I per run of I (1, O, 2·runs_i) and ‖W_OI[:, i]‖² (1, I) for
    dX's)."""
    forward = runs_o > 0
    if layout == "out_in":  # nn.Linear: W (O, I)
        out = tg.operand_pass(weight, ws, left_w=runs_o, right_w=runs_i, row_sq=forward, col_sq=True, cast=cast)
        fwd, fwd_sq, ww, w_sq = out.wx, out.rsq, out.xw, out.csq
    else:  # Conv1D: W (I, O)
        out = tg.operand_pass(weight, ws, right_w=runs_o, left_w=runs_i, col_sq=forward, row_sq=True, cast=cast)
        fwd, fwd_sq, ww, w_sq = out.xw, out.csq, out.wx, out.rsq
    assert ww is not None and w_sq is not None
    return fwd, fwd_sq, ww, w_sq


def _weight_floats(weight: torch.Tensor, layout: str, *, runs_o: int, runs_i: int) -> int:
    if layout == "out_in":
        return tg.operand_floats(weight, left_w=runs_o, col_sq=True)
    return tg.operand_floats(weight, left_w=runs_i, col_sq=runs_o > 0)


def linear_forward(ctx: LayerContext, tier: str, y_MO: torch.Tensor, x_MI: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None, layout: str, *, check_forward: bool) -> LinearSides | None:
    """A checked Linear's forward on this path: on a full-check step, one read of W and one of x for this check and
    the backward's two (``LinearSides``), then y's check pass and repair; on a tier-1 step, y's tier-1 pass (when this
    module's forward is ours to check). No sync. Raises KernelFailed (nothing checked) where a kernel failed: the
    caller checks this forward on the CPU path, and the backward too (``takes`` declines from then on)."""
    if ctx.config.mode == "off":
        return None
    w_IO = weight.T if layout == "out_in" else weight
    gemm = DeviceGemm("linear", y_MO, x_MI, w_IO, bias)
    if tier != "abft":
        if check_forward:
            _trip(ctx, [gemm])
        return None
    clock = Clock(y_MO.device)
    tol = _tolerance(ctx)
    runs_o = runs(y_MO.shape[-1], tol) if check_forward else 0
    runs_i = runs(x_MI.shape[-1], tol)
    cast = _casts(y_MO.dtype, x_MI, weight)
    with _Launches(), torch.no_grad():
        ws = _workspace(ctx, y_MO.device, _weight_floats(weight, layout, runs_o=runs_o, runs_i=runs_i)
                        + tg.operand_floats(x_MI, right=2 * runs_o, col_sq=True) + tg.STATE_SIZE)
        fwd, fwd_sq, ww, w_sq = _weight_pass(weight, layout, ws, runs_o=runs_o, runs_i=runs_i, cast=cast)
        xo = tg.operand_pass(x_MI, ws, right=fwd if check_forward else None, right_w=runs_i, row_sq=check_forward,
                             col_sq=True, cast=cast)
        assert xo.xw is not None and xo.csq is not None
        sides = LinearSides(ww_O2=ww, w_col_sq_I=w_sq, xw_M2=xo.xw, x_col_sq_I=xo.csq, runs_I=runs_i)
        if check_forward:
            assert xo.xv is not None and xo.rsq is not None and fwd_sq is not None and xo.vsq is not None
            _check(ctx, gemm, tg.RowSide(ref=xo.xv, a_sq=xo.rsq, b_sq=fwd_sq, ref_sq=xo.vsq, runs=runs_o), ws, tol,
                   tier="abft")
    if check_forward:
        _count(ctx, "linear", clock.seconds(ctx, ["linear"]))
    else:
        clock.seconds(ctx, ["linear_dx", "linear_dw"])  # the operand passes are the backward checks' (their time)
    return sides


def linear_backward(ctx: LayerContext, tier: str, dy_MO: torch.Tensor, x_MI: torch.Tensor, weight: torch.Tensor,
                    layout: str, dx_MI: torch.Tensor | None, dw: torch.Tensor | None, sides: LinearSides | None
                    ) -> None:
    """A checked Linear's backward on this path: dX = dY·W_OI and dW (as dYᵀ·x (O, I): a Conv1D's (I, O) gradient
    through its transposed view), both by rows from one read of dY and the forward's ``sides``. No sync. Raises
    KernelFailed where a kernel failed: its ``done`` GEMMs (dX, then dW) were checked, the caller checks the rest."""
    if ctx.config.mode == "off" or (dx_MI is None and dw is None):
        return
    w_OI = weight if layout == "out_in" else weight.T
    gemms = []
    if dx_MI is not None:
        gemms.append(DeviceGemm("linear_dx", dx_MI, dy_MO, w_OI, None))
    if dw is not None:
        gemms.append(DeviceGemm("linear_dw", dw if layout == "out_in" else dw.mT, dy_MO.T, x_MI, None,
                                transposed=layout != "out_in"))
    if tier != "abft":
        _trip(ctx, gemms)
        return
    clock = Clock(dy_MO.device)
    tol = _tolerance(ctx)
    width = 2 * (sides.runs_I if sides is not None else runs(x_MI.shape[-1], tol))
    floats = (tg.operand_floats(dy_MO, right=width if dx_MI is not None else 0, left=width if dw is not None else 0,
                                col_sq=dw is not None)
              + len(gemms) * tg.STATE_SIZE)
    if sides is None:
        floats += (_weight_floats(weight, layout, runs_o=0, runs_i=width // 2)
                   + tg.operand_floats(x_MI, col_sq=True))
    call = _Launches()
    try:
        with call, torch.no_grad():
            ws = _workspace(ctx, dy_MO.device, floats)
            _check_backward(ctx, gemms, call, ws, tol, dy_MO, x_MI, weight, layout, dx_MI is not None,
                            dw is not None, sides)
    finally:
        if call.done:  # the GEMMs checked before a failure are counted; the CPU path counts the rest
            _counted(ctx, [g.op for g in gemms[:call.done]], "abft", clock)


def _check_backward(ctx: LayerContext, gemms: list[DeviceGemm], call: _Launches, ws: tg.Workspace, tol: Tolerance,
                    dy_MO: torch.Tensor, x_MI: torch.Tensor, weight: torch.Tensor, layout: str, need_dx: bool,
                    need_dw: bool, sides: LinearSides | None) -> None:
    """linear_backward's launches: the operand passes (one read of dY; of W and x too where the forward left no
    ``sides``), then dX's and dW's check passes and repairs."""
    if sides is None:
        # A module whose forward the attention's projection hook checked: its W and x are read now.
        runs_i = runs(x_MI.shape[-1], tol)
        cast = _casts(dy_MO.dtype, x_MI, weight)
        _, _, ww, w_sq = _weight_pass(weight, layout, ws, runs_o=0, runs_i=runs_i, cast=cast)
        xo = tg.operand_pass(x_MI, ws, right_w=runs_i, col_sq=True, cast=cast)
        assert xo.xw is not None and xo.csq is not None
        sides = LinearSides(ww_O2=ww, w_col_sq_I=w_sq, xw_M2=xo.xw, x_col_sq_I=xo.csq, runs_I=runs_i)
    do = tg.operand_pass(dy_MO, ws, right=sides.ww_O2 if need_dx else None, row_sq=need_dx,
                         left=sides.xw_M2 if need_dw else None, col_sq=need_dw)
    for g in gemms:
        if g.op == "linear_dx":
            assert do.xv is not None and do.rsq is not None and do.vsq is not None
            side = tg.RowSide(ref=do.xv, a_sq=do.rsq, b_sq=sides.w_col_sq_I, ref_sq=do.vsq, runs=sides.runs_I)
        else:
            assert do.lx is not None and do.csq is not None and do.lsq is not None
            side = tg.RowSide(ref=do.lx, a_sq=do.csq, b_sq=sides.x_col_sq_I, ref_sq=do.lsq, runs=sides.runs_I)
        _check(ctx, g, side, ws, tol, tier="abft")
        call.done += 1
