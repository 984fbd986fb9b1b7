"""Issue 5 acceptance: the agent streams to a real collector and never makes training wait for it.

- N steps with K injected faults: the collector holds exactly K events (unique ids), the stats agree with them, and
  /metrics agrees with both (SQLite and PostgreSQL).
- The collector hangs (SIGSTOP), is killed mid-run, and restarted: no step talks to it (only the sender thread does,
  so none waits on it), and every event arrives exactly once.
- The collector is unreachable for the whole run: the spool holds every event, and `attnchecker sync` (the real CLI)
  uploads them exactly once; a second sync uploads nothing.
"""
from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from e2e_helpers import (
    BACKENDS,
    FAST,
    Collector,
    protect_streaming,
    running_collector,
    tiny_model,
    train,
)

from attnchecker import Fault, FaultPlan, Policy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180), pytest.mark.usefixtures("single_thread")]

OPS = ("q", "k", "v", "scores", "context", "out")


def plan(steps: list[int]) -> FaultPlan:
    """One fault per listed step, cycling through ops, layers and the non-finite kinds (each is one detection)."""
    kinds = ("inf", "neg_inf", "nan", "near_inf")
    return FaultPlan([Fault(op=OPS[i % len(OPS)], layer=i % 2, step=s, kind=kinds[i % len(kinds)], seed=100 + i)
                      for i, s in enumerate(steps)])


def fault_counts(events: list[dict]) -> Counter:
    return Counter((e["op"], e["kind"]) for e in events)


def interval_fault_counts(intervals: list[dict], field: str = "detected") -> Counter:
    out: Counter = Counter()
    for body in intervals:
        for f in body["faults"]:
            out[(f["op"], f["kind"])] += f[field]
    return +out


def interval_checks(intervals: list[dict]) -> dict[str, int]:
    return {op: sum(o["checks"] for b in intervals for o in b["ops"] if o["op"] == op) for op in OPS}


def assert_collector_agrees(c: Collector, guard, steps: int) -> None:
    """Events exactly once; the stats the agent sent, the run's totals and /metrics all tell the same story."""
    run_id, name = guard.transport.run_id, guard.run
    detections = guard.detections
    events = c.events(run_id)
    ids = [e["id"] for e in events]
    assert len(ids) == len(set(ids)), "an event was stored twice"
    assert set(ids) == {d.id for d in detections}, "events lost or unexpected"
    want = Counter((d.op, d.kind) for d in detections)
    assert fault_counts(events) == want

    intervals = guard.intervals
    assert sum(b["steps"] for b in intervals) == steps
    assert interval_fault_counts(intervals) == want
    assert interval_fault_counts(intervals, "corrected") == want  # all corrected (0d, transient)
    report = guard.report()
    assert interval_checks(intervals) == dict(report.checks)

    run = c.run(run_id)
    assert run["status"] == "finished" and run["last_step"] == steps - 1
    assert run["totals"] == {"checks": sum(report.checks.values()), "detected": len(detections),
                             "corrected": len(detections), "uncorrectable": 0}

    m = c.metrics()
    for (op, kind), n in want.items():
        assert m.value("attnchecker_faults_detected_total", run=name, op=op, kind=kind) == n
        assert m.value("attnchecker_faults_corrected_total", run=name, op=op, kind=kind) == n
    assert m.value("attnchecker_faults_detected_total", run=name) == len(detections)
    assert m.value("attnchecker_faults_uncorrectable_total", run=name) == 0
    for op in OPS:
        assert m.value("attnchecker_checks_total", run=name, op=op) == report.checks[op]
    assert m.value("attnchecker_steps_total", run=name) == steps
    assert m.value("attnchecker_run_live", run=name) == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_k_injected_faults_reach_the_collector_exactly_once(backend: str, tmp_path: Path) -> None:
    steps, fault_steps = 12, [1, 3, 4, 6, 8, 9, 11]
    with running_collector(backend, tmp_path / "collector") as c:
        model = tiny_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        guard = protect_streaming(model, opt, c.url, c.agent, f"e2e-k-{backend}", tmp_path / "spool",
                                  policy=Policy.full(), faults=plan(fault_steps))
        version = c.set_policy(guard, period=1, adaptive=False)  # the collector's policy: every op, every step
        train(model, opt, steps)
        assert guard.policy.version == version
        guard.close(flush_timeout_s=10.0)

        assert len(guard.injector.injected) == len(fault_steps)
        assert len(guard.detections) == len(fault_steps)  # each transient 0d fault is one detection
        t = guard.transport
        assert (t.sent, t.spooled, t.dropped) == (len(fault_steps), 0, 0)
        assert_collector_agrees(c, guard, steps)
        assert c.run(t.run_id)["applied_policy_version"] == version
        assert c.metrics().value("attnchecker_policy_applied_version", run=guard.run) == version


