"""The loop every service runs: poll, handle, produce downstream, commit what is safe to commit.

A job can stay in flight across many polls (decode holds it for its whole generation). A
partition is therefore committed only up to the oldest record whose job is not finished:
if the worker dies, whichever replica takes the partition over replays from there, and the
numbering of everything produced (common/job_streams.py) lets downstream drop what it has
seen. Produce waits for the broker's acknowledgement, so a commit that follows it covers
only work whose output is stored.

Two more ways to lose a job's work are handled here: a partition the group gives to another
replica (its jobs are dropped here, silently: the new owner replays them) and a step that
fails part way (every job in flight is dropped and the consumer goes back to its committed
offsets, so the work is really done again, not skipped).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, Generic, Protocol, TypeVar

from common import metrics
from common.bus import Bus, Headers, Record, produce_everywhere
from common.cache_entries import Stored
from common.messages import BadMessage, DeadLetter, DecodePayload, Envelope, PrefillPayload, decode, payload_of
from common.replicas import REPORT_SECONDS, LoadReport, ReplicaTable, Reporter, replica_name
from common.routing import Route, Router
from common.topics import Topic, topic_name
from common.tracing import Context, Span, SpanKind, headers_of, job_span, sender_span, within

log = logging.getLogger(__name__)


class Watermarks:
    """Commit positions per (topic, partition): up to the oldest record of a job still in flight."""

    def __init__(self) -> None:
        self._next: dict[tuple[str, int], int] = {}
        self._open: dict[tuple[str, int], dict[int, str]] = {}  # partition -> {offset: job id}

    def seen(self, record: Record) -> None:
        where = (record.topic, record.partition)
        self._next[where] = max(self._next.get(where, 0), record.offset + 1)

    def hold(self, record: Record, job_id: str) -> None:
        """Keep this record uncommitted until `release(job_id)`."""
        self.seen(record)
        self._open.setdefault((record.topic, record.partition), {})[record.offset] = job_id

    def release(self, job_id: str) -> None:
        for held in self._open.values():
            for offset in [o for o, j in held.items() if j == job_id]:
                del held[offset]

    def taken(self, topic: str) -> dict[int, int]:
        """Per partition of the topic, the offset after the last record taken in."""
        return {part: nxt for (t, part), nxt in self._next.items() if t == topic}

    def jobs(self, partitions: set[tuple[str, int]] | None = None) -> set[str]:
        """The jobs with records held, in these partitions (None: in any)."""
        return {
            j for where, held in self._open.items() if partitions is None or where in partitions for j in held.values()
        }

    def forget(self, partitions: set[tuple[str, int]]) -> None:
        """Partitions this worker no longer owns: their positions are their new owner's to commit."""
        for where in partitions:
            self._next.pop(where, None)
            self._open.pop(where, None)

    def offsets(self) -> dict[tuple[str, int], int]:
        return {where: min(self._open.get(where) or {nxt: None}) for where, nxt in self._next.items()}


class EarlyCancels:
    """Cancels that arrived before their job: it is dropped when it comes. A cancel can overtake
    its job (sent to every stage at once, it reaches a stage the job has not reached yet); one
    whose job never comes is forgotten after `limit` newer ones."""

    def __init__(self, limit: int = 100_000):
        self.limit = limit
        self._ids: OrderedDict[str, None] = OrderedDict()

    def add(self, job_id: str) -> None:
        self._ids[job_id] = None
        if len(self._ids) > self.limit:
            self._ids.popitem(last=False)

    def take(self, job_id: str) -> bool:
        """Whether this job was cancelled before it came (asked once, when it comes)."""
        return self._ids.pop(job_id, 0) is None


URGENT_FETCH_SECONDS = 0.02  # how long an engine sharing its thread waits for an interactive job's fetch
# how long, at most in a row, an engine whose steps come after first tokens (decode) and that holds
# batch work leaves a thread it shares to an interactive job on its way to its first token (see
# run_workers)
YIELD_SECONDS = 0.2


