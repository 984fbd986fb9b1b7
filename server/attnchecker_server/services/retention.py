"""``attnchecker-server prune``: delete old fault events, stats intervals and event-batch receipts in batches, one
transaction per batch, on SQLite and PostgreSQL (docs/collector.md, "Retention").

Totals are untouched by design: a run's and a device's counters are summed into their own rows on ingest (run,
run_*_counter, device, device_*), never recomputed from events or intervals, so deleting those loses the detail and
keeps every total. Rows are old by ``received_at`` (the collector's clock, which an agent cannot set).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import CursorResult, Table, delete, func, select, tuple_
from sqlalchemy.orm import Session, sessionmaker

from ..models import EventBatch, FaultEvent, Run, StatsInterval, utcnow

__all__ = ["MIN_AGE", "PruneReport", "prune"]

MIN_AGE = timedelta(days=1)
"""The youngest rows prune may delete: a receipt younger than a day may still stop an agent's retry from counting
twice."""
RUN_CHUNK = 500
"""Runs per delete statement: a bounded IN list."""
_TABLES: tuple[Table, ...] = (
    cast(Table, FaultEvent.__table__), cast(Table, StatsInterval.__table__), cast(Table, EventBatch.__table__)
)


@dataclass
class PruneReport:
    cutoff: datetime
    deleted: dict[str, int] = field(default_factory=lambda: {t.name: 0 for t in _TABLES})
    runs_scanned: int = 0
    batches: int = 0


def _old_runs(session: Session, cutoff: datetime) -> list[str]:
    """Runs that can hold rows received before the cutoff: every row of a run is received after it was created."""
    return list(session.scalars(select(Run.id).where(Run.created_at < cutoff).order_by(Run.id)))


def _batch(table: Table, run_ids: list[str], cutoff: datetime, limit: int) -> Any:
    # One bounded batch by primary key: the (run_id, id) prefix of each run's rows, filtered by age.
    doomed = (
        select(table.c.run_id, table.c.id)
        .where(table.c.run_id.in_(run_ids), table.c.received_at < cutoff)
        .limit(limit)
    )
    return delete(table).where(tuple_(table.c.run_id, table.c.id).in_(doomed))


def _count(table: Table, run_ids: list[str], cutoff: datetime) -> Any:
    return select(func.count()).select_from(table).where(table.c.run_id.in_(run_ids), table.c.received_at < cutoff)


def prune(
    session_factory: sessionmaker[Session],
    *,
    older_than: timedelta,
    batch_size: int = 5000,
    dry_run: bool = False,
    now: datetime | None = None,
    progress: Callable[[PruneReport], None] | None = None,
) -> PruneReport:
    """Deletes (or with ``dry_run`` counts) the events, intervals and batch receipts received more than
    ``older_than`` ago. Each batch of at most ``batch_size`` rows commits on its own, so a long prune holds no lock
    for long and can be interrupted and run again."""
    if older_than < MIN_AGE:
        raise ValueError(f"older_than must be at least {MIN_AGE}: younger receipts still deduplicate agent retries")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    report = PruneReport(cutoff=(now or utcnow()) - older_than)
    with session_factory() as session:
        runs = _old_runs(session, report.cutoff)
    report.runs_scanned = len(runs)
    for start in range(0, len(runs), RUN_CHUNK):
        chunk = runs[start:start + RUN_CHUNK]
        for table in _TABLES:
            if dry_run:
                with session_factory() as session:
                    report.deleted[table.name] += int(session.scalar(_count(table, chunk, report.cutoff)) or 0)
                continue
            while True:
                with session_factory() as session, session.begin():
                    result = cast(CursorResult[Any], session.execute(_batch(table, chunk, report.cutoff, batch_size)))
                    deleted = int(result.rowcount or 0)
                report.deleted[table.name] += deleted
                report.batches += 1
                if progress is not None:
                    progress(report)
                if deleted < batch_size:
                    break
    return report
