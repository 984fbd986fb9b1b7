"""The suspicion statistic on its own (attnchecker_server.suspicion, docs/collector.md "Suspicion"): the binomial tail
against exact sums, a fleet without excess flags no more often than the stated false-alarm rate, a device at ten
times the fleet's rate is found and ranked first, and one run's burst is not enough."""

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from attnchecker_server.suspicion import DeviceCounts, assess, binomial_upper_tail_log

PROPERTY = settings(derandomize=True, deadline=None, database=None)


def _exact_tail(k: int, n: int, p: float) -> float:
    return math.fsum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k, n + 1))


@PROPERTY
@given(n=st.integers(1, 400), data=st.data(), p=st.floats(1e-4, 1 - 1e-4))
def test_binomial_tail_matches_the_exact_sum(n: int, data: st.DataObject, p: float) -> None:
    k = data.draw(st.integers(0, n))
    exact = _exact_tail(k, n, p)
    if exact > 1e-200:  # below that the reference sum itself loses digits to underflow
        assert math.isclose(math.exp(binomial_upper_tail_log(k, n, p)), exact, rel_tol=1e-9)


def test_binomial_tail_keeps_its_score_far_below_double_underflow() -> None:
    # 900 faults where 10 are expected: p ~ 1e-1660, far below the smallest double; the score stays finite.
    assert -binomial_upper_tail_log(900, 1000, 0.01) / math.log(10) > 1600


def _simulate(rng: np.random.Generator, checks: np.ndarray, rates: np.ndarray, runs: int) -> list[DeviceCounts]:
    """Each device's faults in each of `runs` runs: Poisson(checks/runs * rate)."""
    per_run = rng.poisson(np.outer(checks / runs, np.ones(runs)) * rates[:, None])
    return [DeviceCounts(f"d{i}", int(checks[i]), int(per_run[i].sum()), int((per_run[i] > 0).sum()), runs)
            for i in range(len(checks))]


@settings(derandomize=True, deadline=None, database=None, max_examples=12)
@given(m=st.integers(2, 64), rate=st.floats(1e-6, 1e-3), spread=st.floats(1.0, 100.0), seed=st.integers(0, 2**32 - 1))
def test_a_fleet_without_excess_flags_a_device_at_most_at_the_stated_rate(m: int, rate: float, spread: float,
                                                                        seed: int) -> None:
    """300 fleets with one common rate and checks that differ up to `spread` times between devices: the fraction
    with any device flagged stays within alpha plus three binomial standard errors (Holm controls the family-wise
    error; the conditional test is exact, so only discreteness makes it conservative)."""
    rng = np.random.default_rng(seed)
    alpha, fleets = 0.05, 300
    flagged = 0
    for _ in range(fleets):
        checks = rng.integers(10_000, int(10_000 * spread) + 1, size=m)
        devices = _simulate(rng, checks, np.full(m, rate), runs=4)
        flagged += any(v.excess for v in assess(devices, alpha=alpha, min_fault_runs=1).values())
    assert flagged / fleets <= alpha + 3 * math.sqrt(alpha * (1 - alpha) / fleets)


@settings(derandomize=True, deadline=None, database=None, max_examples=20)
@given(m=st.integers(4, 64), healthy_faults=st.floats(3.0, 30.0), runs=st.integers(2, 6),
       seed=st.integers(0, 2**32 - 1))
def test_a_device_at_ten_times_the_fleet_rate_is_found_and_ranked_first(m: int, healthy_faults: float, runs: int,
                                                                        seed: int) -> None:
    rng = np.random.default_rng(seed)
    checks = rng.integers(50_000, 150_001, size=m)
    rates = np.full(m, healthy_faults / 100_000)
    bad = int(rng.integers(m))
    rates[bad] *= 10
    devices = _simulate(rng, checks, rates, runs)
    verdicts = assess(devices, alpha=0.01, min_fault_runs=2)
    assert verdicts[f"d{bad}"].significant, verdicts[f"d{bad}"].reason
    ranked = sorted(devices, key=lambda d: (-verdicts[d.key].score, d.key))
    assert ranked[0].key == f"d{bad}"


def test_one_runs_burst_is_an_excess_but_not_significant() -> None:
    fleet = [DeviceCounts(f"d{i}", 100_000, 5, 3, 4) for i in range(8)]
    fleet.append(DeviceCounts("burst", 100_000, 60, 1, 4))
    verdict = assess(fleet, alpha=0.01, min_fault_runs=2)["burst"]
    assert verdict.excess and not verdict.significant
    assert "in 1 of 4 runs" in verdict.reason and "faults in 2 runs" in verdict.reason
    assert assess(fleet, alpha=0.01, min_fault_runs=1)["burst"].significant


def test_without_checks_or_without_a_fleet_nothing_is_significant() -> None:
    lone = assess([DeviceCounts("a", 1000, 500, 5, 5)])
    assert not lone["a"].significant and "no other device" in lone["a"].reason
    quiet = assess([DeviceCounts("a", 0, 3, 1, 1), DeviceCounts("b", 10, 0, 0, 1), DeviceCounts("c", 10, 0, 0, 1)])
    assert not quiet["a"].significant and "no checks" in quiet["a"].reason
    assert all(v.p_value == 1.0 and v.score == 0.0 for v in quiet.values())
