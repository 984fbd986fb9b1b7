"""What a protected call needs to know, passed explicitly from the guard to the engine.

The engine (``attention.py`` over ``abft/``) never reads global state: every protected projection and attention call
gets a :class:`LayerContext`, one per protected attention layer, whose ``runtime`` is shared by all layers of a guard
and swapped by the guard at step boundaries.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..policy import MODES, OPS, TIERS, TOLERANCES
from .passed import PassedChecksums
from .ratio_histogram import RESIDUAL_RATIO_BUCKETS, RatioHistogram
from .zeroed import ZeroedArena

if TYPE_CHECKING:
    from ..abft.repair import MatrixReport
    from ..events import Detection
    from ..inject import Injector

__all__ = [
    "MODES", "OPS", "RESIDUAL_RATIO_BUCKETS", "TIERS", "TOLERANCES",
    "CallLog", "CheckConfig", "Deferred", "LayerContext", "OpStats", "Runtime",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckConfig:
    """The per-step snapshot of the policy the engine acts on. Immutable: the guard swaps whole objects."""

    mode: str = "correct"
    """off: compute (and inject) only; detect: verify and report; correct: verify, correct, recompute."""
    tolerance: str = "roundoff"
    """roundoff: a bound from dtype epsilon, reduction length and operand norms; extreme: the paper's thresholds."""
    tolerance_factor: float = 1.0
    """Multiplies the bound (roundoff) or the absolute threshold (extreme)."""
    source_repair: bool = True
    """True: q/k/v are verified and repaired at their projection, so autograd never saves a faulty value.
    False: paper-faithful checksum passing; q/k/v are only verified through scores and context."""
    checked_ops: frozenset[str] = frozenset(OPS)
    """Ops verified on the current step (the scheduler decides); the others are computed (and injected) only."""
    tripwire: bool = True
    """Tier 1: every op that is not verified on this step still gets the extreme-value tripwire (INF/NaN/near-INF),
    and a trip recovers through the full check (docs/abft.md, "Tier 1")."""

    def checks(self, op: str) -> bool:
        return self.mode != "off" and op in self.checked_ops

    def trips(self, op: str) -> bool:
        """Whether ``op`` gets the tier-1 tripwire on this step (it is on, and the op is not fully checked)."""
        return self.tripwire and self.mode != "off" and op not in self.checked_ops


@dataclass(slots=True)
class OpStats:
    """Counters for one interval. Host-side ints for things the host already knows; device tensors for the rest,
    copied out only at step boundaries (no sync on the hot path)."""

    checks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OPS, 0))
    check_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(OPS, 0.0))
    # (op, kind) -> [detected, corrected, uncorrectable]
    faults: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    trip_checks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OPS, 0))
    """Tier-1 tripwire checks per op (op calls not fully checked on their step)."""
    catches: dict[tuple[str, str], int] = field(default_factory=dict)
    """(tier, op) -> faults caught; tier is one of TIERS. The optimizer net counts under op "grad"."""
    trip_seconds: float = 0.0
    """Time spent in tier 1 (and recovering from its trips), all ops."""
    grad_checks: int = 0
    """Optimizer steps whose gradients the last net looked at."""
    seen: set[tuple[int, str]] = field(default_factory=set)
    """(layer, op) checked or tripwired this interval: what the coverage map's claims are held to (coverage.py)."""
    forwards: int = 0
    """Forward passes of the protected model that finished this interval."""
    ratios: RatioHistogram = field(default_factory=RatioHistogram)
    """The clean checks' residual/bound ratios (records._record_ratio), on the device; read below."""

    @property
    def residual_counts(self) -> torch.Tensor | None:
        """(len(RESIDUAL_RATIO_BUCKETS) + 1,) int64 bucket counts of the clean ratios; None before the first."""
        return self.ratios.counts

    @property
    def residual_sum(self) -> torch.Tensor | None:
        return self.ratios.total

    @property
    def residual_count(self) -> torch.Tensor | None:
        return self.ratios.count

    @property
    def residual_max(self) -> dict[str, torch.Tensor]:
        """op -> the worst clean residual/bound ratio of its checks this interval (a device scalar, no sync): how
        close clean data came to a flag, per op (the clean campaign reports it; the histogram mixes the ops)."""
        return self.ratios.maxima

    def add_fault(self, op: str, kind: str, action: str, tier: str = "abft") -> None:
        self.catches[(tier, op)] = self.catches.get((tier, op), 0) + 1
        row = self.faults.setdefault((op, kind), [0, 0, 0])
        row[0] += 1
        if action in ("corrected", "recomputed"):
            row[1] += 1
        elif action == "uncorrectable":
            row[2] += 1


