"""Pydantic schemas of the wire contract (docs/wire.md); tests/contract validates the agent's payloads against them."""

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "FAULT_OPS",
    "OPS",
    "EventBatchIn",
    "EventBatchResult",
    "FaultEventIn",
    "FaultEventPublic",
    "FaultEventsPublic",
    "PolicyHistoryPublic",
    "PolicyIn",
    "PolicyPublic",
    "PolicyRevisionPublic",
    "PolicyUpdate",
    "RunFinishIn",
    "RunPublic",
    "RunRegisterIn",
    "RunRegistered",
    "RunsPublic",
    "StatsIn",
    "StatsResult",
]

Op = Literal["q", "k", "v", "scores", "context", "out"]
OPS: tuple[str, ...] = ("q", "k", "v", "scores", "context", "out")
# Ops a fault event (and fault stats) may name: the attention ops, plus the whole-step GEMMs of protect(scope="all")
# (a Linear/Conv1D output, its input and weight gradients; the attention core's backward products). Not policy ops:
# they follow the "out" schedule.
FaultOp = Literal["q", "k", "v", "scores", "context", "out", "linear", "linear_dx", "linear_dw", "scores_bwd",
                  "grad_probs", "grad_v", "grad_q", "grad_k"]
FAULT_OPS: tuple[str, ...] = (*OPS, "linear", "linear_dx", "linear_dw", "scores_bwd", "grad_probs", "grad_v",
                               "grad_q", "grad_k")
Kind = Literal["inf", "neg_inf", "nan", "near_inf", "silent"]
Pattern = Literal["0d", "1d", "2d"]
Action = Literal["corrected", "recomputed", "detected", "uncorrectable"]
Mode = Literal["off", "detect", "correct"]
Tolerance = Literal["roundoff", "extreme"]
OnUncorrectable = Literal["log", "skip_step", "raise"]
RunStatus = Literal["running", "finished"]

NonNegInt = Annotated[int, Field(ge=0, le=2**62)]
PositiveInt = Annotated[int, Field(ge=1, le=2**31 - 1)]
# Stored in 32-bit integer columns; larger values are a client bug, answered with a 422 rather than a DB error.
SmallNonNegInt = Annotated[int, Field(ge=0, le=2**31 - 1)]
NonNegFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Uuid = Annotated[str, Field(min_length=1, max_length=36, pattern=r"^[0-9A-Za-z-]+$")]


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


# --- runs -------------------------------------------------------------------------------------------------------


class RunRegisterIn(_In):
    # The name is a Prometheus label value and a path in dashboards: printable text only.
    name: str = Field(min_length=1, max_length=200, pattern=r"^[^\x00-\x1f\x7f]+$")
    model: str | None = Field(default=None, max_length=200)
    world_size: PositiveInt = 1
    rank: SmallNonNegInt = 0
    host: str | None = Field(default=None, max_length=200)
    agent_version: str | None = Field(default=None, max_length=50)
    config: dict[str, Any] = Field(default_factory=dict)
    # The new run's starting policy (version 1) instead of a copy of the default; ignored when the run is resumed.
    policy: "PolicyIn | None" = None


class RunFinishIn(_In):
    rank: SmallNonNegInt = 0
    last_step: SmallNonNegInt | None = None


class RunTotals(BaseModel):
    checks: int
    detected: int
    corrected: int
    uncorrectable: int


class RunPublic(BaseModel):
    id: str
    name: str
    model: str | None
    world_size: int
    host: str | None
    config: dict[str, Any]
    status: RunStatus
    created_at: datetime
    last_seen_at: datetime
    last_step: int | None
    requested_policy_version: int
    applied_policy_version: int | None
    totals: RunTotals


class RunsPublic(BaseModel):
    data: list[RunPublic]
    next_cursor: str | None


# --- policy -----------------------------------------------------------------------------------------------------


class PolicyIn(_In):
    """A whole policy (PUT). strict: "3" is not a period, 1 is not a bool."""

    model_config = ConfigDict(extra="forbid", strict=True)

    mode: Mode = "correct"
    period: PositiveInt = 1
    op_periods: dict[Op, PositiveInt] = Field(default_factory=dict)
    adaptive: bool = True
    min_period: PositiveInt = 1
    max_period: PositiveInt = 8
    tolerance: Tolerance = "roundoff"
    tolerance_factor: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 1.0
    on_uncorrectable: OnUncorrectable = "log"
    source_repair: bool = True
    overhead_budget: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] = 0.05

    @model_validator(mode="after")
    def _min_le_max(self) -> "PolicyIn":
        if self.min_period > self.max_period:
            raise ValueError(
                f"min_period ({self.min_period}) must be <= max_period ({self.max_period}); lower min_period or "
                "raise max_period"
            )
        return self


RunRegisterIn.model_rebuild()


