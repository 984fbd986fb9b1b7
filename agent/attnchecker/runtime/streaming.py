"""Interval statistics: what the guard saw over a few steps, as the wire's ``stats`` payload (docs/wire.md).

The guard hands over each closed step's :class:`~attnchecker.checks.context.OpStats` at the step boundary. Host counters
(checks, check time, faults per op and kind) are summed on the host; the residual histogram stays on the device and
is summed there, so a step costs no host-device sync. When an interval is due (``interval_s`` since it started, or
``interval_steps`` steps, whichever comes first; at a policy change; at close) the device sums are copied out with
one sync and the payload goes to the transport, which never blocks.
"""
from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..checks.context import OPS, RESIDUAL_RATIO_BUCKETS, OpStats
from ..policy import WHOLE_STEP_OPS, WHOLE_STEP_SCHEDULE

__all__ = ["IntervalStats", "add_counts"]

log = logging.getLogger(__name__)

_NB = len(RESIDUAL_RATIO_BUCKETS) + 1
"""Histogram bins, the last one +Inf; the packed device accumulator is [counts..., sum, count]."""


def add_counts(checks: dict[str, int], faults: dict[tuple[str, str], list[int]], stats: OpStats) -> None:
    """Add a step's host counters (checks per op; [detected, corrected, uncorrectable] per (op, kind)) into sums."""
    for op, n in stats.checks.items():
        checks[op] = checks.get(op, 0) + n
    for key, row in stats.faults.items():
        mine = faults.setdefault(key, [0, 0, 0])
        for i in range(3):
            mine[i] += row[i]


