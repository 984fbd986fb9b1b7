"""Drive a protected run to the path a long clean run takes: the default policy's first full check of an op after
the schedule has gone quiet (its period grown to the maximum)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any


def step_until_due_after_quiet(guard: Any, step: Callable[[bool], object], *, op: str = "scores", quiet: int = 7,
                               limit: int = 64) -> None:
    """Call step(due) until ``op`` is due for its full check after at least ``quiet`` steps without one; returns
    before that step, so the caller takes it. Fails if the schedule does not get there within ``limit`` steps."""
    run = 0
    for _ in range(limit):
        due = guard.check_config.checks(op)
        if due and run >= quiet:
            return
        run = 0 if due else run + 1
        step(due)
    raise AssertionError(f"the default schedule did not come back to {op} after {quiet} quiet steps in {limit} steps")
