"""The time a check takes where its work runs: on the host for the CPU paths, on the device for the CUDA ones.

On a CPU a check's work is done when its call returns, so the host's clock around the call is its time. A CUDA
check (the Triton kernels: attention, its backward, the GEMM checks) only queues kernels and returns; the host's
clock around it measures the launches, microseconds, while the kernels run for milliseconds after it. Counting that
as the check's time made the overhead the guard reports (``OpStats.check_seconds``, the wire's ``check_seconds``, the
dashboard's overhead ratio) and the adaptive schedule's overhead budget (docs/adaptive.md, rule 5) blind to the
checks' cost on a GPU.

So a ``Clock`` started before a full check's launches records a CUDA event there, and when the check ends, another;
the pair waits on the runtime (``Runtime.device_spans``) until the step boundary, where the host has waited for the
device anyway (checks/deferred.drain reads the step's flags), and ``settle`` adds the time between the two events to
the check's ops then. Recording an event queues a marker on the stream: no sync. On a CPU ``Clock`` is the host's
clock, as before, and so is tier 1's everywhere (``Clock``). What a span holds: every kernel queued between its two
events, on that stream, and any time the device waited for the host's next launch in between: the checks, and for
the checked attention forward the attention itself (its checks are inside the kernel: 7 to 20 times the unchecked
kernel on the first H200 run, docs/performance.md §8).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from .context import LayerContext, Runtime

__all__ = ["Clock", "DeviceSpan", "settle"]


@dataclass(frozen=True, slots=True)
class DeviceSpan:
    start: Any
    """torch.cuda.Event (timing on): recorded before the check's first launch."""
    end: Any
    """recorded after its last."""
    ops: tuple[str, ...]
    """Full checks: the ops the span's time is shared by (one check each). Empty: tier-1 time (trip_seconds)."""


class Clock:
    """Started before a check's work on ``device``; ``seconds`` when it is done. full: a full check, timed on the
    device on CUDA. Tier 1 keeps the host's clock everywhere: it runs on every step, at up to a few hundred calls a
    step (every Linear's forward and backward under scope="all"), where two events a call would cost the host about
    as much as the launches they time; and its time is reported, not budgeted (``OpStats.trip_seconds``)."""

    __slots__ = ("_start", "_t0")

    def __init__(self, device: torch.device, *, full: bool = True) -> None:
        self._t0 = time.perf_counter()
        self._start = None
        if full and device.type == "cuda":
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()

    def seconds(self, ctx: LayerContext, ops: list[str] | tuple[str, ...] = ()) -> float:
        """The seconds to count now: the host's since the start on a CPU (and for tier 1); for a full check on
        CUDA 0.0, the device's time between the start and now left for ``settle`` to add at the step boundary to
        ``ops`` (shared evenly), or with ops empty to tier 1's time (a trip's recovery)."""
        if self._start is None:
            return time.perf_counter() - self._t0
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        ctx.runtime.device_spans.append(DeviceSpan(self._start, end, tuple(ops)))
        return 0.0


def settle(runtime: Runtime) -> float:
    """At the step boundary, after the step's flags were read: each pending span's device time added to the
    runtime's current stats (a check's ops, or tier 1's time); returns the seconds added. Waits for a span's end
    event if the device has not passed it yet (the flags' read has waited for the device already, on its stream).
    """
    spans = list(runtime.device_spans)
    runtime.device_spans.clear()
    stats = runtime.stats
    added = 0.0
    for span in spans:
        span.end.synchronize()  # sync: at the step boundary, after the flags' read (free then)
        seconds = span.start.elapsed_time(span.end) / 1e3
        added += seconds
        if stats is None:
            continue
        if span.ops:
            for op in span.ops:
                stats.check_seconds[op] = stats.check_seconds.get(op, 0.0) + seconds / len(span.ops)
        else:
            stats.trip_seconds += seconds
    return added
