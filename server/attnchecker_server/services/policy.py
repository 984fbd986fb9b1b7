"""Versioned policies: the server default, the suspect-device policy and one per run, every change kept as a revision
with its actor; and which of them a rank follows (its device's status decides)."""

from typing import Any, cast

from sqlalchemy import CursorResult, select, update
from sqlalchemy.orm import Session

from ..errors import NotFound, PreconditionFailed
from ..models import Device, Policy, PolicyRevision, Run, RunRank, utcnow
from ..schemas import PolicyIn, PolicyPublic, PolicyRevisionPublic
from .devices import SUSPECT_STATUSES
from .sql import upsert_insert

__all__ = [
    "DEFAULT_SCOPE",
    "SUSPECT_SCOPE",
    "change_policy",
    "create_run_policy",
    "get_policy",
    "policy_history",
    "policy_scope",
    "rank_policy",
    "to_public",
]

DEFAULT_SCOPE = "default"
SUSPECT_SCOPE = "suspect"
"""The policy every rank on a suspect or quarantined device follows instead of its run's."""
SYSTEM_ACTOR = "system"
# The server-wide scopes and the body each starts with: the default as PolicyIn's defaults, the suspect-device policy
# as full protection (every op on every step, no adaptation: the agent's Policy.full()).
_SERVER_SCOPES = {
    DEFAULT_SCOPE: lambda: PolicyIn(),
    SUSPECT_SCOPE: lambda: PolicyIn(period=1, adaptive=False),
}

# Concurrent writers without If-Match retry on a lost race rather than failing.
MAX_UPDATE_ATTEMPTS = 5


def to_public(row: Policy) -> PolicyPublic:
    return PolicyPublic(**row.body, version=row.version, updated_at=row.updated_at, updated_by=row.updated_by)


def _ensure_server_scope(session: Session, scope: str) -> Policy:
    """The default or suspect-device policy, created at version 1 on first use."""
    row = session.get(Policy, scope)
    if row is not None:
        return row
    now = utcnow()
    body = _SERVER_SCOPES[scope]().model_dump(mode="json")
    inserted = session.execute(
        upsert_insert(session, Policy)
        .values(scope=scope, run_id=None, version=1, body=body, updated_at=now, updated_by=SYSTEM_ACTOR)
        .on_conflict_do_nothing(index_elements=["scope"])
        .returning(Policy.scope)
    ).first()
    if inserted is not None:
        session.add(PolicyRevision(scope=scope, version=1, body=body, actor=SYSTEM_ACTOR, changed_at=now))
        session.flush()
    row = session.get(Policy, scope, populate_existing=True)
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
    if scope in _SERVER_SCOPES:
        return _ensure_server_scope(session, scope)
    row = session.get(Policy, scope)
    if row is None:
        raise NotFound(f"run {scope} has no policy")
    return row


def create_run_policy(session: Session, *, run_id: str, actor: str, policy: PolicyIn | None = None) -> Policy:
    """A new run's version 1: ``policy`` (given at registration) or else a copy of the current default."""
    if policy is not None:
        body = policy.model_dump(mode="json")
    else:
        body = dict(_ensure_server_scope(session, DEFAULT_SCOPE).body)
    now = utcnow()
    row = Policy(scope=run_id, run_id=run_id, version=1, body=body, updated_at=now, updated_by=actor)
    session.add(row)
    session.add(PolicyRevision(scope=run_id, version=1, body=dict(body), actor=actor, changed_at=now))
    session.flush()
    return row


def rank_policy(session: Session, *, run_id: str, rank: int) -> tuple[Policy, str]:
    """The policy a rank follows and its scope: the suspect-device policy ("device") while the device the rank
    registered is suspect or quarantined, else the run's ("run"). A rank that registered no device follows the run's.
    """
    status = session.scalar(
        select(Device.status).join(RunRank, RunRank.device_uuid == Device.uuid)
        .where(RunRank.run_id == run_id, RunRank.rank == rank)
    )
    if status in SUSPECT_STATUSES:
        return get_policy(session, scope=SUSPECT_SCOPE), "device"
    return get_policy(session, scope=run_id), "run"


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
