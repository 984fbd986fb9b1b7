"""Prometheus metrics: run metrics read from the database at scrape time, and this process's ingest metrics.

Names, types and labels are the table in docs/wire.md; tests/dashboards reads METRIC_NAMES from here.
"""

import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString
from sqlalchemy import or_, select
from sqlalchemy.orm import Session, sessionmaker

from .models import Policy, Run, RunFaultCounter, RunOpCounter, RunResidualBucket, RunTierCounter, utcnow

__all__ = ["METRIC_NAMES", "DbCollector", "IngestMetrics"]

# name -> (type, labels); the wire contract's table.
METRIC_NAMES: dict[str, tuple[str, tuple[str, ...]]] = {
    "attnchecker_checks_total": ("counter", ("run", "op")),
    "attnchecker_tier_checks_total": ("counter", ("run", "tier", "op")),
    "attnchecker_tier_catches_total": ("counter", ("run", "tier", "op")),
    "attnchecker_faults_detected_total": ("counter", ("run", "op", "kind")),
    "attnchecker_faults_corrected_total": ("counter", ("run", "op", "kind")),
    "attnchecker_faults_uncorrectable_total": ("counter", ("run", "op", "kind")),
    "attnchecker_check_seconds_total": ("counter", ("run",)),
    "attnchecker_step_seconds_total": ("counter", ("run",)),
    "attnchecker_steps_total": ("counter", ("run",)),
    "attnchecker_overhead_budget_ratio": ("gauge", ("run",)),
    "attnchecker_checksum_residual_ratio": ("histogram", ("run",)),
    "attnchecker_policy_requested_version": ("gauge", ("run",)),
    "attnchecker_policy_applied_version": ("gauge", ("run",)),
    "attnchecker_check_period_steps": ("gauge", ("run", "op")),
    "attnchecker_run_live": ("gauge", ("run",)),
    "attnchecker_run_last_seen_timestamp_seconds": ("gauge", ("run",)),
    "attnchecker_run_last_step": ("gauge", ("run",)),
    "attnchecker_agent_events_sent_total": ("counter", ("run",)),
    "attnchecker_agent_events_spooled_total": ("counter", ("run",)),
    "attnchecker_agent_events_dropped_total": ("counter", ("run",)),
    "attnchecker_coverage_ops": ("gauge", ("run", "state")),
    "attnchecker_ingest_events_total": ("counter", ()),
    "attnchecker_ingest_requests_total": ("counter", ("endpoint", "status")),
    "attnchecker_ingest_request_duration_seconds": ("histogram", ("endpoint",)),
}


def _strip_total(name: str) -> str:
    # CounterMetricFamily appends _total itself.
    return name.removesuffix("_total")


