"""Per-tier check and catch counters (issue 10: tripwire, abft, optimizer).

Revision ID: 0010
Revises: 0001
Create Date: 2026-11-30 19:20:00

Numbered 0010 so that it does not collide with other 0002 migrations made at the same time; when merged after
one, only down_revision changes.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "run_tier_counter",
        sa.Column("run_id", sa.String(length=36), nullable=False),
        sa.Column("tier", sa.String(length=16), nullable=False),
        sa.Column("op", sa.String(length=16), nullable=False),
        sa.Column("checks", sa.BigInteger(), nullable=False),
        sa.Column("catches", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["run.id"], name=op.f("fk_run_tier_counter_run_id_run"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "tier", "op", name=op.f("pk_run_tier_counter")),
    )


def downgrade() -> None:
    op.drop_table("run_tier_counter")
