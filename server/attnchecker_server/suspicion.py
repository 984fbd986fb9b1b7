"""Which devices fault more often than the fleet's rate predicts (docs/collector.md, "Suspicion"). Pure: counts in,
verdicts out; no database, no clock.

The test, per device i with n_i checks and x_i faults, among the m devices with checks (N checks, X faults in all):
under the null hypothesis every device faults at one common (unknown) rate per check, so given the fleet's X faults,
device i's share is Binomial(X, n_i / N). Its one-sided p-value is P(Binomial(X, n_i / N) >= x_i). Conditioning on X
makes the test exact whatever the common rate is: no rate is estimated, so a small fleet or a rare fault gives no
false confidence. Holm's step-down over the m devices keeps the chance that a fleet without excess flags any device
at or below ``alpha``, under any dependence between devices.

A device is **significant** when its excess survives Holm's correction and it faulted in at least
``min_fault_runs`` different runs: one run's burst of faults (a bad batch, a software bug of that job) is not what a
defective device does; faults that follow the device from job to job are.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["DeviceCounts", "Verdict", "assess", "binomial_upper_tail_log"]

_CF_MAX_ITERATIONS = 10_000
_CF_EPS = 1e-15
_TINY = 1e-300


@dataclass(frozen=True, slots=True)
class DeviceCounts:
    key: str
    checks: int
    """Op calls checked on the device (its exposure)."""
    faults: int
    """Faults detected on it."""
    fault_runs: int = 0
    """Distinct runs in which it detected at least one fault."""
    runs: int = 0
    """Distinct runs it took part in (reported in the reason only)."""


@dataclass(frozen=True, slots=True)
class Verdict:
    score: float
    """-log10 of the p-value: 0 for a device at or below the fleet's rate, 2 for p = 0.01, and so on."""
    p_value: float
    """One-sided; 1.0 when the device has no more faults than expected."""
    expected: float
    """Faults the fleet's rate predicts for the device's checks (X * n_i / N)."""
    threshold: float | None
    """Holm's threshold at the device's rank, alpha / (m - rank); None when the device was not tested."""
    excess: bool
    """The excess survives Holm's correction."""
    significant: bool
    """excess, and faults in at least min_fault_runs runs."""
    reason: str


def _log_betacf(a: float, b: float, x: float) -> float:
    """log of the continued fraction of the incomplete beta function (modified Lentz), for x < (a + 1) / (a + b + 2)."""
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > _TINY else _TINY)
    h = d
    for m in range(1, _CF_MAX_ITERATIONS + 1):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > _TINY else _TINY)
        c = 1.0 + aa / c
        c = c if abs(c) > _TINY else _TINY
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > _TINY else _TINY)
        c = 1.0 + aa / c
        c = c if abs(c) > _TINY else _TINY
        step = d * c
        h *= step
        if abs(step - 1.0) < _CF_EPS:
            return math.log(h)
    raise ArithmeticError(f"incomplete beta continued fraction did not converge for a={a}, b={b}, x={x}")


def _log_betainc(a: float, b: float, x: float) -> float:
    """log of the regularised incomplete beta function I_x(a, b), a, b > 0, 0 < x < 1. In logs, so that the p-value
    of a device far above the fleet's rate (1e-400 and below) keeps its score instead of underflowing to 0."""
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return log_front + _log_betacf(a, b, x) - math.log(a)
    # The other tail converges here: I_x(a, b) = 1 - I_{1-x}(b, a). It is not small on this side (x is past the
    # mode), so the subtraction loses nothing that matters.
    other = math.exp(log_front + _log_betacf(b, a, 1.0 - x) - math.log(b))
    return math.log1p(-min(other, 1.0)) if other < 1.0 else -math.inf


