"""files, batches and the requests of each batch

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "files",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("tenant", sa.String(64), nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("filename", sa.String(256), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=True),
    )
    op.create_index("ix_files_tenant", "files", ["tenant", "created_at"])
    op.create_table(
        "batches",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("protocol", sa.String(16), nullable=False),
        sa.Column("tenant", sa.String(64), nullable=False),
        sa.Column("endpoint", sa.String(32), nullable=False),
        sa.Column("input_file_id", sa.String(64), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("completion_window", sa.String(8), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=True),
        sa.Column("errors", sa.JSON(), nullable=True),
        sa.Column("usage", sa.JSON(), nullable=True),
        sa.Column("output_file_id", sa.String(64), nullable=True),
        sa.Column("error_file_id", sa.String(64), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=False),
        sa.Column("in_progress_at", sa.Float(), nullable=True),
        sa.Column("finalizing_at", sa.Float(), nullable=True),
        sa.Column("completed_at", sa.Float(), nullable=True),
        sa.Column("failed_at", sa.Float(), nullable=True),
        sa.Column("expired_at", sa.Float(), nullable=True),
        sa.Column("cancelling_at", sa.Float(), nullable=True),
        sa.Column("cancelled_at", sa.Float(), nullable=True),
    )
    op.create_index("ix_batches_status", "batches", ["status"])
    op.create_index("ix_batches_tenant", "batches", ["tenant", "created_at"])
    op.create_table(
        "batch_requests",
        sa.Column("batch_id", sa.String(64), sa.ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("index", sa.Integer(), primary_key=True),
        sa.Column("custom_id", sa.String(512), nullable=False),
        sa.Column("body", sa.JSON(), nullable=False),
        sa.Column("job_id", sa.String(64), nullable=False, unique=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("sent_at", sa.Float(), nullable=True),
    )
    op.create_index("ix_batch_requests_state", "batch_requests", ["batch_id", "state"])


def downgrade() -> None:
    op.drop_index("ix_batch_requests_state", "batch_requests")
    op.drop_table("batch_requests")
    op.drop_index("ix_batches_tenant", "batches")
    op.drop_index("ix_batches_status", "batches")
    op.drop_table("batches")
    op.drop_index("ix_files_tenant", "files")
    op.drop_table("files")
