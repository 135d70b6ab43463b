"""SQL databases with Alembic-owned schemas: the gateway's job store and the cache catalog."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker


def migrate(url: str, migrations: Path) -> None:
    """Bring the database to the newest revision of these migrations."""
    config = Config()
    config.set_main_option("script_location", str(migrations))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))  # configparser interpolates %
    command.upgrade(config, "head")


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
