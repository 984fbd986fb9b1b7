"""Run registration (idempotent by name, so every rank of a job lands on one run), finish, list and totals."""

import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.orm import Session

from ..auth import Principal
from ..errors import NotFound
from ..models import Device, Policy, Run, RunFaultCounter, RunOpCounter, utcnow
from ..schemas import RunFinishIn, RunPublic, RunRegisterIn, RunTotals
from .access import check_may_register, check_may_write
from .cursor import cursor_id, cursor_time, decode_cursor, encode_cursor
from .devices import register_identity
from .policy import create_run_policy, rank_policy
from .quota import LiveRunQuota, is_live
from .sql import greatest, upsert_insert

__all__ = [
    "Registration",
    "finish_run",
    "get_run",
    "list_runs",
    "register_run",
    "require_run",
    "require_writable_run",
    "run_public",
]


def require_run(session: Session, run_id: str) -> Run:
    run = session.get(Run, run_id)
    if run is None:
        raise NotFound(f"run {run_id} not found; register it with POST /api/v1/runs")
    return run


def require_writable_run(session: Session, run_id: str, principal: Principal) -> Run:
    """The run (404 if unknown) when principal may write to it, else 403."""
    run = require_run(session, run_id)
    check_may_write(principal, run)
    return run


def _claim_or_check(session: Session, run_id: str, principal: Principal) -> None:
    """A resume: the owner, a bound token or an operator may; an unowned (pre-ownership) run is claimed by the
    unbound agent token that resumes it first. Anyone else gets 403 before anything is changed."""
    run = session.get(Run, run_id, populate_existing=True)
    assert run is not None
    if run.owner_token_id is None and principal.role == "agent" and principal.run_name is None:
        session.execute(
            update(Run)
            .where(Run.id == run_id, Run.owner_token_id.is_(None))
            .values(owner_token_id=principal.token_id)
            .execution_options(synchronize_session=False)
        )
        run = session.get(Run, run_id, populate_existing=True)
        assert run is not None
    check_may_write(principal, run)


@dataclass(frozen=True, slots=True)
class Registration:
    run: Run
    policy: Policy
    """The policy the registering rank follows: its run's, or the suspect-device policy."""
    scope: str
    """"run" or "device" (the rank's device is suspect or quarantined)."""
    created: bool
    device: Device | None
    """The rank's device, when the registration named one."""


def register_run(
    session: Session, *, run_in: RunRegisterIn, principal: Principal, quota: LiveRunQuota
) -> Registration:
    """Creates the run (owned by principal's token), or resumes the one with that name, and records the rank's device.
    Raises Forbidden when principal may not write to the existing run, TooManyRequests when a new (or revived) run
    would take the token past its quota of live runs; nothing is changed then (the route commits only on success).

    A created run starts with ``run_in.policy`` when given (else the default); a resumed run keeps its policy.
    """
    check_may_register(principal, run_in.name)
    quota.lock(session, principal)
    actor = principal.name
    now = utcnow()
    values: dict[str, Any] = {
        "model": run_in.model,
        "world_size": run_in.world_size,
        "host": run_in.host,
        "agent_version": run_in.agent_version,
        "config": run_in.config,
    }
    # ON CONFLICT makes concurrent registrations by several ranks agree on one row without a lost-update race.
    created_id = session.execute(
        upsert_insert(session, Run)
        .values(
            id=str(uuid.uuid4()),
            name=run_in.name,
            status="running",
            created_at=now,
            last_seen_at=now,
            steps_total=0,
            step_seconds_total=0.0,
            check_seconds_total=0.0,
            events_sent_total=0,
            events_spooled_total=0,
            events_dropped_total=0,
            residual_sum=0.0,
            residual_count=0,
            owner_token_id=principal.token_id,
            **values,
        )
        .on_conflict_do_nothing(index_elements=["name"])
        .returning(Run.id)
    ).scalar()
    device: Device | None = None
    if created_id is not None:
        run_id = created_id
        # After the write: on SQLite this transaction now holds the write lock, so the count sees every other one.
        quota.require_room(session, principal, run_id=run_id)
        create_run_policy(session, run_id=run_id, actor=actor, policy=run_in.policy)
        if run_in.device is not None:
            device = register_identity(session, run_id=run_id, rank=run_in.rank, identity=run_in.device, now=now)
    else:
        found = session.scalar(select(Run.id).where(Run.name == run_in.name))
        assert found is not None
        run_id = found
        _claim_or_check(session, run_id, principal)
        before = session.get(Run, run_id)
        assert before is not None
        # Another rank of a live run (or the same one again) adds nothing to the token's live runs.
        was_live = is_live(before, now, quota.abandoned_after)
        # The device rows before the run row: the lock order of ingest_stats (devices, then the run).
        if run_in.device is not None:
            device = register_identity(session, run_id=run_id, rank=run_in.rank, identity=run_in.device, now=now)
        # Rank 0 describes the job; other ranks only mark it alive so they don't overwrite its host.
        changes: dict[str, Any] = {"status": "running", "last_seen_at": now, "finished_at": None}
        if run_in.rank == 0:
            changes.update(values)
        session.execute(
            update(Run).where(Run.id == run_id).values(**changes).execution_options(synchronize_session=False)
        )
        if not was_live:
            quota.require_room(session, principal, run_id=run_id)
    run = session.get(Run, run_id, populate_existing=True)
    assert run is not None
    policy, scope = rank_policy(session, run_id=run_id, rank=run_in.rank)
    return Registration(run=run, policy=policy, scope=scope, created=created_id is not None, device=device)


