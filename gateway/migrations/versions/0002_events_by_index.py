"""job events are numbered by their index in the job's stream; the per-message counter goes

Revision ID: 0002
Revises: 0001
"""

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:  # SQLite rebuilds the table to drop a column
        batch.drop_column("next_result_seq")


def downgrade() -> None:
    import sqlalchemy as sa

    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("next_result_seq", sa.Integer(), nullable=False, server_default="0"))