class PolicyUpdate(_In):
    """A sparse policy (PATCH): the fields given replace the current ones, then the whole is validated again."""

    model_config = ConfigDict(extra="forbid", strict=True)

    mode: Mode | None = None
    period: PositiveInt | None = None
    op_periods: dict[Op, PositiveInt] | None = None
    adaptive: bool | None = None
    min_period: PositiveInt | None = None
    max_period: PositiveInt | None = None
    tolerance: Tolerance | None = None
    tolerance_factor: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    on_uncorrectable: OnUncorrectable | None = None
    source_repair: bool | None = None
    overhead_budget: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_nulls(cls, data: Any) -> Any:
        if isinstance(data, dict):
            nulls = sorted(key for key, value in data.items() if value is None)
            if nulls:
                raise ValueError(f"{', '.join(nulls)}: null is not a value; leave the field out to keep it")
        return data


class PolicyPublic(PolicyIn):
    # Not strict: clients validate the JSON they received, where datetimes are strings.
    model_config = ConfigDict(extra="forbid", strict=False)

    version: int
    updated_at: datetime
    updated_by: str


class PolicyRevisionPublic(BaseModel):
    version: int
    policy: PolicyIn
    actor: str
    changed_at: datetime


class PolicyHistoryPublic(BaseModel):
    data: list[PolicyRevisionPublic]


class RunRegistered(BaseModel):
    id: str
    name: str
    created: bool
    status: RunStatus
    policy: PolicyPublic


# --- events -----------------------------------------------------------------------------------------------------


class Location(_In):
    batch: SmallNonNegInt | None = None
    head: SmallNonNegInt | None = None
    row: SmallNonNegInt | None = None
    col: SmallNonNegInt | None = None


class FaultEventIn(_In):
    id: Uuid
    ts: datetime
    step: SmallNonNegInt
    rank: SmallNonNegInt
    layer: SmallNonNegInt
    op: FaultOp
    pattern: Pattern
    kind: Kind
    action: Action
    location: Location
    value: str = Field(min_length=1, max_length=64)
    residual: NonNegFloat | None = None
    bound: NonNegFloat
    policy_version: SmallNonNegInt | None = None

    @field_validator("ts")
    @classmethod
    def _zoned(cls, value: datetime) -> datetime:
        if value.tzinfo is None:
            raise ValueError("ts needs a zone (RFC 3339, e.g. 2026-11-29T15:32:40.123Z)")
        return value


class EventBatchIn(_In):
    batch_id: Uuid
    events: list[FaultEventIn]

    @model_validator(mode="after")
    def _unique_ids(self) -> "EventBatchIn":
        ids = [event.id for event in self.events]
        if len(set(ids)) != len(ids):
            raise ValueError("events: the same event id appears twice in one batch")
        return self


class EventBatchResult(BaseModel):
    batch_id: str
    accepted: int
    duplicates: int


class FaultEventPublic(BaseModel):
    id: str
    run_id: str
    batch_id: str
    ts: datetime
    step: int
    rank: int
    layer: int
    op: FaultOp
    pattern: Pattern
    kind: Kind
    action: Action
    location: Location
    value: str
    residual: float | None
    bound: float
    policy_version: int | None
    received_at: datetime


class FaultEventsPublic(BaseModel):
    data: list[FaultEventPublic]
    next_cursor: str | None


# --- interval statistics ----------------------------------------------------------------------------------------


class OpStatsIn(_In):
    op: Op
    checks: NonNegInt
    check_seconds: NonNegFloat = 0.0
    period: PositiveInt | None = None


class FaultStatsIn(_In):
    op: FaultOp
    kind: Kind
    detected: NonNegInt = 0
    corrected: NonNegInt = 0
    uncorrectable: NonNegInt = 0


class ResidualHistogramIn(_In):
    le: list[Annotated[float, Field(allow_inf_nan=False)]] = Field(max_length=64)
    counts: list[NonNegInt]
    sum: NonNegFloat = 0.0
    count: NonNegInt = 0

    @model_validator(mode="after")
    def _shape(self) -> "ResidualHistogramIn":
        if len(self.counts) != len(self.le) + 1:
            raise ValueError(
                f"residual_ratio.counts has {len(self.counts)} entries; it needs len(le) + 1 = {len(self.le) + 1} "
                "(the last one is +Inf)"
            )
        if any(b <= a for a, b in zip(self.le, self.le[1:], strict=False)):
            raise ValueError("residual_ratio.le must be strictly increasing")
        return self


class TransportStatsIn(_In):
    sent: NonNegInt = 0
    spooled: NonNegInt = 0
    dropped: NonNegInt = 0


class StatsIn(_In):
    interval_id: Uuid
    rank: SmallNonNegInt = 0
    step_start: SmallNonNegInt
    step_end: SmallNonNegInt
    steps: NonNegInt
    applied_policy_version: SmallNonNegInt | None = None
    step_seconds: NonNegFloat = 0.0
    check_seconds: NonNegFloat = 0.0
    ops: list[OpStatsIn] = Field(default_factory=list, max_length=64)
    faults: list[FaultStatsIn] = Field(default_factory=list, max_length=256)
    residual_ratio: ResidualHistogramIn | None = None
    transport: TransportStatsIn = Field(default_factory=TransportStatsIn)

    @model_validator(mode="after")
    def _consistent(self) -> "StatsIn":
        if self.step_end < self.step_start:
            raise ValueError(f"step_end ({self.step_end}) is before step_start ({self.step_start})")
        return self


class StatsResult(BaseModel):
    interval_id: str
    duplicate: bool
