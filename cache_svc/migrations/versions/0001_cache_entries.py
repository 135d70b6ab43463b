"""cache entries

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "cache_entries",
        sa.Column("key", sa.String(80), primary_key=True),
        sa.Column("kind", sa.String(8), nullable=False),
        sa.Column("tenant", sa.String(64), nullable=False),
        sa.Column("link", sa.String(64), nullable=False),
        sa.Column("num_tokens", sa.Integer(), nullable=False),
        sa.Column("size", sa.Integer(), nullable=False),
        sa.Column("checksum", sa.String(64), nullable=False),
        sa.Column("blocks", sa.JSON(), nullable=False),
        sa.Column("tiers", sa.String(128), nullable=False),
        sa.Column("leases", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("last_hit_at", sa.Float(), nullable=True),
        sa.Column("expires_at", sa.Float(), nullable=False),
        sa.Column("hits", sa.Integer(), nullable=False, server_default="0"),
    )
    op.create_index("ix_cache_entries_link", "cache_entries", ["link"])
    op.create_index("ix_cache_entries_expires_at", "cache_entries", ["expires_at"])


def downgrade() -> None:
    op.drop_table("cache_entries")