class OnTheirWay:
    """Interactive jobs on their way to a first token, written on one thread and asked about on
    another (see run_workers). One whose end this worker never saw stops counting after
    `expire_seconds`, so that nothing holds batch work for ever."""

    def __init__(self, expire_seconds: float = 10.0):
        self.expire_seconds = expire_seconds
        self._since: dict[str, float] = {}
        self._lock = threading.Lock()

    def add(self, job_id: str) -> None:
        with self._lock:
            self._since[job_id] = time.monotonic()

    def discard(self, job_id: str) -> None:
        with self._lock:
            self._since.pop(job_id, None)

    def __bool__(self) -> bool:
        oldest = time.monotonic() - self.expire_seconds
        with self._lock:
            for job_id in [j for j, since in self._since.items() if since < oldest]:
                del self._since[job_id]
            return bool(self._since)


class Worker:
    """Base for a service loop: subclasses set `topics` and `group` and implement `handle`."""

    topics: tuple[Topic, ...] = ()
    group = ""

    def __init__(self, bus: Bus, topic_prefix: str):
        self.bus = bus
        self.prefix = topic_prefix
        self.watermarks = Watermarks()
        self._consumer = None
        self._committed: dict[tuple[str, int], int] = {}
        self._owned: set[tuple[str, int]] = set()
        self.failed = False  # a step failed: recover before the next one
        self.wakeup: Any = None  # shared with the workers polled on the same thread (run_workers)

    def topic(self, topic: Topic) -> str:
        return topic_name(topic, self.prefix)

    @property
    def consumer_group(self) -> str:
        """Group ids are namespaced like topics: two deployments on one broker never share a group."""
        return f"{self.prefix}{self.group}"

    def handle(self, records: list[Record]) -> None:
        raise NotImplementedError

    def cancel(self, job_id: str) -> None:
        """Stop a job for good and free its state (stages whose topic carries cancels implement it)."""
        raise NotImplementedError

    def drop(self, job_id: str) -> bool:
        """Forget a job in flight without a word downstream, freeing its state: its records are
        delivered again, here or to another replica, which does the work again. False if the
        job is not here."""
        return False

    def job_message(self, record: Record, job_type: str, also: tuple[str, ...] = ()) -> Envelope | None:
        """The record's envelope if it is a `job_type` message (or of a type in `also`); a
        `cancel` goes to `cancel` and gives None; anything else is a BadMessage."""
        envelope = decode(record.value)
        if envelope.type == "cancel":
            self.cancel(envelope.job_id)
            self.watermarks.seen(record)
            return None
        if envelope.type != job_type and envelope.type not in also:
            raise BadMessage(f"envelope type {envelope.type!r} does not belong on the {job_type} topic")
        return envelope

    def idle(self) -> None:
        """Called after every poll: workers with jobs in flight do their work here."""

    @property
    def busy(self) -> bool:
        return False

    @property
    def urgent(self) -> bool:
        """It holds interactive work on its way to a first token (see run_workers)."""
        return False

    # its steps come after its jobs' first tokens (decode): sharing a thread, it may leave its turns
    # to the steps that compute another job's (run_workers, EngineWorker.yields_step)
    steps_after_first_tokens = False

    @property
    def yielding(self) -> bool:
        """It is leaving its turns to another job's first token."""
        return False

    def run_once(self, timeout: float = 0.1) -> None:
        if self._consumer is None:
            topics = [self.topic(t) for t in self.topics]
            self._consumer = self.bus.consumer(topics, self.consumer_group, wakeup=self.wakeup)
        if self.failed:
            self.recover()
        # busy: only a glance at the bus between engine steps (see Bus.busy_poll_timeout)
        records = self._consumer.poll(timeout=self.bus.busy_poll_timeout if self.busy else timeout)
        if self._consumer.membership_changed():
            # the group removed this replica (it was stopped, or cut off, past its session
            # timeout): its partitions' new owners redo its jobs from the committed offsets, so
            # what it holds is stale. Drop it all and start again from those offsets.
            log.warning("%s: the group removed this replica; its jobs go to the partitions' owners", self.group)
            self.recover()
            return
        owned = self._consumer.owned()
        if lost := self._owned - owned:  # a rebalance gave them to another replica, which replays their jobs
            log.info("%s: partitions %s moved away; dropping their jobs", self.group, sorted(lost))
            for job_id in self.watermarks.jobs(lost):
                self.drop(job_id)
            self.watermarks.forget(lost)
        self._owned = owned
        records = [r for r in records if (r.topic, r.partition) in owned]
        if records:
            for r in records:
                if log.isEnabledFor(logging.DEBUG):  # in the record's trace, with its job: the key
                    with within(sender_span(r.headers), r.key):
                        log.debug("%s: %s[%d]@%d", self.group, r.topic, r.partition, r.offset)
                metrics.CONSUMED.labels(self.group, r.topic.removeprefix(self.prefix)).inc()
            self.handle(records)
        self.idle()
        offsets = self.watermarks.offsets()
        # commit only what moved: an idle worker then never commits, and a commit refused
        # during a rebalance is not retried in a tight loop that keeps the rejoin from finishing
        if offsets != self._committed and self._consumer.commit(offsets):
            self._committed = offsets

    def run(self, stop: threading.Event) -> None:
        run_workers([self], stop)

    def recover(self) -> None:
        """After a failed step: go back to the committed offsets and drop every job in flight, so
        the records of those jobs come again and their work is redone, not skipped."""
        self._consumer.rewind()  # first: if the bus is down, this fails and is tried again
        for job_id in self.watermarks.jobs():
            self.drop(job_id)
        self.watermarks = Watermarks()
        self._committed = {}
        self.failed = False

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None
            self._committed = {}
            self._owned = set()

    def send(
        self, topic: Topic, envelope: Envelope, headers: Headers | None = None, partition: int | None = None
    ) -> tuple[int, int] | None:
        """Produce a job's message downstream (keyed by its job id, so a job's messages stay in
        order; in `partition`, if a router chose one); returns where it was stored."""
        stored = self.bus.produce_batch(self.topic(topic), [(envelope.job_id, envelope.encode(), headers, partition)])
        metrics.PRODUCED.labels(self.group, topic.value).inc()
        return stored[0] if stored else None

    def send_batch(self, topic: Topic, messages: list[tuple[Envelope, Headers | None]]) -> None:
        """Produce several jobs' messages at once (a step's tokens, a poll's results)."""
        if messages:
            self.bus.produce_batch(self.topic(topic), [(e.job_id, e.encode(), h) for e, h in messages])
            metrics.PRODUCED.labels(self.group, topic.value).inc(len(messages))

    def hop(self, topic: Topic, envelope: Envelope, parent: Context | Span | None) -> None:
        """Send a job on to its next stage in a producer span, whose context the record carries."""
        with job_span(f"send {topic.value}", envelope.job_id, parent, SpanKind.PRODUCER) as span:
            self.send(topic, envelope, headers_of(span))

    def dispatch(
        self, topic: Topic, envelope: Envelope, parent: Context | Span | None, router: Router, route: Route
    ) -> None:
        """`hop` to the replica a router chose (its name travels in a header: a replica that
        finds the job in a partition it took over from another knows it was meant elsewhere)."""
        with job_span(f"send {topic.value}", envelope.job_id, parent, SpanKind.PRODUCER) as span:
            span.set_attribute("deepmesh.route_reason", route.reason)
            headers = headers_of(span)
            if route.replica is not None:
                span.set_attribute("deepmesh.replica", route.replica)
                headers[ROUTED_TO] = route.replica.encode()
            router.sent(route, self.send(topic, envelope, headers, route.partition))

    def cancel_everywhere(self, topic: Topic, job_id: str, headers: Headers | None = None) -> None:
        """A cancel to every replica of a stage: a router sent the job to one of them."""
        cancel = Envelope(type="cancel", job_id=job_id).encode()
        produce_everywhere(self.bus, self.topic(topic), job_id, cancel, headers)

    def dead_letter(self, record: Record, error: BadMessage | Exception) -> None:
        """Park a record no worker can use, with the reason, and move on."""
        log.warning("dead-lettering %s/%s@%s: %s", record.topic, record.partition, record.offset, error)
        letter = DeadLetter.of(record, str(error), self.consumer_group)
        self.bus.produce(self.topic(Topic.DEAD_LETTER), record.key, letter.model_dump_json().encode())
        metrics.DEAD_LETTERS.labels(self.group, record.topic.removeprefix(self.prefix)).inc()
        self.watermarks.seen(record)


