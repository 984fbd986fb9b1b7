"""Liveness, readiness (database reachable and at the Alembic head) and the Prometheus endpoint."""

from typing import Annotated

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

from ..auth import Principal
from ..errors import RETRY_AFTER_SECONDS
from ..migrate import current_revisions, head_revisions
from .deps import READ, StateDep

__all__ = ["router"]

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"description": "database unreachable or not migrated"}})
def readyz(state: StateDep) -> JSONResponse:
    try:
        with state.session_factory() as session:
            session.execute(text("SELECT 1"))
            current = current_revisions(session.connection())
    except SQLAlchemyError as exc:
        return JSONResponse(
            {"status": "unavailable", "detail": f"database unreachable: {exc.__class__.__name__}"},
            503,
            headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
        )
    heads = head_revisions()
    if current != heads:
        return JSONResponse(
            {
                "status": "unavailable",
                "detail": f"database at revision {sorted(current) or 'none'}, code expects {sorted(heads)}: "
                "run `attnchecker-server migrate`",
            },
            503,
            headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
        )
    return JSONResponse({"status": "ready", "revision": sorted(heads)})


def metrics_route(registry: CollectorRegistry) -> APIRouter:
    metrics_router = APIRouter()

    # A plain def route: it runs in the threadpool (collect() queries the DB) and answers /metrics itself,
    # unlike a mounted ASGI app, which redirects /metrics to /metrics/ with a 307.
    @metrics_router.get("/metrics", include_in_schema=False)
    def metrics(_: Annotated[Principal, READ]) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return metrics_router
