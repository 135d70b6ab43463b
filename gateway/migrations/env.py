"""Alembic environment: the URL comes from the caller (JobStore) or alembic.ini."""

from alembic import context
from sqlalchemy import create_engine

# every table's model on Base, so that autogenerate (`alembic check`, a new revision) compares
# the whole schema, not only the jobs' tables
import gateway.batch_store
import gateway.files
import gateway.keys
import gateway.ledger  # noqa: F401
from gateway.jobs import Base

config = context.config
engine = create_engine(config.get_main_option("sqlalchemy.url"))
with engine.connect() as connection:
    context.configure(connection=connection, target_metadata=Base.metadata)
    with context.begin_transaction():
        context.run_migrations()
engine.dispose()