ROUTED_TO = "deepmesh-replica"  # header of a routed job's record: the replica it was sent to


class StageEngine(Protocol):
    """What an EngineWorker asks of its engine: the public API of engine.LLMEngine that workers
    use (its methods "for workers" and its requests in and outputs out). common imports no
    engine code, so the shape is stated here and LLMEngine has it."""

    def step(self) -> list[Any]: ...

    def has_unfinished_requests(self) -> bool: ...

    def has_request(self, request_id: str) -> bool: ...

    def abort(self, request_id: str) -> None: ...

    def hold_low_priority(self, hold: bool) -> None: ...

    def num_waiting(self) -> int: ...

    def num_running(self) -> int: ...

    def num_free_blocks(self) -> int: ...

    def num_blocks(self) -> int: ...

    def num_free_slots(self) -> int: ...

    def max_slots(self) -> int: ...

    def resident_summary(self, limit: int = 256) -> list[tuple[int, str, str]]: ...

    @property
    def prompt_keep_tokens(self) -> int: ...


class StateSaver(Protocol):
    """Where an EngineWorker stores states: engine.prefix_connector.PrefixConnector."""

    def save(
        self, job_id: str, tenant: str, retention_class: str, snapshot: Any, lease_seconds: float = 0.0
    ) -> Stored | None: ...