class IntervalStats:
    """Sums closed steps into one stats interval and sends it when due.

    Args:
        emit: where a finished payload goes (``Transport.emit_stats``; it fills ``interval_id`` and ``transport``).
        rank: the distributed rank, stamped on every interval.
        interval_s: send at the first step boundary at least this long after the interval started.
        interval_steps: ... or after this many steps, whichever comes first. 1 sends every step.
        clock: monotonic seconds (tests pass a fake one).
        keep: how many sent payloads ``sent`` keeps (the most recent).
    """

    def __init__(
        self,
        emit: Callable[[dict[str, Any]], None],
        *,
        rank: int = 0,
        interval_s: float = 1.0,
        interval_steps: int = 100,
        clock: Callable[[], float] = time.monotonic,
        keep: int = 1000,
    ) -> None:
        if not isinstance(interval_s, (int, float)) or isinstance(interval_s, bool) or not interval_s > 0:
            raise ValueError(f"stats_interval_s must be a number > 0, got {interval_s!r}")
        if not isinstance(interval_steps, int) or isinstance(interval_steps, bool) or interval_steps < 1:
            raise ValueError(f"stats_interval_steps must be an int >= 1, got {interval_steps!r}")
        self._emit = emit
        self.rank = rank
        self.interval_s = float(interval_s)
        self.interval_steps = interval_steps
        self._clock = clock
        self.sent: deque[dict[str, Any]] = deque(maxlen=keep)
        """The most recent payloads handed to ``emit``, oldest first."""
        self._reset()

    def _reset(self) -> None:
        self._started = self._clock()
        self._step_start: int | None = None
        self._step_end: int | None = None
        self._steps = 0
        self._step_seconds = 0.0
        self._checks = dict.fromkeys(OPS, 0)
        self._check_seconds = dict.fromkeys(OPS, 0.0)
        self._faults: dict[tuple[str, str], list[int]] = {}
        self._residual: torch.Tensor | None = None
        self._trip_checks = dict.fromkeys(OPS, 0)
        self._trip_seconds = 0.0
        self._catches: dict[tuple[str, str], int] = {}
        self._grad_checks = 0

    @property
    def pending_steps(self) -> int:
        """Steps summed into the interval that has not been sent yet."""
        return self._steps

    def add(self, step: int, stats: OpStats, step_seconds: float, *, count_step: bool = True) -> None:
        """Sum one closed step (``count_step=False``: a partial step at close, counted in the totals only)."""
        if self._step_start is None:
            self._step_start = step
        self._step_end = step if self._step_end is None else max(self._step_end, step)
        if count_step:
            self._steps += 1
        self._step_seconds += max(0.0, step_seconds)
        add_counts(self._checks, self._faults, stats)
        for op, s in stats.check_seconds.items():
            self._check_seconds[op] = self._check_seconds.get(op, 0.0) + s
        self._add_residual(stats)
        for op, n in stats.trip_checks.items():
            self._trip_checks[op] = self._trip_checks.get(op, 0) + n
        self._trip_seconds += stats.trip_seconds
        for key, n in stats.catches.items():
            self._catches[key] = self._catches.get(key, 0) + n
        self._grad_checks += stats.grad_checks

    def _add_residual(self, stats: OpStats) -> None:
        counts, total, count = stats.residual_counts, stats.residual_sum, stats.residual_count
        if counts is None or total is None or count is None:
            return
        # Packed so that the interval's copy-out is a single transfer; float64 holds counts exactly up to 2**53.
        packed = torch.cat([counts.to(torch.float64), total.reshape(1).to(torch.float64),
                            count.reshape(1).to(torch.float64)])
        if self._residual is None:
            self._residual = packed
        elif self._residual.device == packed.device:
            self._residual += packed  # on the device: no sync
        else:
            # The model moved between devices mid-interval (rare): bring the old sums along.
            self._residual = self._residual.to(packed.device) + packed

    def due(self) -> bool:
        return self._steps > 0 and (self._steps >= self.interval_steps
                                    or self._clock() - self._started >= self.interval_s)

    def maybe_send(self, *, applied_policy_version: int, periods: Mapping[str, int], force: bool = False,
                   applied_policy_scope: str = "run") -> bool:
        """Send the interval when it is due (or ``force`` and it holds anything). True when one was sent."""
        if not (self.due() or (force and self._step_start is not None)):
            return False
        payload = self.build(applied_policy_version=applied_policy_version, periods=periods,
                             applied_policy_scope=applied_policy_scope)
        self._reset()
        self.sent.append(payload)
        try:
            self._emit(payload)
        except Exception:  # the emit side never raises by contract; if it does, telemetry is what we lose
            log.exception("attnchecker: could not hand a stats interval to the transport")
            return False
        return True

    def _active(self, op: str) -> bool:
        """Whether the interval counted anything for ``op``: checks, their time, tier-1 checks or catches."""
        return bool(self._checks.get(op) or self._check_seconds.get(op) or self._trip_checks.get(op)
                    or any(self._catches.get((tier, op)) for tier in ("tripwire", "abft")))

    def build(self, *, applied_policy_version: int, periods: Mapping[str, int],
              applied_policy_scope: str = "run") -> dict[str, Any]:
        """The wire payload of the interval so far (``interval_id`` and ``transport`` are the transport's)."""
        assert self._step_start is not None and self._step_end is not None
        body: dict[str, Any] = {
            "rank": self.rank,
            "step_start": self._step_start,
            "step_end": self._step_end,
            "steps": self._steps,
            "applied_policy_version": applied_policy_version,
            "step_seconds": self._step_seconds,
            "check_seconds": sum(self._check_seconds.values()),
            # The attention ops always; a whole-step op (protect(scope="all")) when it did anything this interval,
            # with the schedule it follows, so a run of the attention scope sends what it always sent.
            "ops": [
                {"op": op, "checks": self._checks.get(op, 0), "check_seconds": self._check_seconds.get(op, 0.0),
                 "period": int(periods[op if op in OPS else WHOLE_STEP_SCHEDULE]),
                 # Per tier (docs/wire.md): tier-1 checks, and what each tier caught.
                 "tripwire_checks": self._trip_checks.get(op, 0),
                 "tripwire_catches": self._catches.get(("tripwire", op), 0),
                 "abft_catches": self._catches.get(("abft", op), 0)}
                for op in (*OPS, *(op for op in WHOLE_STEP_OPS if self._active(op)))
            ],
            "tripwire_seconds": self._trip_seconds,
            "optimizer_checks": self._grad_checks,
            "optimizer_catches": self._catches.get(("optimizer", "grad"), 0),
            "faults": [
                {"op": op, "kind": kind, "detected": row[0], "corrected": row[1], "uncorrectable": row[2]}
                for (op, kind), row in sorted(self._faults.items())
            ],
        }
        if applied_policy_scope != "run":
            # Only then: "run" is the default, and a collector from before devices (which never sends the
            # suspect-device policy) refuses fields it does not know.
            body["applied_policy_scope"] = applied_policy_scope
        if self._residual is not None:
            host = self._residual.tolist()  # sync: the one copy-out per stats interval, at a step boundary
            total = float(host[_NB])
            if math.isfinite(total):  # JSON has no INF/NaN; a non-finite sum would cost the whole interval
                body["residual_ratio"] = {"le": list(RESIDUAL_RATIO_BUCKETS), "counts": [int(c) for c in host[:_NB]],
                                          "sum": total, "count": int(host[_NB + 1])}
        return body
