"""Collector ingest throughput and the agent-side cost of streaming.

1. events/s and p50/p99 latency of 500-event batches (POST .../events:batch) into a real collector (uvicorn
   subprocess, tests/collector_testing.py) on SQLite and on PostgreSQL, with 1, 4 and 16 concurrent agents (threads,
   each its own HTTP client and run, bodies encoded before the clock starts so the clients spend their time waiting on
   the collector, not in json.dumps).
2. the agent's enqueue cost per event: Transport.emit_event of a Detection (to_wire runs on the sender thread).
3. the transport's added step time: a small training step that emits events every step, with no transport, with the
   collector up, and with it down (nothing listening), interleaved.

    python bench/ingest.py [--backends sqlite,postgres] [--agents 1,4,16] [--workers 1,2] [--repeats 3] [--tiny]

--workers 1,2 runs the PostgreSQL rows once per collector worker count (serve --workers N); --repeats interleaves
rounds and reports the median with min/max; lost/dup count events missing from or doubled in the database.
"""
from __future__ import annotations

import argparse
import functools
import statistics
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

import httpx

from attnchecker.events import Detection
from attnchecker.transport import Transport
from attnchecker.transport.client import encode, events_body


def make_event(step: int, i: int) -> Detection:
    return Detection(op=("q", "k", "v", "scores", "context", "out")[i % 6], layer=i % 12, step=step, pattern="0d",
                     kind="inf", action="corrected", batch=0, head=i % 8, row=i % 256, col=(7 * i) % 256,
                     value="inf", residual=None, bound=1e-3)


def batches_for(n_batches: int, per_batch: int, seed: int) -> list[bytes]:
    return [events_body([encode(make_event(seed * 1000 + b, i).to_wire()) for i in range(per_batch)])
            for b in range(n_batches)]


def register(url: str, token: str, name: str) -> str:
    r = httpx.post(f"{url}/api/v1/runs", json={"name": name, "world_size": 1, "rank": 0},
                   headers={"Authorization": f"Bearer {token}"}, timeout=30)
    r.raise_for_status()
    return str(r.json()["id"])