class EngineJob(Protocol):
    """A job an EngineWorker holds: its span, and its fetch until the cache has answered for it."""

    span: Span
    fetch: Future[Any] | None
    payload: PrefillPayload | DecodePayload


JobT = TypeVar("JobT", bound=EngineJob)
PayloadT = TypeVar("PayloadT", PrefillPayload, DecodePayload)


class ReplicaWorker(Worker):
    """A worker that is a replica of its stage: it reports its load (common/replicas.py) under its
    name, a fresh report for every one its reporter thread sends."""

    def __init__(self, bus: Bus, topic_prefix: str):
        super().__init__(bus, topic_prefix)
        self.replica = replica_name(self.group)
        self.report: LoadReport | None = None
        self._reported_at = 0.0
        self._reporter: Reporter | None = None

    def run_once(self, timeout: float = 0.1) -> None:
        if self._reporter is None:
            self._reporter = Reporter(self.bus, self.prefix, lambda: self.report)
            self._reporter.start()
        super().run_once(timeout)
        now = time.monotonic()
        if now - self._reported_at >= REPORT_SECONDS / 2:  # fresh for every report the reporter sends
            self._reported_at = now
            self.report = self.load_report()

    def load_report(self) -> LoadReport:
        """What this replica holds and has room for, read on its own thread."""
        raise NotImplementedError

    def close(self) -> None:
        super().close()
        if self._reporter is not None:
            self._reporter.stop()
            self._reporter = None


