"""SQLAlchemy 2 tables. Counters are summed on ingest so /metrics and run totals are single-row reads."""

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    TypeDecorator,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

__all__ = [
    "ApiToken",
    "Base",
    "Device",
    "DeviceFaultCounter",
    "DeviceRun",
    "DeviceStatusRevision",
    "EventBatch",
    "FaultEvent",
    "Policy",
    "PolicyRevision",
    "Run",
    "RunFaultCounter",
    "RunOpCounter",
    "RunRank",
    "RunResidualBucket",
    "RunTierCounter",
    "StatsInterval",
    "utcnow",
]

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

JsonType = JSON().with_variant(JSONB(), "postgresql")


def utcnow() -> datetime:
    return datetime.now(UTC)


class UtcDateTime(TypeDecorator[datetime]):
    """timestamptz on PostgreSQL; on SQLite (no zones) stored as naive UTC and handed back aware."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Run(Base):
    __tablename__ = "run"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    model: Mapped[str | None] = mapped_column(String(200))
    world_size: Mapped[int] = mapped_column(Integer, default=1)
    host: Mapped[str | None] = mapped_column(String(200))
    agent_version: Mapped[str | None] = mapped_column(String(50))
    config: Mapped[dict[str, Any]] = mapped_column(JsonType, default=dict)
    owner_token_id: Mapped[int | None] = mapped_column(Integer)
    """The agent token that created the run: only it (and tokens bound to the run's name) may write to it.
    NULL for runs created before ownership existed; the next agent token that registers the run claims it."""
    status: Mapped[str] = mapped_column(String(16), default="running")
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)
    last_seen_at: Mapped[datetime] = mapped_column(UtcDateTime, index=True)
    finished_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    last_step: Mapped[int | None] = mapped_column(Integer)
    applied_policy_version: Mapped[int | None] = mapped_column(Integer)
    # Run-wide sums of the interval statistics' deltas.
    steps_total: Mapped[int] = mapped_column(BigInteger, default=0)
    step_seconds_total: Mapped[float] = mapped_column(Float, default=0.0)
    check_seconds_total: Mapped[float] = mapped_column(Float, default=0.0)
    events_sent_total: Mapped[int] = mapped_column(BigInteger, default=0)
    events_spooled_total: Mapped[int] = mapped_column(BigInteger, default=0)
    events_dropped_total: Mapped[int] = mapped_column(BigInteger, default=0)
    residual_sum: Mapped[float] = mapped_column(Float, default=0.0)
    residual_count: Mapped[int] = mapped_column(BigInteger, default=0)

    __table_args__ = (Index("ix_run_status_last_seen_at", "status", "last_seen_at"),)


class FaultEvent(Base):
    __tablename__ = "fault_event"

    # Ids are unique per run (composite key): the same id in another run is another event.
    run_id: Mapped[str] = mapped_column(ForeignKey("run.id", ondelete="CASCADE"), primary_key=True)
    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    batch_id: Mapped[str] = mapped_column(String(36))
    ts: Mapped[datetime] = mapped_column(UtcDateTime)
    step: Mapped[int] = mapped_column(Integer)
    rank: Mapped[int] = mapped_column(Integer)
    layer: Mapped[int] = mapped_column(Integer)
    op: Mapped[str] = mapped_column(String(16))
    pattern: Mapped[str] = mapped_column(String(4))
    kind: Mapped[str] = mapped_column(String(16))
    action: Mapped[str] = mapped_column(String(16))
    loc_batch: Mapped[int | None] = mapped_column(Integer)
    loc_head: Mapped[int | None] = mapped_column(Integer)
    loc_row: Mapped[int | None] = mapped_column(Integer)
    loc_col: Mapped[int | None] = mapped_column(Integer)
    value: Mapped[str] = mapped_column(String(64))
    residual: Mapped[float | None] = mapped_column(Float)
    bound: Mapped[float] = mapped_column(Float)
    policy_version: Mapped[int | None] = mapped_column(Integer)
    received_at: Mapped[datetime] = mapped_column(UtcDateTime)
    device_uuid: Mapped[str | None] = mapped_column(String(64))
    """The device of the event's rank when it was stored (run_rank), so a rank that later moves keeps its history;
    NULL for a rank that registered no identity (an agent older than device identities)."""

    __table_args__ = (
        # The events query's order and cursor: (step, ts, id) within one run.
        Index("ix_fault_event_run_order", "run_id", "step", "ts", "id"),
        # A device's events over time (GET /devices/{uuid}).
        Index("ix_fault_event_device_ts", "device_uuid", "ts"),
    )


class EventBatch(Base):
    __tablename__ = "event_batch"

    run_id: Mapped[str] = mapped_column(ForeignKey("run.id", ondelete="CASCADE"), primary_key=True)
    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    received_at: Mapped[datetime] = mapped_column(UtcDateTime)
    accepted: Mapped[int] = mapped_column(Integer)
    duplicates: Mapped[int] = mapped_column(Integer)


class StatsInterval(Base):
    __tablename__ = "stats_interval"

    run_id: Mapped[str] = mapped_column(ForeignKey("run.id", ondelete="CASCADE"), primary_key=True)
    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    """The agent's interval_id (unique per run)."""
    rank: Mapped[int] = mapped_column(Integer)
    step_start: Mapped[int] = mapped_column(Integer)
    step_end: Mapped[int] = mapped_column(Integer)
    steps: Mapped[int] = mapped_column(Integer)
    applied_policy_version: Mapped[int | None] = mapped_column(Integer)
    step_seconds: Mapped[float] = mapped_column(Float)
    check_seconds: Mapped[float] = mapped_column(Float)
    payload: Mapped[dict[str, Any]] = mapped_column(JsonType)
    received_at: Mapped[datetime] = mapped_column(UtcDateTime)
    device_uuid: Mapped[str | None] = mapped_column(String(64))
    """As for events: the rank's device when the interval was stored."""


class RunOpCounter(Base):
    __tablename__ = "run_op_counter"

    run_id: Mapped[str] = mapped_column(ForeignKey("run.id", ondelete="CASCADE"), primary_key=True)
    op: Mapped[str] = mapped_column(String(16), primary_key=True)
    checks: Mapped[int] = mapped_column(BigInteger, default=0)
    check_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    period: Mapped[int | None] = mapped_column(Integer)
    """The period the agent last reported for this op (a value, not a delta)."""


class RunFaultCounter(Base):
    __tablename__ = "run_fault_counter"

    run_id: Mapped[str] = mapped_column(ForeignKey("run.id", ondelete="CASCADE"), primary_key=True)
    op: Mapped[str] = mapped_column(String(16), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16), primary_key=True)
    detected: Mapped[int] = mapped_column(BigInteger, default=0)
    corrected: Mapped[int] = mapped_column(BigInteger, default=0)
    uncorrectable: Mapped[int] = mapped_column(BigInteger, default=0)


