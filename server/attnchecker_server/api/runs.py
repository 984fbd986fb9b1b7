"""Runs: register/resume, finish, list, get; and the two ingest endpoints that hang off a run."""

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Response
from fastapi.exceptions import RequestValidationError

from ..auth import Principal
from ..schemas import (
    DeviceStatusPublic,
    EventBatchIn,
    EventBatchResult,
    RunFinishIn,
    RunPublic,
    RunRegistered,
    RunRegisterIn,
    RunsPublic,
    StatsIn,
    StatsResult,
)
from ..services import ingest, runs
from ..services.policy import to_public
from .deps import AGENT_WRITE, READ, SessionDep, StateDep
from .devices import live_run_quota
from .responses import errors

__all__ = ["router"]

router = APIRouter(prefix="/api/v1/runs", tags=["runs"])


@router.post(
    "",
    response_model=RunRegistered,
    status_code=201,
    responses={200: {"model": RunRegistered}, **errors(403, 413, 429)},
)
def register_run(
    run_in: RunRegisterIn,
    response: Response,
    session: SessionDep,
    state: StateDep,
    principal: Annotated[Principal, AGENT_WRITE],
) -> RunRegistered:
    reg = runs.register_run(session, run_in=run_in, principal=principal, quota=live_run_quota(state.settings))
    device = reg.device
    result = RunRegistered(
        id=reg.run.id,
        name=reg.run.name,
        created=reg.created,
        status="running",
        policy=to_public(reg.policy),
        policy_scope=reg.scope,  # type: ignore[arg-type]
        device=DeviceStatusPublic(uuid=device.uuid, status=device.status, reason=device.status_reason)  # type: ignore[arg-type]
        if device is not None
        else None,
    )
    session.commit()
    response.status_code = 201 if reg.created else 200
    return result


@router.post("/{run_id}/finish", response_model=RunPublic, responses=errors(403, 404, 413))
def finish_run(
    run_id: str, finish_in: RunFinishIn, session: SessionDep, principal: Annotated[Principal, AGENT_WRITE]
) -> RunPublic:
    run = runs.finish_run(session, run_id=run_id, finish_in=finish_in, principal=principal)
    result = runs.run_public(session, run)
    session.commit()
    return result


@router.get("", response_model=RunsPublic, responses=errors(403))
def list_runs(
    session: SessionDep,
    _: Annotated[Principal, READ],
    status: Literal["running", "finished"] | None = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: Annotated[str | None, Query(max_length=512)] = None,
) -> RunsPublic:
    data, next_cursor = runs.list_runs(session, status=status, limit=limit, cursor=cursor)
    return RunsPublic(data=data, next_cursor=next_cursor)


@router.get("/{run_id}", response_model=RunPublic, responses=errors(403, 404))
def get_run(run_id: str, session: SessionDep, _: Annotated[Principal, READ]) -> RunPublic:
    return runs.get_run(session, run_id=run_id)


@router.post("/{run_id}/events:batch", response_model=EventBatchResult, responses=errors(403, 404, 413))
def post_events(
    run_id: str,
    batch: EventBatchIn,
    session: SessionDep,
    state: StateDep,
    principal: Annotated[Principal, AGENT_WRITE],
) -> EventBatchResult:
    limit = state.settings.max_events_per_batch
    if len(batch.events) > limit:
        raise RequestValidationError(
            [
                {
                    "loc": ("body", "events"),
                    "msg": f"{len(batch.events)} events in one batch; the limit is {limit} "
                    "(ATTNCHECKER_MAX_EVENTS_PER_BATCH): split the batch",
                    "type": "too_long",
                }
            ]
        )
    result = ingest.ingest_events(session, run_id=run_id, batch=batch, principal=principal)
    session.commit()
    state.ingest.events.inc(result.accepted)
    return result


@router.post("/{run_id}/stats", response_model=StatsResult, responses=errors(403, 404, 413))
def post_stats(
    run_id: str, stats: StatsIn, session: SessionDep, principal: Annotated[Principal, AGENT_WRITE]
) -> StatsResult:
    result = ingest.ingest_stats(session, run_id=run_id, stats=stats, principal=principal)
    session.commit()
    return result