class EngineWorker(ReplicaWorker, Generic[JobT, PayloadT]):
    """A worker whose jobs run in an engine (prefill, decode): `jobs` maps a job id to its state,
    which has the job's `span` and, until the cache has answered for it, its `fetch` (a future
    from a fetch thread); `engine` holds a request per admitted job under the same id.

    Every engine stage takes its jobs in the same way (`handle`): a record is decoded (one no
    worker can use is dead-lettered), a cancel stops its job (`cancel`), a replay of a job here
    or a job cancelled before it came is passed over, a job meant for a replica that left goes
    on to another, and any other job is taken in (`arrived`, the stage's own) and its state
    fetched on a fetch thread (`_fetch`), then admitted to the engine once there (`_admit`).

    It is a replica of its stage: it reports its load (common/replicas.py) under its name, and,
    given the table of reports (`replicas`), sends a job that reaches it in a partition it took
    over from another replica to the replica with room for it now."""

    job_type: str  # the envelope type of this stage's jobs, on its topic
    payload_type: type[PayloadT]
    other_types: tuple[str, ...] = ()  # other envelope types on its topic: `other_message`
    engine: StageEngine
    cache: StateSaver

    # set by run_workers when engines share a thread: whether one of them holds interactive work
    # on its way to its first token (then every engine steps interactive work only)
    hold: Callable[[], bool] | None = None
    # set by run_workers on an engine whose steps come after first tokens, sharing its thread:
    # whether an interactive job is on its way to its first token (see `yields_step`)
    first_token_pending: Callable[[], bool] | None = None
    _yielding_since: float | None = None

    @property
    def yielding(self) -> bool:
        since = self._yielding_since
        return since is not None and time.monotonic() - since < YIELD_SECONDS

    def yields_step(self) -> bool:
        """Whether this turn's step waits: an interactive job is on its way to its first token, which
        the other engine on this thread computes, while this engine holds batch work, so that its
        step (of jobs that have had their first tokens) does not stand in the way. At most
        YIELD_SECONDS in a row, then one step. Among interactive jobs alone it steps as before:
        under a load generator's uniform traffic (aiperf, 32 in flight) the yield raised time to
        first token instead (docs/benchmarks.md)."""
        pending = self.first_token_pending is not None and self.first_token_pending()
        if pending and any(job.payload.priority == "batch" for job in self.jobs.values()):
            if self._yielding_since is None:
                self._yielding_since = time.monotonic()
            if self.yielding:
                return True
        self._yielding_since = None
        return False

    def step_engine(self) -> list:
        """One engine step, asking first whether batch work must wait (see `hold`)."""
        self.engine.hold_low_priority(self.hold is not None and self.hold())
        return self.engine.step()

    def __init__(self, bus: Bus, topic_prefix: str, fetch_threads: int = 2, replicas: ReplicaTable | None = None):
        super().__init__(bus, topic_prefix)
        self.jobs: dict[str, JobT] = {}
        self.cancelled = EarlyCancels()
        self.fetch_threads = fetch_threads
        # loads and stores of interactive jobs, and of batch jobs: apart, so that an interactive
        # job's never waits in a queue behind batch work's
        self.fetcher = self._fetch_pool()
        self.batch_fetcher = self._fetch_pool("batch")
        self.replicas = replicas

    def handle(self, records: list[Record]) -> None:
        for record in records:
            try:
                envelope = self.job_message(record, self.job_type, also=self.other_types)
                if envelope is None:
                    continue
                if envelope.type != self.job_type:
                    self.other_message(record, envelope)
                    self.watermarks.seen(record)
                    continue
                payload = payload_of(envelope, self.payload_type)
            except BadMessage as err:
                self.dead_letter(record, err)
                continue
            job_id = envelope.job_id
            if job_id in self.jobs:  # a replay
                self.passed_over(job_id, payload)
                self.watermarks.seen(record)
                continue
            if self.cancelled.take(job_id):  # cancelled before it came
                self.passed_over(job_id, payload)
                self.end_here(job_id)
                self.watermarks.seen(record)
                continue
            if self.rerouted(record, envelope, payload):
                continue
            job = self.jobs[job_id] = self.arrived(record, envelope, payload)
            job.fetch = self.fetch_pool(payload.priority).submit(self._fetch, job_id, job)
            self.watermarks.hold(record, job_id)
        metrics.RUNNING_JOBS.labels(self.group).set(len(self.jobs))

    def arrived(self, record: Record, envelope: Envelope, payload: PayloadT) -> JobT:
        """A new job for this stage: its state here, with its span started (its fetch follows)."""
        raise NotImplementedError

    def _fetch(self, job_id: str, job: JobT) -> Any:
        """On a fetch thread: what the job needs from the cache before the engine takes it (no
        engine work here: the engine has one thread); `_admit` gets it."""
        raise NotImplementedError

    def other_message(self, record: Record, envelope: Envelope) -> None:
        """A message of one of `other_types` (BadMessage if its payload is not one)."""
        raise BadMessage(f"envelope type {envelope.type!r} is not handled on the {self.job_type} topic")

    def passed_over(self, job_id: str, payload: PayloadT) -> None:
        """A job's message that will not run here: a replay of a job here, or a job cancelled
        before it came."""

    def cancel(self, job_id: str) -> None:
        """Stop a job now, wherever it is here; a cancel that comes first drops it on arrival."""
        job = self.jobs.get(job_id)
        if job is None:
            self.cancelled.add(job_id)
            return
        if job.fetch is None and self.cancel_started(job_id, job):
            return
        self.drop(job_id)
        self.end_here(job_id)
        self.watermarks.release(job_id)

    def cancel_started(self, job_id: str, job: JobT) -> bool:
        """Stop a job the engine has (its fetch is done) the stage's own way; False: it is dropped
        as one not started."""
        return False

    def load_report(self) -> LoadReport:
        topic = self.topic(self.topics[0])
        engine = self.engine
        fetching = sum(1 for job in self.jobs.values() if job.fetch is not None)
        report = LoadReport(
            replica=self.replica,
            stage=self.group,
            partitions=sorted(part for t, part in self._owned if t == topic),
            consumed=self.watermarks.taken(topic),
            queued_jobs=fetching + engine.num_waiting(),
            running_jobs=engine.num_running(),
            queued_tokens=self.queued_tokens(),
            free_blocks=engine.num_free_blocks(),
            total_blocks=engine.num_blocks(),
            free_slots=engine.num_free_slots(),
            max_slots=engine.max_slots(),
            resident=engine.resident_summary(),
            keep_tokens=engine.prompt_keep_tokens,
            **self.speeds(),
        )
        for measure in ("queued_jobs", "running_jobs", "queued_tokens", "free_blocks", "free_slots"):
            metrics.REPORTED_LOAD.labels(self.group, measure).set(getattr(report, measure))
        return report

    def queued_tokens(self) -> int:
        """Prompt tokens still to compute over every job held (prefill's work ahead of a new job)."""
        return 0

    def speeds(self) -> dict[str, float]:
        """What this replica measured of its speed, by LoadReport field."""
        return {}

    def route_again(self, router: Router, job_id: str, payload: PayloadT) -> Route:
        """Where this stage's router would send the job now."""
        raise NotImplementedError

    def rerouted(self, record: Record, envelope: Envelope, payload: PayloadT) -> bool:
        """Whether a job that was sent to another replica went on to the replica chosen for it
        now: it is in a partition this replica took over when that one left. Handled here
        (False) when this replica is the choice, or when nothing routes (no table of reports)."""
        sent_to = record.headers.get(ROUTED_TO)
        if self.replicas is None or sent_to is None or sent_to.decode() == self.replica:
            return False
        router = Router(self.replicas, self.group)
        chosen = self.route_again(router, envelope.job_id, payload)
        if chosen.replica in (None, self.replica):
            return False
        log.info("%s: %s was sent to %s, which left; on to %s", self.group, envelope.job_id, sent_to, chosen.replica)
        topic = Topic(record.topic.removeprefix(self.prefix))
        self.dispatch(topic, envelope, sender_span(record.headers), router, chosen)
        self.watermarks.seen(record)
        return True

    def _fetch_pool(self, kind: str = "") -> ThreadPoolExecutor:
        """The threads every cache call runs on: never the engine's."""
        return ThreadPoolExecutor(self.fetch_threads, thread_name_prefix=f"{self.group}-{kind}fetch")

    def fetch_pool(self, priority: str) -> ThreadPoolExecutor:
        """Where a job of this priority loads and stores its state."""
        return self.batch_fetcher if priority == "batch" else self.fetcher

    def save_later(
        self,
        job_id: str,
        span: Span,
        tenant: str,
        retention: str,
        state: Any,
        lease_seconds: float = 0.0,
        priority: str = "interactive",
    ) -> Future[Stored | None]:
        """Store a state (an engine StateSnapshot) where a longer prompt that starts with its tokens
        can resume, on a fetch thread (the engine goes on meanwhile); the future gives the stored
        entry, or None."""

        def save() -> Stored | None:
            with within(span, job_id):
                return self.cache.save(job_id, tenant, retention, state, lease_seconds)

        return self.fetch_pool(priority).submit(save)

    def close(self) -> None:
        """Stop consuming and reporting. Loads and stores under way finish on their threads (a
        fetched job is admitted if this worker runs again); new ones go to a fresh pool."""
        super().close()
        for pool in (self.fetcher, self.batch_fetcher):
            pool.shutdown(wait=False)
        self.fetcher, self.batch_fetcher = self._fetch_pool(), self._fetch_pool("batch")

    def admit_fetched(self) -> None:
        """Admit (`_admit`) every job whose fetch is done; with nothing else for the engine to
        do, wait a moment for one first. While batch work is held (`hold`), batch jobs wait here
        too: loading a state into the engine is the engine thread's time (a batch job's took
        2.5 ms, at most 350, beside a batch of 64 in flight), which an interactive job on its way
        to its first token would wait for."""
        fetching = [job.fetch for job in self.jobs.values() if job.fetch is not None]
        if fetching and not self.engine.has_unfinished_requests():
            wait(fetching, timeout=0.005, return_when=FIRST_COMPLETED)
        held = self.hold is not None and self.hold()
        if held:
            # engines share this thread: an interactive job not admitted now waits for the other
            # engine's step (tens of ms beside a batch); its lookup or load takes a few
            jobs = self.jobs.values()
            if urgent := [job.fetch for job in jobs if job.fetch is not None and job.payload.priority != "batch"]:
                wait(urgent, timeout=URGENT_FETCH_SECONDS)
        for job_id, job in list(self.jobs.items()):
            if job.fetch is not None and job.fetch.done() and not (held and job.payload.priority == "batch"):
                self._admit(job_id, job)

    def _admit(self, job_id: str, job: JobT) -> None:
        raise NotImplementedError

    def end_here(self, job_id: str) -> None:
        """A job ends in this stage without a finished tokens message (cancelled, or refused):
        say so on `tokens`, where the output side holds the job's start until the job ends."""
        self.send(Topic.TOKENS, Envelope(type="cancel", job_id=job_id))

    def drop(self, job_id: str) -> bool:
        """Forget a job wherever it is here (a prefill's fetch result is then dropped too) and free
        its state in the engine."""
        job = self.jobs.pop(job_id, None)
        if job is None:
            return False
        if self.engine.has_request(job_id):
            self.engine.abort(job_id)
        with within(job.span, job_id, end=True):
            job.span.set_attribute("deepmesh.finish", "dropped")
        metrics.RUNNING_JOBS.labels(self.group).set(len(self.jobs))
        return True