class RunTierCounter(Base):
    """Checks and catches per protection tier (docs/adaptive.md): "tripwire" and "abft" per op, "optimizer" under
    op "grad". Rows appear only for what an agent reported (agents from before the tiers send none)."""

    __tablename__ = "run_tier_counter"

    run_id: Mapped[str] = mapped_column(ForeignKey("run.id", ondelete="CASCADE"), primary_key=True)
    tier: Mapped[str] = mapped_column(String(16), primary_key=True)
    op: Mapped[str] = mapped_column(String(16), primary_key=True)
    checks: Mapped[int] = mapped_column(BigInteger, default=0)
    catches: Mapped[int] = mapped_column(BigInteger, default=0)


class RunResidualBucket(Base):
    __tablename__ = "run_residual_bucket"

    run_id: Mapped[str] = mapped_column(ForeignKey("run.id", ondelete="CASCADE"), primary_key=True)
    le: Mapped[str] = mapped_column(String(32), primary_key=True)
    """Upper bound as text ("0.001", "+Inf"): an exact key, whatever the float round trip does."""
    count: Mapped[int] = mapped_column(BigInteger, default=0)
    """Non-cumulative, as the agent sends it; /metrics accumulates."""


class Policy(Base):
    __tablename__ = "policy"

    scope: Mapped[str] = mapped_column(String(36), primary_key=True)
    """"default" for the server-wide default, else the run id."""
    run_id: Mapped[str | None] = mapped_column(ForeignKey("run.id", ondelete="CASCADE"), unique=True)
    version: Mapped[int] = mapped_column(Integer)
    body: Mapped[dict[str, Any]] = mapped_column(JsonType)
    updated_at: Mapped[datetime] = mapped_column(UtcDateTime)
    updated_by: Mapped[str] = mapped_column(String(100))


class PolicyRevision(Base):
    __tablename__ = "policy_revision"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    scope: Mapped[str] = mapped_column(ForeignKey("policy.scope", ondelete="CASCADE"))
    version: Mapped[int] = mapped_column(Integer)
    body: Mapped[dict[str, Any]] = mapped_column(JsonType)
    actor: Mapped[str] = mapped_column(String(100))
    changed_at: Mapped[datetime] = mapped_column(UtcDateTime)

    __table_args__ = (Index("uq_policy_revision_scope_version", "scope", "version", unique=True),)


class ApiToken(Base):
    __tablename__ = "api_token"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(100), index=True)
    """Not unique: rotating a credential means creating a new token with the same name, then revoking the old one."""
    role: Mapped[str] = mapped_column(String(16))
    prefix: Mapped[str] = mapped_column(String(16), unique=True)
    """Public lookup key embedded in the token; the secret part is only stored as a hash."""
    secret_sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    expires_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    """After this the token is refused (401); NULL: never expires."""
    run_name: Mapped[str | None] = mapped_column(String(200))
    """An agent token bound to this run name may register (create or resume) and write to it, whoever created it:
    the ranks of one job share one run this way."""


