"""The adaptive scheduler, deterministically: the rule of docs/adaptive.md, step by step."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnchecker.policy import OPS, Policy, Scheduler


def run(sched: Scheduler, steps, faults_at=None, overhead=None):
    """Drive the scheduler like the guard does; returns {step: due ops}."""
    faults_at = faults_at or {}
    seen = {}
    for s in steps:
        due = sched.due(s)
        seen[s] = due
        faults = {op: n for op, n in faults_at.get(s, {}).items() if op in due}
        sched.observe(s, checked=due, faults=faults, overhead_ratio=overhead)
    return seen


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_scheduler_fixed_period_checks_exactly_multiples(n):
    sched = Scheduler(Policy(period=n, adaptive=False))
    seen = run(sched, range(40))
    for op in OPS:
        assert [s for s, d in seen.items() if op in d] == list(range(0, 40, n))


def test_scheduler_pin_overrides_adaptive_and_base():
    sched = Scheduler(Policy(period=1, op_periods={"scores": 4}, adaptive=True))
    seen = run(sched, range(20), faults_at={4: {"scores": 3}})
    assert [s for s, d in seen.items() if "scores" in d] == [0, 4, 8, 12, 16]
    assert sched.periods()["scores"] == 4


def test_scheduler_pin_may_leave_adaptive_bounds():
    sched = Scheduler(Policy(op_periods={"q": 50}, max_period=8))
    assert sched.periods()["q"] == 50


def test_scheduler_burst_drops_affected_ops_to_min_within_one_step():
    sched = Scheduler(Policy(min_period=1, max_period=8), quiet_checks=2)
    run(sched, range(100))
    assert set(sched.periods().values()) == {8}
    step = 104  # periods are 8 and every op was last checked at 96
    due = sched.due(step)
    assert due == frozenset(OPS)
    sched.observe(step, checked=due, faults={"scores": 2, "context": 1})
    periods = sched.periods()
    assert periods["scores"] == periods["context"] == 1
    assert all(periods[op] == 8 for op in OPS if op not in ("scores", "context"))
    assert sched.due(step + 1) == {"scores", "context"}


def test_scheduler_quiet_checks_double_period_up_to_max():
    q = 3
    sched = Scheduler(Policy(min_period=1, max_period=8), quiet_checks=q)
    seen = run(sched, range(60))
    checks = [s for s, d in seen.items() if "v" in d]
    # q checks at period 1, q at 2, q at 4, then period 8 from there on.
    assert checks == [0, 1, 2, 4, 6, 8, 12, 16, 20, 28, 36, 44, 52]
    assert sched.periods()["v"] == 8


def test_scheduler_quiet_history_is_the_documented_default():
    # Default quiet_checks=8: from a fault to the max period takes 8 + 16 + 32 = 56 steps (docs/adaptive.md).
    sched = Scheduler(Policy())
    history = []
    for s in range(80):
        due = sched.due(s)
        sched.observe(s, checked=due, faults={})
        history.append(sched.periods()["q"])
    assert history[6] == 1 and history[7] == 2
    assert history[22] == 2 and history[23] == 4
    assert history[54] == 4 and history[55] == 8


def test_scheduler_fault_restarts_relaxation_and_unchecked_steps_are_not_quiet():
    sched = Scheduler(Policy(max_period=4), quiet_checks=2)
    seen = run(sched, range(14))
    assert [s for s, d in seen.items() if "k" in d] == [0, 1, 3, 5, 9, 13]
    assert sched.periods()["k"] == 4
    run(sched, [17], faults_at={17: {"k": 1}})
    assert sched.periods()["k"] == 1
    run(sched, [18])
    assert sched.periods()["k"] == 1  # one quiet check, needs two
    run(sched, [19])
    assert sched.periods()["k"] == 2


def test_scheduler_overhead_over_budget_lengthens_unpinned_quiet_ops():
    pol = Policy(max_period=8, overhead_budget=0.05, op_periods={"out": 1})
    sched = Scheduler(pol, quiet_checks=1000, overhead_window=4)
    run(sched, range(3), overhead=0.5)
    assert sched.periods()["q"] == 1  # window not full yet
    run(sched, [3], faults_at={3: {"scores": 1}}, overhead=0.5)
    p = sched.periods()
    assert p["q"] == 2 and p["out"] == 1  # the pin holds
    assert p["scores"] == 1  # recovering from a fault: safety over overhead
    run(sched, range(4, 8), overhead=0.01)
    assert sched.periods()["q"] == 2  # under budget: no change


def test_scheduler_overhead_never_exceeds_max_period():
    sched = Scheduler(Policy(max_period=4), quiet_checks=1000, overhead_window=1)
    run(sched, range(20), overhead=1.0)
    assert set(sched.periods().values()) == {4}


def test_scheduler_mode_off_checks_nothing_and_does_not_adapt():
    sched = Scheduler(Policy(mode="off"), quiet_checks=1)
    seen = run(sched, range(10))
    assert all(d == frozenset() for d in seen.values())
    assert set(sched.periods().values()) == {1}


def test_scheduler_adaptive_off_uses_base_period():
    sched = Scheduler(Policy(period=3, adaptive=False), quiet_checks=1)
    run(sched, range(10), faults_at={3: {"q": 1}}, overhead=1.0)
    assert set(sched.periods().values()) == {3}


def test_scheduler_set_policy_counts_new_period_from_last_check():
    sched = Scheduler(Policy(period=2, adaptive=False))
    run(sched, range(5))  # checked 0, 2, 4
    sched.set_policy(Policy(version=1, period=3, adaptive=False))
    seen = run(sched, range(5, 12))
    assert [s for s, d in seen.items() if "q" in d] == [7, 10]


def test_scheduler_set_policy_clamps_adaptive_periods_into_new_bounds():
    sched = Scheduler(Policy(max_period=8), quiet_checks=1)
    run(sched, range(30))
    assert sched.periods()["q"] == 8
    sched.set_policy(Policy(version=1, max_period=4))
    assert sched.periods()["q"] == 4
    sched.set_policy(Policy(version=2, min_period=2, max_period=4))
    assert sched.periods()["q"] == 4


def test_scheduler_set_policy_pin_then_unpin_restarts_from_base():
    sched = Scheduler(Policy(max_period=8), quiet_checks=1)
    run(sched, range(30))
    sched.set_policy(Policy(version=1, op_periods={"q": 2}))
    assert sched.periods()["q"] == 2 and sched.periods()["k"] == 8
    sched.set_policy(Policy(version=2))
    assert sched.periods()["q"] == 1 and sched.periods()["k"] == 8


def test_scheduler_set_policy_new_base_period_restarts_adaptation():
    sched = Scheduler(Policy(max_period=8), quiet_checks=1)
    run(sched, range(30))
    sched.set_policy(Policy(version=1, period=2))
    assert set(sched.periods().values()) == {2}


def test_scheduler_checks_at_once_when_the_step_goes_back():
    sched = Scheduler(Policy(period=5, adaptive=False))
    run(sched, range(12))  # last check at 10
    assert sched.due(3) == frozenset(OPS)


def test_scheduler_rejects_unknown_ops():
    sched = Scheduler(Policy())
    with pytest.raises(ValueError, match="unknown op.*attn"):
        sched.observe(0, checked=["attn"], faults={})


def test_scheduler_follows_the_example_in_docs_adaptive():
    sched = Scheduler(Policy())
    checked, found = [], None
    for s in range(120):
        due = sched.due(s)
        faults = {}
        if "scores" in due:
            checked.append(s)
            if s >= 100 and found is None:  # a persistent fault from step 100 on, found at the next check
                found, faults = s, {"scores": 1}
        sched.observe(s, checked=due, faults=faults)
    assert found == 103
    assert checked == [*range(8), *range(9, 24, 2), *range(27, 56, 4), 63, 71, 79, 87, 95, 103,
                       *range(104, 112), *range(113, 120, 2)]


@settings(max_examples=60, deadline=None)
@given(
    split=st.integers(0, 60),
    faults=st.dictionaries(st.integers(0, 99), st.sampled_from(OPS), max_size=6),
    overheads=st.lists(st.floats(0.0, 0.5), min_size=100, max_size=100),
    budget=st.sampled_from([0.02, 0.2]),
)
def test_a_schedule_saved_and_loaded_anywhere_decides_as_the_one_that_kept_going(split, faults, overheads, budget):
    """Run A goes 100 steps (faults in due ops, measured overheads, the overhead window filling and doubling periods);
    run B stops at ``split``, its state goes through JSON into a fresh scheduler, which goes on with the same outcomes:
    every later step due and every period are A's."""
    import json

    policy = Policy(overhead_budget=budget)

    def drive(sched, steps):
        seen = []
        for s in steps:
            due = sched.due(s)
            hit = faults.get(s)
            sched.observe(s, checked=due, faults={hit: 1} if hit in due else {}, overhead_ratio=overheads[s])
            seen.append((due, sched.periods()))
        return seen

    kept = Scheduler(policy)
    whole = drive(kept, range(100))
    first = Scheduler(policy)
    drive(first, range(split))
    resumed = Scheduler(policy)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())), step=split)
    assert drive(resumed, range(split, 100)) == whole[split:]
    assert resumed.state_dict() == kept.state_dict()
