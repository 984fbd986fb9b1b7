"""The fleet at scale (issue 34): the collector's device views and /metrics over a long history on PostgreSQL, what
`attnchecker-server prune` removes and keeps, and the suspicion statistic's false-alarm rate and power.

1. history: a 10,000-run, 64-device history over two years, written straight into the collector's tables as a
   year of ingest would have left them (8 ranks per run on 8 of the 64 devices, one device at ten times the others'
   fault rate; every event, interval and counter row, device totals equal to the sum of their runs). A real collector
   (uvicorn on that database, metrics uncached) is timed answering GET /api/v1/devices, GET /api/v1/devices/{uuid}
   and /metrics; then `attnchecker-server prune --older-than 365d` (the command, in a subprocess) deletes the older
   year, and every run's and device's totals are compared before and after.
2. suspicion: fleets simulated without excess (every device one rate; checks ten times apart) give the statistic's
   false-alarm rate at its default alpha; fleets with one device at ten times the rate give its power.
3. quota: what an attacker holding one agent token gets by registering 600 runs as fast as it can against a real
   collector (SQLite, default settings): how many are refused, and how large /metrics grows.

    python bench/fleet.py [--parts history,suspicion,quota] [--runs 10000] [--devices 64] [--requests 7] [--repeats 3]
                          [--tiny]

Every figure is the median of --repeats repetitions with min and max; latencies are per request, median over
--requests requests in each repetition. Writes bench/results/fleet.json (or --out).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common

_common.setup_path()

import httpx
import numpy as np

RANKS = 8
BAD_DEVICE = 17
KINDS = ("inf", "nan", "near_inf", "silent")
POLICY = {"mode": "correct", "period": 1, "op_periods": {}, "adaptive": True, "min_period": 1, "max_period": 8,
          "tolerance": "roundoff", "tolerance_factor": 1.0, "on_uncorrectable": "log", "source_repair": True,
          "overhead_budget": 0.05, "tripwire": True}


def _uuid(device: int) -> str:
    return f"GPU-be7c0000-0000-4000-8000-{device:012d}"


def _copy(cur: Any, table: str, columns: list[str], rows: list[tuple[Any, ...]]) -> None:
    with cur.copy(f"COPY {table} ({', '.join(columns)}) FROM STDIN") as copy:
        for row in rows:
            copy.write_row(row)


def build_history(url: str, *, runs: int, devices: int, seed: int) -> dict[str, Any]:
    """Writes the history with COPY (psycopg 3); returns what was written."""
    import psycopg

    rng = np.random.default_rng(seed)
    now = datetime.now(UTC)
    span = timedelta(days=730)
    dsn = url.replace("postgresql+psycopg://", "postgresql://")
    rows: dict[str, list[tuple[Any, ...]]] = {k: [] for k in (
        "run", "policy", "run_op_counter", "run_fault_counter", "run_rank", "device_run", "event_batch",
        "fault_event", "stats_interval")}
    dev_tot = {d: {"checks": 0, "detected": 0, "corrected": 0, "uncorrectable": 0, "runs": 0, "fault_runs": 0,
                   "last": now - span, "kinds": dict.fromkeys(KINDS, 0)} for d in range(devices)}
    created = sorted(now - span + timedelta(seconds=float(s)) for s in rng.uniform(0, span.total_seconds() - 3600,
                                                                                    size=runs))
    for r, start in enumerate(created):
        run_id = str(uuid.UUID(int=int(rng.integers(2**63)) << 64 | r))
        end = start + timedelta(hours=float(rng.uniform(0.5, 6)))
        live = r >= runs - 50  # the newest 50 still running
        if live:
            end = now - timedelta(minutes=float(rng.uniform(0, 5)))
        placed = rng.choice(devices, size=RANKS, replace=False)
        run_checks = run_detected = run_uncorrectable = 0
        for rank, device in enumerate(int(d) for d in placed):
            checks = int(rng.integers(8_000, 12_000))
            rate = 2.0 * (10 if device == BAD_DEVICE else 1)
            detected = int(rng.poisson(rate))
            uncorrectable = int(rng.binomial(detected, 0.05))
            rows["run_rank"].append((run_id, rank, _uuid(device), f"node-{device // 8}", rank, start, 1, "run"))
            rows["device_run"].append((_uuid(device), run_id, rank, checks, detected, uncorrectable, start, end))
            t = dev_tot[device]
            t["checks"] += checks
            t["detected"] += detected
            t["corrected"] += detected - uncorrectable
            t["uncorrectable"] += uncorrectable
            t["runs"] += 1
            t["fault_runs"] += int(detected > 0)
            t["last"] = max(t["last"], end)
            batch = str(uuid.uuid4())
            rows["event_batch"].append((batch, run_id, end, detected, 0))
            for e in range(detected):
                kind = KINDS[int(rng.integers(len(KINDS)))]
                t["kinds"][kind] += 1
                ts = start + (end - start) * float(rng.uniform())
                action = "uncorrectable" if e < uncorrectable else "corrected"
                rows["fault_event"].append((str(uuid.uuid4()), run_id, batch, ts, int(rng.integers(10_000)), rank,
                                            int(rng.integers(32)), "scores", "0d", kind, action, 0, 3, 17, 41, "inf",
                                            None, 0.001, 1, ts, _uuid(device)))
            for half in range(2):
                payload = json.dumps({"rank": rank, "steps": 500, "ops": [{"op": "scores", "checks": checks // 2}],
                                      "faults": []})
                rows["stats_interval"].append((str(uuid.uuid4()), run_id, rank, half * 500, half * 500 + 499, 500, 1,
                                               120.0, 3.0, payload, start + (end - start) * (half + 1) / 2,
                                               _uuid(device)))
            run_checks += checks
            run_detected += detected
            run_uncorrectable += uncorrectable
        rows["run"].append((run_id, f"bench-run-{r:05d}", "LlamaForCausalLM", RANKS, "node-0", "bench", "{}", None,
                            "running" if live else "finished", start, end, None if live else end, 5000, 1,
                            RANKS * 1000, 960.0, 24.0, run_detected, 0, 0, 0.0, 0))
        rows["policy"].append((run_id, run_id, 1, json.dumps(POLICY), start, "bench"))
        rows["run_op_counter"].append((run_id, "scores", run_checks, 24.0, 1))
        rows["run_fault_counter"].append((run_id, "scores", "inf", run_detected, run_detected - run_uncorrectable,
                                          run_uncorrectable))
    with psycopg.connect(dsn) as conn, conn.cursor() as cur:
        _copy(cur, "run", ["id", "name", "model", "world_size", "host", "agent_version", "config", "owner_token_id",
                           "status", "created_at", "last_seen_at", "finished_at", "last_step", "applied_policy_version",
                           "steps_total", "step_seconds_total", "check_seconds_total", "events_sent_total",
                           "events_spooled_total", "events_dropped_total", "residual_sum", "residual_count"],
              rows["run"])
        _copy(cur, "policy", ["scope", "run_id", "version", "body", "updated_at", "updated_by"], rows["policy"])
        _copy(cur, "run_op_counter", ["run_id", "op", "checks", "check_seconds", "period"], rows["run_op_counter"])
        _copy(cur, "run_fault_counter", ["run_id", "op", "kind", "detected", "corrected", "uncorrectable"],
              rows["run_fault_counter"])
        _copy(cur, "device", ["uuid", "hostname", "kind", "name", "first_seen_at", "last_seen_at", "status",
                              "status_version", "checks", "detected", "corrected", "uncorrectable", "runs",
                              "fault_runs"],
              [(_uuid(d), f"node-{d // 8}", "cuda", "NVIDIA H200", now - span, t["last"], "ok", 1, t["checks"],
                t["detected"], t["corrected"], t["uncorrectable"], t["runs"], t["fault_runs"])
               for d, t in dev_tot.items()])
        _copy(cur, "device_fault_counter", ["device_uuid", "kind", "detected", "corrected", "uncorrectable"],
              [(_uuid(d), k, n, n, 0) for d, t in dev_tot.items() for k, n in t["kinds"].items() if n])
        _copy(cur, "run_rank", ["run_id", "rank", "device_uuid", "hostname", "local_rank", "registered_at",
                                "applied_policy_version", "applied_policy_scope"], rows["run_rank"])
        _copy(cur, "device_run", ["device_uuid", "run_id", "rank", "checks", "detected", "uncorrectable",
                                  "first_seen_at", "last_seen_at"], rows["device_run"])
        _copy(cur, "event_batch", ["id", "run_id", "received_at", "accepted", "duplicates"], rows["event_batch"])
        _copy(cur, "fault_event", ["id", "run_id", "batch_id", "ts", "step", "rank", "layer", "op", "pattern", "kind",
                                   "action", "loc_batch", "loc_head", "loc_row", "loc_col", "value", "residual",
                                   "bound", "policy_version", "received_at", "device_uuid"], rows["fault_event"])
        _copy(cur, "stats_interval", ["id", "run_id", "rank", "step_start", "step_end", "steps",
                                      "applied_policy_version", "step_seconds", "check_seconds", "payload",
                                      "received_at", "device_uuid"], rows["stats_interval"])
        cur.execute("ANALYZE")
    return {"runs": runs, "devices": devices, "ranks_per_run": RANKS, "bad_device": _uuid(BAD_DEVICE),
            **{f"{k}_rows": len(v) for k, v in rows.items() if k in ("fault_event", "stats_interval", "event_batch",
                                                                      "run_rank", "device_run")}}


def _timed(client: httpx.Client, path: str, n: int) -> tuple[list[float], httpx.Response]:
    seconds, last = [], None
    client.get(path).raise_for_status()  # warm: the first request pays for imports and the pool
    for _ in range(n):
        t0 = time.perf_counter()
        last = client.get(path)
        seconds.append(time.perf_counter() - t0)
        last.raise_for_status()
    assert last is not None
    return seconds, last


def _totals(client: httpx.Client) -> tuple[dict[str, Any], dict[str, Any]]:
    runs: dict[str, Any] = {}
    cursor = None
    while True:
        page = client.get("/api/v1/runs", params={"limit": 500, **({"cursor": cursor} if cursor else {})}).json()
        runs.update({r["id"]: r["totals"] for r in page["data"]})
        cursor = page["next_cursor"]
        if not cursor:
            break
    devices = {d["uuid"]: (d["totals"], d["faults"]) for d in
               client.get("/api/v1/devices", params={"limit": 1000}).json()["items"]}
    return runs, devices


def history_once(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    import collector_testing as testing

    out: dict[str, Any] = {"seed": seed}
    with testing.postgres_database(prefix="attnchecker_bench_fleet") as url:
        settings = testing.make_settings("postgres", Path("/tmp"), database_url=url, metrics_cache_seconds=0)
        testing.migrate(settings)
        t0 = time.perf_counter()
        out["history"] = build_history(url, runs=args.runs, devices=args.devices, seed=seed)
        out["build_s"] = time.perf_counter() - t0
        viewer = testing.make_token(settings, "viewer", "bench")
        with testing.run_collector(settings, migrate_first=False) as collector, httpx.Client(
                base_url=collector.url, headers={"Authorization": f"Bearer {viewer}"}, timeout=120) as client:
            seconds, devices = _timed(client, "/api/v1/devices", args.requests)
            items = devices.json()["items"]
            out["devices_list_s"] = seconds
            out["first_device"] = items[0]["uuid"]
            out["first_suspicion"] = items[0]["suspicion"]
            out["significant"] = [d["uuid"] for d in items if d["suspicion"]["significant"]]
            out["device_detail_s"], _ = _timed(client, f"/api/v1/devices/{_uuid(BAD_DEVICE)}", args.requests)
            out["metrics_s"], metrics = _timed(client, "/metrics", args.requests)
            out["metrics_bytes"] = len(metrics.content)
            out["metrics_series"] = sum(1 for line in metrics.text.splitlines() if line and not line.startswith("#"))
            before = _totals(client)
            env = {**os.environ, **testing.settings_env(settings)}
            t0 = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "attnchecker_server.cli", "prune", "--older-than", "365d"],
                                  env=env, capture_output=True, text=True, check=True)
            out["prune_s"] = time.perf_counter() - t0
            out["prune_output"] = done.stdout.strip()
            after = _totals(client)
            out["run_totals_unchanged"] = before[0] == after[0]
            out["device_totals_unchanged"] = before[1] == after[1]
            out["runs_compared"] = len(before[0])
            out["devices_after_prune_s"], _ = _timed(client, "/api/v1/devices", args.requests)
        from sqlalchemy import create_engine, text

        engine = create_engine(url)
        with engine.connect() as conn:
            cutoff = datetime.now(UTC) - timedelta(days=365)
            older = "SELECT count(*) FROM {} WHERE received_at < :c"
            out["left_older_than_cutoff"] = {
                t: int(conn.execute(text(older.format(t)), {"c": cutoff}).scalar_one())
                for t in ("fault_event", "stats_interval", "event_batch")}
            out["left"] = {t: int(conn.execute(text(f"SELECT count(*) FROM {t}")).scalar_one())
                           for t in ("fault_event", "stats_interval", "event_batch")}
        engine.dispose()
    return out


def _fleet(rng: np.random.Generator, m: int, runs: int, healthy_faults: float, bad_factor: float) -> list[Any]:
    from attnchecker_server.suspicion import DeviceCounts

    checks = rng.integers(100_000, 1_000_001, size=m)
    rates = np.full(m, healthy_faults / checks.mean())
    if bad_factor != 1:
        rates[0] *= bad_factor
    per_run = rng.poisson(np.outer(checks / runs, np.ones(runs)) * rates[:, None])
    return [DeviceCounts(f"d{i}", int(checks[i]), int(per_run[i].sum()), int((per_run[i] > 0).sum()), runs)
            for i in range(m)]


def suspicion_once(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    from attnchecker_server.suspicion import assess

    rng = np.random.default_rng(seed)
    out: dict[str, Any] = {"seed": seed, "alpha": args.alpha, "devices": args.devices, "runs": 4, "null": {},
                           "power": {}}
    for healthy in (0.5, 2.0, 10.0):
        flagged = sum(any(v.significant for v in assess(_fleet(rng, args.devices, 4, healthy, 1),
                                                        alpha=args.alpha).values())
                      for _ in range(args.fleets))
        out["null"][str(healthy)] = flagged / args.fleets
        found = first = 0
        for _ in range(args.fleets // 4):
            fleet = _fleet(rng, args.devices, 4, healthy, 10)
            verdicts = assess(fleet, alpha=args.alpha)
            found += verdicts["d0"].significant
            first += max(fleet, key=lambda d: (verdicts[d.key].score, d.key == "d0")).key == "d0"
        out["power"][str(healthy)] = {"found": found / (args.fleets // 4), "first": first / (args.fleets // 4)}
    return out


def quota_once(seed: int, attempts: int) -> dict[str, Any]:
    import tempfile

    import collector_testing as testing

    with tempfile.TemporaryDirectory() as d:
        settings = testing.make_settings("sqlite", Path(d), metrics_cache_seconds=0)
        testing.migrate(settings)
        agent = testing.make_token(settings, "agent", "attacker")
        viewer = testing.make_token(settings, "viewer", "bench")
        with testing.run_collector(settings, migrate_first=False) as collector, httpx.Client(
                base_url=collector.url, timeout=60) as client:
            statuses: dict[int, int] = {}
            retry_after = set()
            t0 = time.perf_counter()
            for i in range(attempts):
                r = client.post("/api/v1/runs", json={"name": f"flood-{seed}-{i}"},
                                headers={"Authorization": f"Bearer {agent}"})
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                if r.status_code == 429:
                    retry_after.add(r.headers.get("Retry-After"))
            seconds = time.perf_counter() - t0
            metrics = client.get("/metrics", headers={"Authorization": f"Bearer {viewer}"}).text
    runs = {line.split('run="')[1].split('"')[0] for line in metrics.splitlines()
            if line.startswith("attnchecker_run_live{")}
    return {"attempts": attempts, "statuses": statuses, "retry_after": sorted(r for r in retry_after if r),
            "seconds": seconds, "metrics_runs": len(runs), "metrics_bytes": len(metrics.encode())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="history,suspicion,quota")
    p.add_argument("--runs", type=int, default=10_000)
    p.add_argument("--devices", type=int, default=64)
    p.add_argument("--requests", type=int, default=7)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--fleets", type=int, default=2000, help="simulated fleets per repetition (suspicion)")
    p.add_argument("--alpha", type=float, default=0.01)
    p.add_argument("--attempts", type=int, default=600, help="registrations of the quota flood")
    p.add_argument("--tiny", action="store_true", help="a few hundred runs, one repetition: the smoke test's size")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.tiny:
        args.runs, args.devices, args.requests, args.repeats, args.fleets, args.attempts = 300, 32, 2, 1, 40, 110
    parts = set(args.parts.split(","))
    result: dict[str, Any] = {"parts": sorted(parts)}
    if "history" in parts:
        reps = [history_once(args, seed) for seed in range(args.repeats)]
        result["history"] = reps
        rows = []
        for name in ("devices_list_s", "device_detail_s", "metrics_s", "devices_after_prune_s"):
            medians = [statistics.median(r[name]) * 1e3 for r in reps]
            rows.append([name.removesuffix("_s"), statistics.median(medians), min(medians), max(medians)])
        prune = [r["prune_s"] for r in reps]
        rows.append(["prune (s, not ms)", statistics.median(prune), min(prune), max(prune)])
        print(_common.table(rows, ["GET (ms per request)", "median", "min", "max"]))
        for r in reps:
            print(f"seed {r['seed']}: {r['history']}; {r['prune_output']}; totals unchanged: runs "
                  f"{r['run_totals_unchanged']} ({r['runs_compared']}), devices {r['device_totals_unchanged']}; "
                  f"first {r['first_device']} significant {r['significant']}; /metrics {r['metrics_series']} series, "
                  f"{r['metrics_bytes']} bytes")
    if "suspicion" in parts:
        reps = [suspicion_once(args, 100 + seed) for seed in range(args.repeats)]
        result["suspicion"] = reps
        rows = []
        for healthy in reps[0]["null"]:
            null = [r["null"][healthy] for r in reps]
            found = [r["power"][healthy]["found"] for r in reps]
            first = [r["power"][healthy]["first"] for r in reps]
            rows.append([healthy, statistics.median(null), min(null), max(null), statistics.median(found),
                         statistics.median(first)])
        print(_common.table(rows, ["healthy faults/device", "false alarms (median)", "min", "max",
                                   "10x found (median)", "10x ranked first"]))
    if "quota" in parts:
        reps = [quota_once(seed, args.attempts) for seed in range(args.repeats)]
        result["quota"] = reps
        print(_common.table([[r["attempts"], json.dumps(r["statuses"]), ",".join(r["retry_after"]), r["seconds"],
                              r["metrics_runs"], r["metrics_bytes"]] for r in reps],
                            ["registrations", "answers", "Retry-After", "seconds", "/metrics runs", "/metrics bytes"]))
    path = _common.write_result("fleet", result, args.out)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
