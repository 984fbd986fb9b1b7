"""Devices: identity per rank (run_rank), per-device totals across runs, operator status and its history, and the
device of each event and interval.

Existing events and intervals keep a NULL device: their ranks registered no identity.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03 15:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "device",
        sa.Column("uuid", sa.String(length=64), nullable=False),
        sa.Column("hostname", sa.String(length=253), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=True),
        sa.Column("pci_bus_id", sa.String(length=32), nullable=True),
        sa.Column("serial", sa.String(length=64), nullable=True),
        sa.Column("first_seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("status_version", sa.Integer(), nullable=False),
        sa.Column("status_reason", sa.String(length=500), nullable=True),
        sa.Column("status_by", sa.String(length=100), nullable=True),
        sa.Column("status_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("checks", sa.BigInteger(), nullable=False),
        sa.Column("detected", sa.BigInteger(), nullable=False),
        sa.Column("corrected", sa.BigInteger(), nullable=False),
        sa.Column("uncorrectable", sa.BigInteger(), nullable=False),
        sa.Column("runs", sa.Integer(), nullable=False),
        sa.Column("fault_runs", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("uuid", name=op.f("pk_device")),
    )
    with op.batch_alter_table("device", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_device_last_seen_at"), ["last_seen_at"], unique=False)

    op.create_table(
        "device_fault_counter",
        sa.Column("device_uuid", sa.String(length=64), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("detected", sa.BigInteger(), nullable=False),
        sa.Column("corrected", sa.BigInteger(), nullable=False),
        sa.Column("uncorrectable", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["device_uuid"], ["device.uuid"], name=op.f("fk_device_fault_counter_device_uuid_device"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("device_uuid", "kind", name=op.f("pk_device_fault_counter")),
    )
    op.create_table(
        "device_run",
        sa.Column("device_uuid", sa.String(length=64), nullable=False),
        sa.Column("run_id", sa.String(length=36), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("checks", sa.BigInteger(), nullable=False),
        sa.Column("detected", sa.BigInteger(), nullable=False),
        sa.Column("uncorrectable", sa.BigInteger(), nullable=False),
        sa.Column("first_seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["device_uuid"], ["device.uuid"], name=op.f("fk_device_run_device_uuid_device"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(["run_id"], ["run.id"], name=op.f("fk_device_run_run_id_run"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("device_uuid", "run_id", name=op.f("pk_device_run")),
    )
    with op.batch_alter_table("device_run", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_device_run_run_id"), ["run_id"], unique=False)

    op.create_table(
        "run_rank",
        sa.Column("run_id", sa.String(length=36), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("device_uuid", sa.String(length=64), nullable=False),
        sa.Column("hostname", sa.String(length=253), nullable=False),
        sa.Column("local_rank", sa.Integer(), nullable=True),
        sa.Column("registered_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("applied_policy_version", sa.Integer(), nullable=True),
        sa.Column("applied_policy_scope", sa.String(length=16), nullable=True),
        sa.ForeignKeyConstraint(
            ["device_uuid"], ["device.uuid"], name=op.f("fk_run_rank_device_uuid_device"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(["run_id"], ["run.id"], name=op.f("fk_run_rank_run_id_run"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "rank", name=op.f("pk_run_rank")),
    )
    with op.batch_alter_table("run_rank", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_run_rank_device_uuid"), ["device_uuid"], unique=False)

    op.create_table(
        "device_status_revision",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("device_uuid", sa.String(length=64), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.String(length=500), nullable=True),
        sa.Column("actor", sa.String(length=100), nullable=False),
        sa.Column("changed_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["device_uuid"], ["device.uuid"], name=op.f("fk_device_status_revision_device_uuid_device"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_device_status_revision")),
    )
    with op.batch_alter_table("device_status_revision", schema=None) as batch_op:
        batch_op.create_index(
            "uq_device_status_revision_device_version", ["device_uuid", "version"], unique=True
        )

    with op.batch_alter_table("fault_event", schema=None) as batch_op:
        batch_op.add_column(sa.Column("device_uuid", sa.String(length=64), nullable=True))
        batch_op.create_index("ix_fault_event_device_ts", ["device_uuid", "ts"], unique=False)
    with op.batch_alter_table("stats_interval", schema=None) as batch_op:
        batch_op.add_column(sa.Column("device_uuid", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("stats_interval", schema=None) as batch_op:
        batch_op.drop_column("device_uuid")
    with op.batch_alter_table("fault_event", schema=None) as batch_op:
        batch_op.drop_index("ix_fault_event_device_ts")
        batch_op.drop_column("device_uuid")
    with op.batch_alter_table("device_status_revision", schema=None) as batch_op:
        batch_op.drop_index("uq_device_status_revision_device_version")
    op.drop_table("device_status_revision")
    with op.batch_alter_table("run_rank", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_run_rank_device_uuid"))
    op.drop_table("run_rank")
    with op.batch_alter_table("device_run", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_device_run_run_id"))
    op.drop_table("device_run")
    op.drop_table("device_fault_counter")
    with op.batch_alter_table("device", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_device_last_seen_at"))
    op.drop_table("device")
