"""The gateway's two readers of `results`: the router, which hands each waiting call its job's
events, and the recorder, which stores async jobs' events and outcomes.

Both rebuild a job's event stream from messages that a replaying tokenizer may repeat or
regroup (common/job_streams.py): each event reaches its waiter, and the job store, once and
in order. They run on threads of their own and are plain classes: tests drive them directly.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from common.bus import Bus, Record
from common.job_streams import StreamCursor
from common.messages import Envelope, ResultPayload, Usage, decode
from common.worker import Watermarks
from gateway.jobs import JobStore
from gateway.ledger import Ledger

Delivery = tuple[asyncio.Queue, ResultPayload]
log = logging.getLogger(__name__)


def read_result(record: Record) -> tuple[Envelope, ResultPayload] | None:
    """A results record, or None for one that is not: the topic is public, producers own their records."""
    try:
        envelope = decode(record.value, "result")
        return envelope, ResultPayload.model_validate(envelope.payload)
    except ValueError:
        return None


@dataclass
class _Watch:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    cursor: StreamCursor[ResultPayload] = field(default_factory=StreamCursor)
    done: bool = False


@dataclass
class ResultRouter:
    """Reads `results` on a thread and hands each job's events, in order and once, to its waiter."""

    bus: Bus
    topic: str
    _watches: dict[str, _Watch] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    ready: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="results-router", daemon=True)
        self._thread.start()
        if not self.ready.wait(timeout=60):
            raise RuntimeError("could not subscribe to the results topic")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def watch(self, job_id: str) -> asyncio.Queue:
        """Register interest before the request is produced, so no result can be missed."""
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._watches[job_id] = _Watch(asyncio.get_running_loop(), queue)
        return queue

    def forget(self, job_id: str) -> None:
        with self._lock:
            self._watches.pop(job_id, None)

    def _run(self) -> None:
        # every partition, from the next result on: only this gateway's calls, made from now on,
        # are waited for (a reader: nothing to commit, no group to join before the first call)
        reader = self.bus.reader([self.topic])
        try:
            self.ready.set()
            while not self._stop.is_set():
                try:
                    self.route(reader.poll(timeout=0.2))
                except Exception:  # the broker away: the waiters wait, the thread carries on
                    log.exception("reading results failed; retrying")
                    self._stop.wait(1.0)
        finally:
            reader.close()

    def route(self, records: list[Record]) -> None:
        """Hand a poll's new events to their waiters: each event loop gets them in one wake-up."""
        batches: dict[asyncio.AbstractEventLoop, list[Delivery]] = {}
        for record in records:
            read = read_result(record)
            if read is None:
                continue
            envelope, result = read
            with self._lock:
                watch = self._watches.get(envelope.job_id)
                if watch is None:
                    continue  # another gateway's job, or one whose caller has gone
                for message, taken in watch.cursor.take(envelope.seq, len(result.events), result):
                    if watch.done or (taken == len(message.events) and not message.done):
                        continue  # nothing the waiter has not had
                    watch.done = message.done
                    fresh = message.model_copy(update={"events": message.events[taken:]}) if taken else message
                    batches.setdefault(watch.loop, []).append((watch.queue, fresh))
        for loop, deliveries in batches.items():
            loop.call_soon_threadsafe(_deliver, deliveries)


def _deliver(deliveries: list[Delivery]) -> None:
    for queue, result in deliveries:
        queue.put_nowait(result)


@dataclass
class JobRecorder:
    """Stores the results of async jobs (status, events, outcome). One consumer group for all
    gateway replicas, so each results message is stored by one of them; storing is idempotent
    (events go in by their index), so a replayed or regrouped message changes nothing."""

    bus: Bus
    topic: str
    group: str  # shared by every gateway of the deployment
    store: JobStore
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    # Ids with nothing to record: synchronous calls (most of the traffic) and ended jobs. A job's
    # row is written before its request is produced, so one lookup per id settles it.
    _ignored: OrderedDict[str, None] = field(default_factory=OrderedDict)
    # jobs that keep only their outcome (stored responses answered as they ran): until their
    # last message, nothing to store
    _outcome_only: OrderedDict[str, None] = field(default_factory=OrderedDict)
    # messages that start past the events stored so far, until the ones before them arrive
    _ahead: dict[str, list[tuple[Record, Envelope, ResultPayload]]] = field(default_factory=dict)
    watermarks: Watermarks = field(default_factory=Watermarks)  # a held message's record stays uncommitted
    ledger: Ledger | None = None  # where every answered job's usage goes (sync calls' too)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="job-recorder", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        consumer = self.bus.consumer([self.topic], self.group)
        failed = False
        committed: dict[tuple[str, int], int] = {}
        try:
            while not self._stop.is_set():
                try:
                    if failed:  # read again from the last commit: storing is idempotent
                        consumer.rewind()
                        self._ahead.clear()
                        self.watermarks, committed = Watermarks(), {}
                        failed = False
                    self.record(consumer.poll(timeout=0.2))
                    # only what moved, as the workers commit: a commit is a round trip to the
                    # broker, and five a second cost an idle gateway 1% of a core
                    offsets = self.watermarks.offsets()
                    if offsets != committed and consumer.commit(offsets):
                        committed = offsets
                except Exception:  # the broker or the database away
                    log.exception("recording job results failed; reading them again")
                    failed = True
                    self._stop.wait(1.0)
        finally:
            consumer.close()

    def ignore(self, job_id: str) -> None:
        """A synchronous call's job, which has no row: its results are not looked up in the store.
        Called by the handler before the job is produced, so that its first token does not wait
        beside a database query (where several gateways share the results, another one's recorder
        may still look it up once)."""
        _remember(self._ignored, job_id)

    def record(self, records: list[Record]) -> None:
        answered: list[tuple[str, Usage]] = []
        for record in records:
            self.watermarks.seen(record)
            read = read_result(record)
            if read is None:
                continue
            envelope, result = read
            if result.done and result.usage is not None:
                answered.append((envelope.job_id, result.usage))
            waiting_for_end = envelope.job_id in self._outcome_only and not result.done
            if envelope.job_id not in self._ignored and not waiting_for_end:
                self._store(record, envelope, result)
        if self.ledger is not None:
            self.ledger.record(answered)  # before the commit: a failure reads these again

    def _store(self, record: Record, envelope: Envelope, result: ResultPayload) -> None:
        job_id = envelope.job_id
        events = [(e.name, e.data) for e in result.events]
        outcome = self.store.record(
            job_id, envelope.seq, events, result.done, result.status, result.body, result.done_data
        )
        if outcome == "gap":
            self._ahead.setdefault(job_id, []).append((record, envelope, result))
            self.watermarks.hold(record, job_id)
        elif outcome in ("ignored", "outcome_only"):
            _remember(self._ignored if outcome == "ignored" else self._outcome_only, job_id)
        if outcome != "gap" and job_id in self._ahead:  # the stored events may close the gap
            waiting = sorted(self._ahead.pop(job_id), key=lambda held: held[1].seq)
            self.watermarks.release(job_id)
            for held in waiting:
                self._store(*held)


def _remember(ids: OrderedDict[str, None], job_id: str) -> None:
    """Keep an id among the newest 100,000 (written from the event loop and the recorder's thread:
    each dict operation is atomic)."""
    ids[job_id] = None
    if len(ids) > 100_000:
        ids.popitem(last=False)
