"""Event batches and interval statistics. Idempotent by batch, event and interval id; one transaction each.

Counters behind /metrics come from the statistics only (their fault counts are the agent's deltas); events are
stored for the SQL view and never counted twice.
"""

import math
from datetime import datetime
from typing import Any

from pydantic import TypeAdapter
from sqlalchemy import func, select, text, update
from sqlalchemy.orm import Session

from ..auth import Principal
from ..bounds import BIGINT_MAX
from ..errors import InvalidRequest
from ..models import (
    EventBatch,
    FaultEvent,
    Run,
    RunFaultCounter,
    RunOpCounter,
    RunResidualBucket,
    StatsInterval,
    utcnow,
)
from ..schemas import EventBatchIn, EventBatchResult, FaultEventIn, StatsIn, StatsResult
from .devices import attribute_interval, rank_devices
from .runs import require_writable_run
from .sql import greatest, upsert_insert
from .tiers import add_tier_counts

__all__ = ["ingest_events", "ingest_stats"]


def _touch(session: Session, run_id: str, **values: Any) -> None:
    session.execute(
        update(Run)
        .where(Run.id == run_id)
        .values(last_seen_at=utcnow(), **values)
        .execution_options(synchronize_session=False)
    )


# The event columns in table order; every row of a batch shares run_id, batch_id and received_at.
_EVENT_COLUMNS = [column.name for column in FaultEvent.__table__.columns]
# Each event's fields as json_to_recordset reads them from the validated events' JSON, in the columns' SQL types.
_RECORD = (
    "id varchar, ts timestamptz, step integer, rank integer, layer integer, op varchar, pattern varchar, "
    "kind varchar, action varchar, location json, value varchar, residual double precision, "
    "bound double precision, policy_version integer"
)
_SELECTED = {
    "run_id": ":run_id",
    "batch_id": ":batch_id",
    "received_at": ":received_at",
    "loc_batch": "CAST(e.location->>'batch' AS integer)",
    "loc_head": "CAST(e.location->>'head' AS integer)",
    "loc_row": "CAST(e.location->>'row' AS integer)",
    "loc_col": "CAST(e.location->>'col' AS integer)",
    # The rank's device as registered now (run_rank's primary key): an event is attributed where it is stored.
    "device_uuid": "(SELECT rr.device_uuid FROM run_rank rr "
    "WHERE rr.run_id = CAST(:run_id AS varchar) AND rr.rank = e.rank)",
}

# One statement whose text never depends on the batch size, so SQLAlchemy caches it and psycopg prepares it
# server-side. The validated events travel as one JSON parameter (serialised by pydantic in Rust): 17 array
# parameters cost more to dump in psycopg than the whole insert takes in PostgreSQL. Rows are inserted in id order
# (COLLATE "C": code-point order, as Python sorts), so concurrent batches that share events lock rows in one order
# and cannot deadlock. ON CONFLICT skips events stored before (under another batch id); the count is of the rows
# really inserted, and the batch row's counts are written in the same round trip.
_INSERT_EVENTS_POSTGRES = text(
    "WITH inserted AS ("
    f"INSERT INTO {FaultEvent.__tablename__} ({', '.join(_EVENT_COLUMNS)}) "
    "SELECT "
    + ", ".join(_SELECTED.get(name, f"e.{name}") for name in _EVENT_COLUMNS)
    + f" FROM json_to_recordset(CAST(:events AS json)) AS e({_RECORD}) "
    'ORDER BY e.id COLLATE "C" '
    "ON CONFLICT (run_id, id) DO NOTHING RETURNING 1), "
    "n AS (SELECT count(*) AS accepted FROM inserted), "
    # Runs after the events (nothing reads it), as _touch did: the run row is locked last, in every transaction.
    f"touched AS (UPDATE {Run.__tablename__} SET last_seen_at = :seen_at, "
    "last_step = GREATEST(last_step, :max_step) WHERE id = :run_id) "
    f"UPDATE {EventBatch.__tablename__} SET accepted = n.accepted, duplicates = :total - n.accepted "
    "FROM n WHERE run_id = :run_id AND id = :batch_id RETURNING n.accepted"
)
_EVENTS_JSON = TypeAdapter(list[FaultEventIn])


