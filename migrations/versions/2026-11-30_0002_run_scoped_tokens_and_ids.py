"""Run-scoped agent tokens (run owner, token expiry and run binding) and ids unique per run (composite keys).

Existing rows keep their values: old ids were globally unique, so they are unique per run too; old runs have no
owner and are claimed by the next agent token that registers them.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 19:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# table -> its index on run_id alone, made redundant by the (run_id, id) primary key.
_PER_RUN_TABLES = {"fault_event": None, "event_batch": "ix_event_batch_run_id", "stats_interval": "ix_stats_interval_run_id"}


def upgrade() -> None:
    with op.batch_alter_table("api_token", schema=None) as batch_op:
        batch_op.add_column(sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column("run_name", sa.String(length=200), nullable=True))
    with op.batch_alter_table("run", schema=None) as batch_op:
        batch_op.add_column(sa.Column("owner_token_id", sa.Integer(), nullable=True))
    for table, run_index in _PER_RUN_TABLES.items():
        with op.batch_alter_table(table, schema=None) as batch_op:
            if run_index is not None:
                batch_op.drop_index(run_index)
            batch_op.drop_constraint(f"pk_{table}", type_="primary")
            batch_op.create_primary_key(f"pk_{table}", ["run_id", "id"])


def downgrade() -> None:
    bind = op.get_bind()
    for table, run_index in _PER_RUN_TABLES.items():
        # A global key cannot hold the same id in two runs: say so instead of failing on a constraint error.
        shared = bind.execute(
            sa.text(f"SELECT id FROM {table} GROUP BY id HAVING count(*) > 1 LIMIT 1")
        ).first()
        if shared is not None:
            raise RuntimeError(
                f"cannot downgrade: {table} holds id {shared[0]} in more than one run; delete one of them first"
            )
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_constraint(f"pk_{table}", type_="primary")
            batch_op.create_primary_key(f"pk_{table}", ["id"])
            if run_index is not None:
                batch_op.create_index(run_index, ["run_id"], unique=False)
    with op.batch_alter_table("run", schema=None) as batch_op:
        batch_op.drop_column("owner_token_id")
    with op.batch_alter_table("api_token", schema=None) as batch_op:
        batch_op.drop_column("run_name")
        batch_op.drop_column("expires_at")
