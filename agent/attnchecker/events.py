"""The structured record of one detection. The engine builds them; it does no I/O (the transport ships them)."""
from __future__ import annotations

import math
import uuid
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

from .abft.tolerance import NEAR_INF

KINDS = ("inf", "neg_inf", "nan", "near_inf", "silent")
PATTERNS = ("0d", "1d", "2d")
ACTIONS = ("corrected", "recomputed", "detected", "uncorrectable")


def value_to_wire(x: float) -> str:
    """JSON has no INF/NaN: the offending value always travels as a string."""
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return repr(float(x))


def kind_of(x: float, *, near_inf: float = NEAR_INF) -> str:
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "neg_inf"
    if abs(x) > near_inf:
        return "near_inf"
    return "silent"


@dataclass(slots=True, kw_only=True)
class Detection:
    """One fault occurrence in one op call (a bad row is one ``1d`` record, not one per element)."""

    op: str
    layer: int
    step: int
    pattern: str
    kind: str
    action: str
    batch: int | None = None
    head: int | None = None
    row: int | None = None
    col: int | None = None
    value: str = "nan"
    residual: float | None = None
    """|d1|, the checksum difference; None when non-finite."""
    bound: float = 0.0
    rank: int = 0
    policy_version: int = 0
    tier: str = "abft"
    """Which tier caught it (context.TIERS): "tripwire" (tier 1, every step), "abft" (tier 2, scheduled), "optimizer"
    (the net at the optimizer step). Local only for now: the event wire format has no field for it (docs/wire.md);
    the stats payload carries the per-tier counts."""
    id: str = field(default_factory=lambda: str(uuid.uuid4()))
    ts: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="milliseconds"))

    def to_wire(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("tier")
        loc = {k: d.pop(k) for k in ("batch", "head", "row", "col")}
        d["location"] = loc
        if d["residual"] is not None and not math.isfinite(d["residual"]):
            d["residual"] = None
        return d