def _insert_events_postgres(
    session: Session, *, run_id: str, batch_id: str, events: list[FaultEventIn], now: datetime
) -> int:
    params = {
        "run_id": run_id,
        "batch_id": batch_id,
        "received_at": now,
        "total": len(events),
        "events": _EVENTS_JSON.dump_json(events).decode(),
        # GREATEST ignores NULL: an empty batch leaves last_step as it is.
        "max_step": max((e.step for e in events), default=None),
        "seen_at": utcnow(),
    }
    return int(session.execute(_INSERT_EVENTS_POSTGRES, params).scalar_one())


def _insert_events_executemany(
    session: Session, *, run_id: str, batch_id: str, events: list[FaultEventIn], now: datetime
) -> int:
    """SQLite (no unnest, no JSON recordset): one cached INSERT … ON CONFLICT DO NOTHING RETURNING id, with the rows
    as executemany parameters. SQLAlchemy's insertmanyvalues compiles it once and expands it into multi-row batches
    by string operations, not a fresh compile per batch size."""
    accepted = 0
    if events:
        devices = rank_devices(session, run_id, {e.rank for e in events})
        rows = [
            {
                "id": e.id,
                "run_id": run_id,
                "batch_id": batch_id,
                "ts": e.ts,
                "step": e.step,
                "rank": e.rank,
                "layer": e.layer,
                "op": e.op,
                "pattern": e.pattern,
                "kind": e.kind,
                "action": e.action,
                "loc_batch": e.location.batch,
                "loc_head": e.location.head,
                "loc_row": e.location.row,
                "loc_col": e.location.col,
                "value": e.value,
                "residual": e.residual,
                "bound": e.bound,
                "policy_version": e.policy_version,
                "received_at": now,
                "device_uuid": devices.get(e.rank),
            }
            for e in events
        ]
        # RETURNING lists only the rows really inserted: events already stored (from another batch id) are skipped.
        table = FaultEvent.__table__
        accepted = len(
            session.execute(
                upsert_insert(session, table)
                .on_conflict_do_nothing(index_elements=["run_id", "id"])
                .returning(table.c.id),
                rows,
            ).all()
        )
    session.execute(
        update(EventBatch)
        .where(EventBatch.run_id == run_id, EventBatch.id == batch_id)
        .values(accepted=accepted, duplicates=len(events) - accepted)
        .execution_options(synchronize_session=False)
    )
    return accepted


def ingest_events(session: Session, *, run_id: str, batch: EventBatchIn, principal: Principal) -> EventBatchResult:
    require_writable_run(session, run_id, principal)
    now = utcnow()
    # The batch row is written first: a concurrent copy of the same batch blocks on its key until this
    # transaction ends, then sees it and stores nothing.
    new_batch = session.execute(
        upsert_insert(session, EventBatch)
        .values(id=batch.batch_id, run_id=run_id, received_at=now, accepted=0, duplicates=0)
        .on_conflict_do_nothing(index_elements=["run_id", "id"])
        .returning(EventBatch.id)
    ).first()
    if new_batch is None:
        return EventBatchResult(batch_id=batch.batch_id, accepted=0, duplicates=len(batch.events))
    events = sorted(batch.events, key=lambda event: event.id)
    if session.get_bind().dialect.name == "postgresql":
        # Also touches the run, in the same round trip.
        accepted = _insert_events_postgres(session, run_id=run_id, batch_id=batch.batch_id, events=events, now=now)
    else:
        accepted = _insert_events_executemany(session, run_id=run_id, batch_id=batch.batch_id, events=events, now=now)
        max_step = max((e.step for e in batch.events), default=None)
        _touch(
            session,
            run_id,
            **({"last_step": greatest(session, Run.last_step, max_step)} if max_step is not None else {}),
        )
    duplicates = len(batch.events) - accepted
    return EventBatchResult(batch_id=batch.batch_id, accepted=accepted, duplicates=duplicates)


