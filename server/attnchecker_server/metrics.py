"""Prometheus metrics: run metrics read from the database at scrape time, and this process's ingest metrics.

Names, types and labels are the table in docs/wire.md; tests/dashboards reads METRIC_NAMES from here.
"""

import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString
from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session, sessionmaker

from .fleet_metrics import FleetMetricsConfig, device_families
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
    "attnchecker_metrics_runs_omitted": ("gauge", ()),
    # Per device (fleet_metrics.py): labelled as dcgm-exporter labels a GPU, so PromQL joins them on (UUID).
    "attnchecker_device_checks_total": ("counter", ("Hostname", "UUID")),
    "attnchecker_device_faults_total": ("counter", ("Hostname", "UUID", "kind", "action")),
    "attnchecker_device_suspect": ("gauge", ("Hostname", "UUID")),
    "attnchecker_device_suspicion_score": ("gauge", ("Hostname", "UUID")),
    "attnchecker_device_status": ("gauge", ("Hostname", "UUID", "status")),
    "attnchecker_metrics_devices_omitted": ("gauge", ()),
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
        abandoned_seconds: float = 86400.0,
        fleet: FleetMetricsConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._session_factory = session_factory
        self._recent = timedelta(seconds=recent_seconds)
        self._abandoned = timedelta(seconds=abandoned_seconds)
        self._fleet = fleet or FleetMetricsConfig()
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

    def _runs(self, session: Session) -> tuple[list[Run], int]:
        """Every live run, whatever the cap (a live run whose agent went quiet is exactly what "agent silent"
        watches), then the most recently seen finished runs in the room the cap leaves; and how many finished
        runs within recent_seconds did not fit. Live: running and heard from within abandoned_seconds; there are at
        most the agent tokens' quotas of them (services/quota.py), so the cap-free part stays bounded too."""
        now = utcnow()
        cutoff = now - self._recent
        fresh = Run.last_seen_at >= now - self._abandoned
        live = list(session.scalars(
            select(Run).where(Run.status == "running", fresh).order_by(Run.last_seen_at.desc())
        ))
        recent = (or_(Run.status != "running", ~fresh), Run.last_seen_at >= cutoff)
        room = max(0, self._max_runs - len(live))
        finished = list(session.scalars(select(Run).where(*recent).order_by(Run.last_seen_at.desc()).limit(room)))
        omitted = 0
        if len(finished) == room:
            omitted = int(session.scalar(select(func.count()).select_from(Run).where(*recent)) or 0) - room
        return live + finished, omitted

    def _read(self) -> Iterator[Metric]:
        snapshot = self._snapshot()
        with self._session_factory() as session:
            devices = device_families(session, self._fleet)
        names = {run.id: run.name for run in snapshot.runs}
        checks, period = _op_families(snapshot.op_rows, names)
        families: list[Metric] = [
            checks,
            *_fault_families(snapshot.fault_rows, names),
            *_tier_families(snapshot.tier_rows, names),
            *_run_families(snapshot.runs),
            *_policy_families(snapshot.runs, snapshot.policies),
            period,
            _coverage(snapshot.runs),
            _residual_family(snapshot.runs, snapshot.bucket_rows),
            GaugeMetricFamily(
                "attnchecker_metrics_runs_omitted",
                "Finished runs seen within metrics_recent_seconds left out by metrics_max_runs (live runs never are).",
                value=snapshot.omitted,
            ),
            *devices,
        ]
        return iter(families)

    def _snapshot(self) -> "_Snapshot":
        """Every row one refresh needs, read in one session (a few small queries)."""
        with self._session_factory() as session:
            runs, omitted = self._runs(session)
            ids = [run.id for run in runs]
            if not ids:
                return _Snapshot(runs, omitted, [], [], [], [], {})
            return _Snapshot(
                runs=runs,
                omitted=omitted,
                op_rows=list(session.scalars(select(RunOpCounter).where(RunOpCounter.run_id.in_(ids)))),
                fault_rows=list(session.scalars(select(RunFaultCounter).where(RunFaultCounter.run_id.in_(ids)))),
                bucket_rows=list(session.scalars(select(RunResidualBucket).where(RunResidualBucket.run_id.in_(ids)))),
                tier_rows=list(session.scalars(select(RunTierCounter).where(RunTierCounter.run_id.in_(ids)))),
                policies={p.scope: p for p in session.scalars(select(Policy).where(Policy.scope.in_(ids)))},
            )


