"""stored Responses: a job belongs to a tenant, may keep only its outcome, and may expire

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("tenant", sa.String(64), nullable=False, server_default="default"))
        batch.add_column(sa.Column("keep_events", sa.Boolean(), nullable=False, server_default=sa.true()))
        batch.add_column(sa.Column("expires_at", sa.Float(), nullable=True))
        batch.create_index("ix_jobs_expires_at", ["expires_at"])


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_index("ix_jobs_expires_at")
        batch.drop_column("expires_at")
        batch.drop_column("keep_events")
        batch.drop_column("tenant")
