"""The fleet as operators read it: every device with its totals and its suspicion (suspicion.py over the whole
fleet's counters), most suspect first; one device with its runs, recent events and status history; a run's ranks."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from ..models import Device, DeviceFaultCounter, DeviceRun, DeviceStatusRevision, FaultEvent, Run, RunRank
from ..schemas import (
    DeviceDetailPublic,
    DeviceFaultsPublic,
    DevicePublic,
    DeviceRunPublic,
    DevicesPublic,
    DeviceStatusRevisionPublic,
    DeviceTotals,
    FleetPublic,
    RankPublic,
    SuspicionPublic,
)
from ..suspicion import DeviceCounts, Verdict, assess
from .devices import require_device
from .events import event_public
from .runs import require_run

__all__ = [
    "FleetView",
    "SuspicionSettings",
    "device_detail",
    "device_summary",
    "fleet_view",
    "list_devices",
    "run_ranks",
]

DETAIL_RUNS = 200
DETAIL_EVENTS = 200


@dataclass(frozen=True, slots=True)
class SuspicionSettings:
    alpha: float
    min_fault_runs: int


@dataclass(frozen=True, slots=True)
class FleetView:
    verdicts: dict[str, Verdict]
    fleet: FleetPublic


def fleet_view(session: Session, settings: SuspicionSettings) -> FleetView:
    """Every device's verdict, from one read of the device totals (a row per device)."""
    rows = session.execute(select(Device.uuid, Device.checks, Device.detected, Device.fault_runs, Device.runs)).all()
    counts = [DeviceCounts(uuid, int(checks), int(detected), int(fault_runs), int(runs))
              for uuid, checks, detected, fault_runs, runs in rows]
    verdicts = assess(counts, alpha=settings.alpha, min_fault_runs=settings.min_fault_runs)
    tested = [c for c in counts if c.checks > 0]
    fleet = FleetPublic(devices=len(tested), checks=sum(c.checks for c in tested),
                        detected=sum(c.faults for c in tested), alpha=settings.alpha,
                        min_fault_runs=settings.min_fault_runs)
    return FleetView(verdicts, fleet)


def _suspicion(verdict: Verdict) -> SuspicionPublic:
    return SuspicionPublic(score=verdict.score, significant=verdict.significant, p_value=verdict.p_value,
                           expected=verdict.expected, reason=verdict.reason)


def _public(device: Device, verdict: Verdict, faults: list[DeviceFaultCounter]) -> DevicePublic:
    return DevicePublic(
        uuid=device.uuid,
        hostname=device.hostname,
        kind=device.kind,
        name=device.name,
        pci_bus_id=device.pci_bus_id,
        serial=device.serial,
        first_seen_at=device.first_seen_at,
        last_seen_at=device.last_seen_at,
        status=device.status,  # type: ignore[arg-type]
        status_version=device.status_version,
        status_reason=device.status_reason,
        status_by=device.status_by,
        status_at=device.status_at,
        totals=DeviceTotals(checks=device.checks, detected=device.detected, corrected=device.corrected,
                            uncorrectable=device.uncorrectable, runs=device.runs, fault_runs=device.fault_runs),
        faults=[DeviceFaultsPublic(kind=f.kind, detected=f.detected, corrected=f.corrected,  # type: ignore[arg-type]
                                   uncorrectable=f.uncorrectable) for f in sorted(faults, key=lambda f: f.kind)],
        suspicion=_suspicion(verdict),
    )


def suspicion_order(device: Device, verdict: Verdict) -> tuple[int, float, int, str]:
    """Most suspect first: significant devices, then by score (-log10 p), then by faults; uuid breaks ties."""
    return (-int(verdict.significant), -verdict.score, -device.detected, device.uuid)


def list_devices(
    session: Session, settings: SuspicionSettings, *, status: str | None, hostname: str | None,
    significant: bool | None, limit: int,
) -> DevicesPublic:
    view = fleet_view(session, settings)
    stmt = select(Device)
    if status is not None:
        stmt = stmt.where(Device.status == status)
    if hostname is not None:
        stmt = stmt.where(Device.hostname == hostname)
    devices = [d for d in session.scalars(stmt)
               if significant is None or view.verdicts[d.uuid].significant == significant]
    devices.sort(key=lambda d: suspicion_order(d, view.verdicts[d.uuid]))
    page = devices[:limit]
    faults: dict[str, list[DeviceFaultCounter]] = {}
    if page:
        for row in session.scalars(
            select(DeviceFaultCounter).where(DeviceFaultCounter.device_uuid.in_([d.uuid for d in page]))
        ):
            faults.setdefault(row.device_uuid, []).append(row)
    items = [_public(d, view.verdicts[d.uuid], faults.get(d.uuid, [])) for d in page]
    return DevicesPublic(items=items, total=len(devices), fleet=view.fleet)


def device_summary(session: Session, settings: SuspicionSettings, uuid: str) -> DevicePublic:
    """One device as the list shows it (404 when unknown)."""
    device = require_device(session, uuid)
    faults = list(session.scalars(select(DeviceFaultCounter).where(DeviceFaultCounter.device_uuid == uuid)))
    return _public(device, fleet_view(session, settings).verdicts[uuid], faults)


def device_detail(session: Session, settings: SuspicionSettings, uuid: str) -> DeviceDetailPublic:
    base = device_summary(session, settings, uuid)
    runs = session.execute(
        select(DeviceRun, Run.name)
        .join(Run, Run.id == DeviceRun.run_id)
        .where(DeviceRun.device_uuid == uuid)
        .order_by(DeviceRun.last_seen_at.desc(), DeviceRun.run_id)
        .limit(DETAIL_RUNS)
    ).all()
    events = session.scalars(
        select(FaultEvent).where(FaultEvent.device_uuid == uuid).order_by(FaultEvent.ts.desc(), FaultEvent.id)
        .limit(DETAIL_EVENTS)
    )
    history = session.scalars(
        select(DeviceStatusRevision).where(DeviceStatusRevision.device_uuid == uuid)
        .order_by(DeviceStatusRevision.version)
    )
    return DeviceDetailPublic(
        **base.model_dump(),
        runs=[DeviceRunPublic(run_id=r.run_id, run_name=name, rank=r.rank, checks=r.checks, detected=r.detected,
                              uncorrectable=r.uncorrectable, first_seen_at=r.first_seen_at,
                              last_seen_at=r.last_seen_at) for r, name in runs],
        events=[event_public(e) for e in events],
        history=[DeviceStatusRevisionPublic(version=h.version, status=h.status, reason=h.reason,  # type: ignore[arg-type]
                                            actor=h.actor, changed_at=h.changed_at) for h in history],
    )


def run_ranks(session: Session, run_id: str) -> list[RankPublic]:
    require_run(session, run_id)
    rows = session.execute(
        select(RunRank, Device.status).join(Device, Device.uuid == RunRank.device_uuid)
        .where(RunRank.run_id == run_id).order_by(RunRank.rank)
    ).all()
    return [
        RankPublic(rank=r.rank, hostname=r.hostname, local_rank=r.local_rank, device_uuid=r.device_uuid,
                   device_status=status, registered_at=r.registered_at,  # type: ignore[arg-type]
                   applied_policy_version=r.applied_policy_version,
                   applied_policy_scope=r.applied_policy_scope)  # type: ignore[arg-type]
        for r, status in rows
    ]
