"""Services as OS processes over the stack's real Apache Kafka, PostgreSQL and Redis: what the
distributed, routing, large-input and chaos tests run against."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx

from tests.support.behaviour import MODEL
from tests.support.infra import SESSION_TIMEOUT_MS, free_port, fresh_database, require_service, wait_until_up

ROOT = Path(__file__).resolve().parents[2]


def stack_up() -> None:
    """Kafka, PostgreSQL and Redis as `make test` starts them (`scripts/stack up`), their addresses in
    this process's environment: for a script that runs a cluster outside the test suite."""
    out = subprocess.run([str(ROOT / "scripts" / "stack"), "up"], check=True, capture_output=True, text=True).stdout
    for line in out.splitlines():
        name, _, value = line.removeprefix("export ").partition("=")
        os.environ[name] = value


@contextlib.contextmanager
def served_distributed(root: Path, model: Path, traces: Path | None = None) -> Iterator[str]:
    """Every service its own process over the stack's Kafka (started here if it is not), on
    `model`, logs under `root` and spans in `traces` (None: root/traces.jsonl): its gateway's URL
    (the benchmarks' distributed API). One torch thread a process, as the tests run a cluster
    (tests/conftest.py says why), and decode eager: no graphs compiling on a core beside the
    requests."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    stack_up()
    cluster = Cluster(root, model)
    if traces is not None:
        cluster.traces = traces
        cluster.env["DEEPMESH_TRACE_FILE"] = str(traces)
    cluster.env["DEEPMESH_LOG_LEVEL"] = "WARNING"
    cluster.env["DEEPMESH_COMPILE_DECODE"] = "false"
    cluster.env["DEEPMESH_COMPILE_PREFILL"] = "false"
    try:
        cluster.start(("cache", "gateway", "tokenizer", "prefill", "decode"))
        yield cluster.url
    finally:
        cluster.stop()


class Cluster:
    """Services as OS processes, sharing one topic prefix; logs and traces under `root`."""

    def __init__(self, root: Path, model: Path):
        self.root = root
        self.gateway_port, self.cache_port = free_port(), free_port()
        self.prefix = f"dist{uuid.uuid4().hex[:8]}."
        self.traces = root / "traces.jsonl"
        self.env = {
            **os.environ,
            "DEEPMESH_KAFKA_BOOTSTRAP": require_service("DEEPMESH_KAFKA_BOOTSTRAP"),
            "DEEPMESH_DATABASE_URL": fresh_database(root),  # jobs and the cache catalog, apart from other tests
            "DEEPMESH_TOPIC_PREFIX": self.prefix,
            "DEEPMESH_TOPIC_PARTITIONS": "2",
            "DEEPMESH_CACHE_URL": f"http://127.0.0.1:{self.cache_port}",
            "DEEPMESH_MODEL": str(model),
            "DEEPMESH_SERVED_MODEL_NAME": MODEL,
            "DEEPMESH_LOG_LEVEL": "DEBUG",
            "DEEPMESH_TRACE_EXPORTER": "jsonl",
            "DEEPMESH_TRACE_FILE": str(self.traces),
            "DEEPMESH_CLAIM_DIR": str(root / "claims"),
            "DEEPMESH_FILES_DIR": str(root / "files"),
            "DEEPMESH_REDIS_URL": require_service("DEEPMESH_REDIS_URL"),
            "DEEPMESH_BATCH_ROUND_SECONDS": "0.5",
            # a Celery worker killed mid-round leaves requests `sending`: sent again soon
            "DEEPMESH_BATCH_RESEND_AFTER_SECONDS": "3",
            # a killed worker's partitions move after 3 s instead of 10
            "DEEPMESH_KAFKA_SESSION_TIMEOUT_MS": str(SESSION_TIMEOUT_MS),
        }
        self.processes: dict[str, subprocess.Popen] = {}
        self.url = f"http://127.0.0.1:{self.gateway_port}"
        self.cache_url = self.env["DEEPMESH_CACHE_URL"]
        self.decode_metrics = ""

    def spawn(self, name: str, *extra: str) -> subprocess.Popen:
        if name == "decode":  # its /metrics tell the tests what decode holds
            port = free_port()
            extra = (*extra, "--metrics-port", str(port))
            self.decode_metrics = f"http://127.0.0.1:{port}/metrics"
        log = open(self.root / f"{name}-{len(self.processes)}.log", "w")  # noqa: SIM115 (lives with the process)
        command = [sys.executable, "-m", "deepmesh.cli", name, *extra]
        if name == "batches":  # the batch runner: Celery beat and a worker (gateway/batch_tasks.py)
            beat = ["--beat", "--schedule", str(self.root / "beat-schedule"), "--pool", "solo"]
            command = [sys.executable, "-m", "celery", "-A", "gateway.batch_tasks", "--quiet", "worker", *beat, *extra]
        # a process group of its own: Celery's embedded beat is a child of the worker, and outlives a
        # worker killed by a test unless its whole group is ended at stop()
        process = subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.processes[f"{name}-{process.pid}"] = process
        return process

    def start(
        self, services: tuple[str, ...] = ("cache", "gateway", "tokenizer", "prefill", "decode", "batches")
    ) -> Cluster:
        for name in services:
            if name == "cache":
                self.spawn("cache", "--port", str(self.cache_port), "--dir", str(self.root / "kv"))
            elif name == "gateway":
                self.spawn("gateway", "--port", str(self.gateway_port))
            else:
                self.spawn(name)
        wait_until_up(f"{self.url}/readyz", list(self.processes.values()), 180, f"see {self.root}")
        return self

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
            with contextlib.suppress(ProcessLookupError):  # what it left behind: a beat whose worker was killed
                os.killpg(process.pid, signal.SIGKILL)

    def decode_running(self) -> int:
        scraped = httpx.get(self.decode_metrics).text
        return int(float(re.search(r'^deepmesh_running_jobs\{service="decode"\} (\S+)$', scraped, re.M).group(1)))

    def pinned_by(self, holder: str) -> list[str]:
        from cache_svc.catalog import Catalog

        catalog = Catalog(self.env["DEEPMESH_DATABASE_URL"])
        try:
            return catalog.pinned_by(holder)
        finally:
            catalog.close()
