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
from .records import _emit

__all__ = ["Deferred", "defer", "drain"]


def defer(ctx: LayerContext, op: str, flagged: torch.Tensor, reports: Callable[[], list[MatrixReport]], *,
          tier: str = "abft", heads: bool = True) -> None:
    """Keep a call's device-side outcome for the step boundary. No sync."""
    ctx.runtime.deferred.append(Deferred(ctx=ctx, step=ctx.step, op=op, tier=tier, flagged=flagged, reports=reports,
                                         heads=heads))


def drain(records: list[Deferred]) -> int:
    """Emit the detections of every flagged record and empty the list; returns how many were emitted. One sync per
    device for all of a step's records (none when there are none)."""
    pending = list(records)
    records.clear()
    if not pending:
        return 0
    by_device: dict[torch.device, list[int]] = {}
    for i, rec in enumerate(pending):
        by_device.setdefault(rec.flagged.device, []).append(i)
    flagged = [False] * len(pending)
    for idx in by_device.values():
        flags = torch.stack([pending[i].flagged.reshape(()).to(torch.bool) for i in idx])
        for i, f in zip(idx, flags.tolist(), strict=True):  # sync: once per step and device, at the step boundary
            flagged[i] = f
    emitted = 0
    for rec, f in zip(pending, flagged, strict=True):
        if not f:
            continue
        reports = rec.reports()
        _emit(rec.ctx, rec.op, reports, heads=rec.heads, tier=rec.tier, step=rec.step)
        emitted += len(reports)
    return emitted
