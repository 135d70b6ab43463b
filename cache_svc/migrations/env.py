"""Alembic environment of the cache catalog; its own version table, so that it can share a
database with the gateway's job store."""

from alembic import context
from sqlalchemy import create_engine

from cache_svc.catalog import Base

config = context.config
engine = create_engine(config.get_main_option("sqlalchemy.url"))
with engine.connect() as connection:
    context.configure(connection=connection, target_metadata=Base.metadata, version_table="cache_alembic_version")
    with context.begin_transaction():
        context.run_migrations()
engine.dispose()