def run_workers(workers: list[Worker], stop: threading.Event, also_urgent: list[Worker] | None = None) -> None:
    """Run workers in turn on the calling thread until `stop` is set; each outlives any one failure.

    The embedded mode runs its prefill and decode workers together this way: PyTorch on CPU
    slows down ~1.7x as soon as two threads of a process run parallel operators (each gets an
    OpenMP pool, together they oversubscribe the cores, and the pools stop spinning between
    operators), so a process has one thread that runs engines. Its turns then cross: an
    interactive job waits for the steps of both engines at each hop (admission, prefill,
    hand-over), which is why batch work is held while one is on its way. `also_urgent`: workers
    on other threads of the process that know of such jobs earlier (the tokenizer, from the
    moment it sends the prompt on until the first token is back).
    """
    if len(workers) > 1 or also_urgent:
        # an interactive job on its way to its first token, in any of them: every engine steps
        # interactive work only, so that no step of batch work stands in its way (asked before
        # each step: the job may have arrived in the same turn)
        watched = [*workers, *(also_urgent or [])]
        for worker in workers:
            worker.hold = lambda: any(w.urgent for w in watched)
        # and an engine whose steps come after first tokens (decode), while it holds batch work,
        # leaves its turns to the steps that compute one (prefill's), for at most YIELD_SECONDS in a row
        before_first_tokens = [w for w in watched if not w.steps_after_first_tokens]
        for worker in workers:
            if worker.steps_after_first_tokens and len(workers) > 1:
                worker.first_token_pending = lambda: any(w.urgent for w in before_first_tokens)
    shared = len(workers) > 1 and (shared_wakeup := getattr(workers[0].bus, "shared_wakeup", None)) is not None
    if shared:
        # a record for one of them ends whichever's poll is waiting: none waits out the others'
        wakeup = shared_wakeup()
        for worker in workers:
            worker.wakeup = wakeup
    try:
        while not stop.is_set():
            for worker in workers:
                # while any of them has work in flight (asked anew: the one before may have just
                # taken a job), the others only glance at the bus; one leaving its turns waits on
                # the shared wake-up instead, which a record for any of them ends (where there is
                # none, a wait would hold up the other's record: it glances)
                busy = any(w.busy and not (shared and w.yielding) for w in workers)
                bus = workers[0].bus
                timeout = bus.busy_poll_timeout if busy else bus.idle_poll_timeout / len(workers)
                try:
                    worker.run_once(timeout)
                except Exception:
                    log.exception("%s worker: step failed; its jobs in flight are done again", worker.group)
                    metrics.WORKER_ERRORS.labels(worker.group).inc()
                    worker.failed = True
                    stop.wait(1.0)
    finally:
        for worker in workers:
            worker.close()