# --- devices (docs/collector.md "Devices") -----------------------------------------------------------------------


class Device(Base):
    """One accelerator (or CPU machine) as its ranks identify it, with totals across every run it took part in.

    The totals are summed from the interval statistics on ingest (as the run counters are), so the device list, its
    suspicion and /metrics read one row per device and survive ``prune``."""

    __tablename__ = "device"

    uuid: Mapped[str] = mapped_column(String(64), primary_key=True)
    """"GPU-…" as nvidia-smi and dcgm-exporter write it; "CPU-…" for a machine without an accelerator."""
    hostname: Mapped[str] = mapped_column(String(253))
    """The host it was last registered from."""
    kind: Mapped[str] = mapped_column(String(16))
    name: Mapped[str | None] = mapped_column(String(200))
    pci_bus_id: Mapped[str | None] = mapped_column(String(32))
    serial: Mapped[str | None] = mapped_column(String(64))
    first_seen_at: Mapped[datetime] = mapped_column(UtcDateTime)
    last_seen_at: Mapped[datetime] = mapped_column(UtcDateTime, index=True)
    status: Mapped[str] = mapped_column(String(16), default="ok")
    """ok | suspect | quarantined; set by operators (PATCH /devices/{uuid}), never by the statistics."""
    status_version: Mapped[int] = mapped_column(Integer, default=1)
    status_reason: Mapped[str | None] = mapped_column(String(500))
    status_by: Mapped[str | None] = mapped_column(String(100))
    status_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    checks: Mapped[int] = mapped_column(BigInteger, default=0)
    """Op calls checked on it, by either tier (ops[].checks + ops[].tripwire_checks): its exposure."""
    detected: Mapped[int] = mapped_column(BigInteger, default=0)
    corrected: Mapped[int] = mapped_column(BigInteger, default=0)
    uncorrectable: Mapped[int] = mapped_column(BigInteger, default=0)
    runs: Mapped[int] = mapped_column(Integer, default=0)
    """Distinct runs that registered a rank on it."""
    fault_runs: Mapped[int] = mapped_column(Integer, default=0)
    """Distinct runs in which it detected at least one fault."""


class DeviceFaultCounter(Base):
    __tablename__ = "device_fault_counter"

    device_uuid: Mapped[str] = mapped_column(ForeignKey("device.uuid", ondelete="CASCADE"), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16), primary_key=True)
    detected: Mapped[int] = mapped_column(BigInteger, default=0)
    corrected: Mapped[int] = mapped_column(BigInteger, default=0)
    uncorrectable: Mapped[int] = mapped_column(BigInteger, default=0)


class DeviceRun(Base):
    """What a device did in one run: the repeat-across-runs signal and the device page's list of runs."""

    __tablename__ = "device_run"

    device_uuid: Mapped[str] = mapped_column(ForeignKey("device.uuid", ondelete="CASCADE"), primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("run.id", ondelete="CASCADE"), primary_key=True, index=True)
    rank: Mapped[int] = mapped_column(Integer)
    checks: Mapped[int] = mapped_column(BigInteger, default=0)
    detected: Mapped[int] = mapped_column(BigInteger, default=0)
    uncorrectable: Mapped[int] = mapped_column(BigInteger, default=0)
    first_seen_at: Mapped[datetime] = mapped_column(UtcDateTime)
    last_seen_at: Mapped[datetime] = mapped_column(UtcDateTime)


class RunRank(Base):
    """(run, rank) -> device, as the rank registered it; ingest attributes the rank's events and intervals with it."""

    __tablename__ = "run_rank"

    run_id: Mapped[str] = mapped_column(ForeignKey("run.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    device_uuid: Mapped[str] = mapped_column(ForeignKey("device.uuid", ondelete="CASCADE"), index=True)
    hostname: Mapped[str] = mapped_column(String(253))
    local_rank: Mapped[int | None] = mapped_column(Integer)
    registered_at: Mapped[datetime] = mapped_column(UtcDateTime)
    applied_policy_version: Mapped[int | None] = mapped_column(Integer)
    applied_policy_scope: Mapped[str | None] = mapped_column(String(16))
    """"run" (the run's policy) or "device" (the suspect-device policy), as the rank last reported."""


class DeviceStatusRevision(Base):
    __tablename__ = "device_status_revision"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    device_uuid: Mapped[str] = mapped_column(ForeignKey("device.uuid", ondelete="CASCADE"))
    version: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(String(500))
    actor: Mapped[str] = mapped_column(String(100))
    changed_at: Mapped[datetime] = mapped_column(UtcDateTime)

    __table_args__ = (Index("uq_device_status_revision_device_version", "device_uuid", "version", unique=True),)