class DbCollector(Collector):
    """Scrape-time collector over the run tables, cached for cache_seconds with at most one refresh in flight."""

    def __init__(
        self,
        session_factory: sessionmaker[Session],
        *,
        recent_seconds: float,
        cache_seconds: float,
        max_runs: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._session_factory = session_factory
        self._recent = timedelta(seconds=recent_seconds)
        self._cache_seconds = cache_seconds
        self._max_runs = max_runs
        self._clock = clock
        self._lock = threading.Lock()
        self._cached: list[Metric] | None = None
        self._cached_at = -math.inf

    def describe(self) -> Iterable[Metric]:
        # Empty: registering must not query the database (auto-describe would call collect()).
        return []

    def collect(self) -> Iterable[Metric]:
        cached = self._cached
        if cached is not None and self._clock() - self._cached_at < self._cache_seconds:
            return cached
        # At most one refresh in flight. Scrapes arriving meanwhile get the previous result if there is one (a slow
        # database must not pile up queries), else wait for the refresh and share it.
        if not self._lock.acquire(blocking=cached is None):
            return cached  # type: ignore[return-value]
        try:
            if self._cached is None or self._clock() - self._cached_at >= self._cache_seconds:
                self._cached = list(self._read())
                self._cached_at = self._clock()
            return self._cached
        finally:
            self._lock.release()

    def invalidate(self) -> None:
        self._cached_at = -math.inf

    def _read(self) -> Iterator[Metric]:
        with self._session_factory() as session:
            cutoff = utcnow() - self._recent
            runs = list(
                session.scalars(
                    select(Run)
                    .where(or_(Run.status == "running", Run.last_seen_at >= cutoff))
                    .order_by(Run.last_seen_at.desc())
                    .limit(self._max_runs)
                )
            )
            names = {run.id: run.name for run in runs}
            ids = list(names)
            op_rows = session.scalars(select(RunOpCounter).where(RunOpCounter.run_id.in_(ids))).all() if ids else []
            fault_rows = (
                session.scalars(select(RunFaultCounter).where(RunFaultCounter.run_id.in_(ids))).all() if ids else []
            )
            bucket_rows = (
                session.scalars(select(RunResidualBucket).where(RunResidualBucket.run_id.in_(ids))).all() if ids else []
            )
            tier_rows = (
                session.scalars(select(RunTierCounter).where(RunTierCounter.run_id.in_(ids))).all() if ids else []
            )
            policies = {p.scope: p for p in session.scalars(select(Policy).where(Policy.scope.in_(ids)))} if ids else {}

        def counter(name: str, doc: str, labels: list[str]) -> CounterMetricFamily:
            return CounterMetricFamily(_strip_total(name), doc, labels=labels)

        checks = counter("attnchecker_checks_total", "Protected op calls checked.", ["run", "op"])
        period = GaugeMetricFamily(
            "attnchecker_check_period_steps",
            "Check period per op the agent last reported, in steps.",
            labels=["run", "op"],
        )
        for row in op_rows:
            checks.add_metric([names[row.run_id], row.op], row.checks)
            if row.period is not None:
                period.add_metric([names[row.run_id], row.op], row.period)

        detected = counter("attnchecker_faults_detected_total", "Faults detected.", ["run", "op", "kind"])
        corrected = counter(
            "attnchecker_faults_corrected_total",
            "Faults corrected (from checksums or by recompute).",
            ["run", "op", "kind"],
        )
        uncorrectable = counter(
            "attnchecker_faults_uncorrectable_total", "Faults still wrong after recompute.", ["run", "op", "kind"]
        )
        for fault in fault_rows:
            labels = [names[fault.run_id], fault.op, fault.kind]
            detected.add_metric(labels, fault.detected)
            corrected.add_metric(labels, fault.corrected)
            uncorrectable.add_metric(labels, fault.uncorrectable)

        per_run: list[tuple[str, str, str, Callable[[Run], float | None]]] = [
            ("counter", "attnchecker_check_seconds_total", "Time spent checking.", lambda r: r.check_seconds_total),
            ("counter", "attnchecker_step_seconds_total", "Training step time.", lambda r: r.step_seconds_total),
            ("counter", "attnchecker_steps_total", "Training steps reported.", lambda r: r.steps_total),
            (
                "gauge",
                "attnchecker_run_live",
                "1 while the run is running, 0 once finished.",
                lambda r: 1.0 if r.status == "running" else 0.0,
            ),
            (
                "gauge",
                "attnchecker_run_last_seen_timestamp_seconds",
                "Unix time the run was last heard from.",
                lambda r: r.last_seen_at.timestamp(),
            ),
            ("gauge", "attnchecker_run_last_step", "Highest step reported.", lambda r: r.last_step),
            (
                "gauge",
                "attnchecker_policy_applied_version",
                "Policy version the agent reports applied.",
                lambda r: r.applied_policy_version,
            ),
            ("counter", "attnchecker_agent_events_sent_total", "Events the agent sent.", lambda r: r.events_sent_total),
            (
                "counter",
                "attnchecker_agent_events_spooled_total",
                "Events the agent spooled to disk.",
                lambda r: r.events_spooled_total,
            ),
            (
                "counter",
                "attnchecker_agent_events_dropped_total",
                "Events the agent dropped.",
                lambda r: r.events_dropped_total,
            ),
        ]
        tier_checks = counter("attnchecker_tier_checks_total", "Checks per protection tier (tripwire, abft, "
                              "optimizer).", ["run", "tier", "op"])
        tier_catches = counter("attnchecker_tier_catches_total", "Faults caught per protection tier.",
                               ["run", "tier", "op"])
        for tier_row in tier_rows:
            labels = [names[tier_row.run_id], tier_row.tier, tier_row.op]
            tier_checks.add_metric(labels, tier_row.checks)
            tier_catches.add_metric(labels, tier_row.catches)

        families: list[Metric] = [checks, detected, corrected, uncorrectable, tier_checks, tier_catches]
        for kind, name, doc, value_of in per_run:
            family: Metric = (
                counter(name, doc, ["run"]) if kind == "counter" else GaugeMetricFamily(name, doc, labels=["run"])
            )
            for run in runs:
                value = value_of(run)
                if value is not None:
                    family.add_metric([run.name], float(value))  # type: ignore[attr-defined]
            families.append(family)

        requested = GaugeMetricFamily(
            "attnchecker_policy_requested_version", "Current policy version on the collector.", labels=["run"]
        )
        budget = GaugeMetricFamily(
            "attnchecker_overhead_budget_ratio", "Policy's allowed check-time / step-time ratio.", labels=["run"]
        )
        for run in runs:
            policy = policies.get(run.id)
            if policy is not None:
                requested.add_metric([run.name], policy.version)
                budget.add_metric([run.name], float(policy.body.get("overhead_budget", 0.0)))
        families += [requested, budget, period, _coverage(runs)]

        residual = HistogramMetricFamily(
            "attnchecker_checksum_residual_ratio", "Worst |d1| / bound of each clean check.", labels=["run"]
        )
        buckets: dict[str, list[tuple[float, int]]] = {}
        for bucket in bucket_rows:
            buckets.setdefault(bucket.run_id, []).append((float(bucket.le), bucket.count))
        for run in runs:
            if run.id not in buckets:
                continue
            cumulative, rows = 0, sorted(buckets[run.id])
            series = []
            for le, count in rows:
                cumulative += count
                series.append((floatToGoString(le), cumulative))  # type: ignore[no-untyped-call]
            if not math.isinf(rows[-1][0]):
                series.append(("+Inf", cumulative))
            residual.add_metric([run.name], series, sum_value=run.residual_sum)
        families.append(residual)
        return iter(families)


def _coverage(runs: list[Run]) -> GaugeMetricFamily:
    """Attention ops protected / left unprotected, from the coverage map the agent registered (config.coverage,
    docs/wire.md). The config is free-form JSON: anything but a non-negative integer count is skipped."""
    family = GaugeMetricFamily(
        "attnchecker_coverage_ops",
        "Attention ops (per layer and op) the agent protects, and leaves unprotected, as registered.",
        labels=["run", "state"],
    )
    for run in runs:
        coverage = run.config.get("coverage") if isinstance(run.config, dict) else None
        if not isinstance(coverage, dict):
            continue
        for state in ("protected", "unprotected"):
            count = coverage.get(state)
            if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
                family.add_metric([run.name, state], float(count))
    return family


class IngestMetrics:
    """This process's ingest counters and latency, in a per-app registry."""

    ENDPOINTS = ("register", "finish", "events", "stats")

    def __init__(self, registry: CollectorRegistry) -> None:
        self.events = Counter("attnchecker_ingest_events", "Fault events stored by this process.", registry=registry)
        self.requests = Counter(
            "attnchecker_ingest_requests",
            "Ingest requests answered by this process.",
            ["endpoint", "status"],
            registry=registry,
        )
        self.duration = Histogram(
            "attnchecker_ingest_request_duration_seconds",
            "Ingest request latency in this process.",
            ["endpoint"],
            registry=registry,
        )
