"""Issue 5 acceptance: the policy over REST while training runs, per-op check periods, and the adaptive scheduler,
end to end (a real collector; what is checked is read from the stats the agent sends, one interval per step).
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from e2e_helpers import VOCAB, Collector, protect_streaming, tiny_model, wait_until

from attnchecker import Fault, FaultPlan, Policy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180), pytest.mark.usefixtures("single_thread")]

OPS = ("q", "k", "v", "scores", "context", "out")
LAYERS = 2


def one_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(step))
    logits = model(ids)
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)).backward()
    opt.step()  # the guard's step boundary runs in the optimizer's post hook
    opt.zero_grad(set_to_none=True)


def checked_steps(intervals: list[dict], op: str) -> list[int]:
    """The steps on which ``op`` was verified, from 1-step stats intervals (every layer checks it once)."""
    out = []
    for body in intervals:
        assert body["steps"] == 1 and body["step_start"] == body["step_end"]
        (row,) = [o for o in body["ops"] if o["op"] == op]
        assert row["checks"] in (0, LAYERS), row
        if row["checks"]:
            out.append(body["step_start"])
    return out


def due_steps(last_checked: int, period: int, first: int, last: int) -> list[int]:
    """docs/wire.md: an op is checked on step s when s - last_checked >= period."""
    out = []
    for s in range(first, last + 1):
        if s - last_checked >= period:
            out.append(s)
            last_checked = s
    return out


def test_policy_change_over_rest_is_applied_within_a_step_and_periods_decide_the_checks(
        collector: Collector, tmp_path: Path) -> None:
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = protect_streaming(model, opt, collector.url, collector.agent, "e2e-policy", tmp_path / "spool",
                              policy=Policy.full())
    t = guard.transport
    # The policy given to protect() is the new run's version 1 on the collector, set by the agent's token.
    assert wait_until(lambda: t.latest_policy() is not None), "the run never registered"
    assert t.latest_policy().version == 1
    history = collector.api("GET", f"/runs/{t.run_id}/policy/history").json()["data"]
    assert [(h["version"], h["actor"]) for h in history] == [(1, "e2e-agent")]
    assert history[0]["policy"] == {k: v for k, v in Policy.full().to_wire().items() if k != "version"}
    v_full = collector.set_policy(guard, period=1, adaptive=False)
    step = 0
    for _ in range(4):
        one_step(model, opt, step)
        step += 1
    assert guard.policy.version == v_full

    # The operator's change: base period 2, scores pinned at 3. PATCH, as the demo's curl does.
    r = collector.api("PATCH", f"/runs/{t.run_id}/policy", json={"period": 2, "op_periods": {"scores": 3}},
                      headers={"If-Match": f'"{v_full}"'})
    assert r.status_code == 200, r.text
    v_new = r.json()["version"]
    applied_at = None
    deadline = time.monotonic() + 20
    while applied_at is None:
        assert time.monotonic() < deadline, "the change was never polled"
        polled = t.latest_policy().version == v_new  # the sender thread has it before this step's boundary
        one_step(model, opt, step)
        if polled:
            assert guard.policy.version == v_new, "not applied at the first step boundary after the poll"
            applied_at = step
        elif guard.policy.version == v_new:
            applied_at = step  # the poll landed during this step; applied at its boundary all the same
        step += 1
    for _ in range(12):
        one_step(model, opt, step)
        step += 1
    last = step - 1
    assert guard.periods == {**dict.fromkeys(OPS, 2), "scores": 3}
    guard.close(flush_timeout_s=10.0)

    intervals = guard.intervals
    assert [b["step_start"] for b in intervals] == list(range(step))
    # Before the change every op was checked on every step; from the next step on, each op follows its period,
    # counted from its last check (the boundary step itself).
    for op in OPS:
        period = 3 if op == "scores" else 2
        assert checked_steps(intervals, op) == list(range(applied_at + 1)) + due_steps(
            applied_at, period, applied_at + 1, last), op
    for body in intervals:
        version = v_new if body["step_end"] >= applied_at else v_full
        assert body["applied_policy_version"] == version, body["step_end"]
        periods = {o["op"]: o["period"] for o in body["ops"]}
        if body["step_end"] >= applied_at:
            assert periods == {**dict.fromkeys(OPS, 2), "scores": 3}

    run = collector.run(t.run_id)
    assert run["requested_policy_version"] == v_new and run["applied_policy_version"] == v_new
    m = collector.metrics()
    assert m.value("attnchecker_policy_applied_version", run="e2e-policy") == v_new
    assert m.value("attnchecker_policy_requested_version", run="e2e-policy") == v_new
    assert m.value("attnchecker_check_period_steps", run="e2e-policy", op="scores") == 3
    assert m.value("attnchecker_check_period_steps", run="e2e-policy", op="q") == 2
    report = guard.report()
    for op in OPS:
        assert m.value("attnchecker_checks_total", run="e2e-policy", op=op) == report.checks[op]


# docs/adaptive.md with Q = 8 quiet checks, min 1, max 8: period 1 on steps 0-7, 2 from the end of step 7 (checks
# at 9, 11, ..., 23), 4 from the end of step 23 (checks at 27, 31, ...). A burst in q, scores and context at step 27
# (a checked step) puts those at period 1 at the end of that step; the other ops stay at 4. Then 8 quiet checks at
# period 1 (28-35) double it to 2, 8 more (37, 39, ..., 51) to 4.
BURST = 27
STEPS = 54
# (op, layer, kind). Not scores and context in the same layer: repairing scores recomputes that layer's context,
# which washes out a transient context fault before it is checked.
BURST_FAULTS = [("scores", 0, "inf"), ("q", 1, "nan"), ("context", 1, "near_inf")]
AFFECTED = ("q", "scores", "context")


def expected_period(op: str, step: int) -> int:
    """The period in force after the boundary of ``step``."""
    if op in AFFECTED and step >= BURST:
        return 1 if step < 35 else 2 if step < 51 else 4
    return 1 if step < 7 else 2 if step < 23 else 4


def test_adaptive_periods_snap_down_on_a_burst_and_relax_on_quiet_steps(collector: Collector, tmp_path: Path) -> None:
    burst = FaultPlan([Fault(op=op, layer=layer, step=BURST, kind=kind, seed=7 + i)
                       for i, (op, layer, kind) in enumerate(BURST_FAULTS)])
    # The overhead budget at its maximum, so that only faults and quiet checks move the periods (deterministic).
    adaptive = {"adaptive": True, "period": 1, "min_period": 1, "max_period": 8, "overhead_budget": 1.0}
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = protect_streaming(model, opt, collector.url, collector.agent, "e2e-adaptive", tmp_path / "spool",
                              policy=Policy(**adaptive), faults=burst)
    collector.set_policy(guard, **adaptive)
    seen = []
    for step in range(STEPS):
        one_step(model, opt, step)
        seen.append(dict(guard.periods))
    guard.close(flush_timeout_s=10.0)

    for step, periods in enumerate(seen):
        assert periods == {op: expected_period(op, step) for op in OPS}, step
    assert sorted((d.op, d.layer, d.step) for d in guard.detections) == sorted(
        (op, layer, BURST) for op, layer, _ in BURST_FAULTS)

    intervals = guard.intervals
    for body in intervals:
        assert {o["op"]: o["period"] for o in body["ops"]} == seen[body["step_end"]]
    for op in OPS:
        last, want = -(10**9), []
        for step in range(STEPS):
            if step - last >= (expected_period(op, step - 1) if step else 1):
                want.append(step)
                last = step
        assert checked_steps(intervals, op) == want, op
    assert 27 in checked_steps(intervals, "scores") and 28 in checked_steps(intervals, "scores")
    assert 28 not in checked_steps(intervals, "k")

    run = collector.run(guard.transport.run_id)
    assert run["totals"]["detected"] == 3 and run["totals"]["corrected"] == 3
    m = collector.metrics()
    assert m.value("attnchecker_check_period_steps", run="e2e-adaptive", op="scores") == 4
    assert wait_until(lambda: collector.run(guard.transport.run_id)["status"] == "finished", 5.0)
