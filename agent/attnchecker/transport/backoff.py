"""When to try the collector again while it is down: exponential backoff for the API, and a cheaper, frequent
``/readyz`` probe meanwhile, so a long outage does not keep the agent away long after the collector is back."""
from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(slots=True)
class Backoff:
    """Exponential backoff with "equal jitter": half the delay fixed, half random, so many agents that lost the same
    collector do not come back in lockstep, and none retries at once."""

    base_s: float = 0.5
    max_s: float = 30.0
    failures: int = 0
    rng: random.Random | None = None

    def next_delay(self) -> float:
        self.failures += 1
        d = min(self.max_s, self.base_s * 2.0 ** min(self.failures - 1, 30))
        return d / 2 + float((self.rng or random).uniform(0, d / 2))

    def reset(self) -> None:
        self.failures = 0

    def probe_delay(self, interval_s: float) -> float:
        """The wait before the next ``/readyz`` probe: ``interval_s`` with the same equal jitter (never more than the
        backoff itself, which retries anyway)."""
        d = min(interval_s, self.max_s)
        return d / 2 + (self.rng or random).uniform(0, d / 2)
