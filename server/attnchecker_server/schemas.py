"""Pydantic schemas of the wire contract (docs/wire.md); tests/contract validates the agent's payloads against them."""

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator
from typing_extensions import TypeAliasType

from .bounds import TS_PATTERN, bounded_json, in_range_utc, valid_text

__all__ = [
    "DEVICE_STATUSES",
    "FAULT_OPS",
    "OPS",
    "DeviceDetailPublic",
    "DeviceIdentityIn",
    "DevicePublic",
    "DeviceStatusPublic",
    "DeviceStatusUpdate",
    "DevicesPublic",
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
    "RankPublic",
    "RanksPublic",
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
# Ops a fault event, fault stats and per-op check stats may name: the attention ops, plus the whole-step GEMMs of
# protect(scope="all") (a Linear/Conv1D output, its input and weight gradients; the attention core's backward
# products). Not policy ops: they follow the "out" schedule.
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
DeviceStatus = Literal["ok", "suspect", "quarantined"]
DEVICE_STATUSES: tuple[str, ...] = ("ok", "suspect", "quarantined")
PolicyScope = Literal["run", "device"]
"""Which policy a rank follows: the run's, or the suspect-device policy (its device is suspect or quarantined)."""

# A counter delta: at most 2^53 - 1, so that every client (and JSON Schema validators that compare in doubles) reads
# the bound exactly; the run totals these add up to are 64-bit and guarded against overflow at ingest.
NonNegInt = Annotated[int, Field(ge=0, le=2**53 - 1)]
def _integral(value: Any) -> Any:
    # JSON Schema's "integer" includes 4.0; strict models still refuse "4" and true.
    return int(value) if isinstance(value, float) and value.is_integer() else value


PositiveInt = Annotated[int, Field(ge=1, le=2**31 - 1), BeforeValidator(_integral)]
# Stored in 32-bit integer columns; larger values are a client bug, answered with a 422 rather than a DB error.
SmallNonNegInt = Annotated[int, Field(ge=0, le=2**31 - 1)]
NonNegFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Uuid = Annotated[str, Field(min_length=1, max_length=36, pattern=r"^[0-9A-Za-z-]+$")]


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


# --- runs -------------------------------------------------------------------------------------------------------


# Text the database can store and give back: no NUL (PostgreSQL refuses it). Lone surrogates are refused by
# bounds.valid_text; a schema pattern cannot say that. The config's type is spelled out recursively so that the
# OpenAPI document says what is accepted.
NoNulText = Annotated[str, Field(pattern=r"^[^\x00]*$")]
# Keys are only those matching the pattern (patternProperties alone would allow any other key).
_KEYS_BY_PATTERN = Field(json_schema_extra={"additionalProperties": False})
ConfigValue = TypeAliasType(
    "ConfigValue",
    "bool | int | float | NoNulText | list[ConfigValue] | "  # type: ignore[misc]
    "Annotated[dict[NoNulText, ConfigValue], _KEYS_BY_PATTERN] | None",
)


class DeviceIdentityIn(_In):
    """Who a rank is (docs/wire.md, "Device identity"). Every string here can become a Prometheus label value or a
    path segment, so each is a short token of a fixed alphabet."""

    uuid: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")
    """"GPU-…" as nvidia-smi and dcgm-exporter write it (label UUID), "CPU-…" for a machine without a GPU."""
    hostname: str = Field(min_length=1, max_length=253, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    kind: str = Field(pattern=r"^[a-z][a-z0-9_]{0,15}$")
    """torch's device type: cuda, cpu, …"""
    index: SmallNonNegInt | None = None
    local_rank: SmallNonNegInt | None = None
    name: str | None = Field(default=None, max_length=200, pattern=r"^[^\x00-\x1f\x7f]*$")
    pci_bus_id: str | None = Field(default=None, max_length=32, pattern=r"^[0-9A-Fa-f:.]+$")
    serial: str | None = Field(default=None, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")

    @field_validator("name")
    @classmethod
    def _text(cls, value: str | None) -> str | None:
        return None if value is None else valid_text(value)


class RunRegisterIn(_In):
    # The name is a Prometheus label value and a path in dashboards: printable text only.
    name: str = Field(min_length=1, max_length=200, pattern=r"^[^\x00-\x1f\x7f]+$")
    model: str | None = Field(default=None, max_length=200, pattern=r"^[^\x00]*$")
    world_size: PositiveInt = 1
    rank: SmallNonNegInt = 0
    host: str | None = Field(default=None, max_length=200, pattern=r"^[^\x00]*$")
    agent_version: str | None = Field(default=None, max_length=50, pattern=r"^[^\x00]*$")
    config: dict[NoNulText, ConfigValue] = Field(
        default_factory=dict, json_schema_extra={"additionalProperties": False}
    )
    # The new run's starting policy (version 1) instead of a copy of the default; ignored when the run is resumed.
    policy: "PolicyIn | None" = None
    # The rank's device (agents from before device identities send none: their events stay unattributed).
    device: DeviceIdentityIn | None = None

    @model_validator(mode="after")
    def _rank_in_world(self) -> "RunRegisterIn":
        if self.device is not None and self.rank >= self.world_size:
            raise ValueError(
                f"rank ({self.rank}) must be below world_size ({self.world_size}): send the job's world size with "
                "every rank's registration"
            )
        return self

    @field_validator("name", "model", "host", "agent_version")
    @classmethod
    def _text(cls, value: str | None) -> str | None:
        return None if value is None else valid_text(value)

    @field_validator("config")
    @classmethod
    def _bounded(cls, value: dict[str, Any]) -> dict[str, Any]:
        return bounded_json(value)


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


class RankPublic(BaseModel):
    """One rank of a run, as it registered: its device, and the policy it last reported applied."""

    rank: int
    hostname: str
    local_rank: int | None
    device_uuid: str
    device_status: DeviceStatus
    registered_at: datetime
    applied_policy_version: int | None
    applied_policy_scope: PolicyScope | None


class RanksPublic(BaseModel):
    data: list[RankPublic]


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
    tripwire: bool = True

    @model_validator(mode="after")
    def _min_le_max(self) -> "PolicyIn":
        if self.min_period > self.max_period:
            raise ValueError(
                f"min_period ({self.min_period}) must be <= max_period ({self.max_period}); lower min_period or "
                "raise max_period"
            )
        return self


RunRegisterIn.model_rebuild()


def _absent_not_null(schema: dict[str, Any]) -> None:
    # The fields are optional (leave one out to keep it), but null is not a value: say so in the OpenAPI document.
    for prop in schema.get("properties", {}).values():
        options = [o for o in prop.pop("anyOf", []) if o != {"type": "null"}]
        if len(options) == 1:
            prop.update(options[0])
        elif options:
            prop["anyOf"] = options
        if prop.get("default", 0) is None:
            del prop["default"]


class PolicyUpdate(_In):
    """A sparse policy (PATCH): the fields given replace the current ones, then the whole is validated again."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=_absent_not_null)

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
    tripwire: bool | None = None

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


class DeviceStatusPublic(BaseModel):
    """What a rank needs to know about its device: the status an operator set, and why."""

    uuid: str
    status: DeviceStatus
    reason: str | None


class RunRegistered(BaseModel):
    id: str
    name: str
    created: bool
    status: RunStatus
    policy: PolicyPublic
    """The policy this rank follows: the run's, or the suspect-device policy when its device is under suspicion."""
    policy_scope: PolicyScope = "run"
    device: DeviceStatusPublic | None = None
    """The registering rank's device, when the registration named one."""


# --- events -----------------------------------------------------------------------------------------------------


class Location(_In):
    batch: SmallNonNegInt | None = None
    head: SmallNonNegInt | None = None
    row: SmallNonNegInt | None = None
    col: SmallNonNegInt | None = None


class FaultEventIn(_In):
    id: Uuid
    ts: datetime = Field(json_schema_extra={"pattern": TS_PATTERN})
    step: SmallNonNegInt
    rank: SmallNonNegInt
    layer: SmallNonNegInt
    op: FaultOp
    pattern: Pattern
    kind: Kind
    action: Action
    location: Location
    value: str = Field(min_length=1, max_length=64, pattern=r"^[^\x00]+$")
    residual: NonNegFloat | None = None
    bound: NonNegFloat
    policy_version: SmallNonNegInt | None = None

    @field_validator("ts")
    @classmethod
    def _zoned(cls, value: datetime) -> datetime:
        return in_range_utc(value)

    @field_validator("value")
    @classmethod
    def _text(cls, value: str) -> str:
        return valid_text(value)


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
    device_uuid: str | None = None
    """The device of the event's rank (null: the rank registered no identity)."""


class FaultEventsPublic(BaseModel):
    data: list[FaultEventPublic]
    next_cursor: str | None


# --- interval statistics ----------------------------------------------------------------------------------------


class OpStatsIn(_In):
    # A whole-step op's row carries the period of the schedule it follows ("out"'s).
    op: FaultOp
    checks: NonNegInt
    check_seconds: NonNegFloat = 0.0
    period: PositiveInt | None = None
    # Per tier (issue 10); optional, so agents from before the tiers still validate.
    tripwire_checks: NonNegInt = 0
    tripwire_catches: NonNegInt = 0
    abft_catches: NonNegInt = 0


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
    steps: SmallNonNegInt  # also stored per interval, in a 32-bit column
    applied_policy_version: SmallNonNegInt | None = None
    step_seconds: NonNegFloat = 0.0
    check_seconds: NonNegFloat = 0.0
    ops: list[OpStatsIn] = Field(default_factory=list, max_length=64)
    faults: list[FaultStatsIn] = Field(default_factory=list, max_length=256)
    residual_ratio: ResidualHistogramIn | None = None
    transport: TransportStatsIn = Field(default_factory=TransportStatsIn)
    tripwire_seconds: NonNegFloat = 0.0
    optimizer_checks: NonNegInt = 0
    optimizer_catches: NonNegInt = 0
    # Which policy applied_policy_version belongs to: the run's, or the suspect-device policy (docs/wire.md).
    applied_policy_scope: PolicyScope = "run"

    @model_validator(mode="after")
    def _consistent(self) -> "StatsIn":
        if self.step_end < self.step_start:
            raise ValueError(f"step_end ({self.step_end}) is before step_start ({self.step_start})")
        return self


class StatsResult(BaseModel):
    interval_id: str
    duplicate: bool


# --- devices ------------------------------------------------------------------------------------------------------


class DeviceStatusUpdate(_In):
    """An operator's verdict on a device (PATCH /api/v1/devices/{uuid})."""

    model_config = ConfigDict(extra="forbid", strict=True)

    status: DeviceStatus
    reason: str = Field(min_length=1, max_length=500, pattern=r"^[^\x00]+$")
    """Why: kept in the device's history with the operator's token name."""

    @field_validator("reason")
    @classmethod
    def _text(cls, value: str) -> str:
        return valid_text(value)


class SuspicionPublic(BaseModel):
    """docs/collector.md "Suspicion": a conditional binomial test of the device's faults against the fleet's rate for
    its checks, Holm-corrected over the devices with checks, and faults in at least min_fault_runs runs."""

    score: float
    """-log10 of the p-value (0 at or below the fleet's rate)."""
    significant: bool
    p_value: float
    expected: float
    """Faults the fleet's rate predicts for the device's checks."""
    reason: str


class DeviceTotals(BaseModel):
    checks: int
    detected: int
    corrected: int
    uncorrectable: int
    runs: int
    fault_runs: int


class DeviceFaultsPublic(BaseModel):
    kind: Kind
    detected: int
    corrected: int
    uncorrectable: int


class DevicePublic(BaseModel):
    uuid: str
    hostname: str
    kind: str
    name: str | None
    pci_bus_id: str | None
    serial: str | None
    first_seen_at: datetime
    last_seen_at: datetime
    status: DeviceStatus
    status_version: int
    status_reason: str | None
    status_by: str | None
    status_at: datetime | None
    totals: DeviceTotals
    faults: list[DeviceFaultsPublic]
    suspicion: SuspicionPublic


class FleetPublic(BaseModel):
    devices: int
    """Devices with checks: the m of Holm's correction."""
    checks: int
    detected: int
    alpha: float
    min_fault_runs: int


class DevicesPublic(BaseModel):
    items: list[DevicePublic]
    total: int
    """Devices matching the filters (items holds at most `limit` of them, most suspect first)."""
    fleet: FleetPublic


class DeviceRunPublic(BaseModel):
    run_id: str
    run_name: str
    rank: int
    checks: int
    detected: int
    uncorrectable: int
    first_seen_at: datetime
    last_seen_at: datetime


class DeviceStatusRevisionPublic(BaseModel):
    version: int
    status: DeviceStatus
    reason: str | None
    actor: str
    changed_at: datetime


class DeviceDetailPublic(DevicePublic):
    runs: list[DeviceRunPublic]
    """Its most recent runs (at most 200), newest first."""
    events: list[FaultEventPublic]
    """Its most recent fault events (at most 200), newest first; older ones go with `prune`."""
    history: list[DeviceStatusRevisionPublic]
