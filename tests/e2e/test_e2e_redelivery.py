"""Issue 14 item 7 end to end: the real collector (SQLite and PostgreSQL) hangs, is killed and comes back, or loses its
database, and the agent delivers everything by itself, promptly, exactly once, without `attnchecker sync`:

- killed and restarted mid-run with the default 30 s maximum backoff: the agent is back through its /readyz probe,
  the run's `finish` arrives, nothing is left in the spool, no step talked to the collector (only the sender did);
- a run that ends while the collector is down leaves its tail and `finish` in the spool; the next run on the same
  spool directory uploads them, and the first run shows finished;
- PostgreSQL refuses the collector's connections (the database made unreachable, a real outage condition): the
  collector answers 5xx and /readyz 503, the agent spools, and once the database is back everything arrives once.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import httpx
import pytest
import test_e2e_streaming as streaming
import torch
from e2e_helpers import (
    BACKENDS,
    FAST,
    protect_streaming,
    running_collector,
    tiny_model,
    train,
    wait_until,
)

from attnchecker import Policy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240), pytest.mark.usefixtures("single_thread")]

# The product's default backoff ceiling: without the /readyz probe the agent could stay away up to 30 s.
PATIENT = {**FAST, "max_backoff_s": 30.0, "read_timeout_s": 5.0}
OUTAGE_S = 8.0


def spool_files(spool: Path) -> list[Path]:
    return sorted(spool.glob("*.jsonl"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_killed_and_restarted_collector_gets_everything_without_sync(backend: str, tmp_path: Path, caplog) -> None:
    steps, hang_at, kill_at, restart_at = 40, 8, 12, 24
    fault_steps = [2, 5, 11, 13, 16, 19, 25, 27, 33]  # before, during and after the outage
    spool = tmp_path / "spool"
    with running_collector(backend, tmp_path / "collector") as c:
        model = tiny_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        guard = protect_streaming(model, opt, c.url, c.agent, f"e2e-redeliver-{backend}", spool, policy=Policy.full(),
                                  faults=streaming.plan(fault_steps), transport_options=PATIENT)
        c.set_policy(guard, period=1, adaptive=False)
        restarted = {}

        def outage(step: int) -> None:
            if step == hang_at:
                c.hang()  # SIGSTOP: requests in flight wait for their read timeout
            elif step == kill_at:
                c.kill()  # SIGKILL
                # Down long enough for the backoff to grow past what is left of the run (retries 4-8 s apart): a
                # sender that only waited out its backoff would still be away at close() and leave the rest spooled.
                time.sleep(OUTAGE_S)
            elif step == restart_at:
                c.restart()  # same port and database; returns once /healthz answers
                restarted["at"] = time.time()

        caplog.set_level(logging.INFO, logger="attnchecker.transport")
        trained = train(model, opt, steps, before_step=outage)
        guard.close(flush_timeout_s=15.0)

        t = guard.transport
        assert t.spooled > 0, "the outage was not noticed (nothing spooled)"
        assert t.dropped == 0
        streaming.assert_collector_agrees(c, guard, steps)  # 0 lost, 0 duplicated, finished, totals agree
        assert spool_files(spool) == [], "something was left for a manual sync"
        assert trained.network_elsewhere > 0
        assert trained.network_in_steps == [], "a step talked to the collector itself, so it could wait on it"
        back = [r.created for r in caplog.records if "reachable again" in r.getMessage()]
        assert back and back[-1] >= restarted["at"] - 1.0  # it came back after the restart, on its own


@pytest.mark.parametrize("backend", BACKENDS)
def test_run_that_ended_during_an_outage_is_delivered_by_the_next_run(backend: str, tmp_path: Path) -> None:
    steps, kill_at = 12, 6
    spool = tmp_path / "spool"  # both runs use it, as two jobs on one node with the same $ATTNCHECKER_SPOOL_DIR
    with running_collector(backend, tmp_path / "collector") as c:
        model = tiny_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        first = protect_streaming(model, opt, c.url, c.agent, f"e2e-ended-down-{backend}", spool,
                                  policy=Policy.full(), faults=streaming.plan([2, 8, 10]), transport_options=PATIENT)
        c.set_policy(first, period=1, adaptive=False)
        train(model, opt, steps, before_step=lambda s: c.kill() if s == kill_at else None)
        first.close(flush_timeout_s=3.0)  # the collector is still down: the tail and the finish are spooled
        assert first.transport.spooled > 0 and spool_files(spool)
        c.restart()

        model2 = tiny_model(seed=1)
        opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
        second = protect_streaming(model2, opt2, c.url, c.agent, f"e2e-next-{backend}", spool,
                                   policy=Policy.full(), faults=streaming.plan([1]))
        assert wait_until(lambda: not spool_files(spool), 30.0), "the next run did not upload what the first left"
        train(model2, opt2, 3)
        second.close(flush_timeout_s=10.0)

        run = c.run(first.transport.run_id)
        assert run["status"] == "finished" and run["last_step"] == steps - 1
        events = c.events(first.transport.run_id)
        ids = [e["id"] for e in events]
        assert len(ids) == len(set(ids)) and set(ids) == {d.id for d in first.detections}
        assert run["totals"]["detected"] == len(first.detections) == 3
        assert sum(b["steps"] for b in first.intervals) == steps
        assert second.transport.leftover_events == first.transport.spooled
        streaming.assert_collector_agrees(c, second, 3)
        assert spool_files(spool) == []


@pytest.mark.postgres
def test_database_unreachable_then_back(tmp_path: Path) -> None:
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url
    from sqlalchemy.pool import NullPool

    with running_collector("postgres", tmp_path / "collector") as c:
        url = make_url(c.settings.effective_database_url)
        admin = create_engine(url.set(database="postgres"), poolclass=NullPool, isolation_level="AUTOCOMMIT")

        def database(up: bool) -> None:
            with admin.connect() as conn:
                conn.execute(text(f'ALTER DATABASE "{url.database}" WITH ALLOW_CONNECTIONS {str(up).lower()}'))
                if not up:  # the collector's pooled connections go too, as when the database server restarts
                    conn.execute(text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                      "WHERE datname = :db AND pid <> pg_backend_pid()"), {"db": url.database})

        steps, down_at, up_at = 30, 8, 20
        model = tiny_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        guard = protect_streaming(model, opt, c.url, c.agent, "e2e-db-down", tmp_path / "spool", policy=Policy.full(),
                                  faults=streaming.plan([3, 10, 14, 17, 22, 26]), transport_options=PATIENT)
        c.set_policy(guard, period=1, adaptive=False)
        seen = {}

        def outage(step: int) -> None:
            if step == down_at:
                database(up=False)
                time.sleep(OUTAGE_S)  # see test_killed_and_restarted_collector_gets_everything_without_sync
            elif step == down_at + 2:
                seen["readyz"] = httpx.get(f"{c.url}/readyz", timeout=5).status_code
            elif step == up_at:
                database(up=True)

        try:
            trained = train(model, opt, steps, before_step=outage)
        finally:
            database(up=True)
            admin.dispose()
        guard.close(flush_timeout_s=15.0)

        assert seen["readyz"] == 503
        t = guard.transport
        assert t.spooled > 0 and t.dropped == 0
        streaming.assert_collector_agrees(c, guard, steps)
        assert spool_files(tmp_path / "spool") == []
        assert trained.network_elsewhere > 0
        assert trained.network_in_steps == [], "a step talked to the collector itself, so it could wait on it"
