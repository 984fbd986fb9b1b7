"""Versioned policies: the server default and one per run, every change kept as a revision with its actor."""

from typing import Any, cast

from sqlalchemy import CursorResult, select, update
from sqlalchemy.orm import Session

from ..errors import NotFound, PreconditionFailed
from ..models import Policy, PolicyRevision, Run, utcnow
from ..schemas import PolicyIn, PolicyPublic, PolicyRevisionPublic
from .sql import upsert_insert

__all__ = [
    "DEFAULT_SCOPE",
    "change_policy",
    "create_run_policy",
    "get_policy",
    "policy_history",
    "policy_scope",
    "to_public",
]

DEFAULT_SCOPE = "default"
SYSTEM_ACTOR = "system"
# Concurrent writers without If-Match retry on a lost race rather than failing.
MAX_UPDATE_ATTEMPTS = 5


def to_public(row: Policy) -> PolicyPublic:
    return PolicyPublic(**row.body, version=row.version, updated_at=row.updated_at, updated_by=row.updated_by)


def _ensure_default(session: Session) -> Policy:
    row = session.get(Policy, DEFAULT_SCOPE)
    if row is not None:
        return row
    now = utcnow()
    body = PolicyIn().model_dump(mode="json")
    inserted = session.execute(
        upsert_insert(session, Policy)
        .values(scope=DEFAULT_SCOPE, run_id=None, version=1, body=body, updated_at=now, updated_by=SYSTEM_ACTOR)
        .on_conflict_do_nothing(index_elements=["scope"])
        .returning(Policy.scope)
    ).first()
    if inserted is not None:
        session.add(PolicyRevision(scope=DEFAULT_SCOPE, version=1, body=body, actor=SYSTEM_ACTOR, changed_at=now))
        session.flush()
    row = session.get(Policy, DEFAULT_SCOPE, populate_existing=True)
    assert row is not None
    return row


def policy_scope(session: Session, run_id: str | None) -> str:
    """The policy key for a run (404 if the run is unknown) or for the server default."""
    if run_id is None:
        return DEFAULT_SCOPE
    if session.get(Run, run_id) is None:
        raise NotFound(f"run {run_id} not found; register it with POST /api/v1/runs")
    return run_id


def get_policy(session: Session, *, scope: str) -> Policy:
    if scope == DEFAULT_SCOPE:
        return _ensure_default(session)
    row = session.get(Policy, scope)
    if row is None:
        raise NotFound(f"run {scope} has no policy")
    return row


def create_run_policy(session: Session, *, run_id: str, actor: str, policy: PolicyIn | None = None) -> Policy:
    """A new run's version 1: ``policy`` (given at registration) or else a copy of the current default."""
    body = policy.model_dump(mode="json") if policy is not None else dict(_ensure_default(session).body)
    now = utcnow()
    row = Policy(scope=run_id, run_id=run_id, version=1, body=body, updated_at=now, updated_by=actor)
    session.add(row)
    session.add(PolicyRevision(scope=run_id, version=1, body=dict(body), actor=actor, changed_at=now))
    session.flush()
    return row


def change_policy(
    session: Session, *, scope: str, changes: dict[str, Any], replace: bool, actor: str, if_match: int | None
) -> Policy:
    """PUT (replace=True: changes is a whole policy) or PATCH (merged); validates the result as a whole.

    Raises PreconditionFailed when if_match is not the current version. pydantic.ValidationError when the merged
    policy is invalid (e.g. a PATCH of min_period above the stored max_period).
    """
    for _ in range(MAX_UPDATE_ATTEMPTS):
        current = get_policy(session, scope=scope)
        if if_match is not None and if_match != current.version:
            raise PreconditionFailed(
                f"If-Match version {if_match} is stale: the policy is at version {current.version}; "
                "GET it again and retry with the new ETag"
            )
        merged = changes if replace else {**current.body, **changes}
        body = PolicyIn.model_validate(merged).model_dump(mode="json")
        now = utcnow()
        # Compare-and-swap on the version: two writers that read the same version cannot both win.
        result = cast(
            CursorResult[Any],
            session.execute(
                update(Policy)
                .where(Policy.scope == scope, Policy.version == current.version)
                .values(version=current.version + 1, body=body, updated_at=now, updated_by=actor)
                .execution_options(synchronize_session=False)
            ),
        )
        if result.rowcount == 1:
            session.add(
                PolicyRevision(scope=scope, version=current.version + 1, body=body, actor=actor, changed_at=now)
            )
            session.flush()
            row = session.get(Policy, scope, populate_existing=True)
            assert row is not None
            return row
        session.expire_all()
    raise PreconditionFailed("the policy kept changing under this request; retry it")


def policy_history(session: Session, *, scope: str) -> list[PolicyRevisionPublic]:
    get_policy(session, scope=scope)
    rows = session.scalars(select(PolicyRevision).where(PolicyRevision.scope == scope).order_by(PolicyRevision.version))
    return [
        PolicyRevisionPublic(version=r.version, policy=PolicyIn(**r.body), actor=r.actor, changed_at=r.changed_at)
        for r in rows
    ]
