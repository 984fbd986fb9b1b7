"""Devices: the fleet list (most suspect first), one device, its status for the agent on it, an operator's verdict
(PATCH with If-Match), and a run's ranks."""

from datetime import timedelta
from typing import Annotated

from fastapi import APIRouter, Path, Query, Response
from fastapi.responses import JSONResponse

from ..auth import Principal
from ..config import Settings
from ..schemas import (
    DeviceDetailPublic,
    DevicePublic,
    DevicesPublic,
    DeviceStatus,
    DeviceStatusPublic,
    DeviceStatusUpdate,
    RanksPublic,
)
from ..services import devices as device_service
from ..services import fleet
from ..services.quota import LiveRunQuota
from .deps import OPERATOR, POLICY_READ, READ, SessionDep, StateDep
from .etags import IfMatch, if_match_version
from .responses import errors

__all__ = ["live_run_quota", "router", "suspicion_settings"]

router = APIRouter(tags=["devices"])

# What a rank may send as its uuid (schemas.DeviceIdentityIn): anything else names no device.
DeviceUuid = Annotated[str, Path(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")]


def suspicion_settings(settings: Settings) -> fleet.SuspicionSettings:
    return fleet.SuspicionSettings(alpha=settings.suspicion_alpha, min_fault_runs=settings.suspicion_min_fault_runs)


def live_run_quota(settings: Settings) -> LiveRunQuota:
    return LiveRunQuota(limit=settings.max_live_runs_per_token,
                        abandoned_after=timedelta(seconds=settings.run_abandoned_seconds))


@router.get("/api/v1/devices", response_model=DevicesPublic, responses=errors(403))
def list_devices(
    session: SessionDep,
    state: StateDep,
    _: Annotated[Principal, READ],
    status: DeviceStatus | None = None,
    hostname: Annotated[str | None, Query(max_length=253, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")] = None,
    significant: bool | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> DevicesPublic:
    return fleet.list_devices(session, suspicion_settings(state.settings), status=status, hostname=hostname,
                              significant=significant, limit=limit)


@router.get("/api/v1/devices/{uuid}", response_model=DeviceDetailPublic, responses=errors(403, 404))
def get_device(uuid: DeviceUuid, session: SessionDep, state: StateDep, _: Annotated[Principal, READ]) -> JSONResponse:
    detail = fleet.device_detail(session, suspicion_settings(state.settings), uuid)
    return JSONResponse(detail.model_dump(mode="json"), headers={"ETag": f'"{detail.status_version}"'})


@router.get("/api/v1/devices/{uuid}/status", response_model=DeviceStatusPublic, responses=errors(403, 404))
def get_device_status(
    uuid: DeviceUuid, session: SessionDep, _: Annotated[Principal, POLICY_READ]
) -> DeviceStatusPublic:
    """What an agent asks at protect() about the device it runs on (agent tokens may read this, not the fleet)."""
    return device_service.device_status(session, uuid)


@router.patch("/api/v1/devices/{uuid}", response_model=DevicePublic, responses=errors(403, 404, 412, 413))
def patch_device(
    uuid: DeviceUuid,
    update_in: DeviceStatusUpdate,
    session: SessionDep,
    state: StateDep,
    principal: Annotated[Principal, OPERATOR],
    if_match: IfMatch = None,  # type: ignore[assignment]
) -> Response:
    device_service.change_status(session, uuid=uuid, update_in=update_in, actor=principal.name,
                                 if_match=if_match_version(if_match))
    session.commit()
    public = fleet.device_summary(session, suspicion_settings(state.settings), uuid)
    return JSONResponse(public.model_dump(mode="json"), headers={"ETag": f'"{public.status_version}"'})


@router.get("/api/v1/runs/{run_id}/ranks", response_model=RanksPublic, responses=errors(403, 404))
def get_run_ranks(run_id: str, session: SessionDep, _: Annotated[Principal, READ]) -> RanksPublic:
    return RanksPublic(data=fleet.run_ranks(session, run_id))