@dataclass(frozen=True, slots=True)
class _Snapshot:
    runs: list[Run]
    omitted: int
    op_rows: list[RunOpCounter]
    fault_rows: list[RunFaultCounter]
    bucket_rows: list[RunResidualBucket]
    tier_rows: list[RunTierCounter]
    policies: dict[str, Policy]


def _counter(name: str, doc: str, labels: list[str]) -> CounterMetricFamily:
    return CounterMetricFamily(_strip_total(name), doc, labels=labels)


def _op_families(rows: list[RunOpCounter], names: dict[str, str]) -> tuple[Metric, Metric]:
    checks = _counter("attnchecker_checks_total", "Protected op calls checked.", ["run", "op"])
    period = GaugeMetricFamily(
        "attnchecker_check_period_steps",
        "Check period per op the agent last reported, in steps.",
        labels=["run", "op"],
    )
    for row in rows:
        checks.add_metric([names[row.run_id], row.op], row.checks)
        if row.period is not None:
            period.add_metric([names[row.run_id], row.op], row.period)
    return checks, period


def _fault_families(rows: list[RunFaultCounter], names: dict[str, str]) -> list[Metric]:
    detected = _counter("attnchecker_faults_detected_total", "Faults detected.", ["run", "op", "kind"])
    corrected = _counter(
        "attnchecker_faults_corrected_total",
        "Faults corrected (from checksums or by recompute).",
        ["run", "op", "kind"],
    )
    uncorrectable = _counter(
        "attnchecker_faults_uncorrectable_total", "Faults still wrong after recompute.", ["run", "op", "kind"]
    )
    for fault in rows:
        labels = [names[fault.run_id], fault.op, fault.kind]
        detected.add_metric(labels, fault.detected)
        corrected.add_metric(labels, fault.corrected)
        uncorrectable.add_metric(labels, fault.uncorrectable)
    return [detected, corrected, uncorrectable]


def _tier_families(rows: list[RunTierCounter], names: dict[str, str]) -> list[Metric]:
    checks = _counter("attnchecker_tier_checks_total", "Checks per protection tier (tripwire, abft, optimizer).",
                      ["run", "tier", "op"])
    catches = _counter("attnchecker_tier_catches_total", "Faults caught per protection tier.", ["run", "tier", "op"])
    for row in rows:
        labels = [names[row.run_id], row.tier, row.op]
        checks.add_metric(labels, row.checks)
        catches.add_metric(labels, row.catches)
    return [checks, catches]


# (type, name, help, value of a run; None: no sample) of every per-run family.
_PER_RUN: list[tuple[str, str, str, Callable[[Run], float | None]]] = [
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


def _run_families(runs: list[Run]) -> list[Metric]:
    families: list[Metric] = []
    for kind, name, doc, value_of in _PER_RUN:
        family: Metric = (
            _counter(name, doc, ["run"]) if kind == "counter" else GaugeMetricFamily(name, doc, labels=["run"])
        )
        for run in runs:
            value = value_of(run)
            if value is not None:
                family.add_metric([run.name], float(value))  # type: ignore[attr-defined]
        families.append(family)
    return families


def _policy_families(runs: list[Run], policies: dict[str, Policy]) -> list[Metric]:
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
    return [requested, budget]


def _residual_family(runs: list[Run], rows: list[RunResidualBucket]) -> Metric:
    """The agents' non-cumulative buckets (the union of their le values), made cumulative per run."""
    residual = HistogramMetricFamily(
        "attnchecker_checksum_residual_ratio", "Worst |d1| / bound of each clean check.", labels=["run"]
    )
    buckets: dict[str, list[tuple[float, int]]] = {}
    for bucket in rows:
        buckets.setdefault(bucket.run_id, []).append((float(bucket.le), bucket.count))
    for run in runs:
        if run.id not in buckets:
            continue
        cumulative, ordered = 0, sorted(buckets[run.id])
        series = []
        for le, count in ordered:
            cumulative += count
            series.append((floatToGoString(le), cumulative))  # type: ignore[no-untyped-call]
        if not math.isinf(ordered[-1][0]):
            series.append(("+Inf", cumulative))
        residual.add_metric([run.name], series, sum_value=run.residual_sum)
    return residual


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