def finish_run(session: Session, *, run_id: str, finish_in: RunFinishIn, principal: Principal) -> Run:
    require_writable_run(session, run_id, principal)
    values: dict[str, Any] = {"status": "finished", "finished_at": utcnow(), "last_seen_at": utcnow()}
    if finish_in.last_step is not None:
        values["last_step"] = greatest(session, Run.last_step, finish_in.last_step)
    session.execute(update(Run).where(Run.id == run_id).values(**values).execution_options(synchronize_session=False))
    run = session.get(Run, run_id, populate_existing=True)
    assert run is not None
    return run


def _totals(session: Session, run_ids: list[str]) -> dict[str, RunTotals]:
    checks = dict(
        session.execute(
            select(RunOpCounter.run_id, func.sum(RunOpCounter.checks))
            .where(RunOpCounter.run_id.in_(run_ids))
            .group_by(RunOpCounter.run_id)
        ).all()
    )
    faults = {
        row[0]: row[1:]
        for row in session.execute(
            select(
                RunFaultCounter.run_id,
                func.sum(RunFaultCounter.detected),
                func.sum(RunFaultCounter.corrected),
                func.sum(RunFaultCounter.uncorrectable),
            )
            .where(RunFaultCounter.run_id.in_(run_ids))
            .group_by(RunFaultCounter.run_id)
        ).all()
    }
    out = {}
    for run_id in run_ids:
        detected, corrected, uncorrectable = faults.get(run_id, (0, 0, 0))
        out[run_id] = RunTotals(
            checks=int(checks.get(run_id) or 0),
            detected=int(detected or 0),
            corrected=int(corrected or 0),
            uncorrectable=int(uncorrectable or 0),
        )
    return out


def _public(run: Run, requested: int, totals: RunTotals) -> RunPublic:
    return RunPublic(
        id=run.id,
        name=run.name,
        model=run.model,
        world_size=run.world_size,
        host=run.host,
        config=run.config,
        status=run.status,  # type: ignore[arg-type]
        created_at=run.created_at,
        last_seen_at=run.last_seen_at,
        last_step=run.last_step,
        requested_policy_version=requested,
        applied_policy_version=run.applied_policy_version,
        totals=totals,
    )


def run_public(session: Session, run: Run) -> RunPublic:
    policy = session.get(Policy, run.id)
    return _public(run, policy.version if policy else 0, _totals(session, [run.id])[run.id])


def get_run(session: Session, *, run_id: str) -> RunPublic:
    return run_public(session, require_run(session, run_id))


def list_runs(
    session: Session, *, status: str | None, limit: int, cursor: str | None
) -> tuple[list[RunPublic], str | None]:
    """Newest first, ordered by (created_at desc, id desc)."""
    stmt = select(Run, Policy.version).outerjoin(Policy, Policy.scope == Run.id)
    if status is not None:
        stmt = stmt.where(Run.status == status)
    if cursor is not None:
        created_key, id_key = decode_cursor(cursor, length=2)
        created, last_id = cursor_time(created_key), cursor_id(id_key)
        stmt = stmt.where(or_(Run.created_at < created, and_(Run.created_at == created, Run.id < str(last_id))))
    rows = session.execute(stmt.order_by(Run.created_at.desc(), Run.id.desc()).limit(limit + 1)).all()
    page = rows[:limit]
    totals = _totals(session, [run.id for run, _ in page])
    data = [_public(run, version or 0, totals[run.id]) for run, version in page]
    next_cursor = None
    if len(rows) > limit:
        last = page[-1][0]
        next_cursor = encode_cursor([last.created_at.isoformat(), last.id])
    return data, next_cursor
