"""Reconnect latency: how long after a killed collector is back the agent resumes sending (issue 14 item 7).

Per repeat and backend (SQLite, PostgreSQL): a real collector (``attnchecker-server serve`` in a subprocess), a
Transport with the product's defaults streaming an event every 20 ms, SIGKILL of the collector, ``--down`` seconds of
outage (long enough for the exponential backoff to reach many seconds), a restart on the same port and database.
Measured: from the moment the restarted collector answers /healthz to the agent's "reachable again" (its first
successful round after the outage), for the default ``/readyz`` probe (every ``probe_interval_s`` = 1 s) and, in the
same rounds, for a transport whose probe is pushed out to ``max_backoff_s`` (30 s): the backoff-only behaviour the
issue reported. Also checked each time: every emitted event stored exactly once, the run finished, the spool empty
after close, without `attnchecker sync`.

    python bench/reconnect.py [--repeats 3] [--down 15] [--backends sqlite,postgres]
"""
from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common

_common.setup_path()

import collector_testing as testing
import httpx

from attnchecker.transport import Transport

VARIANTS = {"probe (default)": {}, "backoff only": {"probe_interval_s": 30.0}}


class _Back(logging.Handler):
    """Collects the times of the sender's "reachable again" log records."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.times: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "reachable again" in record.getMessage():
            self.times.append(record.created)


def _event(step: int) -> dict[str, Any]:
    return {"id": str(uuid.uuid4()), "ts": "2026-11-29T15:32:40.123Z", "step": step, "rank": 0, "layer": 0,
            "op": "scores", "pattern": "0d", "kind": "inf", "action": "corrected",
            "location": {"batch": 0, "head": 0, "row": 1, "col": 2}, "value": "inf", "residual": None,
            "bound": 0.001, "policy_version": 1}


def _stored_ids(url: str, operator: str, run_id: str) -> list[str]:
    ids: list[str] = []
    cursor = None
    while True:
        params: dict[str, Any] = {"limit": 500, **({"cursor": cursor} if cursor else {})}
        page = httpx.get(f"{url}/api/v1/runs/{run_id}/events", params=params, timeout=30,
                         headers={"Authorization": f"Bearer {operator}"}).json()
        ids += [e["id"] for e in page["data"]]
        cursor = page.get("next_cursor")
        if not cursor:
            return ids


def one(settings: Any, agent: str, operator: str, options: dict[str, Any], down_s: float, work: Path) -> dict:
    c = testing.start_collector(settings, migrate_first=False)
    back = _Back()
    logging.getLogger("attnchecker.transport").addHandler(back)
    logging.getLogger("attnchecker.transport").setLevel(logging.INFO)
    spool = work / uuid.uuid4().hex[:8]
    t = Transport(c.url, agent, f"bench-reconnect-{uuid.uuid4().hex[:8]}", spool_dir=spool,
                  run_info={"model": "bench"}, **options).start()
    emitted: list[str] = []
    stop = threading.Event()

    def emit() -> None:  # the "training loop": one event per 20 ms step
        step = 0
        while not stop.is_set():
            e = _event(step)
            emitted.append(e["id"])
            t.emit_event(e)
            step += 1
            time.sleep(0.02)

    emitter = threading.Thread(target=emit, daemon=True)
    emitter.start()
    try:
        time.sleep(1.0)
        c.process.kill()
        c.process.wait(10)
        time.sleep(down_s)
        c = testing.start_collector(settings, port=c.port, migrate_first=False)
        ready = time.time()
        end = time.monotonic() + 60
        while time.monotonic() < end and not [x for x in back.times if x >= ready - 1.0]:
            time.sleep(0.01)
        resumed = [x for x in back.times if x >= ready - 1.0]
        time.sleep(0.5)
        stop.set()
        emitter.join()
        t.close(deadline_s=10.0)
        ids = _stored_ids(c.url, operator, t.run_id) if t.run_id else []
        run = httpx.get(f"{c.url}/api/v1/runs/{t.run_id}", headers={"Authorization": f"Bearer {operator}"},
                        timeout=30).json() if t.run_id else {}
        return {
            "resume_s": resumed[0] - ready if resumed else None,
            "emitted": len(emitted), "stored": len(ids), "lost": len(set(emitted) - set(ids)),
            "duplicated": len(ids) - len(set(ids)), "dropped": t.dropped, "spooled": t.spooled,
            "finished": run.get("status") == "finished", "left_in_spool": len(list(spool.glob("*.jsonl"))),
        }
    finally:
        stop.set()
        logging.getLogger("attnchecker.transport").removeHandler(back)
        c.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--down", type=float, default=15.0, help="seconds the collector stays down")
    p.add_argument("--backends", default="sqlite,postgres")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows, results = [], {}
    for backend in args.backends.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            if backend == "postgres":
                if not testing.postgres_available():
                    print("postgres: not reachable on 127.0.0.1:5432, skipped")
                    continue
                url = testing.create_postgres_database(prefix="attnchecker_bench")
                settings = testing.make_settings("postgres", work, database_url=url)
            else:
                url = None
                settings = testing.make_settings("sqlite", work)
            try:
                testing.migrate(settings)
                agent, operator = testing.make_token(settings, "agent"), testing.make_token(settings, "operator")
                runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
                for r in range(args.repeats):
                    order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))  # interleaved, alternating
                    for v in order:
                        runs[v].append(one(settings, agent, operator, VARIANTS[v], args.down, work))
            finally:
                if url:
                    testing.drop_postgres_database(url)
        for v, rs in runs.items():
            resume = [x["resume_s"] for x in rs if x["resume_s"] is not None]
            s = _common.summary(resume) if resume else {"median": float("nan"), "min": float("nan"),
                                                         "max": float("nan")}
            rows.append([backend, v, len(rs), s["median"], s["min"], s["max"], sum(x["lost"] for x in rs),
                         sum(x["duplicated"] for x in rs), sum(x["finished"] for x in rs),
                         sum(x["left_in_spool"] for x in rs)])
            results[f"{backend}/{v}"] = {"runs": rs, "resume_s": s}
    print(_common.table(rows, ["backend", "agent", "repeats", "resume s (median)", "min", "max", "lost", "duplicated",
                               "finished", "files left"]))
    print(f"(collector down {args.down:g} s each time; resume = restarted collector answers /healthz -> agent's "
          "first successful round; median of the repeats)")
    path = _common.write_result("reconnect", {"down_s": args.down, "repeats": args.repeats, "results": results},
                                args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
