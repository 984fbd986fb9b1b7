"""What a guard has counted: the running totals it keeps per step, and the ``Report`` assembled from them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ..checks.context import OPS, TIERS, OpStats
from ..coverage import Coverage
from .streaming import add_counts

__all__ = ["FaultCounts", "Report", "Totals"]


@dataclass(frozen=True, slots=True)
class FaultCounts:
    detected: int = 0
    corrected: int = 0
    """Corrected in place or by recomputation."""
    uncorrectable: int = 0


@dataclass(frozen=True, slots=True)
class Report:
    """What the guard has counted since ``protect()``. Plain data; ``as_dict()`` is JSON-ready."""

    steps: int
    """Step boundaries passed (``Guard.step()`` calls)."""
    checks: Mapping[str, int]
    """Verified op calls, per op."""
    faults: Mapping[tuple[str, str], FaultCounts]
    """Per (op, kind); kinds are events.KINDS."""
    skipped_steps: int = 0
    """Optimizer steps skipped under ``on_uncorrectable="skip_step"`` (and by the optimizer net)."""
    tier_checks: Mapping[str, int] = field(default_factory=dict)
    """Checks per tier (context.TIERS): tripwire = op calls only tier 1 looked at, abft = ``sum(checks)``,
    optimizer = optimizer steps whose gradients the last net looked at."""
    tier_catches: Mapping[str, int] = field(default_factory=dict)
    """Faults caught per tier (each Detection once)."""
    coverage: Coverage | None = None
    """Per layer and op: protected by which path, or not and why; and calls that fell back at run time."""

    @property
    def detected(self) -> int:
        return sum(c.detected for c in self.faults.values())

    @property
    def corrected(self) -> int:
        return sum(c.corrected for c in self.faults.values())

    @property
    def uncorrectable(self) -> int:
        return sum(c.uncorrectable for c in self.faults.values())

    def by_op(self) -> dict[str, FaultCounts]:
        out: dict[str, list[int]] = {}
        for (op, _kind), c in self.faults.items():
            row = out.setdefault(op, [0, 0, 0])
            row[0] += c.detected
            row[1] += c.corrected
            row[2] += c.uncorrectable
        return {op: FaultCounts(*row) for op, row in out.items()}

    def as_dict(self) -> dict[str, Any]:
        faults: dict[str, dict[str, dict[str, int]]] = {}
        for (op, kind), c in sorted(self.faults.items()):
            faults.setdefault(op, {})[kind] = {
                "detected": c.detected,
                "corrected": c.corrected,
                "uncorrectable": c.uncorrectable,
            }
        return {
            "steps": self.steps,
            "checks": dict(self.checks),
            "faults": faults,
            "detected": self.detected,
            "corrected": self.corrected,
            "uncorrectable": self.uncorrectable,
            "skipped_steps": self.skipped_steps,
            "tier_checks": dict(self.tier_checks),
            "tier_catches": dict(self.tier_catches),
            "coverage": self.coverage.as_dict() if self.coverage is not None else None,
        }


@dataclass(slots=True)
class Totals:
    """The guard's running counts since ``protect()``: every finished step's ``OpStats`` folded in."""

    checks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OPS, 0))
    faults: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    """Per (op, kind): [detected, corrected, uncorrectable]."""
    tier_checks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    tier_catches: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))

    def add(self, stats: OpStats) -> None:
        add_counts(self.checks, self.faults, stats)
        self.tier_checks["tripwire"] += sum(stats.trip_checks.values())
        self.tier_checks["abft"] += sum(stats.checks.values())
        self.tier_checks["optimizer"] += stats.grad_checks
        for (tier, _op), n in stats.catches.items():
            self.tier_catches[tier] = self.tier_catches.get(tier, 0) + n

    def copy(self) -> Totals:
        return Totals(checks=dict(self.checks), faults={k: list(v) for k, v in self.faults.items()},
                      tier_checks=dict(self.tier_checks), tier_catches=dict(self.tier_catches))

    def report(self, *, in_progress: OpStats | None, steps: int, skipped_steps: int, coverage: Coverage) -> Report:
        """A frozen Report of these totals plus the step ``in_progress`` (left out of the totals themselves)."""
        totals = self.copy()
        if in_progress is not None:
            totals.add(in_progress)
        return Report(
            steps=steps,
            checks=MappingProxyType(totals.checks),
            faults=MappingProxyType({k: FaultCounts(*v) for k, v in totals.faults.items()}),
            skipped_steps=skipped_steps,
            tier_checks=MappingProxyType(totals.tier_checks),
            tier_catches=MappingProxyType(totals.tier_catches),
            coverage=coverage,
        )
