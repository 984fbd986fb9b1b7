"""Policy per run, the server default and the suspect-device policy: GET (ETag, If-None-Match), PUT/PATCH (If-Match),
history. A run's GET with ?rank=N answers the policy that rank follows (its device's status decides)."""

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Query, Response
from fastapi.responses import JSONResponse

from ..auth import Principal
from ..models import Policy
from ..schemas import PolicyHistoryPublic, PolicyIn, PolicyPublic, PolicyUpdate
from ..services import policy as service
from .deps import OPERATOR, POLICY_READ, READ, SessionDep
from .etags import IfMatch, IfNoneMatch, etag_versions, if_match_version
from .responses import errors

__all__ = ["router"]

router = APIRouter(tags=["policy"])

_NOT_MODIFIED: dict[int | str, dict[str, Any]] = {304: {"description": "If-None-Match equals the current version"}}
_RUN_READ = {**_NOT_MODIFIED, **errors(403, 404)}
_RUN_WRITE = errors(403, 404, 412, 413)
_DEFAULT_READ = {**_NOT_MODIFIED, **errors(403)}
_DEFAULT_WRITE = errors(403, 412, 413)


SCOPE_HEADER = "X-Policy-Scope"
"""On a GET with ?rank: "run" (the run's policy) or "device" (the suspect-device policy the rank follows)."""


def _etag(row: Policy, scope: str) -> str:
    # The suspect-device policy has versions of its own: its ETag must never equal one of the run's.
    return f'"{row.version}"' if scope == "run" else f'"device-{row.version}"'


def _with_etag(public: PolicyPublic, etag: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    etag = etag or f'"{public.version}"'
    return JSONResponse(public.model_dump(mode="json"), headers={"ETag": etag, **(headers or {})})


def _answer(row: Policy, if_none_match: str | None, *, scope: str, headers: dict[str, str]) -> Response:
    etag = _etag(row, scope)
    if if_none_match is not None and (etag.strip('"') in etag_versions(if_none_match) or if_none_match.strip() == "*"):
        return Response(status_code=304, headers={"ETag": etag, **headers})
    return _with_etag(service.to_public(row), etag, headers)


def _get(session: SessionDep, scope: str, if_none_match: str | None) -> Response:
    row = service.get_policy(session, scope=scope)
    session.commit()  # a server-wide policy may just have been created
    return _answer(row, if_none_match, scope="run", headers={})


def _change(
    session: SessionDep,
    scope: str,
    changes: dict[str, object],
    *,
    replace: bool,
    actor: str,
    if_match: str | None,
) -> JSONResponse:
    """``scope``: a run's (service.policy_scope: 404 for an unknown run), DEFAULT_SCOPE or SUSPECT_SCOPE."""
    row = service.change_policy(
        session, scope=scope, changes=changes, replace=replace, actor=actor, if_match=if_match_version(if_match)
    )
    public = service.to_public(row)
    session.commit()
    return _with_etag(public)


_RANK_READ = {
    **_RUN_READ,
    200: {"description": "the policy; with ?rank, the one that rank follows",
          "headers": {SCOPE_HEADER: {"description": "with ?rank: run or device", "schema": {"type": "string"}}}},
}


@router.get("/api/v1/runs/{run_id}/policy", response_model=PolicyPublic, responses=_RANK_READ)
def get_run_policy(
    run_id: str,
    session: SessionDep,
    _: Annotated[Principal, POLICY_READ],
    if_none_match: IfNoneMatch = None,
    rank: Annotated[int | None, Query(ge=0, le=2**31 - 1)] = None,
) -> Response:
    scope = service.policy_scope(session, run_id)
    if rank is None:
        return _get(session, scope, if_none_match)
    row, which = service.rank_policy(session, run_id=scope, rank=rank)
    session.commit()  # the suspect-device policy may just have been created
    return _answer(row, if_none_match, scope=which, headers={SCOPE_HEADER: which})


@router.put("/api/v1/runs/{run_id}/policy", response_model=PolicyPublic, responses=_RUN_WRITE)
def put_run_policy(
    run_id: str,
    policy: PolicyIn,
    session: SessionDep,
    principal: Annotated[Principal, OPERATOR],
    if_match: IfMatch = None,  # type: ignore[assignment]
) -> Response:
    return _change(session, service.policy_scope(session, run_id), policy.model_dump(mode="json"), replace=True,
                   actor=principal.name, if_match=if_match)


@router.patch("/api/v1/runs/{run_id}/policy", response_model=PolicyPublic, responses=_RUN_WRITE)
def patch_run_policy(
    run_id: str,
    patch: PolicyUpdate,
    session: SessionDep,
    principal: Annotated[Principal, OPERATOR],
    if_match: IfMatch = None,  # type: ignore[assignment]
) -> Response:
    changes = patch.model_dump(mode="json", exclude_unset=True)
    return _change(session, service.policy_scope(session, run_id), changes, replace=False, actor=principal.name,
                   if_match=if_match)


@router.get("/api/v1/runs/{run_id}/policy/history", response_model=PolicyHistoryPublic, responses=errors(403, 404))
def get_run_policy_history(run_id: str, session: SessionDep, _: Annotated[Principal, READ]) -> PolicyHistoryPublic:
    return PolicyHistoryPublic(data=service.policy_history(session, scope=service.policy_scope(session, run_id)))


# The server-wide policies: "default" (copied into new runs registered without a policy) and "suspect" (what every
# rank on a suspect or quarantined device follows instead of its run's).
ServerScope = Annotated[Literal["default", "suspect"], Path(description="default, or suspect (suspect devices)")]


@router.get("/api/v1/policy/{scope}", response_model=PolicyPublic, responses=_DEFAULT_READ)
def get_server_policy(
    scope: ServerScope, session: SessionDep, _: Annotated[Principal, POLICY_READ], if_none_match: IfNoneMatch = None
) -> Response:
    return _get(session, scope, if_none_match)


@router.put("/api/v1/policy/{scope}", response_model=PolicyPublic, responses=_DEFAULT_WRITE)
def put_server_policy(
    scope: ServerScope,
    policy: PolicyIn,
    session: SessionDep,
    principal: Annotated[Principal, OPERATOR],
    if_match: IfMatch = None,  # type: ignore[assignment]
) -> Response:
    return _change(session, scope, policy.model_dump(mode="json"), replace=True, actor=principal.name,
                   if_match=if_match)


@router.patch("/api/v1/policy/{scope}", response_model=PolicyPublic, responses=_DEFAULT_WRITE)
def patch_server_policy(
    scope: ServerScope,
    patch: PolicyUpdate,
    session: SessionDep,
    principal: Annotated[Principal, OPERATOR],
    if_match: IfMatch = None,  # type: ignore[assignment]
) -> Response:
    changes = patch.model_dump(mode="json", exclude_unset=True)
    return _change(session, scope, changes, replace=False, actor=principal.name, if_match=if_match)


@router.get("/api/v1/policy/{scope}/history", response_model=PolicyHistoryPublic, responses=errors(403))
def get_server_policy_history(scope: ServerScope, session: SessionDep,
                              _: Annotated[Principal, READ]) -> PolicyHistoryPublic:
    return PolicyHistoryPublic(data=service.policy_history(session, scope=scope))
