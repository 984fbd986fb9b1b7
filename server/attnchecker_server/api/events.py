"""The fault-event query."""

from typing import Annotated

from fastapi import APIRouter, Query

from ..auth import Principal
from ..schemas import Action, FaultEventsPublic, FaultOp, Kind
from ..services.events import EventFilters, query_events
from .deps import READ, SessionDep
from .responses import errors

__all__ = ["router"]

router = APIRouter(prefix="/api/v1/runs", tags=["events"])


@router.get("/{run_id}/events", response_model=FaultEventsPublic, responses=errors(403, 404))
def list_events(
    run_id: str,
    session: SessionDep,
    _principal: Annotated[Principal, READ],
    op: FaultOp | None = None,
    kind: Kind | None = None,
    layer: Annotated[int | None, Query(ge=0, le=2**31 - 1)] = None,
    rank: Annotated[int | None, Query(ge=0, le=2**31 - 1)] = None,
    action: Action | None = None,
    step_min: Annotated[int | None, Query(ge=0, le=2**31 - 1)] = None,
    step_max: Annotated[int | None, Query(ge=0, le=2**31 - 1)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    cursor: Annotated[str | None, Query(max_length=512)] = None,
) -> FaultEventsPublic:
    filters = EventFilters(
        op=op, kind=kind, layer=layer, rank=rank, action=action, step_min=step_min, step_max=step_max
    )
    data, next_cursor = query_events(session, run_id=run_id, filters=filters, limit=limit, cursor=cursor)
    return FaultEventsPublic(data=data, next_cursor=next_cursor)
