"""Run registration (idempotent by name, so every rank of a job lands on one run), finish, list and totals."""

import uuid
from typing import Any

from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.orm import Session

from ..auth import Principal
from ..errors import NotFound
from ..models import Policy, Run, RunFaultCounter, RunOpCounter, utcnow
from ..schemas import RunFinishIn, RunPublic, RunRegisterIn, RunTotals
from .access import check_may_register, check_may_write
from .cursor import cursor_id, cursor_time, decode_cursor, encode_cursor
from .policy import create_run_policy
from .sql import greatest, upsert_insert

__all__ = [
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


def register_run(session: Session, *, run_in: RunRegisterIn, principal: Principal) -> tuple[Run, Policy, bool]:
    """Creates the run (owned by principal's token), or resumes the one with that name; returns (run, its policy,
    created). Raises Forbidden when principal may not write to the existing run (nothing is changed then).

    A created run starts with ``run_in.policy`` when given (else the default); a resumed run keeps its policy.
    """
    check_may_register(principal, run_in.name)
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
    if created_id is not None:
        policy = create_run_policy(session, run_id=created_id, actor=actor, policy=run_in.policy)
        run = session.get(Run, created_id)
        assert run is not None
        return run, policy, True
    run_id = session.scalar(select(Run.id).where(Run.name == run_in.name))
    assert run_id is not None
    _claim_or_check(session, run_id, principal)
    # Rank 0 describes the job; other ranks only mark it alive so they don't overwrite its host.
    changes: dict[str, Any] = {"status": "running", "last_seen_at": now, "finished_at": None}
    if run_in.rank == 0:
        changes.update(values)
    session.execute(update(Run).where(Run.id == run_id).values(**changes).execution_options(synchronize_session=False))
    resumed = session.get(Run, run_id, populate_existing=True)
    resumed_policy = session.get(Policy, run_id)
    assert resumed is not None
    assert resumed_policy is not None
    return resumed, resumed_policy, False


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
