"""The two SQL schemas (the gateway's jobs, files, batches, keys and usage; the cache catalog) as
processes bring them up through their Alembic migrations, on PostgreSQL (the stack's) and on an
SQLite file (the default): each schema as its models declare it, by Alembic's own comparison; and
several processes starting together on a new database, as a gateway and its batch runner or
replicas of the cache do."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine

from cache_svc import catalog
from gateway import jobs
from tests.support.infra import fresh_database

ROOT = Path(__file__).resolve().parents[2]
# each schema: its migrations, the table that holds its revision, and the class a service opens it with
SCHEMAS = {
    "jobs": (jobs.MIGRATIONS, "alembic_version", "gateway.jobs:JobStore"),
    "catalog": (catalog.MIGRATIONS, "cache_alembic_version", "cache_svc.catalog:Catalog"),
}


def postgresql_here() -> bool:
    """The stack's PostgreSQL is up, or required (fresh_database then fails without it)."""
    return bool(os.environ.get("DEEPMESH_DATABASE_URL")) or os.environ.get("DEEPMESH_REQUIRE_INFRA") == "1"


def new_database(backend: str, tmp_path: Path) -> str:
    """A new, empty database: a schema of its own in the stack's PostgreSQL, or an SQLite file."""
    if backend == "sqlite":
        return f"sqlite:///{tmp_path}/{uuid.uuid4().hex[:8]}.db"
    if not postgresql_here():
        pytest.skip("no PostgreSQL: scripts/stack up")
    return fresh_database(tmp_path)


def revision_of(url: str, schema: str) -> tuple[str, ...]:
    _, version_table, _ = SCHEMAS[schema]
    engine = create_engine(url)
    with engine.connect() as connection:
        heads = MigrationContext.configure(connection, opts={"version_table": version_table}).get_current_heads()
    engine.dispose()
    return heads


def head_of(schema: str) -> tuple[str, ...]:
    return tuple(ScriptDirectory(str(SCHEMAS[schema][0])).get_heads())


# In a process of its own, as a service and then a developer run them: the models `alembic check`
# compares are the ones the schema's env.py imports, not whatever a test process has imported.
LIFECYCLE = """
import importlib, sys
from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine, inspect
url, migrations, opener = sys.argv[1:]
module, name = opener.split(":")
getattr(importlib.import_module(module), name)(url).engine.dispose()  # as a service opens it
config = Config()
config.set_main_option("script_location", migrations)
config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
command.check(config)
command.downgrade(config, "base")
engine = create_engine(url)
print("left:", sorted(inspect(engine).get_table_names()), flush=True)
engine.dispose()
command.upgrade(config, "head")
command.check(config)
"""


@pytest.mark.parametrize("schema", list(SCHEMAS))
@pytest.mark.parametrize("backend", ["postgresql", "sqlite"])
def test_a_schema_migrated_up_down_and_up_again_is_what_its_models_declare(backend, schema, tmp_path):
    """`alembic check` compares the migrated database with the models (every table, column and
    index): a model that declares what no migration makes, or a migration that makes what no
    model declares, fails it. It failed on the gateway's four composite indexes, which no model
    declared, and on its files, batches, keys and usage tables, whose models its env.py did not
    import. Then every downgrade runs, leaving only the version table, and the upgrades again."""
    url = new_database(backend, tmp_path)
    migrations, version_table, opener = SCHEMAS[schema]
    lifecycle = subprocess.run(
        [sys.executable, "-c", LIFECYCLE, url, str(migrations), opener],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert lifecycle.returncode == 0, lifecycle.stderr[-3000:]
    assert f"left: {[version_table]}" in lifecycle.stdout.splitlines()  # the tables after the downgrades
    assert revision_of(url, schema) == head_of(schema)


# One process opening its schema's store for each database named on its stdin, once every process
# has been given it: the same moment for all, as near as the pipes allow.
OPENER = """
import importlib, sys
module, name = sys.argv[1].split(":")
opener = getattr(importlib.import_module(module), name)
print("ready", flush=True)
for url in sys.stdin:
    try:
        opener(url.strip()).engine.dispose()
        print("ok", flush=True)
    except Exception as error:
        print(repr(error).replace("\\n", " ")[:300], flush=True)
"""


def test_processes_that_start_together_on_a_new_database_all_come_up(tmp_path):
    """Three job stores and three catalogs open each new database at once (processes of their own,
    as a gateway, its batch runner and cache replicas start), three PostgreSQL schemas and three
    SQLite files in turn. Each process found no version table and created the tables: all but one
    failed on the tables' names, on PostgreSQL in 4 of 5 rounds (a gateway started by the system
    tests died of it), on SQLite in every round. A lock held while migrating (common/database.py)
    lets one process at a time bring the schema to its head."""
    backends = ("postgresql", "sqlite") if postgresql_here() else ("sqlite",)
    databases = [new_database(backend, tmp_path) for _ in range(3) for backend in backends]
    openers = [SCHEMAS[schema][2] for schema in ("jobs", "catalog") for _ in range(3)]
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", OPENER, opener], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for opener in openers
    ]
    try:
        assert [p.stdout.readline().strip() for p in processes] == ["ready"] * len(processes)
        for url in databases:
            for process in processes:
                process.stdin.write(url + "\n")
                process.stdin.flush()
            assert [p.stdout.readline().strip() for p in processes] == ["ok"] * len(processes), url
            for schema in SCHEMAS:
                assert revision_of(url, schema) == head_of(schema)
    finally:
        for process in processes:
            process.stdin.close()
        for process in processes:
            process.wait(timeout=30)
