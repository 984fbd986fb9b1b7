"""attnchecker.runtime.streaming.IntervalStats: steps summed into stats intervals, sent by steps or by time, whichever first."""
from __future__ import annotations

import pytest
import torch

from attnchecker.checks.context import OPS, RESIDUAL_RATIO_BUCKETS, OpStats
from attnchecker.runtime.streaming import IntervalStats

PERIODS = dict.fromkeys(OPS, 1)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def step_stats(checks: int = 1, faults: dict | None = None, worst: list[float] | None = None) -> OpStats:
    s = OpStats()
    for op in OPS:
        s.checks[op] = checks
        s.check_seconds[op] = 0.001 * checks
    for (op, kind), action in (faults or {}).items():
        s.add_fault(op, kind, action)
    for w in worst or []:  # what the engine does per clean check, on the device
        s.ratios.add(torch.tensor(w))
    return s


def test_sends_every_n_steps_with_deltas_and_step_range() -> None:
    sent: list[dict] = []
    clock = Clock()
    iv = IntervalStats(sent.append, rank=3, interval_s=60.0, interval_steps=2, clock=clock)
    for step in range(5):
        faults = {("scores", "inf"): "corrected"} if step == 1 else None
        iv.add(step, step_stats(faults=faults), 0.1)
        iv.maybe_send(applied_policy_version=4, periods=PERIODS)
    assert [(b["step_start"], b["step_end"], b["steps"]) for b in sent] == [(0, 1, 2), (2, 3, 2)]
    first = sent[0]
    assert first["rank"] == 3 and first["applied_policy_version"] == 4
    assert first["step_seconds"] == pytest.approx(0.2)
    assert first["check_seconds"] == pytest.approx(0.012)
    assert {o["op"]: (o["checks"], o["period"]) for o in first["ops"]} == dict.fromkeys(OPS, (2, 1))
    assert first["faults"] == [{"op": "scores", "kind": "inf", "detected": 1, "corrected": 1, "uncorrectable": 0}]
    assert sent[1]["faults"] == []  # deltas: the interval starts from zero
    assert iv.pending_steps == 1
    assert iv.maybe_send(applied_policy_version=4, periods=PERIODS, force=True)  # close: the rest goes out
    assert (sent[2]["step_start"], sent[2]["step_end"], sent[2]["steps"]) == (4, 4, 1)
    assert not iv.maybe_send(applied_policy_version=4, periods=PERIODS, force=True)  # nothing left
    assert list(iv.sent) == sent


def test_sends_by_time_when_steps_are_slow() -> None:
    sent: list[dict] = []
    clock = Clock()
    iv = IntervalStats(sent.append, interval_s=1.0, interval_steps=100, clock=clock)
    iv.add(0, step_stats(), 0.4)
    clock.now = 0.5
    assert not iv.maybe_send(applied_policy_version=1, periods=PERIODS)
    iv.add(1, step_stats(), 0.6)
    clock.now = 1.0
    assert iv.maybe_send(applied_policy_version=1, periods=PERIODS)
    assert sent[0]["steps"] == 2


def test_residual_histogram_is_summed_on_the_device_and_copied_once() -> None:
    sent: list[dict] = []
    iv = IntervalStats(sent.append, interval_steps=2)
    iv.add(0, step_stats(worst=[0.0005, 0.05]), 0.1)
    iv.add(1, step_stats(worst=[0.05, 2000.0]), 0.1)
    iv.maybe_send(applied_policy_version=0, periods=PERIODS)
    hist = sent[0]["residual_ratio"]
    assert hist["le"] == list(RESIDUAL_RATIO_BUCKETS)
    assert hist["counts"] == [1, 0, 2, 0, 0, 0, 0, 1] and len(hist["counts"]) == len(hist["le"]) + 1
    assert hist["count"] == 4 and hist["sum"] == pytest.approx(2000.1005)


def test_a_partial_step_counts_in_the_totals_not_in_steps() -> None:
    sent: list[dict] = []
    iv = IntervalStats(sent.append, interval_steps=10)
    iv.add(0, step_stats(), 0.1)
    iv.add(1, step_stats(faults={("q", "nan"): "uncorrectable"}), 0.0, count_step=False)
    iv.maybe_send(applied_policy_version=0, periods=PERIODS, force=True)
    (body,) = sent
    assert (body["step_start"], body["step_end"], body["steps"]) == (0, 1, 1)
    assert body["faults"] == [{"op": "q", "kind": "nan", "detected": 1, "corrected": 0, "uncorrectable": 1}]
    assert "residual_ratio" not in body  # no clean check recorded a residual


@pytest.mark.parametrize("kwargs", [{"interval_s": 0}, {"interval_steps": 0}, {"interval_steps": 1.5}])
def test_rejects_bad_intervals(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="stats_interval"):
        IntervalStats(lambda _: None, **kwargs)


def test_a_failing_emit_costs_the_interval_not_the_step() -> None:
    def broken(_: dict) -> None:
        raise RuntimeError("transport bug")

    iv = IntervalStats(broken, interval_steps=1)
    iv.add(0, step_stats(), 0.1)
    assert not iv.maybe_send(applied_policy_version=0, periods=PERIODS)
    assert iv.pending_steps == 0


def test_a_whole_step_op_gets_a_row_of_its_own_only_in_intervals_it_was_active() -> None:
    """protect(scope="all")'s ops (issue 17): their checks, tier-1 checks and catches get a row each, with the period
    of the schedule they follow; an interval where one did nothing sends no row for it, so an attention-scope run's
    payload is what it always was."""
    from attnchecker.policy import WHOLE_STEP_OPS, WHOLE_STEP_SCHEDULE

    sent: list[dict] = []
    iv = IntervalStats(sent.append, interval_steps=2)
    periods = {**PERIODS, WHOLE_STEP_SCHEDULE: 4}
    full, quiet = step_stats(), step_stats()
    full.checks["linear_dw"] = 3
    full.check_seconds["linear_dw"] = 0.03
    full.add_fault("linear_dw", "inf", "corrected")
    quiet.trip_checks["linear"] = 5
    quiet.add_fault("linear", "nan", "corrected", tier="tripwire")
    iv.add(0, full, 0.1)
    iv.add(1, quiet, 0.1)
    iv.maybe_send(applied_policy_version=1, periods=periods)
    rows = {o["op"]: o for o in sent[0]["ops"]}
    assert [o["op"] for o in sent[0]["ops"]] == [*OPS, "linear", "linear_dw"]  # the vocabulary's order
    assert set(WHOLE_STEP_OPS) >= {"linear", "linear_dw"}
    assert (rows["linear_dw"]["checks"], rows["linear_dw"]["abft_catches"], rows["linear_dw"]["period"]) == (3, 1, 4)
    assert (rows["linear"]["checks"], rows["linear"]["tripwire_checks"], rows["linear"]["tripwire_catches"]) == (0, 5, 1)
    assert rows["linear"]["period"] == 4
    assert sent[0]["check_seconds"] == pytest.approx(2 * 0.006 + 0.03)
    iv.add(2, step_stats(), 0.1)
    iv.add(3, step_stats(), 0.1)
    iv.maybe_send(applied_policy_version=1, periods=periods)
    assert [o["op"] for o in sent[1]["ops"]] == list(OPS)
