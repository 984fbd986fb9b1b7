"""Checks whose outcome stays on the device until the step boundary: a GPU kernel writes its flags and a small summary
per flagged tile, repairs on the device what it can, and nothing on the training thread waits for it. At the step
boundary (``Guard.step()``, or the optimizer's pre-step hook, so an uncorrectable fault can still skip the step)
``drain`` reads every deferred record of the step in one host-device sync and emits the detections of the flagged
ones, as the CPU backends emit theirs at once.

What it costs: a detection reaches the log, the collector and ``on_uncorrectable`` at the end of its step instead of
inside its layer's call; "raise" raises at the step boundary, not in the forward that met the fault.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..abft.repair import MatrixReport
from .context import Deferred, LayerContext
from .records import _emit, _record_ratio

__all__ = ["Deferred", "defer", "drain"]


def defer(ctx: LayerContext, op: str, flagged: torch.Tensor, reports: Callable[[], list[MatrixReport]], *,
          tier: str = "abft", heads: bool = True, ratio: torch.Tensor | None = None) -> None:
    """Keep a call's device-side outcome for the step boundary (``ratio``: its worst clean residual/bound ratio, for
    the histogram). No sync."""
    ctx.runtime.deferred.append(Deferred(ctx=ctx, step=ctx.step, op=op, tier=tier, flagged=flagged, reports=reports,
                                         heads=heads, ratio=ratio))


def drain(records: list[Deferred]) -> int:
    """Emit the detections of every flagged record and empty the list; returns how many were emitted. One sync per
    device (and flag dtype) for all of a step's records (none when there are none)."""
    pending = list(records)
    records.clear()
    if not pending:
        return 0
    _record_ratios(pending)
    # Grouped by device and dtype, so that a step's flags are one stack and one comparison per group, whatever the
    # number of records (a GEMM check leaves one per checked product).
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, rec in enumerate(pending):
        groups.setdefault((rec.flagged.device, rec.flagged.dtype), []).append(i)
    flagged = [False] * len(pending)
    for idx in groups.values():
        flags = torch.stack([pending[i].flagged.reshape(()) for i in idx]) != 0
        for i, f in zip(idx, flags.tolist(), strict=True):  # sync: once per step, device and dtype, at the boundary
            flagged[i] = f
    emitted = 0
    for rec, f in zip(pending, flagged, strict=True):
        if not f:
            continue
        reports = rec.reports()
        _emit(rec.ctx, rec.op, reports, heads=rec.heads, tier=rec.tier, step=rec.step)
        emitted += len(reports)
    return emitted


def _record_ratios(records: list[Deferred]) -> None:
    """The records' worst clean ratios into their runtime's histogram: one update per runtime and device. No sync."""
    groups: dict[tuple[int, torch.device], list[Deferred]] = {}
    for rec in records:
        if rec.ratio is not None:
            groups.setdefault((id(rec.ctx.runtime), rec.ratio.device), []).append(rec)
    for recs in groups.values():
        _record_ratio(recs[0].ctx, torch.cat([r.ratio.reshape(1) for r in recs if r.ratio is not None]),
                      [r.op for r in recs])