@dataclass(slots=True)
class CallLog:
    """Which attention backend ran each layer's checked calls, and why the ones ahead of it in the order did not
    (attention/backends): what the coverage map shows. Bounded by layers × backends."""

    ran_by: dict[tuple[int, str], int] = field(default_factory=dict)
    """(layer, backend) -> checked calls it ran."""
    declined: dict[tuple[int, str], tuple[str, ...]] = field(default_factory=dict)
    """(layer, backend) -> the reasons it gave, the last time it declined a call of that layer."""

    def ran(self, layer: int, backend: str, declined: Mapping[str, tuple[str, ...]]) -> None:
        self.ran_by[(layer, backend)] = self.ran_by.get((layer, backend), 0) + 1
        for name, reasons in declined.items():
            self.declined[(layer, name)] = reasons


@dataclass(slots=True, kw_only=True)
class Runtime:
    """Guard-wide state every layer reads: the current step, what to check, where records go."""

    step: int = 0
    config: CheckConfig = dataclasses.field(default_factory=CheckConfig)
    injector: Injector | None = None
    on_detection: Callable[[Detection], None] | None = None
    stats: OpStats | None = None
    calls: CallLog = field(default_factory=CallLog)
    deferred: list[Deferred] = field(default_factory=list)
    """Device-side outcomes of this step's checks, emitted at the step boundary (checks/deferred.py)."""
    early_reads: int = 0
    """Times the deferred outcomes were read before a step boundary because ``deferred.MAX_PENDING`` piled up."""
    device_spans: list[Any] = field(default_factory=list)
    """CUDA checks' start and end events (checks/device_time.DeviceSpan), timed at the step boundary."""
    zeroed: ZeroedArena = field(default_factory=ZeroedArena)
    """Zero-filled device memory for the GPU path's atomics (checks/zeroed.py): a memset a chunk, not a call."""


@dataclass(frozen=True, slots=True)
class Deferred:
    """One checked call's outcome for one op, left on the device until the step boundary (checks/deferred.py)."""

    ctx: LayerContext
    step: int
    op: str
    tier: str
    flagged: torch.Tensor
    """() bool or integer, on the call's device: nonzero = something to report."""
    reports: Callable[[], list[MatrixReport]]
    """Host side, after the drain's sync, only when ``flagged``: the call's reports (its summaries read back)."""
    heads: bool = True
    """The reports' index is (batch, head) (attention) rather than (batch,) or () (a GEMM)."""
    ratio: torch.Tensor | None = None
    """() fp32 on the device: the check's worst clean residual/bound ratio, put in the histogram at the drain with the
    step's others (one update a step, not a few ops a check); None: recorded by the check itself."""


@dataclass(slots=True, kw_only=True)
class LayerContext:
    """One per protected attention layer. The projections of the layer and its attention call share it."""

    layer: int
    runtime: Runtime
    passed: PassedChecksums = field(default_factory=PassedChecksums)
    """Checksum passing within one forward of this layer (projections put, the attention takes)."""
    op_key: int = 0
    """Its key in ``compiled.registry``, which the custom ops of a compiled graph find it by (0: not registered)."""

    @property
    def step(self) -> int:
        return self.runtime.step

    @property
    def config(self) -> CheckConfig:
        return self.runtime.config
