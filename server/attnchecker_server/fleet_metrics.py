"""Per-device series for /metrics, labelled as dcgm-exporter labels its GPU series (``Hostname``, ``UUID``), so that
PromQL joins them ``on (UUID)`` with its XID, ECC and row-remap series. Bounded: only devices seen within
``recent_seconds``, at most ``max_devices`` of them (most recently seen first). Read by metrics.DbCollector in its
scrape session; the suspicion is the API's (services.fleet), over the whole fleet's totals."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from .models import Device, DeviceFaultCounter, utcnow
from .schemas import DEVICE_STATUSES
from .services.fleet import SuspicionSettings, fleet_view

__all__ = ["DEVICE_LABELS", "FleetMetricsConfig", "device_families"]

DEVICE_LABELS = ["Hostname", "UUID"]
"""dcgm-exporter's label names for a GPU's host and uuid (its UUID values read "GPU-…", as ours do)."""


@dataclass(frozen=True, slots=True)
class FleetMetricsConfig:
    recent_seconds: float = 86400.0
    max_devices: int = 2000
    suspicion: SuspicionSettings = field(default_factory=lambda: SuspicionSettings(alpha=0.01, min_fault_runs=2))


def _recent_devices(session: Session, config: FleetMetricsConfig) -> tuple[list[Device], int]:
    cutoff = utcnow() - timedelta(seconds=config.recent_seconds)
    recent = Device.last_seen_at >= cutoff
    devices = list(session.scalars(
        select(Device).where(recent).order_by(Device.last_seen_at.desc(), Device.uuid).limit(config.max_devices)
    ))
    omitted = 0
    if len(devices) == config.max_devices:
        omitted = int(session.scalar(select(func.count()).select_from(Device).where(recent)) or 0) - len(devices)
    return devices, omitted


def device_families(session: Session, config: FleetMetricsConfig) -> list[Metric]:
    devices, omitted = _recent_devices(session, config)
    checks = CounterMetricFamily("attnchecker_device_checks", "Op calls checked on the device, every run, by either "
                                 "tier (its exposure).", labels=DEVICE_LABELS)
    faults = CounterMetricFamily(
        "attnchecker_device_faults",
        "Faults detected on the device, every run, by kind and what became of them: corrected (from the checksums "
        "or by recompute), uncorrectable, or detected (reported and left in place, mode detect).",
        labels=[*DEVICE_LABELS, "kind", "action"],
    )
    suspect = GaugeMetricFamily(
        "attnchecker_device_suspect",
        "1 when the device's faults are significantly above the fleet's rate for its checks (docs/collector.md, "
        "Suspicion), else 0.", labels=DEVICE_LABELS)
    score = GaugeMetricFamily("attnchecker_device_suspicion_score",
                              "-log10 of the p-value of the device's faults against the fleet's rate (0: at or "
                              "below it).", labels=DEVICE_LABELS)
    status = GaugeMetricFamily("attnchecker_device_status",
                               "1 for the status an operator set on the device (ok, suspect, quarantined).",
                               labels=[*DEVICE_LABELS, "status"])
    families: list[Metric] = [checks, faults, suspect, score, status]
    families.append(GaugeMetricFamily(
        "attnchecker_metrics_devices_omitted",
        "Devices seen within metrics_device_recent_seconds left out by metrics_max_devices.", value=omitted))
    if not devices:
        return families
    verdicts = fleet_view(session, config.suspicion).verdicts
    by_device: dict[str, list[DeviceFaultCounter]] = {}
    for row in session.scalars(
        select(DeviceFaultCounter).where(DeviceFaultCounter.device_uuid.in_([d.uuid for d in devices]))
    ):
        by_device.setdefault(row.device_uuid, []).append(row)
    for device in devices:
        labels = [device.hostname, device.uuid]
        checks.add_metric(labels, device.checks)
        for row in sorted(by_device.get(device.uuid, []), key=lambda r: r.kind):
            # The three outcomes partition the detections (corrected counts recomputed ones, as the stats do).
            left = max(0, row.detected - row.corrected - row.uncorrectable)
            for action, value in (("corrected", row.corrected), ("uncorrectable", row.uncorrectable),
                                  ("detected", left)):
                faults.add_metric([*labels, row.kind, action], value)
        verdict = verdicts[device.uuid]
        suspect.add_metric(labels, 1.0 if verdict.significant else 0.0)
        score.add_metric(labels, verdict.score)
        if device.status in DEVICE_STATUSES:
            status.add_metric([*labels, device.status], 1.0)
    return families