def test_a_whole_step_runs_checks_reach_metrics_per_op(collector: Collector, tmp_path: Path) -> None:
    """protect(scope="all") on the default policy (issue 17): the weight- and input-gradient checks and the attention
    backward's, full and tier 1, are on /metrics per op like the attention ops', and in the run's total."""
    from attnchecker.policy import WHOLE_STEP_OPS

    steps = 12
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = protect_streaming(model, opt, collector.url, collector.agent, "e2e-whole-step", tmp_path / "spool",
                              scope="all")
    train(model, opt, steps)
    guard.close(flush_timeout_s=10.0)
    report, name = guard.report(), guard.run
    checked = {op for op in WHOLE_STEP_OPS if report.checks.get(op)}
    assert {"linear_dx", "linear_dw", "grad_q", "grad_k", "grad_v", "grad_probs"} <= checked
    m = collector.metrics()
    for op, n in report.checks.items():
        assert m.value("attnchecker_checks_total", run=name, op=op) == n, op
        assert m.value("attnchecker_tier_checks_total", run=name, tier="abft", op=op) == n, op
    # Tier 1 on the steps the schedule left to it: the whole-step GEMMs' share is on the wire, per op.
    assert m.value("attnchecker_tier_checks_total", run=name, tier="tripwire") == report.tier_checks["tripwire"]
    assert m.value("attnchecker_tier_checks_total", run=name, tier="tripwire", op="linear_dw") > 0
    assert m.value("attnchecker_check_period_steps", run=name, op="linear_dw") == \
        m.value("attnchecker_check_period_steps", run=name, op="out")
    assert collector.run(guard.transport.run_id)["totals"]["checks"] == sum(report.checks.values())


def test_collector_killed_and_restarted_mid_run(collector: Collector, tmp_path: Path) -> None:
    steps, hang_at, kill_at, restart_at = 40, 8, 14, 20
    fault_steps = [2, 5, 11, 13, 16, 19, 21, 24, 33]  # before, during and after the outage
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # A request in flight to the hung collector waits its read timeout (5 s): on the sender thread, never in a step.
    guard = protect_streaming(model, opt, collector.url, collector.agent, "e2e-outage", tmp_path / "spool",
                              policy=Policy.full(), faults=plan(fault_steps),
                              transport_options={**FAST, "read_timeout_s": 5.0})
    collector.set_policy(guard, period=1, adaptive=False)

    def outage(step: int) -> None:
        if step == hang_at:
            collector.hang()  # first it hangs: a request in flight waits for its read timeout (2 s)...
        elif step == kill_at:
            collector.kill()  # ... then it dies
        elif step == restart_at:
            collector.restart()  # the same port and database, as a supervisor would bring it back

    run = train(model, opt, steps, before_step=outage)
    guard.close(flush_timeout_s=15.0)

    # No step waited on the hung collector: every request to it went from the sender thread, none from a step.
    assert run.network_elsewhere > 0 and run.network_in_steps == [], run.network_in_steps
    t = guard.transport
    assert t.spooled > 0, "the outage was not noticed (nothing spooled)"
    assert t.dropped == 0
    assert len(guard.detections) == len(fault_steps)
    assert_collector_agrees(collector, guard, steps)  # 0 lost, 0 duplicated


def test_collector_unreachable_for_the_whole_run_then_sync(collector: Collector, tmp_path: Path) -> None:
    steps, fault_steps = 10, [1, 2, 5, 7, 9]
    spool = tmp_path / "spool"
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dead = "http://127.0.0.1:9"  # discard port: nothing listens, connections are refused
    guard = protect_streaming(model, opt, dead, collector.agent, "e2e-offline", spool, policy=Policy.full(),
                              faults=plan(fault_steps))
    train(model, opt, steps)
    guard.close(flush_timeout_s=3.0)
    assert guard.report().steps == steps
    assert len(guard.detections) == len(fault_steps)

    records = [json.loads(line) for f in sorted(spool.glob("*.jsonl")) for line in f.read_text().splitlines()]
    spooled_ids = [e["id"] for r in records if r["kind"] == "events" for e in r["body"]["events"]]
    assert sorted(spooled_ids) == sorted(d.id for d in guard.detections)
    assert sum(r["body"]["steps"] for r in records if r["kind"] == "stats") == steps
    assert [r["body"] for r in records if r["kind"] == "finish"] == [{"rank": 0, "last_step": steps - 1}]

    sync = [sys.executable, "-m", "attnchecker.cli", "sync", str(spool), "--collector", collector.url,
            "--token", collector.agent]
    first = subprocess.run(sync, check=False, capture_output=True, text=True, timeout=60)
    assert first.returncode == 0, first.stderr
    run = collector.run_by_name("e2e-offline")
    events = collector.events(run["id"])
    assert sorted(e["id"] for e in events) == sorted(d.id for d in guard.detections)
    assert run["status"] == "finished" and run["last_step"] == steps - 1
    assert run["totals"]["detected"] == len(fault_steps) and run["totals"]["corrected"] == len(fault_steps)
    assert run["model"] == "TinyLM"

    second = subprocess.run(sync, check=False, capture_output=True, text=True, timeout=60)
    assert second.returncode == 0, second.stderr
    assert '"requests": 0' in second.stdout, second.stdout
    assert len(collector.events(run["id"])) == len(fault_steps)
    assert collector.run(run["id"])["totals"]["detected"] == len(fault_steps)