def _le_key(le: float) -> str:
    return "+Inf" if math.isinf(le) else repr(float(le))


def _check_headroom(session: Session, run_id: str, stats: StatsIn) -> None:
    """422 naming the field when adding this interval would take one of the run's totals past its 64-bit column
    (or a float total to infinity). Checked against the stored sums, so no sequence of valid payloads overflows:
    on PostgreSQL an overflow would fail every later interval of the run, on SQLite it would silently turn the
    totals into floats."""
    run = session.get(Run, run_id, populate_existing=True)
    assert run is not None
    checks = session.scalar(
        select(func.coalesce(func.sum(RunOpCounter.checks), 0)).where(RunOpCounter.run_id == run_id)
    )
    op_seconds: dict[str, float] = dict(
        session.execute(select(RunOpCounter.op, RunOpCounter.check_seconds).where(RunOpCounter.run_id == run_id)).all()
    )
    detected, corrected, uncorrectable = session.execute(
        select(
            func.coalesce(func.sum(RunFaultCounter.detected), 0),
            func.coalesce(func.sum(RunFaultCounter.corrected), 0),
            func.coalesce(func.sum(RunFaultCounter.uncorrectable), 0),
        ).where(RunFaultCounter.run_id == run_id)
    ).one()
    hist = stats.residual_ratio
    integers: list[tuple[str, int, int]] = [
        ("steps", run.steps_total, stats.steps),
        ("transport.sent", run.events_sent_total, stats.transport.sent),
        ("transport.spooled", run.events_spooled_total, stats.transport.spooled),
        ("transport.dropped", run.events_dropped_total, stats.transport.dropped),
        ("ops.checks", int(checks or 0), sum(op.checks for op in stats.ops)),
        ("faults.detected", detected, sum(f.detected for f in stats.faults)),
        ("faults.corrected", corrected, sum(f.corrected for f in stats.faults)),
        ("faults.uncorrectable", uncorrectable, sum(f.uncorrectable for f in stats.faults)),
        ("residual_ratio.counts", run.residual_count, sum(hist.counts) if hist else 0),
    ]
    for field, stored, delta in integers:
        if int(stored) + delta > BIGINT_MAX:
            raise InvalidRequest(
                f"{field}: adding {delta} takes the run's total past {BIGINT_MAX} (a 64-bit counter); stats carry "
                "deltas since the previous interval, not running totals",
                field=field,
            )
    # Per op, with the deltas of an op listed twice in one interval added up, as the upserts will.
    op_deltas: dict[str, float] = {}
    for op in stats.ops:
        op_deltas[op.op] = op_deltas.get(op.op, 0.0) + op.check_seconds
    floats: list[tuple[str, float, float]] = [
        ("step_seconds", run.step_seconds_total, stats.step_seconds),
        ("check_seconds", run.check_seconds_total, stats.check_seconds),
        *(("ops.check_seconds", op_seconds.get(op, 0.0), delta) for op, delta in op_deltas.items()),
        ("residual_ratio.sum", run.residual_sum, hist.sum if hist else 0.0),
    ]
    for field, total, seconds in floats:
        if not math.isfinite(float(total) + seconds):
            raise InvalidRequest(f"{field}: adding {seconds} takes the run's total to infinity", field=field)


