"""Access to the real infrastructure `scripts/stack up` starts (Kafka, PostgreSQL, Redis).

`make test` starts the stack and sets DEEPMESH_REQUIRE_INFRA=1, so a test that needs a
service fails if it is missing. Run by hand without the stack, those tests are skipped.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

if TYPE_CHECKING:
    from collections.abc import Callable

    from kafka.admin import KafkaAdminClient

# How long a consumer the tests kill or stop keeps its partitions before the group moves them: the
# least scripts/stack's broker allows (group.min.session.timeout.ms), three heartbeats (common/bus.py)
SESSION_TIMEOUT_MS = 3_000
# The stopped-member test's, run beside the other tier's worker: at 3 s, once in several runs, its
# member resumed and heard nothing from the group within 30 s; at 6 s it has held in every run.
STOPPED_MEMBER_SESSION_MS = 6_000


class BrokerNames:
    """The topics and consumer groups on the stack's broker when a run starts: at its end, those
    that appeared during the run are deleted, so that runs do not pile them up: a broker restarted
    after a SIGKILL, as the chaos test does, recovers every partition it holds before it answers.
    What appeared during the run may be another run's too (a second pytest beside `make test`):
    a topic that a live consumer subscribes to stays, as does a group that has members."""

    def __init__(self, bootstrap: str):
        self.bootstrap = bootstrap
        self.topics, self.groups = self._names()

    @classmethod
    def taken(cls, bootstrap: str) -> BrokerNames | None:
        """The names now, or None where no broker answers (the tests that need one say so)."""
        from kafka.errors import KafkaError

        try:
            return cls(bootstrap)
        except KafkaError:
            return None

    def _admin(self) -> KafkaAdminClient:
        from kafka.admin import KafkaAdminClient

        return KafkaAdminClient(bootstrap_servers=self.bootstrap, client_id="tests-cleanup")

    def _names(self) -> tuple[set[str], set[str]]:
        admin = self._admin()
        try:
            return set(admin.list_topics()), {group["group_id"] for group in admin.list_groups()}
        finally:
            admin.close()

    @staticmethod
    def _subscribed(admin: KafkaAdminClient, groups: set[str]) -> set[str]:
        """The topics that some live member of these groups subscribes to."""
        described = admin.describe_groups(sorted(groups)) if groups else {}
        return {
            topic
            for group in described.values()
            for member in group.get("members") or []
            for topic in (member.get("member_metadata") or {}).get("topics") or []
        }

    def delete_new(self, only: Callable[[str], bool] = lambda name: True) -> str | None:
        """Delete what appeared since (of it, the names `only` accepts) and nobody reads; what went
        wrong, if anything did."""
        from kafka.errors import KafkaError

        try:
            topics, groups = self._names()
            admin = self._admin()
            try:
                if new_groups := sorted(g for g in groups - self.groups if only(g)):
                    admin.delete_groups(new_groups)  # a group that still has members stays
                read = self._subscribed(admin, groups)
                if new_topics := sorted(t for t in topics - self.topics if only(t) and t not in read):
                    admin.delete_topics(new_topics)
            finally:
                admin.close()
        except KafkaError as error:
            return f"{type(error).__name__}: {error}"
        return None


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def require_service(env_var: str) -> str:
    value = os.environ.get(env_var)
    if value:
        return value
    if os.environ.get("DEEPMESH_REQUIRE_INFRA") == "1":
        pytest.fail(f"{env_var} is not set: start the stack with scripts/stack up")
    pytest.skip(f'{env_var} not set (run `eval "$(scripts/stack up)"` or `make test`)')


def fresh_database(tmp_path) -> str:
    """A new, empty database: a schema of its own in the stack's PostgreSQL (so tests never see
    each other's rows), or an SQLite file when run by hand without the stack."""
    import uuid

    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    url = os.environ.get("DEEPMESH_DATABASE_URL")
    if not url:
        if os.environ.get("DEEPMESH_REQUIRE_INFRA") == "1":
            require_service("DEEPMESH_DATABASE_URL")
        return f"sqlite:///{tmp_path}/deepmesh-{uuid.uuid4().hex[:8]}.db"
    schema = f"test_{uuid.uuid4().hex[:12]}"
    engine = create_engine(url)
    with engine.begin() as connection:
        connection.execute(text(f'CREATE SCHEMA "{schema}"'))
    engine.dispose()
    return make_url(url).update_query_dict({"options": f"-csearch_path={schema}"}).render_as_string(hide_password=False)


def scratch_store(tmp_path, memory_bytes: int | None = 1 << 30):
    """A cache store of its own: memory (0: every blob goes straight to disk), a disk directory
    (`tmp_path / "kv"`) and a fresh catalog."""
    from cache_svc.catalog import Catalog
    from cache_svc.store import StateStore
    from cache_svc.tiers import DirectoryTier, MemoryTier

    return StateStore(
        Catalog(fresh_database(tmp_path)), [MemoryTier(memory_bytes), DirectoryTier(tmp_path / "kv", None)]
    )


def wait_until_up(url: str, processes: list[subprocess.Popen], timeout: float, where: str) -> None:
    """Wait for `url` to answer 200, failing as soon as one of the processes behind it dies."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        dead = [p.args for p in processes if p.poll() is not None]
        assert not dead and time.monotonic() < deadline, f"{url} did not come up (dead: {dead}); {where}"
        time.sleep(0.2)


class CacheProcess:
    """`deepmesh cache` as a process of its own, with its log in `root`."""

    def __init__(self, root, env: dict[str, str], name: str):
        self.root, self.env, self.name = root, env, name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self) -> CacheProcess:
        log = open(self.root / f"{self.name}.log", "a")  # noqa: SIM115 (lives with the process)
        command = [sys.executable, "-m", "deepmesh.cli", "cache", "--port", str(self.port)]
        command += ["--dir", str(self.root / f"{self.name}-disk")]
        self.process = subprocess.Popen(command, env=self.env, stdout=log, stderr=log)
        wait_until_up(f"{self.url}/healthz", [self.process], 60, f"see {self.root}")
        return self

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)


def thread_cpu_seconds(thread: threading.Thread) -> float:
    """The CPU time a thread of this process has used so far (Linux's per-thread counters)."""
    fields = Path(f"/proc/self/task/{thread.native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
