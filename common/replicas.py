"""Load reports: what every prefill and decode replica tells the routers, several times a second.

A replica's report says which partitions of its stage's topic it owns (a job sent to one of
them reaches that replica), how far it has read them, the work it holds, the room it has, how
fast it measured itself, and which prefixes it holds in its own memory (tier 0). Reports go
to the `replicas` topic, keyed by replica (a short-lived topic: compacted to the last report,
gone after a minute); every router, and the gateway's admission control, reads them into a
`ReplicaTable`. A replica whose last report is older than `stale_after` is out of rotation:
stopped, dead, or cut off, it gets no new jobs until it reports again.

The report is built on the worker's own thread (it alone may read the engine) and sent from a
thread of its own, so a replica deep in a long step still says it is alive.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, get_args

from pydantic import BaseModel, Field, PrivateAttr, ValidationError

from common.bus import Bus
from common.prefixes import base_length
from common.topics import Topic, topic_name

log = logging.getLogger(__name__)

Stage = Literal["encoder", "prefill", "decode"]
REPORT_SECONDS = 0.25  # how often a replica reports
STALE_SECONDS = 1.5  # a replica silent this long is out of rotation


class LoadReport(BaseModel):
    replica: str
    stage: Stage
    sent_at: float = Field(default_factory=time.time)
    partitions: list[int] = Field(default_factory=list)  # of the stage's topic, owned now
    consumed: dict[int, int] = Field(default_factory=dict)  # partition -> next offset it has taken in
    queued_jobs: int = 0  # taken in, not yet running in the engine (loading, or waiting for room)
    running_jobs: int = 0
    queued_tokens: int = 0  # prefill: prompt tokens still to compute, over every job it holds
    free_blocks: int = 0
    total_blocks: int = 0
    free_slots: int = 0  # batch slots (sequences the engine can run at once) not in use
    max_slots: int = 0
    # prefill: a prompt's last tokens this replica always computes itself (V4.1's
    # prefill_keep_tokens): it starts no prompt from a prefix longer than the rest
    keep_tokens: int = 0
    tokens_per_second: float = 0.0  # prefill: measured compute speed (0: not measured yet)
    load_tokens_per_second: float = 0.0  # prefill: measured speed of loads from the cache service
    step_seconds: float = 0.0  # decode: measured step time
    resident: list[tuple[int, str, str]] = Field(default_factory=list)  # tier 0: (tokens, base key, key)
    _by_base: dict[tuple[int, str], list[tuple[int, str]]] | None = PrivateAttr(default=None)

    def by_base(self) -> dict[tuple[int, str], list[tuple[int, str]]]:
        """The resident prefixes by (base length, base key) (common/prefixes.py): built once."""
        if self._by_base is None:
            index: dict[tuple[int, str], list[tuple[int, str]]] = {}
            for n, base, key in self.resident:
                index.setdefault((base_length(n), base), []).append((n, key))
            self._by_base = index
        return self._by_base


def replica_name(stage: str) -> str:
    """A replica's name: its stage, host and process, unique across restarts."""
    return f"{stage}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"


@dataclass
class Dispatch:
    """A job a router sent to a replica that the replica's last report does not count yet."""

    partition: int
    offset: int
    cost: int  # prefill: tokens to compute; decode: state blocks it will hold
    at: float = field(default_factory=time.monotonic)


