"""the replica that wrote each cache entry

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("cache_entries", sa.Column("writer", sa.String(200), nullable=False, server_default=""))
    op.create_index("ix_cache_entries_writer", "cache_entries", ["writer"])


def downgrade() -> None:
    op.drop_index("ix_cache_entries_writer", "cache_entries")
    op.drop_column("cache_entries", "writer")
