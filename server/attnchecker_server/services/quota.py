"""The per-token quota of live runs: what keeps one agent token from filling the database and /metrics with runs
(docs/collector.md, "Quotas").

A run is live while it is running and was heard from within ``run_abandoned_seconds``; /metrics exports every live
run, so the quota bounds what one token adds there. Operators are trusted and have no quota; a token bound to one
run name (`token create --run NAME`) can hold one run only.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ..auth import Principal
from ..errors import TooManyRequests
from ..models import ApiToken, Run, utcnow

__all__ = ["QUOTA_RETRY_AFTER_S", "LiveRunQuota", "is_live"]

QUOTA_RETRY_AFTER_S = 60
"""What a 429 tells the agent to wait: a run of the token may finish meanwhile (the agent spools until then)."""


def is_live(run: Run, now: datetime, abandoned_after: timedelta) -> bool:
    return run.status == "running" and run.last_seen_at >= now - abandoned_after


class LiveRunQuota:
    def __init__(self, *, limit: int, abandoned_after: timedelta) -> None:
        self.limit = limit
        self.abandoned_after = abandoned_after

    @staticmethod
    def applies(principal: Principal) -> bool:
        return principal.role == "agent" and principal.run_name is None and principal.token_id is not None

    def lock(self, session: Session, principal: Principal) -> None:
        """On PostgreSQL, serialise the token's registrations (its row, FOR UPDATE), so that two at once cannot both
        take the last place. SQLite serialises writers itself, and the count runs after this registration's write."""
        if self.applies(principal) and session.get_bind().dialect.name == "postgresql":
            session.execute(select(ApiToken.id).where(ApiToken.id == principal.token_id).with_for_update())

    def require_room(self, session: Session, principal: Principal, *, run_id: str) -> None:
        """429 when the token already holds ``limit`` live runs besides ``run_id`` (the run being created or brought
        back to life). Called after the registration's write, so the count includes every committed registration."""
        if not self.applies(principal):
            return
        now = utcnow()
        others = session.scalar(
            select(func.count())
            .select_from(Run)
            .where(Run.owner_token_id == principal.token_id, Run.status == "running",
                   Run.last_seen_at >= now - self.abandoned_after, Run.id != run_id)
        )
        if int(others or 0) >= self.limit:
            raise TooManyRequests(
                f"this token already holds {others} live runs, its quota (ATTNCHECKER_MAX_LIVE_RUNS_PER_TOKEN="
                f"{self.limit}): let runs finish (Guard.close() finishes a run), or wait until a silent one is "
                f"abandoned ({int(self.abandoned_after.total_seconds())} s without a report, "
                "ATTNCHECKER_RUN_ABANDONED_SECONDS), or use another token",
                retry_after_s=QUOTA_RETRY_AFTER_S,
            )
