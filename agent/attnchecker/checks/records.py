"""What a check reports to the runtime: planned faults injected, one Detection per flagged matrix, check counts and
their time, and the histogram of residual/bound ratios (kept on the device, no sync)."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ..abft import DirectionCheck, MatrixReport
from ..events import Detection, kind_of, value_to_wire
from ..tripwire import NEAR_INF, extreme_value
from .context import LayerContext
from .product import Checks


def _inject(ctx: LayerContext, op: str, out: torch.Tensor, attempt: int = 0) -> None:
    injector = ctx.runtime.injector
    if injector is not None:
        with torch.no_grad():
            injector.apply(out, op=op, layer=ctx.layer, step=ctx.step, attempt=attempt)


def _any_bad(checks: Checks) -> torch.Tensor:
    flags = [chk.bad.any() if chk.flagged is None else chk.flagged for chk in checks.values()]
    if len(flags) == 1:
        return flags[0]
    return torch.stack(flags).any() if flags else torch.zeros((), dtype=torch.bool)


def _observe(ctx: LayerContext, checks: Checks, op: str | None = None) -> None:
    """Histogram of the worst residual/bound ratio (d1 and d2, both flag) among the unflagged vectors of one check,
    kept on the device: the dashboard's margin is its inverse. op: also kept as that op's worst ratio."""
    stats = ctx.runtime.stats
    if stats is None or not checks:
        return
    _record_ratio(ctx, _worst_ratio(checks), op)


def _worst_ratio(checks: Checks) -> torch.Tensor:
    """() fp32: the worst residual/bound ratio among the unflagged vectors of one check (all its directions)."""
    worst = [torch.where(chk.bad, 0.0, _ratio(chk)).amax().float() if chk.worst is None else chk.worst
             for chk in checks.values()]
    return worst[0] if len(worst) == 1 else torch.stack(worst).amax()


def _record_ratio(ctx: LayerContext, worst: torch.Tensor, op: str | Sequence[str] | None = None) -> None:
    """Add checks' worst residual/bound ratios (a device scalar, one check, or (V,), one per check) to the histogram
    (also the tiled path's), where they are kept until it is read (checks/ratio_histogram.py). op: the op of every
    ratio, or one per ratio; each op's running maximum is kept too."""
    stats = ctx.runtime.stats
    if stats is not None:
        stats.ratios.add(worst, op)


def _ratio(chk: DirectionCheck) -> torch.Tensor:
    """(..., V) the larger of |d1|/bound and |d2|/bound2."""
    ratio = chk.diff[..., 0].abs() / chk.bound.clamp_min(1e-30)
    if chk.bound2 is None:
        return ratio
    return torch.maximum(ratio, chk.diff[..., 1].abs() / chk.bound2.clamp_min(1e-30))


def _emit(ctx: LayerContext, op: str, reports: list[MatrixReport], *, heads: bool, tier: str = "abft",
          step: int | None = None) -> None:
    """One Detection per flagged matrix: to the runtime's callback and its counters. tier: who caught it. step: the
    step of the call (default the current one; a deferred record's, checks/deferred.py)."""
    for rep in reports:
        kind = kind_of(rep.value)
        det = Detection(
            op=op,
            layer=ctx.layer,
            step=ctx.step if step is None else step,
            pattern=rep.pattern,
            kind=kind,
            action=rep.action,
            batch=rep.index[0] if rep.index else None,
            head=rep.index[1] if heads and len(rep.index) > 1 else None,
            row=rep.row,
            col=rep.col,
            value=value_to_wire(rep.value),
            residual=rep.residual,
            bound=rep.bound,
            tier=tier,
        )
        _deliver(ctx, det)


def _deliver(ctx: LayerContext, det: Detection) -> None:
    """A Detection to the runtime's counters (per op, kind, action and tier) and its callback."""
    rt = ctx.runtime
    if rt.stats is not None:
        rt.stats.add_fault(det.op, det.kind, det.action, det.tier)
    if rt.on_detection is not None:
        rt.on_detection(det)


def _count(ctx: LayerContext, op: str, seconds: float) -> None:
    stats = ctx.runtime.stats
    if stats is not None:
        stats.checks[op] = stats.checks.get(op, 0) + 1
        stats.check_seconds[op] = stats.check_seconds.get(op, 0.0) + seconds
        stats.seen.add((ctx.layer, op))


def _seen(ctx: LayerContext, ops: Sequence[str]) -> None:
    """ops of this layer verified by another op's check (paper mode: q/k/v through the scores and context)."""
    stats = ctx.runtime.stats
    if stats is not None:
        stats.seen.update((ctx.layer, op) for op in ops)


def _count_trips(ctx: LayerContext, ops: Sequence[str], seconds: float) -> None:
    """Tier-1 checks of ``ops`` (one each) and their time (recovery after a trip too: ``ops`` empty). Kept apart from
    check_seconds: the scheduler's overhead rule relaxes tier 2, which cannot make tier 1 cheaper."""
    stats = ctx.runtime.stats
    if stats is None:
        return
    for name in ops:
        stats.trip_checks[name] = stats.trip_checks.get(name, 0) + 1
        stats.seen.add((ctx.layer, name))
    stats.trip_seconds += seconds


def _emit_unplaced_trip(ctx: LayerContext, op: str, out: torch.Tensor, *, action: str) -> None:
    """The event of a tier-1 trip on a GEMM output that its full check did not place: "recomputed" when the output was
    thrown away and made again (the fused attention backward), "detected" when the fault came in with an input.
    out: (M, N) or (B, H, M, N); the event points at its most extreme element (a sync: slow path only)."""
    value, index = extreme_value(out)
    lead, (row, col) = index[:-2], index[-2:]
    kind = kind_of(value)
    det = Detection(op=op, layer=ctx.layer, step=ctx.step, pattern="0d", kind=kind, action=action,
                    batch=lead[0] if lead else None, head=lead[1] if len(lead) > 1 else None, row=row, col=col,
                    value=value_to_wire(value), residual=None, bound=NEAR_INF, tier="tripwire")
    _deliver(ctx, det)