class ReplicaTable:
    """The replicas of every stage as this process sees them: their last reports, and the jobs
    this process sent them since (work in flight counts from the moment it is sent, so a
    burst spreads out before the next reports arrive)."""

    def __init__(self, stale_after: float = STALE_SECONDS, clock: Callable[[], float] = time.time):
        self.stale_after = stale_after
        self.clock = clock
        self._lock = threading.Lock()
        self._reports: dict[str, LoadReport] = {}
        self._sent: dict[str, list[Dispatch]] = {stage: [] for stage in get_args(Stage)}

    def update(self, report: LoadReport) -> None:
        with self._lock:
            known = self._reports.get(report.replica)
            if known is None or known.sent_at <= report.sent_at:
                self._reports[report.replica] = report

    def live(self, stage: str) -> list[LoadReport]:
        """The replicas in rotation: reported recently, and owning a partition to send to."""
        now = self.clock()
        with self._lock:
            return [
                r
                for r in self._reports.values()
                if r.stage == stage and now - r.sent_at <= self.stale_after and r.partitions
            ]

    def all(self) -> list[LoadReport]:
        with self._lock:
            return sorted(self._reports.values(), key=lambda r: (r.stage, r.replica))

    def sent(self, stage: str, dispatch: Dispatch) -> None:
        with self._lock:
            self._sent[stage].append(dispatch)

    def in_flight(self, report: LoadReport) -> list[Dispatch]:
        """What this process sent to the replica's partitions that its report does not count:
        past the offset it had read up to."""
        with self._lock:
            owned, read = set(report.partitions), report.consumed
            return [
                d for d in self._sent[report.stage] if d.partition in owned and d.offset >= read.get(d.partition, 0)
            ]

    def forget_counted(self) -> None:
        """Drop the dispatches some report has counted already (or older than a minute: sent to
        a partition nobody reads)."""
        now = time.monotonic()
        with self._lock:
            for stage, sent in self._sent.items():
                read: dict[int, int] = {}  # partition -> the furthest any replica of the stage has read it
                for report in self._reports.values():
                    if report.stage == stage:
                        for part, offset in report.consumed.items():
                            read[part] = max(read.get(part, 0), offset)
                self._sent[stage] = [d for d in sent if d.offset >= read.get(d.partition, 0) and now - d.at < 60]


class ReportListener(threading.Thread):
    """Reads every replica's reports into a table, on a thread of its own."""

    def __init__(
        self,
        bus: Bus,
        topic_prefix: str,
        table: ReplicaTable,
        stop: threading.Event | None = None,
        from_beginning: bool = False,
    ):
        """`from_beginning`: read the minute of reports the topic keeps first (a one-off look
        that must show every replica at once); else from the next report on (a router)."""
        super().__init__(name="replica-reports", daemon=True)
        self.bus, self.table, self.from_beginning = bus, table, from_beginning
        self.topic = topic_name(Topic.REPLICAS, topic_prefix)
        self.stopping = stop or threading.Event()

    def run(self) -> None:
        reader = None
        while not self.stopping.is_set():
            try:
                if reader is None:  # every report, for this process alone
                    reader = self.bus.reader([self.topic], self.from_beginning)
                for record in reader.poll(timeout=0.1):
                    try:
                        self.table.update(LoadReport.model_validate_json(record.value))
                    except ValidationError as err:
                        log.warning("ignoring a load report that is not one: %s", err)
                self.table.forget_counted()
            except Exception:  # the broker is away: reports resume when it is back
                log.exception("reading load reports failed; retrying")
                self.stopping.wait(1.0)
        if reader is not None:
            reader.close()

    def stop(self) -> None:
        self.stopping.set()


class Reporter(threading.Thread):
    """Sends a replica's latest report every `interval` seconds, stamped with the time it is sent."""

    def __init__(
        self, bus: Bus, topic_prefix: str, latest: Callable[[], LoadReport | None], interval: float = REPORT_SECONDS
    ):
        super().__init__(name="load-reports", daemon=True)
        self.bus, self.latest, self.interval = bus, latest, interval
        self.topic = topic_name(Topic.REPLICAS, topic_prefix)
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(self.interval):
            report = self.latest()
            if report is None:
                continue
            try:
                stamped = report.model_copy(update={"sent_at": time.time()})
                self.bus.produce(self.topic, report.replica, stamped.model_dump_json().encode())
            except Exception:  # the broker is away: routers count this replica out until it is back
                log.warning("sending a load report failed", exc_info=True)

    def stop(self) -> None:
        self.stopping.set()