def ingest_level(url: str, token: str, agents: int, n_batches: int, per_batch: int) -> dict[str, Any]:
    runs = [register(url, token, f"bench-{uuid.uuid4().hex[:8]}") for _ in range(agents)]
    bodies = [batches_for(n_batches, per_batch, a) for a in range(agents)]
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(agents + 1)

    def agent(a: int) -> None:
        mine: list[float] = []
        with httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {token}",
                                                              "Content-Type": "application/json"}) as c:
            start.wait()
            for body in bodies[a]:
                t0 = time.perf_counter()
                r = c.post(f"/api/v1/runs/{runs[a]}/events:batch", content=body)
                mine.append(time.perf_counter() - t0)
                if r.status_code != 200 or r.json().get("accepted") != per_batch:
                    with lock:
                        errors.append(f"{r.status_code}: {r.text[:200]}")
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=agent, args=(a,)) for a in range(agents)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    lat = sorted(latencies)
    total = agents * n_batches * per_batch
    return {
        "agents": agents, "batches_per_agent": n_batches, "events_per_batch": per_batch, "events": total,
        "wall_s": wall, "events_per_s": total / wall,
        "latency_p50_s": lat[len(lat) // 2], "latency_p99_s": lat[min(len(lat) - 1, int(len(lat) * 0.99))],
        "latency_max_s": lat[-1], "errors": errors[:5], "error_count": len(errors),
    }


def ingest(backend: str, agents: list[int], batches: int, per_batch: int, workers: int = 1,
           ) -> dict[str, Any] | None:
    import collector_testing as testing

    with tempfile.TemporaryDirectory() as d:
        db_url = None
        if backend == "postgres":
            if not testing.postgres_available():
                print("PostgreSQL not reachable: skipped")
                return None
            db_url = testing.create_postgres_database(prefix="attnchecker_bench")
        try:
            settings = testing.make_settings(backend, Path(d), database_url=db_url)
            testing.migrate(settings)
            token = testing.make_token(settings, "agent")
            with testing.run_collector(settings, migrate_first=False, workers=workers) as col:
                levels = [ingest_level(col.url, token, n, batches, per_batch) for n in agents]
                stored = stored_counts(settings)
        finally:
            if db_url:
                testing.drop_postgres_database(db_url)
    sent = sum(lv["events"] for lv in levels)
    return {"backend": backend, "workers": workers, "levels": levels, "events_stored": stored,
            "lost": sent - stored["distinct"], "duplicated": stored["rows"] - stored["distinct"]}


def stored_counts(settings: Any) -> dict[str, int]:
    """Rows in fault_event and distinct (run, id) keys: lost = sent - distinct, duplicated = rows - distinct."""
    from sqlalchemy import text

    from attnchecker_server.db import make_engine

    engine = make_engine(settings, pooled=False)
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT count(*) FROM fault_event")).scalar_one()
        distinct = conn.execute(text("SELECT count(*) FROM (SELECT DISTINCT run_id, id FROM fault_event) d")
                                ).scalar_one()
    engine.dispose()
    return {"rows": int(rows), "distinct": int(distinct)}


def enqueue_cost(url: str | None, token: str | None, n: int) -> dict[str, Any]:
    """µs per emit_event of a Detection, with the sender thread running (it competes for the GIL, as in training)."""
    events = [make_event(1, i) for i in range(n)]
    with tempfile.TemporaryDirectory() as d:
        t = Transport(url, token, f"bench-enqueue-{uuid.uuid4().hex[:6]}", spool_dir=d, queue_max=n + 10,
                      connect_timeout_s=0.2, read_timeout_s=1.0).start()
        time.sleep(0.2)
        chunk = max(1, n // 5)
        per: list[float] = []
        for c in range(5):
            batch = events[c * chunk:(c + 1) * chunk]
            t0 = time.perf_counter()
            for e in batch:
                t.emit_event(e)
            per.append((time.perf_counter() - t0) / len(batch) * 1e6)
        dropped = t.dropped
        t.close(deadline_s=3.0)
    return {"us_per_event": _common.summary(per), "dropped": dropped}


def step_cost(url: str | None, token: str | None, rounds: int, steps: int, events_per_step: int,
              tiny: bool) -> dict[str, Any]:
    """Median step time of a small training loop that emits events_per_step events a step: no transport vs collector
    up vs collector down (a port nothing listens on), one block of `steps` per variant per round, interleaved."""
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(1)
    # Full size: ~3 GFLOP a step, tens of ms on one core: long enough that the step is compute, short enough that
    # 100 events a step (a fault storm; a healthy run emits none) is a visible load on the sender thread.
    width, rows = (64, 64) if tiny else (1024, 256)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, width))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(rows, width)
    from collector_testing import free_port

    down_url = f"http://127.0.0.1:{free_port()}"
    targets = {"none": "none", "up": url, "down": down_url}

    cpu: dict[str, list[float]] = {k: [] for k in targets}

    def block(name: str, target: str | None) -> float:
        with tempfile.TemporaryDirectory() as d:
            t = None if target == "none" else Transport(
                target, token, f"bench-step-{uuid.uuid4().hex[:6]}", spool_dir=d, connect_timeout_s=0.2,
                read_timeout_s=1.0, flush_interval_s=0.05).start()
            times = []
            c0 = time.process_time()
            for s in range(steps):
                t0 = time.perf_counter()
                opt.zero_grad()
                model(x).square().mean().backward()
                opt.step()
                if t is not None:
                    for i in range(events_per_step):
                        t.emit_event(make_event(s, i))
                times.append(time.perf_counter() - t0)
            # This process's CPU per step, the sender thread included (the agent's whole cost); wall time also
            # carries the co-located collector's CPU on a small machine.
            cpu[name].append((time.process_time() - c0) / steps)
            if t is not None:
                t.close(deadline_s=2.0)
        return statistics.median(times)

    samples = _common.interleaved({k: functools.partial(block, k, v) for k, v in targets.items()}, rounds=rounds,
                                  warmup=1)
    cpu = {k: v[1:] for k, v in cpu.items()}
    return {"steps_per_block": steps, "events_per_step": events_per_step, "step_s": {
        k: _common.summary(v) for k, v in samples.items()}, "ratio_vs_none": _common.ratios(samples, "none"),
        "down_over_up": _common.summary([d / u for d, u in zip(samples["down"], samples["up"], strict=True)]),
        "cpu_step_s": {k: _common.summary(v) for k, v in cpu.items()}, "cpu_ratio_vs_none": _common.ratios(cpu, "none")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default="sqlite,postgres")
    p.add_argument("--agents", default="1,4,16")
    p.add_argument("--batches", type=int, default=None, help="batches per agent (default 8; tiny 2)")
    p.add_argument("--events-per-batch", type=int, default=500)
    p.add_argument("--enqueue-events", type=int, default=None, help="default 100000; tiny 2000")
    p.add_argument("--rounds", type=int, default=None, help="step-cost rounds (default 6; tiny 2)")
    p.add_argument("--workers", default="1",
                   help="collector worker processes to compare, e.g. 1,2 (serve --workers; more than 1: PostgreSQL "
                        "only, SQLite rows always use 1)")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds; each round runs every (backend, workers) in turn, so they are interleaved")
    p.add_argument("--ingest-only", action="store_true", help="skip the agent-side enqueue and step-cost parts")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    batches = a.batches or (2 if a.tiny else 8)
    per_batch = 50 if a.tiny and a.events_per_batch == 500 else a.events_per_batch
    agents = [int(x) for x in a.agents.split(",") if x]
    worker_counts = [int(x) for x in a.workers.split(",") if x]
    result: dict[str, Any] = {"backends": [], "repeats": a.repeats}
    configs = [(b, w) for b in a.backends.split(",") if b for w in (worker_counts if b == "postgres" else [1])]
    samples: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for round_ in range(a.repeats):
        for backend, workers in configs:
            res = ingest(backend, agents, batches, per_batch, workers)
            if res is None:
                continue
            res["round"] = round_
            result["backends"].append(res)
            for lv in res["levels"]:
                samples.setdefault((backend, workers, lv["agents"]), []).append(
                    {**lv, "lost": res["lost"], "duplicated": res["duplicated"]})
    rows = []
    for (backend, workers, n), runs in samples.items():
        rate = [r["events_per_s"] for r in runs]
        p99 = [r["latency_p99_s"] * 1e3 for r in runs]
        rows.append([backend, workers, n, runs[0]["events"], statistics.median(rate), min(rate), max(rate),
                     statistics.median([r["latency_p50_s"] * 1e3 for r in runs]), statistics.median(p99), max(p99),
                     sum(r["error_count"] for r in runs), max(r["lost"] for r in runs),
                     max(r["duplicated"] for r in runs), len(runs)])
    result["summary"] = [dict(zip(["backend", "workers", "agents", "events", "events_per_s_median", "events_per_s_min",
                                   "events_per_s_max", "p50_ms_median", "p99_ms_median", "p99_ms_max", "errors",
                                   "lost", "duplicated", "repeats"], row, strict=True)) for row in rows]
    print(_common.table(rows, ["backend", "workers", "agents", "events", "events/s (median)", "min", "max",
                               "p50 ms/batch", "p99 ms/batch", "p99 max", "errors", "lost", "dup", "repeats"]))
    if a.ingest_only:
        path = _common.write_result("ingest", result, a.out)
        print(f"\nwrote {path}")
        return 0

    import collector_testing as testing

    with tempfile.TemporaryDirectory() as d:
        settings = testing.make_settings("sqlite", Path(d))
        testing.migrate(settings)
        token = testing.make_token(settings, "agent")
        with testing.run_collector(settings, migrate_first=False) as col:
            n = a.enqueue_events or (2000 if a.tiny else 100_000)
            result["enqueue"] = {"up": enqueue_cost(col.url, token, n),
                                 "down": enqueue_cost(f"http://127.0.0.1:{testing.free_port()}", token, n)}
            result["step"] = step_cost(col.url, token, a.rounds or (2 if a.tiny else 6), 5 if a.tiny else 20,
                                       100, a.tiny)
    enq = result["enqueue"]
    print(_common.table([[k, v["us_per_event"]["median"], v["us_per_event"]["min"], v["us_per_event"]["max"],
                          v["dropped"]] for k, v in enq.items()],
                        ["collector", "enqueue µs/event (median)", "min", "max", "dropped"]))
    st = result["step"]
    print(_common.table([[k, st["step_s"][k]["median"] * 1e3, _common.pct(st["ratio_vs_none"][k]["median"]),
                          st["cpu_step_s"][k]["median"] * 1e3, _common.pct(st["cpu_ratio_vs_none"][k]["median"])]
                         for k in st["step_s"]], ["transport", "wall ms/step (median)", "wall vs none",
                                                  "process CPU ms/step", "CPU vs none"]))
    print(f"down / up: {st['down_over_up']['median']:.3f} (median of per-round ratios)")
    path = _common.write_result("ingest", result, a.out)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
