"""Per-tier counters from a stats interval (issue 10): tier 1 "tripwire" and tier 2 "abft" per op, and the
optimizer net under op "grad". Summed on ingest like the other counters, so /metrics reads single rows."""

from sqlalchemy.orm import Session

from ..models import RunTierCounter
from ..schemas import StatsIn
from .sql import upsert_insert

__all__ = ["add_tier_counts"]


def _rows(stats: StatsIn) -> list[tuple[str, str, int, int]]:
    rows: list[tuple[str, str, int, int]] = []
    for o in stats.ops:
        # ABFT checks are the op's `checks`; an all-zero row from an agent without tiers adds nothing.
        rows.append(("abft", o.op, o.checks, o.abft_catches))
        rows.append(("tripwire", o.op, o.tripwire_checks, o.tripwire_catches))
    rows.append(("optimizer", "grad", stats.optimizer_checks, stats.optimizer_catches))
    return sorted(r for r in rows if r[2] or r[3])


def add_tier_counts(session: Session, run_id: str, stats: StatsIn) -> None:
    """Upsert in key order (the same lock order for two intervals of one run posted at once)."""
    for tier, op, checks, catches in _rows(stats):
        ins = upsert_insert(session, RunTierCounter).values(run_id=run_id, tier=tier, op=op, checks=checks,
                                                            catches=catches)
        session.execute(
            ins.on_conflict_do_update(
                index_elements=["run_id", "tier", "op"],
                set_={"checks": RunTierCounter.checks + ins.excluded.checks,
                      "catches": RunTierCounter.catches + ins.excluded.catches},
            )
        )
