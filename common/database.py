"""SQL databases with Alembic-owned schemas: the gateway's job store and the cache catalog."""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, NullPool, create_engine, event, make_url, text
from sqlalchemy.orm import Session, sessionmaker

# PostgreSQL's advisory lock (a number any session may hold) taken while a process migrates
MIGRATION_LOCK = 0x646565706D657368  # "deepmesh"


def migrate(url: str, migrations: Path) -> None:
    """Bring the database to the newest revision of these migrations, one process at a time."""
    config = Config()
    config.set_main_option("script_location", str(migrations))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))  # configparser interpolates %
    with migration_lock(url):
        command.upgrade(config, "head")


@contextlib.contextmanager
def migration_lock(url: str) -> Iterator[None]:
    """Held by one process at a time for a database. Processes that start together on a new
    database (a gateway and its batch runner, replicas of the cache) would each see no version
    table and create the tables; all but one then fail. Behind the lock the next one finds the
    schema at its head and changes nothing. A process that dies holding it releases it (its
    session ends, its file closes)."""
    database = make_url(url)
    if database.get_backend_name() == "postgresql":
        engine = create_engine(database, poolclass=NullPool)
        try:
            with engine.connect() as connection:
                connection.execute(text("SELECT pg_advisory_lock(:key)"), {"key": MIGRATION_LOCK})
                connection.commit()  # a session's lock, held past this transaction
                try:
                    yield
                finally:
                    connection.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": MIGRATION_LOCK})
                    connection.commit()
        finally:
            engine.dispose()
    elif database.get_backend_name() == "sqlite" and database.database not in (None, "", ":memory:"):
        with open(f"{database.database}-migration.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield
    else:
        yield


def open_database(url: str, migrations: Path) -> tuple[Engine, sessionmaker[Session]]:
    """Create an SQLite file's directory, migrate, and connect."""
    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    migrate(url, migrations)
    engine = create_engine(url, pool_pre_ping=True)
    if engine.dialect.name == "sqlite":
        event.listen(engine, "connect", _sqlite_pragmas)
    return engine, sessionmaker(engine, expire_on_commit=False)


def _sqlite_pragmas(connection, _record) -> None:
    """Write-ahead logging: readers (fetch threads, the API) never wait for a writer, and a
    commit appends to the log instead of syncing the database file each time. Foreign keys
    enforced, as PostgreSQL does: a deleted row's dependants go with it (ON DELETE CASCADE)."""
    cursor = connection.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA busy_timeout=10000")
    cursor.close()
