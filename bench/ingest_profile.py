"""Where the collector's ingest time goes: one 500-event batch through the service layer (no HTTP), as the
collector does it, against the same rows written as one executemany (SQLAlchemy Core insertmanyvalues), alternating.
Evidence for docs/performance.md; not a benchmark of record.

    python bench/ingest_profile.py sqlite|postgres
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common

_common.setup_path()

import collector_testing as testing
import ingest as ib

from attnchecker_server.auth import Principal
from attnchecker_server.db import make_engine, make_session_factory
from attnchecker_server.models import EventBatch, FaultEvent, utcnow
from attnchecker_server.schemas import EventBatchIn
from attnchecker_server.services import ingest
from attnchecker_server.services.sql import upsert_insert

# The profile calls the service directly, past the HTTP layer; an operator may write to any run.
OPERATOR = Principal(name="profile", role="operator")


def rows_of(batch: EventBatchIn, run_id: str) -> list[dict]:
    now = utcnow()
    # C408 waived below: column names as keywords read like the table
    return [dict(id=e.id, run_id=run_id, batch_id=batch.batch_id, ts=e.ts, step=e.step, rank=e.rank, layer=e.layer,  # noqa: C408
                 op=e.op, pattern=e.pattern, kind=e.kind, action=e.action, loc_batch=e.location.batch,
                 loc_head=e.location.head, loc_row=e.location.row, loc_col=e.location.col, value=e.value,
                 residual=e.residual, bound=e.bound, policy_version=e.policy_version, received_at=now)
            for e in sorted(batch.events, key=lambda e: e.id)]


def main() -> int:
    backend = sys.argv[1]
    with tempfile.TemporaryDirectory() as d:
        url = testing.create_postgres_database(prefix="attnchecker_bench") if backend == "postgres" else None
        try:
            settings = testing.make_settings(backend, Path(d), database_url=url)
            testing.migrate(settings)
            factory = make_session_factory(make_engine(settings))
            with testing.run_collector(settings, migrate_first=False) as col:
                run_id = ib.register(col.url, testing.make_token(settings, "agent"), "profile")
            current, manyvalues = [], []
            for i, body in enumerate(ib.batches_for(10, 500, 0)):
                batch = EventBatchIn.model_validate_json(body)
                t0 = time.perf_counter()
                with factory() as session:
                    if i % 2 == 0:
                        ingest.ingest_events(session, run_id=run_id, batch=batch, principal=OPERATOR)
                    else:
                        session.execute(upsert_insert(session, EventBatch).values(
                            id=batch.batch_id, run_id=run_id, received_at=utcnow(), accepted=0, duplicates=0
                        ).on_conflict_do_nothing(index_elements=["run_id", "id"]))
                        table = FaultEvent.__table__
                        stmt = upsert_insert(session, table).on_conflict_do_nothing(index_elements=["run_id", "id"])
                        inserted = session.connection().execute(stmt.returning(table.c.id), rows_of(batch, run_id))
                        assert len(inserted.all()) == 500
                    session.commit()
                (current if i % 2 == 0 else manyvalues).append(time.perf_counter() - t0)
            print(f"{backend}: current ingest_events {statistics.median(current) * 1e3:.0f} ms/batch, "
                  f"executemany {statistics.median(manyvalues) * 1e3:.0f} ms/batch (median of 5 each, 500 events)")
        finally:
            if url:
                testing.drop_postgres_database(url)
    return 0


if __name__ == "__main__":
    sys.exit(main())
