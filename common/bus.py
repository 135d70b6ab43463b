"""The message bus: Apache Kafka in production, an in-process stand-in for the embedded mode.

Both give the guarantees the services are written against, and the same contract tests run
on both (tests/integration/test_bus.py):

* a topic has partitions; records with the same key go to the same partition, in order;
* consumers in a group share a topic's partitions; every group sees every record;
* delivery is at-least-once: a consumer commits after it has acted on what it polled
  (typically after producing downstream), and records polled but not committed are
  delivered again to whichever consumer of the group owns the partition next;
* `produce` returns once the record is stored (acks=all on Kafka), headers included;
* a value above the claim store's threshold travels as a claim check (common/claims.py):
  records stay within Kafka's default limits, and consumers get the whole value back;
* a record may name its partition instead (a router sending a job to one replica: the
  replica that owns that partition), and `produce_batch` says where each record was stored;
* a reader reads every partition of its topics for its process alone, in no group: nothing to
  join, no heartbeats, nothing committed (a process's own view of the load reports, the
  results of its own calls).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
import uuid
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from common.claims import ClaimStore

Headers = dict[str, bytes]
# (key, value, headers) or (key, value, headers, partition): None or no partition: by the key
Outgoing = tuple[str, bytes, "Headers | None"] | tuple[str, bytes, "Headers | None", "int | None"]
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Record:
    topic: str
    partition: int
    offset: int
    key: str
    value: bytes
    headers: Headers = field(default_factory=dict)


class Consumer(Protocol):
    def poll(self, timeout: float = 1.0, max_records: int = 100) -> list[Record]: ...

    def commit(self, offsets: dict[tuple[str, int], int] | None = None) -> bool:
        """Mark records done for this consumer's group: everything polled so far, or, with
        `offsets`, each (topic, partition) up to (not including) the given offset. False if
        the commit did not happen (retry with the next one)."""

    def close(self) -> None: ...

    def wait_assigned(self, timeout: float) -> None:
        """Block until the group has given this consumer its partitions."""

    def owned(self) -> set[tuple[str, int]]:
        """The (topic, partition)s the group has given this consumer now."""

    def rewind(self) -> None:
        """Go back to the committed offset of every partition this consumer holds: what was
        polled since is delivered again."""

    def membership_changed(self) -> bool:
        """Whether this consumer is no longer the group member it was at the last call: the group
        removed it (stopped or cut off for longer than its session timeout) or it has joined again
        as a new member. Its partitions went to others meanwhile, who redo from the committed
        offsets what it held; what it still holds from before is stale (its first join is no change)."""


class Reader(Protocol):
    """What `Bus.reader` gives: records to poll, and nothing to commit."""

    def poll(self, timeout: float = 1.0, max_records: int = 100) -> list[Record]: ...

    def close(self) -> None: ...


class Bus(Protocol):
    busy_poll_timeout: float  # how long a worker with jobs in flight waits for records between steps
    # How long an idle worker waits for records. Workers that share a thread wait in turn, so
    # this bounds how late one of them sees a record that arrives while another waits.
    idle_poll_timeout: float

    def create_topics(self, names: Iterable[str], partitions: int, short_lived: bool = False) -> None:
        """Create the topics that do not exist yet; `short_lived`: one whose records are status
        that is stale within seconds (compacted to the last per key, deleted after a minute)."""

    def produce(
        self, topic: str, key: str, value: bytes, headers: Headers | None = None, partition: int | None = None
    ) -> tuple[int, int]:
        """Store one record (in `partition`, or by its key); returns (partition, offset)."""

    def produce_batch(self, topic: str, records: list[Outgoing]) -> list[tuple[int, int]]:
        """Several records at once, in order per partition; returns once all are stored, with
        where each one was: (partition, offset)."""

    def produce_waits(self, size: int) -> bool:
        """Whether producing a value of `size` bytes waits on more than this process's memory (a
        broker, a file): an event loop then produces on a thread."""

    def partitions(self, topic: str) -> int:
        """How many partitions the topic has."""

    def consumer(self, topics: Iterable[str], group: str, from_beginning: bool = True, wakeup: Any = None) -> Consumer:
        """A group member; a group with no committed offsets starts at the oldest record, or with
        from_beginning=False at the next record produced. `wakeup`: what the MemoryBus's
        `shared_wakeup` gave, shared by consumers polled in turn on one thread (Kafka's ignore it)."""

    def reader(self, topics: Iterable[str], from_beginning: bool = False) -> Reader:
        """Every partition of the topics, for this process alone: from the next record produced
        after this returns, or with from_beginning=True from the oldest one kept."""

    def close(self) -> None: ...


def partition_for(key: str, partitions: int) -> int:
    return zlib.crc32(key.encode()) % partitions


def produce_everywhere(bus: Bus, topic: str, key: str, value: bytes, headers: Headers | None = None) -> None:
    """One record in every partition of the topic: a cancel reaches the job wherever a router sent it."""
    bus.produce_batch(topic, [(key, value, headers, p) for p in range(bus.partitions(topic))])


def _checked_in(claims: ClaimStore | None, records: list[Outgoing]) -> list[tuple[str, bytes, Headers | None, Any]]:
    """Every record as (key, value, headers, partition), its value a claim check if it is large."""
    out = []
    for key, value, headers, *partition in records:
        value = claims.check_in(key, value) if claims is not None else value
        out.append((key, value, headers, partition[0] if partition else None))
    return out


def _checked_out(claims: ClaimStore | None, records: list[Record]) -> list[Record]:
    if claims is None:
        return records
    out = []
    for record in records:  # every record a consumer polls passes here: a new one only for a claim
        value = claims.check_out(record.value)
        out.append(record if value is record.value else dataclasses.replace(record, value=value))
    return out


# -- in-process ---------------------------------------------------------------------------------

SHORT_LIVED_RECORDS = 1024  # per partition of a short-lived topic, the newest records the in-process bus keeps


class _PartitionLog:
    """One partition's records from offset `start` on: a short-lived topic's (`keep` set) drops
    its oldest, and a consumer positioned before them starts at the oldest kept, as Kafka's do
    when retention has deleted what they had not read."""

    def __init__(self, keep: int | None = None):
        self.records: list[Record] = []
        self.start = 0
        self.keep = keep

    @property
    def end(self) -> int:
        return self.start + len(self.records)

    def append(self, topic: str, part: int, key: str, value: bytes, headers: Headers | None) -> int:
        offset = self.end
        self.records.append(Record(topic, part, offset, key, value, dict(headers or {})))
        if self.keep is not None and len(self.records) >= 2 * self.keep:  # trimmed in bulk, now and then
            dropped = len(self.records) - self.keep
            del self.records[:dropped]
            self.start += dropped
        return offset

    def read(self, position: int, limit: int) -> tuple[list[Record], int]:
        """Up to `limit` records from `position` on, and the position after them."""
        begin = max(position, self.start)
        taken = self.records[begin - self.start : begin - self.start + limit]
        return taken, begin + len(taken)


class MemoryBus:
    """Kafka's delivery model inside one process, for the embedded mode and fast tests."""

    busy_poll_timeout = 0.0  # a poll sees every record already produced
    idle_poll_timeout = 0.1  # a wait on a condition, which a record ends at once

    def __init__(self, claims: ClaimStore | None = None) -> None:
        self.claims = claims  # None: values of any size stay in the records (nothing limits them here)
        self._lock = threading.Lock()
        self._logs: dict[str, list[_PartitionLog]] = {}
        self._committed: dict[tuple[str, str, int], int] = {}  # (group, topic, partition) -> next offset
        self._members: dict[str, list[MemoryConsumer]] = {}

    def create_topics(self, names: Iterable[str], partitions: int, short_lived: bool = False) -> None:
        keep = SHORT_LIVED_RECORDS if short_lived else None
        with self._lock:
            for name in names:
                self._logs.setdefault(name, [_PartitionLog(keep) for _ in range(partitions)])

    def partitions(self, topic: str) -> int:
        with self._lock:
            return len(self._logs[topic])

    def produce(
        self, topic: str, key: str, value: bytes, headers: Headers | None = None, partition: int | None = None
    ) -> tuple[int, int]:
        return self.produce_batch(topic, [(key, value, headers, partition)])[0]

    def produce_waits(self, size: int) -> bool:
        return self.claims is not None and size > self.claims.threshold  # a claimed value is written to a file

    def produce_batch(self, topic: str, records: list[Outgoing]) -> list[tuple[int, int]]:
        checked = _checked_in(self.claims, records)
        stored = []
        with self._lock:
            if topic not in self._logs:
                raise KeyError(f"unknown topic {topic!r} (create it first)")
            log = self._logs[topic]
            for key, value, headers, partition in checked:
                part = partition_for(key, len(log)) if partition is None else partition
                stored.append((part, log[part].append(topic, part, key, value, headers)))
            # one wake-up per batch: a consumer then takes the whole step's records in one poll
            for members in self._members.values():
                for member in members:
                    if topic in member.topics:
                        member.wakeup.pending = True
                        member.wakeup.notify()
        return stored

    def consumer(
        self, topics: Iterable[str], group: str, from_beginning: bool = True, wakeup: Wakeup | None = None
    ) -> MemoryConsumer:
        with self._lock:
            topics = list(topics)
            missing = [t for t in topics if t not in self._logs]
            if missing:
                raise KeyError(f"unknown topics {missing} (create them first)")
            if not from_beginning:
                for topic in topics:
                    for part, log in enumerate(self._logs[topic]):
                        self._committed.setdefault((group, topic, part), log.end)
            member = MemoryConsumer(self, topics, group, wakeup)
            self._members.setdefault(group, []).append(member)
            self._rebalance(group)
            return member

    def shared_wakeup(self) -> Wakeup:
        """A wake-up for consumers that one thread polls in turn (run_workers): a record for any of
        them ends the wait of whichever is polling, or keeps it from starting, so none waits out
        another's poll."""
        return Wakeup(self._lock)

    def reader(self, topics: Iterable[str], from_beginning: bool = False) -> MemoryConsumer:
        return self.consumer(topics, f"reader-{uuid.uuid4().hex}", from_beginning)  # a group of its own

    def close(self) -> None:
        with self._lock:
            for members in self._members.values():
                for member in list(members):
                    member.closed = True
                    member.wakeup.notify()
            self._members.clear()

    def _rebalance(self, group: str) -> None:
        """Deal the group's partitions round-robin to its members; each restarts at the committed offset."""
        members = self._members.get(group, [])
        for member in members:
            member.positions = {}
        pairs = sorted({(t, p) for m in members for t in m.topics for p in range(len(self._logs[t]))})
        for i, (topic, part) in enumerate(pairs):
            owner = members[i % len(members)]
            if topic in owner.topics:
                owner.positions[(topic, part)] = self._committed.get((group, topic, part), 0)


class Wakeup(threading.Condition):
    """What a MemoryConsumer waits on; `pending`: a record came for one of the consumers that wait
    on it since the last wait ended (a notify reaches only a wait under way: where consumers share
    it, the record may be another's, produced while the thread was not waiting)."""

    def __init__(self, lock: threading.Lock):
        super().__init__(lock)
        self.pending = False


class MemoryConsumer:
    def __init__(self, bus: MemoryBus, topics: list[str], group: str, wakeup: Wakeup | None = None):
        self.bus, self.topics, self.group = bus, topics, group
        self.positions: dict[tuple[str, int], int] = {}
        self.closed = False
        # woken by produce() to one of this member's topics (or, shared, to another's its thread polls)
        self.wakeup = wakeup or Wakeup(bus._lock)

    def poll(self, timeout: float = 1.0, max_records: int = 100) -> list[Record]:
        return _checked_out(self.bus.claims, self._poll(timeout, max_records))

    def _poll(self, timeout: float, max_records: int) -> list[Record]:
        """What is there; else whatever a wait comes to: a record for this consumer, or for another
        that shares its wake-up (then nothing, early: the thread's next poll is that one's)."""
        with self.bus._lock:
            if self.closed:
                return []
            if records := self._read(max_records):
                return records
            if not self.wakeup.pending:
                self.wakeup.wait(timeout)
            self.wakeup.pending = False
            return [] if self.closed else self._read(max_records)

    def _read(self, max_records: int) -> list[Record]:
        records = []
        for (topic, part), position in self.positions.items():
            taken, after = self.bus._logs[topic][part].read(position, max_records - len(records))
            records.extend(taken)
            self.positions[(topic, part)] = after
            if len(records) >= max_records:
                break
        return records

    def commit(self, offsets: dict[tuple[str, int], int] | None = None) -> bool:
        with self.bus._lock:
            for (topic, part), position in (offsets if offsets is not None else self.positions).items():
                if (topic, part) in self.positions:  # only partitions this consumer still owns
                    self.bus._committed[(self.group, topic, part)] = position
        return True

    def wait_assigned(self, timeout: float) -> None:
        return  # partitions are dealt as soon as a member joins

    def owned(self) -> set[tuple[str, int]]:
        with self.bus._lock:
            return set(self.positions)

    def rewind(self) -> None:
        with self.bus._lock:
            for topic, part in self.positions:
                self.positions[(topic, part)] = self.bus._committed.get((self.group, topic, part), 0)

    def membership_changed(self) -> bool:
        return False  # in one process, a member is never cut off from its group

    def close(self) -> None:
        with self.bus._lock:
            if self.closed:
                return
            self.closed = True
            members = self.bus._members.get(self.group, [])
            if self in members:
                members.remove(self)
                self.bus._rebalance(self.group)
            self.wakeup.notify()


# -- Apache Kafka -------------------------------------------------------------------------------


# kafka-python backs off reconnecting exponentially up to 30 s: a service would then stay idle
# for up to half a minute after a restarted broker is back. A second at most, on a local network.
RECONNECT_BACKOFF_MAX_MS = 1_000


class KafkaBus:
    """kafka-python: an idempotent acks=all producer, consumer groups with manual commits."""

    # never zero: a zero-timeout poll lets kafka-python skip its network round, and new jobs
    # then starve behind running ones
    busy_poll_timeout = 0.002
    idle_poll_timeout = 0.1  # long enough for group joins and heartbeats to complete within a poll

    def __init__(
        self,
        bootstrap: str,
        client_id: str = "deepmesh",
        claims: ClaimStore | None = None,
        session_timeout_ms: int = 10_000,
    ):
        """`claims`: where values too large for a record go (None: a value over Kafka's limit fails).
        `session_timeout_ms`: how long a consumer that stopped answering (killed, stopped) keeps
        its partitions before the group gives them to the others."""
        from kafka import KafkaProducer

        self.claims = claims
        self.bootstrap = bootstrap
        self.client_id = client_id
        self.session_timeout_ms = session_timeout_ms
        self._producer = KafkaProducer(
            bootstrap_servers=bootstrap,
            client_id=client_id,
            acks="all",
            enable_idempotence=True,
            # a record goes out at once: every hop of a first token waits for it. A step's batch
            # still goes as one request or two (~30 of 32 records a request measured), and
            # sooner: 1.8-2.1 ms a 32-record batch against 2.8-3.0 ms at linger 1
            linger_ms=0,
            request_timeout_ms=30_000,
            reconnect_backoff_max_ms=RECONNECT_BACKOFF_MAX_MS,
        )

    def create_topics(self, names: Iterable[str], partitions: int, short_lived: bool = False) -> None:
        from kafka.admin import KafkaAdminClient, NewTopic
        from kafka.errors import TopicAlreadyExistsError

        configs = {"cleanup.policy": "compact,delete", "retention.ms": "60000", "segment.ms": "10000"}
        admin = KafkaAdminClient(bootstrap_servers=self.bootstrap, client_id=f"{self.client_id}-admin")
        try:
            existing = set(admin.list_topics())
            settings = configs if short_lived else {}
            wanted = [NewTopic(n, partitions, 1, topic_configs=settings) for n in names if n not in existing]
            if wanted:
                with contextlib.suppress(TopicAlreadyExistsError):  # created concurrently by another replica
                    admin.create_topics(wanted)
        finally:
            admin.close()

    def produce(
        self, topic: str, key: str, value: bytes, headers: Headers | None = None, partition: int | None = None
    ) -> tuple[int, int]:
        return self.produce_batch(topic, [(key, value, headers, partition)])[0]

    def produce_batch(self, topic: str, records: list[Outgoing]) -> list[tuple[int, int]]:
        # all sent before any is awaited: one round trip to the broker for the batch, not one each
        futures = [
            self._producer.send(
                topic, key=key.encode(), value=value, headers=list((headers or {}).items()), partition=partition
            )
            for key, value, headers, partition in _checked_in(self.claims, records)
        ]
        stored = []
        for future in futures:
            metadata = future.get(timeout=30)
            stored.append((metadata.partition, metadata.offset))
        return stored

    def produce_waits(self, size: int) -> bool:
        return True  # for the broker's acknowledgement

    def partitions(self, topic: str) -> int:
        found = self._producer.partitions_for(topic)  # waits for the topic's metadata
        if not found:
            raise KeyError(f"unknown topic {topic!r} (create it first)")
        return len(found)

    def consumer(
        self, topics: Iterable[str], group: str, from_beginning: bool = True, wakeup: Any = None
    ) -> KafkaConsumerAdapter:
        return KafkaConsumerAdapter(
            self.bootstrap, list(topics), group, self.client_id, from_beginning, self.claims, self.session_timeout_ms
        )

    def reader(self, topics: Iterable[str], from_beginning: bool = False) -> KafkaReader:
        return KafkaReader(self.bootstrap, list(topics), self.client_id, from_beginning, self.claims)

    def close(self) -> None:
        self._producer.close(timeout=10)


REJOIN_POLL_SECONDS = 1.0


class KafkaConsumerAdapter:
    def __init__(
        self,
        bootstrap: str,
        topics: list[str],
        group: str,
        client_id: str,
        from_beginning: bool = True,
        claims: ClaimStore | None = None,
        session_timeout_ms: int = 10_000,
    ):
        from kafka import KafkaConsumer

        self.claims = claims
        self._consumer = KafkaConsumer(
            bootstrap_servers=bootstrap,
            group_id=group,
            client_id=client_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest" if from_beginning else "latest",
            session_timeout_ms=session_timeout_ms,
            heartbeat_interval_ms=1_000,
            metadata_max_age_ms=10_000,  # a topic created after start-up is noticed within seconds
            reconnect_backoff_max_ms=RECONNECT_BACKOFF_MAX_MS,
        )
        # Subscribe only once this client knows every topic's partitions: a member that joins
        # its group before that is assigned nothing, and nothing rebalances until metadata is
        # refreshed (services start while another one is still creating the topics).
        _wait_for_partitions(self._consumer, topics)
        self._consumer.subscribe(topics)
        self._pending: list[Record] = []
        self._from_beginning = from_beginning
        # the group's id for this member when its first records came, then at the last
        # membership_changed ("": none)
        self._member_id = ""
        self._joined = False  # it has had an id

    def poll(self, timeout: float = 1.0, max_records: int = 100) -> list[Record]:
        if self._pending:  # records polled while waiting for the assignment
            records, self._pending = self._pending, []
            return records
        if self._consumer._coordinator.need_rejoin():
            # kafka-python 3.0 starts the group join over when a poll ends before the join has
            # finished and the next one finds it done: with a busy worker's 2 ms polls the member
            # never became stable and no commit was taken (measured: 4 of 1,212). One poll long
            # enough for the whole join lets it finish.
            timeout = max(timeout, REJOIN_POLL_SECONDS)
        batches = self._consumer.poll(timeout_ms=int(timeout * 1000), max_records=max_records)
        if not self._joined and self._consumer.assignment():
            # The member its first records are delivered under, taken here and not at the first
            # membership_changed: a process stopped between the two would otherwise take the
            # member it rejoined as for its first, and never see that it had been removed.
            self._member_id = self._consumer.group_metadata().member_id or ""
            self._joined = bool(self._member_id)
        return _checked_out(self.claims, _records(batches))

    def commit(self, offsets: dict[tuple[str, int], int] | None = None) -> bool:
        from kafka.errors import KafkaError
        from kafka.structs import OffsetAndMetadata, TopicPartition

        owned = self._consumer.assignment()
        wanted = None
        if offsets is not None:
            wanted = {
                TopicPartition(topic, part): OffsetAndMetadata(offset, "", -1)
                for (topic, part), offset in offsets.items()
                if TopicPartition(topic, part) in owned
            }
            if not wanted:
                return False
        try:
            self._consumer.commit(wanted)
        except KafkaError as err:
            # a rebalance or a broker hiccup: the next commit carries the same offsets, and a
            # partition that moved is replayed by its new owner from the last committed offset
            log.warning("offset commit failed, retried on the next one: %r", err)
            return False
        return True

    def wait_assigned(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self._consumer.assignment():
            if time.monotonic() > deadline:
                raise TimeoutError("no partitions assigned")
            self._pending.extend(self.poll(timeout=0.1))

    def owned(self) -> set[tuple[str, int]]:
        return {(tp.topic, tp.partition) for tp in self._consumer.assignment()}

    def rewind(self) -> None:
        self._pending = []
        for tp in self._consumer.assignment():
            committed = self._consumer.committed(tp)
            if committed is None:  # nothing committed yet: where a new member would start
                (self._consumer.seek_to_beginning if self._from_beginning else self._consumer.seek_to_end)(tp)
            else:
                self._consumer.seek(tp, committed)

    def membership_changed(self) -> bool:
        # A member the group removed loses its id ("" until it joins again, then a new one); one
        # that rebalances with the others keeps it, and its partitions' positions with it.
        member_id = self._consumer.group_metadata().member_id or ""
        if member_id == self._member_id:
            return False
        first_join = not self._member_id and not self._joined
        self._member_id, self._joined = member_id, True
        return not first_join

    def close(self) -> None:
        self._consumer.close(autocommit=False)


class KafkaReader:
    """Every partition of its topics, assigned by hand. A consumer group of one member that reads
    everything would cost a group join before the first record (up to the broker's
    `group.initial.rebalance.delay.ms`, 3 s by default), a heartbeat a second, and a group left
    on the broker by every process that ever ran; there is nothing to share and nothing to commit."""

    def __init__(
        self, bootstrap: str, topics: list[str], client_id: str, from_beginning: bool, claims: ClaimStore | None
    ):
        from kafka import KafkaConsumer, TopicPartition

        self.claims = claims
        self._consumer = KafkaConsumer(
            bootstrap_servers=bootstrap,
            client_id=client_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest" if from_beginning else "latest",
            reconnect_backoff_max_ms=RECONNECT_BACKOFF_MAX_MS,
        )
        _wait_for_partitions(self._consumer, topics)
        assigned = [TopicPartition(t, p) for t in topics for p in sorted(self._consumer.partitions_for_topic(t))]
        self._consumer.assign(assigned)
        for partition in assigned:  # where it starts is looked up now, not at the first poll
            self._consumer.position(partition)

    def poll(self, timeout: float = 1.0, max_records: int = 100) -> list[Record]:
        batches = self._consumer.poll(timeout_ms=int(timeout * 1000), max_records=max_records)
        return _checked_out(self.claims, _records(batches))

    def close(self) -> None:
        self._consumer.close(autocommit=False)


def _wait_for_partitions(consumer: Any, topics: list[str], seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while any(not consumer.partitions_for_topic(t) for t in topics):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no partition metadata for {topics}")
        time.sleep(0.1)


def _records(batches: dict) -> list[Record]:
    """kafka-python's polled messages as Records."""
    return [
        Record(m.topic, m.partition, m.offset, m.key.decode(), m.value, {k: v for k, v in (m.headers or [])})
        for messages in batches.values()
        for m in messages
    ]
