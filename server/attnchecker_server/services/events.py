"""The fault-event query: filters, (step, ts, id) order, opaque cursor."""


from sqlalchemy import and_, or_, select
from sqlalchemy.orm import Session

from ..models import FaultEvent
from ..schemas import FaultEventPublic, Location
from .cursor import cursor_id, cursor_int, cursor_time, decode_cursor, encode_cursor
from .runs import require_run

__all__ = ["EventFilters", "event_public", "query_events"]

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class EventFilters:
    op: str | None = None
    kind: str | None = None
    layer: int | None = None
    rank: int | None = None
    action: str | None = None
    step_min: int | None = None
    step_max: int | None = None


def event_public(e: FaultEvent) -> FaultEventPublic:
    return FaultEventPublic(
        id=e.id,
        run_id=e.run_id,
        batch_id=e.batch_id,
        ts=e.ts,
        step=e.step,
        rank=e.rank,
        layer=e.layer,
        # Stored from validated input, so the columns hold vocabulary values.
        op=e.op,  # type: ignore[arg-type]
        pattern=e.pattern,  # type: ignore[arg-type]
        kind=e.kind,  # type: ignore[arg-type]
        action=e.action,  # type: ignore[arg-type]
        location=Location(batch=e.loc_batch, head=e.loc_head, row=e.loc_row, col=e.loc_col),
        value=e.value,
        residual=e.residual,
        bound=e.bound,
        policy_version=e.policy_version,
        received_at=e.received_at,
        device_uuid=e.device_uuid,
    )


def query_events(
    session: Session, *, run_id: str, filters: EventFilters, limit: int, cursor: str | None
) -> tuple[list[FaultEventPublic], str | None]:
    require_run(session, run_id)
    stmt = select(FaultEvent).where(FaultEvent.run_id == run_id)
    for column in ("op", "kind", "layer", "rank", "action"):
        value = getattr(filters, column)
        if value is not None:
            stmt = stmt.where(getattr(FaultEvent, column) == value)
    if filters.step_min is not None:
        stmt = stmt.where(FaultEvent.step >= filters.step_min)
    if filters.step_max is not None:
        stmt = stmt.where(FaultEvent.step <= filters.step_max)
    if cursor is not None:
        step_key, ts_key, id_key = decode_cursor(cursor, length=3)
        step, ts, last_id = cursor_int(step_key, high=2**31 - 1), cursor_time(ts_key), cursor_id(id_key)
        # Expanded row-value comparison: (step, ts, id) > (cursor) on every backend.
        stmt = stmt.where(
            or_(
                FaultEvent.step > step,
                and_(FaultEvent.step == step, FaultEvent.ts > ts),
                and_(FaultEvent.step == step, FaultEvent.ts == ts, FaultEvent.id > str(last_id)),
            )
        )
    rows = list(session.scalars(stmt.order_by(FaultEvent.step, FaultEvent.ts, FaultEvent.id).limit(limit + 1)))
    page = rows[:limit]
    next_cursor = None
    if len(rows) > limit:
        last = page[-1]
        next_cursor = encode_cursor([last.step, last.ts.isoformat(), last.id])
    return [event_public(e) for e in page], next_cursor
