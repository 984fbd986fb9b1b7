"""Policy per run and the server default: GET (ETag, If-None-Match), PUT/PATCH (If-Match), history."""

from typing import Annotated, Any

from fastapi import APIRouter, Header, Response
from fastapi.responses import JSONResponse

from ..auth import Principal
from ..errors import PreconditionFailed
from ..schemas import PolicyHistoryPublic, PolicyIn, PolicyPublic, PolicyUpdate
from ..services import policy as service
from .deps import OPERATOR, POLICY_READ, READ, SessionDep
from .responses import errors

__all__ = ["router"]

router = APIRouter(tags=["policy"])

_NOT_MODIFIED: dict[int | str, dict[str, Any]] = {304: {"description": "If-None-Match equals the current version"}}
_RUN_READ = {**_NOT_MODIFIED, **errors(403, 404)}
_RUN_WRITE = errors(403, 404, 412, 413)
_DEFAULT_READ = {**_NOT_MODIFIED, **errors(403)}
_DEFAULT_WRITE = errors(403, 412, 413)


def _versions(header: str) -> list[str]:
    return [part.strip().removeprefix("W/").strip('"') for part in header.split(",") if part.strip()]


def _if_match(header: str | None) -> int | None:
    if header is None or "*" in _versions(header):
        return None
    versions = _versions(header)
    try:
        return int(versions[0]) if len(versions) == 1 else None
    except ValueError:
        pass
    raise PreconditionFailed(f'If-Match must be one ETag from GET, like "4"; got {header!r}')


def _with_etag(public: PolicyPublic) -> JSONResponse:
    return JSONResponse(public.model_dump(mode="json"), headers={"ETag": f'"{public.version}"'})


def _get(session: SessionDep, run_id: str | None, if_none_match: str | None) -> Response:
    row = service.get_policy(session, scope=service.policy_scope(session, run_id))
    session.commit()  # the default policy may just have been created
    if if_none_match is not None and (str(row.version) in _versions(if_none_match) or if_none_match.strip() == "*"):
        return Response(status_code=304, headers={"ETag": f'"{row.version}"'})
    return _with_etag(service.to_public(row))


def _change(
    session: SessionDep,
    run_id: str | None,
    changes: dict[str, object],
    *,
    replace: bool,
    actor: str,
    if_match: str | None,
) -> JSONResponse:
    scope = service.policy_scope(session, run_id)
    row = service.change_policy(
        session, scope=scope, changes=changes, replace=replace, actor=actor, if_match=_if_match(if_match)
    )
    public = service.to_public(row)
    session.commit()
    return _with_etag(public)


IfNoneMatch = Annotated[str | None, Header()]
# One ETag as GET sends it ("4"; W/"4" and 4 are read the same) or *.
# Typed str (not str | None, whose OpenAPI form lets clients send the text "null"); absent means None.
IfMatch = Annotated[str, Header(pattern=r'^(\*|(W/)?"?[0-9]{1,10}"?)$')]


@router.get("/api/v1/runs/{run_id}/policy", response_model=PolicyPublic, responses=_RUN_READ)
def get_run_policy(
    run_id: str, session: SessionDep, _: Annotated[Principal, POLICY_READ], if_none_match: IfNoneMatch = None
) -> Response:
    return _get(session, run_id, if_none_match)


@router.put("/api/v1/runs/{run_id}/policy", response_model=PolicyPublic, responses=_RUN_WRITE)
def put_run_policy(
    run_id: str,
    policy: PolicyIn,
    session: SessionDep,
    principal: Annotated[Principal, OPERATOR],
    if_match: IfMatch = None,  # type: ignore[assignment]
) -> Response:
    return _change(
        session, run_id, policy.model_dump(mode="json"), replace=True, actor=principal.name, if_match=if_match
    )


@router.patch("/api/v1/runs/{run_id}/policy", response_model=PolicyPublic, responses=_RUN_WRITE)
def patch_run_policy(
    run_id: str,
    patch: PolicyUpdate,
    session: SessionDep,
    principal: Annotated[Principal, OPERATOR],
    if_match: IfMatch = None,  # type: ignore[assignment]
) -> Response:
    changes = patch.model_dump(mode="json", exclude_unset=True)
    return _change(session, run_id, changes, replace=False, actor=principal.name, if_match=if_match)


@router.get("/api/v1/runs/{run_id}/policy/history", response_model=PolicyHistoryPublic, responses=errors(403, 404))
def get_run_policy_history(run_id: str, session: SessionDep, _: Annotated[Principal, READ]) -> PolicyHistoryPublic:
    return PolicyHistoryPublic(data=service.policy_history(session, scope=service.policy_scope(session, run_id)))


@router.get("/api/v1/policy/default", response_model=PolicyPublic, responses=_DEFAULT_READ)
def get_default_policy(
    session: SessionDep, _: Annotated[Principal, POLICY_READ], if_none_match: IfNoneMatch = None
) -> Response:
    return _get(session, None, if_none_match)


@router.put("/api/v1/policy/default", response_model=PolicyPublic, responses=_DEFAULT_WRITE)
def put_default_policy(
    policy: PolicyIn,
    session: SessionDep,
    principal: Annotated[Principal, OPERATOR],
    if_match: IfMatch = None,  # type: ignore[assignment]
) -> Response:
    return _change(session, None, policy.model_dump(mode="json"), replace=True, actor=principal.name, if_match=if_match)


@router.patch("/api/v1/policy/default", response_model=PolicyPublic, responses=_DEFAULT_WRITE)
def patch_default_policy(
    patch: PolicyUpdate,
    session: SessionDep,
    principal: Annotated[Principal, OPERATOR],
    if_match: IfMatch = None,  # type: ignore[assignment]
) -> Response:
    changes = patch.model_dump(mode="json", exclude_unset=True)
    return _change(session, None, changes, replace=False, actor=principal.name, if_match=if_match)


@router.get("/api/v1/policy/default/history", response_model=PolicyHistoryPublic, responses=errors(403))
def get_default_policy_history(session: SessionDep, _: Annotated[Principal, READ]) -> PolicyHistoryPublic:
    return PolicyHistoryPublic(data=service.policy_history(session, scope=service.DEFAULT_SCOPE))
