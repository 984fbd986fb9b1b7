"""Checks whose outcome stays on the device until the step boundary: a GPU kernel writes its flags and a small summary
per flagged tile, repairs on the device what it can, and nothing on the training thread waits for it. At the step
boundary (``Guard.step()``, or the optimizer's pre-step hook, so an uncorrectable fault can still skip the step)
``drain`` reads every deferred record of the step in one host-device sync and emits the detections of the flagged
ones, as the CPU backends emit theirs at once. The optimizer's last net (runtime/response.py) hands its gradients'
finiteness to the same read, so a step boundary waits for the device once.

What it costs: a detection reaches the log, the collector and ``on_uncorrectable`` at the end of its step instead of
inside its layer's call; "raise" raises at the step boundary, not in the forward that met the fault. ``Guard.report()``
and ``Guard.close()`` read what is pending too (one sync), so a step in progress is counted and nothing is lost at the
end of a run. A loop with no step boundary at all (neither ``Guard.step()`` nor an attached optimizer) would keep its
outcomes, and the device memory they hold, for ever: past ``MAX_PENDING`` records they are read at once.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ..abft.repair import MatrixReport
from .context import Deferred, LayerContext
from .records import _emit, _record_ratio

__all__ = ["MAX_PENDING", "Deferred", "defer", "drain", "read_bools"]

log = logging.getLogger("attnchecker")

MAX_PENDING = 8192
"""Deferred records kept for the step boundary before they are read at once (one sync). A step of a 32-layer model
under scope="all" full checks leaves about a thousand (one per checked product); each holds a few device buffers,
8 bytes a checked row the largest (64 KB at 8,192 tokens)."""


def defer(ctx: LayerContext, op: str, flagged: torch.Tensor, reports: Callable[[], list[MatrixReport]], *,
          tier: str = "abft", heads: bool = True, ratio: torch.Tensor | None = None) -> None:
    """Keep a call's device-side outcome for the step boundary (``ratio``: its worst clean residual/bound ratio, for
    the histogram). No sync, but for the read of every ``MAX_PENDING`` records that no step boundary read."""
    runtime = ctx.runtime
    runtime.deferred.append(Deferred(ctx=ctx, step=ctx.step, op=op, tier=tier, flagged=flagged, reports=reports,
                                     heads=heads, ratio=ratio))
    if len(runtime.deferred) < MAX_PENDING:
        return
    runtime.early_reads += 1
    if runtime.early_reads == 1 and runtime.step == 0:
        log.warning("attnchecker: %d device-side check outcomes wait for a step boundary and none came yet: call "
                    "guard.step() after each training step, or pass optimizer= to protect(); reading them now (one "
                    "sync), and again every %d", MAX_PENDING, MAX_PENDING)
    elif runtime.early_reads == 1:
        # Between two boundaries (an evaluation loop between optimizer steps): expected, not the user's mistake.
        log.info("attnchecker: %d device-side check outcomes wait for the step boundary; reading them now (one "
                 "sync), and again every %d", MAX_PENDING, MAX_PENDING)
    drain(runtime.deferred)  # sync: once per MAX_PENDING records, where no step boundary read them


def drain(records: list[Deferred], also: torch.Tensor | None = None) -> tuple[int, list[bool] | None]:
    """Emit the detections of every flagged record and empty the list. ``also``: a 1-D bool tensor the caller needs
    on the host at the same boundary, read in the same sync. Returns how many detections were emitted and ``also``'s
    values (None without it). One sync per device among the records and ``also`` (none when there is nothing)."""
    pending = list(records)
    records.clear()
    _record_ratios(pending)
    # A step's flags are one stack and one comparison per device and flag dtype, whatever the number of records (a
    # GEMM check leaves one per checked product), then one read per device.
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, rec in enumerate(pending):
        groups.setdefault((rec.flagged.device, rec.flagged.dtype), []).append(i)
    vectors = [torch.stack([pending[i].flagged.reshape(()) for i in idx]) != 0 for idx in groups.values()]
    values = read_bools([*vectors, *([] if also is None else [also])])
    flagged = [False] * len(pending)
    for idx, got in zip(groups.values(), values[:len(groups)], strict=True):
        for i, f in zip(idx, got, strict=True):
            flagged[i] = f
    emitted = 0
    for rec, f in zip(pending, flagged, strict=True):
        if not f:
            continue
        reports = rec.reports()
        _emit(rec.ctx, rec.op, reports, heads=rec.heads, tier=rec.tier, step=rec.step)
        emitted += len(reports)
    return emitted, None if also is None else values[-1]


def read_bools(vectors: list[torch.Tensor]) -> list[list[bool]]:
    """1-D bool tensors' values on the host: one sync per device among them (the tensors of a device concatenated
    and read at once), none for an empty list."""
    by_device: dict[torch.device, list[int]] = {}
    for i, vec in enumerate(vectors):
        by_device.setdefault(vec.device, []).append(i)
    values: list[list[bool]] = [[] for _ in vectors]
    for idx in by_device.values():
        together = torch.cat([vectors[i] for i in idx]) if len(idx) > 1 else vectors[idx[0]]
        read = together.tolist()  # sync: once per device, at a step boundary (or a report, close, MAX_PENDING)
        at = 0
        for i in idx:
            values[i], at = read[at:at + vectors[i].numel()], at + vectors[i].numel()
    return values


def _record_ratios(records: list[Deferred]) -> None:
    """The records' worst clean ratios into their runtime's histogram: one update per runtime and device. No sync."""
    groups: dict[tuple[int, torch.device], list[Deferred]] = {}
    for rec in records:
        if rec.ratio is not None:
            groups.setdefault((id(rec.ctx.runtime), rec.ratio.device), []).append(rec)
    for recs in groups.values():
        _record_ratio(recs[0].ctx, torch.cat([r.ratio.reshape(1) for r in recs if r.ratio is not None]),
                      [r.op for r in recs])