def binomial_upper_tail_log(k: int, n: int, p: float) -> float:
    """log P(Binomial(n, p) >= k), exactly as the regularised incomplete beta I_p(k, n - k + 1)."""
    if k <= 0:
        return 0.0
    if k > n or p <= 0.0:
        return -math.inf
    if p >= 1.0:
        return 0.0
    return min(0.0, _log_betainc(float(k), float(n - k + 1), p))


def _fmt(x: float) -> str:
    return f"{x:.3g}"


def assess(devices: Sequence[DeviceCounts], *, alpha: float = 0.01, min_fault_runs: int = 2) -> dict[str, Verdict]:
    """A verdict per device key. ``alpha``: the family-wise false-alarm rate of the excess test over the fleet
    (Holm); ``min_fault_runs``: how many distinct runs a significant device must have faulted in."""
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must lie in (0, 1), got {alpha!r}")
    if min_fault_runs < 1:
        raise ValueError(f"min_fault_runs must be >= 1, got {min_fault_runs!r}")
    tested = [d for d in devices if d.checks > 0]
    m = len(tested)
    total_checks = sum(d.checks for d in tested)
    total_faults = sum(d.faults for d in tested)
    out: dict[str, Verdict] = {}
    for d in devices:
        if d.checks <= 0:
            out[d.key] = Verdict(0.0, 1.0, 0.0, None, False, False, "no checks counted yet: nothing to test")
    if m < 2:
        for d in tested:
            out[d.key] = Verdict(0.0, 1.0, float(d.faults), None, False, False,
                                 f"{d.faults} faults; the fleet has no other device with checks to compare it with")
        return out

    log_p: dict[str, float] = {}
    expected: dict[str, float] = {}
    for d in tested:
        share = d.checks / total_checks
        expected[d.key] = total_faults * share
        # A device at or below its expected count has p >= 1/2 (a binomial's median is at least floor(mean)): it can
        # never be rejected at alpha < 1/2, so it is reported as 1 instead of computed.
        log_p[d.key] = binomial_upper_tail_log(d.faults, total_faults, share) if d.faults > expected[d.key] else 0.0

    # Holm's step-down: the j-th smallest p-value (j from 0) is rejected when it and every smaller one is at most
    # alpha / (m - j). Ties are ordered by key, so the verdicts do not depend on the input's order.
    ordered = sorted(tested, key=lambda d: (log_p[d.key], d.key))
    rejecting = True
    log_alpha = math.log(alpha)
    for j, d in enumerate(ordered):
        threshold_log = log_alpha - math.log(m - j)
        rejecting = rejecting and log_p[d.key] <= threshold_log
        out[d.key] = _verdict(d, log_p[d.key], expected[d.key], math.exp(threshold_log), rejecting, m,
                              min_fault_runs)
    return out


def _verdict(d: DeviceCounts, log_p: float, expected: float, threshold: float, excess: bool, m: int,
             min_fault_runs: int) -> Verdict:
    p_value = math.exp(log_p)
    score = 0.0 if log_p >= 0.0 else -log_p / math.log(10.0)
    what = f"{d.faults} faults where the fleet's rate predicts {_fmt(expected)} for its {d.checks} checks"
    if log_p >= 0.0:
        return Verdict(0.0, 1.0, expected, threshold, False, False,
                       f"{d.faults} faults, at or below the {_fmt(expected)} the fleet's rate predicts for its "
                       f"{d.checks} checks")
    test = f"p = {_fmt(p_value)}, Holm's threshold {_fmt(threshold)} over {m} devices"
    if not excess:
        return Verdict(score, p_value, expected, threshold, False, False, f"{what} ({test}): not significant")
    runs = f"in {d.fault_runs} of {d.runs} runs" if d.runs else f"in {d.fault_runs} runs"
    if d.fault_runs < min_fault_runs:
        return Verdict(score, p_value, expected, threshold, True, False,
                       f"{what} ({test}), but {runs}: not significant until it faults in {min_fault_runs} runs")
    return Verdict(score, p_value, expected, threshold, True, True, f"{what}, {runs} ({test}): significant")