def ingest_stats(session: Session, *, run_id: str, stats: StatsIn, principal: Principal) -> StatsResult:
    require_writable_run(session, run_id, principal)
    now = utcnow()
    device_uuid = rank_devices(session, run_id, {stats.rank}).get(stats.rank)
    new = session.execute(
        upsert_insert(session, StatsInterval)
        .values(
            id=stats.interval_id,
            run_id=run_id,
            rank=stats.rank,
            step_start=stats.step_start,
            step_end=stats.step_end,
            steps=stats.steps,
            applied_policy_version=stats.applied_policy_version,
            step_seconds=stats.step_seconds,
            check_seconds=stats.check_seconds,
            payload=stats.model_dump(mode="json"),
            received_at=now,
            device_uuid=device_uuid,
        )
        .on_conflict_do_nothing(index_elements=["run_id", "id"])
        .returning(StatsInterval.id)
    ).first()
    if new is None:
        return StatsResult(interval_id=stats.interval_id, duplicate=True)
    # After the duplicate check (a replay of an accepted interval is "duplicate", not a 422), before any counter.
    _check_headroom(session, run_id, stats)

    # Upserts in key order, so two intervals of one run posted at once lock counter rows in the same order.
    for op in sorted(stats.ops, key=lambda o: o.op):
        ins = upsert_insert(session, RunOpCounter).values(
            run_id=run_id, op=op.op, checks=op.checks, check_seconds=op.check_seconds, period=op.period
        )
        session.execute(
            ins.on_conflict_do_update(
                index_elements=["run_id", "op"],
                set_={
                    "checks": RunOpCounter.checks + ins.excluded.checks,
                    "check_seconds": RunOpCounter.check_seconds + ins.excluded.check_seconds,
                    # A period is a value at the interval's end; an interval that does not report one keeps the last.
                    "period": ins.excluded.period if op.period is not None else RunOpCounter.period,
                },
            )
        )
    for fault in sorted(stats.faults, key=lambda f: (f.op, f.kind)):
        ins = upsert_insert(session, RunFaultCounter).values(
            run_id=run_id,
            op=fault.op,
            kind=fault.kind,
            detected=fault.detected,
            corrected=fault.corrected,
            uncorrectable=fault.uncorrectable,
        )
        session.execute(
            ins.on_conflict_do_update(
                index_elements=["run_id", "op", "kind"],
                set_={
                    "detected": RunFaultCounter.detected + ins.excluded.detected,
                    "corrected": RunFaultCounter.corrected + ins.excluded.corrected,
                    "uncorrectable": RunFaultCounter.uncorrectable + ins.excluded.uncorrectable,
                },
            )
        )
    add_tier_counts(session, run_id, stats)
    if device_uuid is not None:
        attribute_interval(session, run_id=run_id, device_uuid=device_uuid, stats=stats, now=now)
    hist = stats.residual_ratio
    if hist is not None:
        for le, count in zip([*hist.le, math.inf], hist.counts, strict=True):
            ins = upsert_insert(session, RunResidualBucket).values(run_id=run_id, le=_le_key(le), count=count)
            session.execute(
                ins.on_conflict_do_update(
                    index_elements=["run_id", "le"], set_={"count": RunResidualBucket.count + ins.excluded.count}
                )
            )
    changes: dict[str, Any] = {
        "last_step": greatest(session, Run.last_step, stats.step_end),
        "steps_total": Run.steps_total + stats.steps,
        "step_seconds_total": Run.step_seconds_total + stats.step_seconds,
        "check_seconds_total": Run.check_seconds_total + stats.check_seconds,
        "events_sent_total": Run.events_sent_total + stats.transport.sent,
        "events_spooled_total": Run.events_spooled_total + stats.transport.spooled,
        "events_dropped_total": Run.events_dropped_total + stats.transport.dropped,
    }
    if hist is not None:
        changes["residual_sum"] = Run.residual_sum + hist.sum
        changes["residual_count"] = Run.residual_count + sum(hist.counts)
    # The run's applied version is the run policy's: a rank on the suspect-device policy reports its own version
    # (run_rank keeps it), which must not read as the run lagging behind its policy.
    if stats.applied_policy_version is not None and stats.applied_policy_scope == "run":
        changes["applied_policy_version"] = stats.applied_policy_version
    _touch(session, run_id, **changes)
    return StatsResult(interval_id=stats.interval_id, duplicate=False)
