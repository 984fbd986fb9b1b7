"""Devices: the identity each rank registers, the attribution of its intervals (and, in ingest.py, its events) to
that device, per-device totals across runs, and the operator's status with its history (docs/collector.md)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, cast

from sqlalchemy import CursorResult, func, select, update
from sqlalchemy.orm import Session

from ..bounds import BIGINT_MAX
from ..errors import NotFound, PreconditionFailed
from ..models import Device, DeviceFaultCounter, DeviceRun, DeviceStatusRevision, RunRank, utcnow
from ..schemas import DeviceIdentityIn, DeviceStatusPublic, DeviceStatusUpdate, StatsIn
from .sql import saturating_add, upsert_insert

__all__ = [
    "SUSPECT_STATUSES",
    "attribute_interval",
    "change_status",
    "device_status",
    "rank_devices",
    "register_identity",
    "require_device",
]

SUSPECT_STATUSES = ("suspect", "quarantined")
"""Statuses whose ranks follow the suspect-device policy."""


def require_device(session: Session, uuid: str) -> Device:
    device = session.get(Device, uuid)
    if device is None:
        raise NotFound(f"device {uuid!r} not found: no rank has registered it (GET /api/v1/devices lists them)")
    return device


def device_status(session: Session, uuid: str) -> DeviceStatusPublic:
    device = require_device(session, uuid)
    return DeviceStatusPublic(uuid=device.uuid, status=device.status, reason=device.status_reason)  # type: ignore[arg-type]


def register_identity(session: Session, *, run_id: str, rank: int, identity: DeviceIdentityIn, now: datetime) -> Device:
    """The rank's device (created on first sight, its description refreshed), (run, rank) -> device, and the device's
    entry for this run (``runs`` counts each run once)."""
    ins = upsert_insert(session, Device).values(
        uuid=identity.uuid, hostname=identity.hostname, kind=identity.kind, name=identity.name,
        pci_bus_id=identity.pci_bus_id, serial=identity.serial, first_seen_at=now, last_seen_at=now, status="ok",
        status_version=1, checks=0, detected=0, corrected=0, uncorrectable=0, runs=0, fault_runs=0,
    )
    session.execute(
        ins.on_conflict_do_update(
            index_elements=["uuid"],
            set_={
                "hostname": ins.excluded.hostname,
                "kind": ins.excluded.kind,
                # An agent without NVML sends no PCI id or serial: keep what another rank reported.
                "name": func.coalesce(ins.excluded.name, Device.name),
                "pci_bus_id": func.coalesce(ins.excluded.pci_bus_id, Device.pci_bus_id),
                "serial": func.coalesce(ins.excluded.serial, Device.serial),
                "last_seen_at": ins.excluded.last_seen_at,
            },
        )
    )
    rank_ins = upsert_insert(session, RunRank).values(
        run_id=run_id, rank=rank, device_uuid=identity.uuid, hostname=identity.hostname,
        local_rank=identity.local_rank, registered_at=now, applied_policy_version=None, applied_policy_scope=None,
    )
    session.execute(
        rank_ins.on_conflict_do_update(
            index_elements=["run_id", "rank"],
            # A rank that registers again (a restarted job, maybe on another machine) is who it says now; what it
            # applied before is unknown until its next interval.
            set_={"device_uuid": rank_ins.excluded.device_uuid, "hostname": rank_ins.excluded.hostname,
                  "local_rank": rank_ins.excluded.local_rank, "registered_at": rank_ins.excluded.registered_at,
                  "applied_policy_version": None, "applied_policy_scope": None},
        )
    )
    new_run = session.execute(
        upsert_insert(session, DeviceRun)
        .values(device_uuid=identity.uuid, run_id=run_id, rank=rank, checks=0, detected=0, uncorrectable=0,
                first_seen_at=now, last_seen_at=now)
        .on_conflict_do_nothing(index_elements=["device_uuid", "run_id"])
        .returning(DeviceRun.run_id)
    ).first()
    if new_run is not None:
        session.execute(
            update(Device).where(Device.uuid == identity.uuid).values(runs=Device.runs + 1)
            .execution_options(synchronize_session=False)
        )
    device = session.get(Device, identity.uuid, populate_existing=True)
    assert device is not None
    return device


def rank_devices(session: Session, run_id: str, ranks: set[int]) -> dict[int, str]:
    """rank -> device uuid for the given ranks of a run (those that registered an identity)."""
    if not ranks:
        return {}
    rows = session.execute(
        select(RunRank.rank, RunRank.device_uuid).where(RunRank.run_id == run_id, RunRank.rank.in_(sorted(ranks)))
    )
    return {int(rank): str(uuid) for rank, uuid in rows}


def _kind_rows(stats: StatsIn) -> list[tuple[str, int, int, int]]:
    by_kind: dict[str, list[int]] = {}
    for f in stats.faults:
        row = by_kind.setdefault(f.kind, [0, 0, 0])
        row[0] += f.detected
        row[1] += f.corrected
        row[2] += f.uncorrectable
    return sorted((kind, *row) for kind, row in by_kind.items() if any(row))  # type: ignore[misc]


def attribute_interval(session: Session, *, run_id: str, device_uuid: str, stats: StatsIn, now: datetime) -> None:
    """Adds an interval's deltas to its rank's device (``rank_devices``) and records the policy the rank applied.
    Device totals saturate at 2^63 - 1 instead of overflowing: they add up many runs, and a run's own headroom check
    (ingest._check_headroom) cannot see the other runs."""
    if stats.applied_policy_version is not None:
        session.execute(
            update(RunRank)
            .where(RunRank.run_id == run_id, RunRank.rank == stats.rank)
            .values(applied_policy_version=stats.applied_policy_version,
                    applied_policy_scope=stats.applied_policy_scope)
            .execution_options(synchronize_session=False)
        )
    checks = sum(op.checks + op.tripwire_checks for op in stats.ops)
    kinds = _kind_rows(stats)
    detected = sum(row[1] for row in kinds)
    corrected = sum(row[2] for row in kinds)
    uncorrectable = sum(row[3] for row in kinds)
    # Locks in one order for every interval: device_run, device, device_fault_counter (the run row comes last, in
    # ingest_stats), so two intervals of one rank posted at once cannot deadlock.
    ins = upsert_insert(session, DeviceRun).values(
        device_uuid=device_uuid, run_id=run_id, rank=stats.rank, checks=checks, detected=detected,
        uncorrectable=uncorrectable, first_seen_at=now, last_seen_at=now,
    )
    run_detected = session.execute(
        ins.on_conflict_do_update(
            index_elements=["device_uuid", "run_id"],
            set_={
                "checks": saturating_add(DeviceRun.checks, checks, BIGINT_MAX),
                "detected": saturating_add(DeviceRun.detected, detected, BIGINT_MAX),
                "uncorrectable": saturating_add(DeviceRun.uncorrectable, uncorrectable, BIGINT_MAX),
                "last_seen_at": ins.excluded.last_seen_at,
            },
        ).returning(DeviceRun.detected)
    ).scalar_one()
    # The run's first fault on this device: its count was 0 before this interval.
    first_fault_in_run = detected > 0 and int(run_detected) == detected
    session.execute(
        update(Device)
        .where(Device.uuid == device_uuid)
        .values(
            checks=saturating_add(Device.checks, checks, BIGINT_MAX),
            detected=saturating_add(Device.detected, detected, BIGINT_MAX),
            corrected=saturating_add(Device.corrected, corrected, BIGINT_MAX),
            uncorrectable=saturating_add(Device.uncorrectable, uncorrectable, BIGINT_MAX),
            fault_runs=Device.fault_runs + (1 if first_fault_in_run else 0),
            last_seen_at=now,
        )
        .execution_options(synchronize_session=False)
    )
    for kind, k_detected, k_corrected, k_uncorrectable in kinds:
        fins = upsert_insert(session, DeviceFaultCounter).values(
            device_uuid=device_uuid, kind=kind, detected=k_detected, corrected=k_corrected,
            uncorrectable=k_uncorrectable,
        )
        session.execute(
            fins.on_conflict_do_update(
                index_elements=["device_uuid", "kind"],
                set_={
                    "detected": saturating_add(DeviceFaultCounter.detected, k_detected, BIGINT_MAX),
                    "corrected": saturating_add(DeviceFaultCounter.corrected, k_corrected, BIGINT_MAX),
                    "uncorrectable": saturating_add(DeviceFaultCounter.uncorrectable, k_uncorrectable, BIGINT_MAX),
                },
            )
        )


def change_status(
    session: Session, *, uuid: str, update_in: DeviceStatusUpdate, actor: str, if_match: int | None
) -> Device:
    """An operator's status, compare-and-swap on ``status_version`` (412 when If-Match is stale or another writer won);
    every change is kept in the device's history with the actor."""
    device = require_device(session, uuid)
    current = device.status_version
    if if_match is not None and if_match != current:
        raise PreconditionFailed(
            f"If-Match version {if_match} is stale: device {uuid} is at version {current}; GET it again and retry "
            "with the new ETag"
        )
    now = utcnow()
    result = cast(
        CursorResult[Any],
        session.execute(
            update(Device)
            .where(Device.uuid == uuid, Device.status_version == current)
            .values(status=update_in.status, status_version=current + 1, status_reason=update_in.reason,
                    status_by=actor, status_at=now)
            .execution_options(synchronize_session=False)
        ),
    )
    if result.rowcount != 1:
        raise PreconditionFailed(f"device {uuid} changed under this request; GET it again and retry")
    session.add(DeviceStatusRevision(device_uuid=uuid, version=current + 1, status=update_in.status,
                                     reason=update_in.reason, actor=actor, changed_at=now))
    session.flush()
    changed = session.get(Device, uuid, populate_existing=True)
    assert changed is not None
    return changed
