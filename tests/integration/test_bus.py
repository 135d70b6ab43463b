"""The bus contract, run against the in-process bus and a real Apache Kafka broker."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

from common.bus import Bus, KafkaBus, MemoryBus, Record
from common.claims import ClaimStore
from common.messages import BadMessage, Envelope, decode
from tests.support.infra import STOPPED_MEMBER_SESSION_MS, require_service


@pytest.fixture(params=["memory", "kafka"])
def bus(request, tmp_path):
    claims = ClaimStore(tmp_path / "claims")
    if request.param == "memory":
        instance: Bus = MemoryBus(claims)
    else:
        instance = KafkaBus(require_service("DEEPMESH_KAFKA_BOOTSTRAP"), claims=claims)
    yield instance
    instance.close()


def fresh(bus: Bus, partitions: int = 3) -> str:
    name = f"test.{uuid.uuid4().hex[:12]}"
    bus.create_topics([name], partitions)
    return name


def poll_until(consumer, count: int, timeout: float = 30.0) -> list[Record]:
    records: list[Record] = []
    deadline = time.monotonic() + timeout
    while len(records) < count and time.monotonic() < deadline:
        records.extend(consumer.poll(timeout=0.5))
    return records


def test_round_trip_keeps_headers_and_per_key_order(bus):
    topic = fresh(bus)
    for i in range(30):
        bus.produce(topic, f"job-{i % 5}", f"{i}".encode(), {"traceparent": f"00-{i:032x}-{i:016x}-01".encode()})
    consumer = bus.consumer([topic], group=f"g-{uuid.uuid4().hex[:8]}")
    records = poll_until(consumer, 30)
    consumer.close()
    assert len(records) == 30
    for key in (f"job-{k}" for k in range(5)):
        values = [int(r.value) for r in records if r.key == key]
        assert values == sorted(values) and len(values) == 6
        assert len({r.partition for r in records if r.key == key}) == 1
    first = next(r for r in records if r.value == b"0")
    assert first.headers["traceparent"] == b"00-" + b"0" * 32 + b"-" + b"0" * 16 + b"-01"


def test_a_record_goes_to_the_partition_it_names_and_says_where_it_was_stored(bus):
    """How a router sends a job to one replica: whatever the key, the record lands in the named
    partition, and produce answers (partition, offset) as the consumer then sees them."""
    topic = fresh(bus, partitions=3)
    assert bus.partitions(topic) == 3
    where = bus.produce_batch(topic, [(f"job-{i}", f"{i}".encode(), None, 2) for i in range(6)])
    where.append(bus.produce(topic, "by-key", b"k"))
    consumer = bus.consumer([topic], group=f"g-{uuid.uuid4().hex[:8]}")
    records = poll_until(consumer, 7)
    consumer.close()
    seen = {r.value: (r.partition, r.offset) for r in records}
    assert [p for p, _ in where[:6]] == [2] * 6
    assert [seen[f"{i}".encode()] for i in range(6)] == where[:6]
    assert seen[b"k"] == where[6]
    assert [o for _, o in where[:6]] == sorted(o for _, o in where[:6])


def test_the_in_process_bus_keeps_only_the_newest_records_of_a_short_lived_topic():
    """Load reports never stop coming: `deepmesh serve` would otherwise hold every one it ever
    sent. A reader that fell behind starts at the oldest record kept, as on Kafka after retention."""
    from common.bus import SHORT_LIVED_RECORDS

    bus = MemoryBus()
    bus.create_topics(["status"], 1, short_lived=True)
    behind = bus.consumer(["status"], group="behind")
    sent = 3 * SHORT_LIVED_RECORDS
    where = [bus.produce("status", "replica-a", f"{i}".encode()) for i in range(sent)]
    assert where[-1] == (0, sent - 1)  # offsets keep counting
    kept = bus._logs["status"][0].records
    assert len(kept) < 2 * SHORT_LIVED_RECORDS and kept[-1].offset == sent - 1
    records = poll_until(behind, len(kept), timeout=5)
    assert [r.offset for r in records] == [r.offset for r in kept]
    late = bus.consumer(["status"], group="late", from_beginning=False)
    bus.produce("status", "replica-a", b"next")
    assert [r.value for r in late.poll(timeout=1)] == [b"next"]


def test_every_group_sees_every_record(bus):
    topic = fresh(bus)
    for i in range(10):
        bus.produce(topic, f"k{i}", b"x")
    a = bus.consumer([topic], group=f"a-{uuid.uuid4().hex[:8]}")
    b = bus.consumer([topic], group=f"b-{uuid.uuid4().hex[:8]}")
    assert len(poll_until(a, 10)) == 10
    assert len(poll_until(b, 10)) == 10
    a.close()
    b.close()


def test_uncommitted_records_are_delivered_again(bus):
    topic = fresh(bus, partitions=1)
    group = f"g-{uuid.uuid4().hex[:8]}"
    for i in range(6):
        bus.produce(topic, "job", f"{i}".encode())
    first = bus.consumer([topic], group)
    got = poll_until(first, 6)
    assert [r.value for r in got] == [b"0", b"1", b"2", b"3", b"4", b"5"]
    first.commit()  # all six done
    for i in range(6, 9):
        bus.produce(topic, "job", f"{i}".encode())
    assert [r.value for r in poll_until(first, 3)] == [b"6", b"7", b"8"]
    first.close()  # crashed before committing 6..8

    second = bus.consumer([topic], group)
    again = poll_until(second, 3)
    assert [r.value for r in again] == [b"6", b"7", b"8"]
    second.commit()
    second.close()
    third = bus.consumer([topic], group)
    assert third.poll(timeout=2.0) == []
    third.close()


def test_rewind_delivers_again_what_came_since_the_last_commit(bus):
    topic = fresh(bus, partitions=1)
    consumer = bus.consumer([topic], f"g-{uuid.uuid4().hex[:8]}")
    for i in range(5):
        bus.produce(topic, "job", f"{i}".encode())
    assert len(poll_until(consumer, 5)) == 5
    consumer.commit({(topic, 0): 2})  # 0 and 1 done; 2..4 polled but not done (a step that failed)
    consumer.rewind()
    assert [r.value for r in poll_until(consumer, 3)] == [b"2", b"3", b"4"]
    consumer.close()


def test_a_reader_sees_every_partition_from_its_start_and_joins_no_group(bus):
    """What a process reads for itself (the load reports, its own calls' results): every partition,
    from the next record produced after the reader is made (or, from the beginning, what is kept),
    beside a group that shares the topic; on Kafka without a consumer group of its own, which every
    process that ever ran would otherwise leave on the broker. The groups are read with
    kafka-python's admin client: those with a member of this test's client id are the group's only."""
    clients = KafkaBus(bus.bootstrap, client_id=f"readers-{uuid.uuid4().hex[:8]}") if isinstance(bus, KafkaBus) else bus
    topic = fresh(bus, partitions=3)
    for i in range(6):
        bus.produce(topic, f"before-{i}", b"before")
    reader = clients.reader([topic])
    everything = clients.reader([topic], from_beginning=True)
    group_name = f"g-{uuid.uuid4().hex[:8]}"
    group = clients.consumer([topic], group_name)
    for i in range(6):
        bus.produce(topic, f"after-{i}", b"after", partition=i % 3)
    after = poll_until(reader, 6)
    assert sorted(r.key for r in after) == [f"after-{i}" for i in range(6)]
    assert {r.partition for r in after} == {0, 1, 2}
    assert [r.value for r in poll_until(everything, 12)].count(b"before") == 6
    assert len(poll_until(group, 12)) == 12  # the group's member reads as before
    assert reader.poll(timeout=0.5) == []
    if isinstance(clients, KafkaBus):
        assert _groups_with_member(clients.client_id) == {group_name}
        clients.close()
    for consumer in (reader, everything, group):
        consumer.close()


def _groups_with_member(client_id: str) -> set[str]:
    from kafka.admin import KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=require_service("DEEPMESH_KAFKA_BOOTSTRAP"))
    try:
        names = [group["group_id"] for group in admin.list_groups()]
        described = admin.describe_groups(names) if names else {}
        return {name for name, group in described.items() if any(m["client_id"] == client_id for m in group["members"])}
    finally:
        admin.close()


def test_owned_partitions_follow_the_group(bus):
    topic = fresh(bus, partitions=2)
    group = f"g-{uuid.uuid4().hex[:8]}"
    first = bus.consumer([topic], group)
    first.wait_assigned(timeout=30)
    assert first.owned() == {(topic, 0), (topic, 1)}
    second = bus.consumer([topic], group)
    deadline = time.monotonic() + 60
    while not (len(first.owned()) == 1 and len(second.owned()) == 1):  # a rebalance splits them
        first.poll(timeout=0.2)
        second.poll(timeout=0.2)
        assert time.monotonic() < deadline, "the group never gave the second member a partition"
    assert first.owned() | second.owned() == {(topic, 0), (topic, 1)}
    second.close()
    first.close()


def test_a_member_stopped_past_its_session_sees_its_membership_change_and_starts_again_from_the_commits():
    """A real fault: the member's process is stopped (SIGSTOP) until the group gives its partitions
    to another, then resumed. It learns it is no longer the member it was (what it still holds
    is stale) and, rewound, gets each partition again from its committed offset, not from where
    it had read to. It stops itself as soon as it holds its records, before its loop first asks
    about its membership: a stop there once went unseen, and a signal from here hit it by chance."""
    bootstrap = require_service("DEEPMESH_KAFKA_BOOTSTRAP")
    bus = KafkaBus(bootstrap, session_timeout_ms=STOPPED_MEMBER_SESSION_MS)
    topic, group = fresh(bus, partitions=2), f"g-{uuid.uuid4().hex[:8]}"
    for i in range(6):
        bus.produce(topic, f"job-{i}", b"x", partition=i % 2)
    member = subprocess.Popen(
        [sys.executable, "-m", "tests.support.stalled_member", bootstrap, topic, group],
        stdout=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[dict] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(json.loads(line)) for line in member.stdout], daemon=True).start()
    other = None
    try:
        assert lines.get(timeout=60)["event"] == "ready"
        deadline = time.monotonic() + 10
        while _process_state(member.pid) != "T":
            assert time.monotonic() < deadline, "the member never stopped itself"
            time.sleep(0.01)
        other = bus.consumer([topic], group)
        deadline = time.monotonic() + 60
        while len(other.owned()) < 2:  # the group evicts the silent member and gives this one both
            other.poll(timeout=0.2)
            assert time.monotonic() < deadline, "the group never gave the stopped member's partitions away"
        member.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 30
        events = []
        while not events or events[-1]["event"] != "delivered":  # it takes a partition back; this one polls on
            other.poll(timeout=0.05)
            with contextlib.suppress(queue.Empty):
                events.append(lines.get_nowait())
            assert time.monotonic() < deadline, f"the resumed member got nothing again: {events}"
        assert events[0]["event"] == "changed"
        assert min(offset for _, offset in events[-1]["at"]) == 1  # from the commit, not from where it had read
    finally:
        member.kill()
        member.wait()
        if other is not None:
            other.close()
        bus.close()


def _process_state(pid: int) -> str:
    """R, S, T (stopped)...: the field after the command's name in /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


def test_memory_bus_refuses_unknown_topics():
    bus = MemoryBus()
    with pytest.raises(KeyError, match="create it first"):
        bus.produce("nope", "k", b"v")
    with pytest.raises(KeyError, match="create them first"):
        bus.consumer(["nope"], "g")


def test_memory_bus_shares_partitions_within_a_group():
    bus = MemoryBus()
    bus.create_topics(["t"], 4)
    a, b = bus.consumer(["t"], "g"), bus.consumer(["t"], "g")
    for i in range(40):
        bus.produce("t", f"job-{i}", b"x")
    got_a, got_b = a.poll(0.1), b.poll(0.1)
    assert got_a and got_b
    assert len(got_a) + len(got_b) == 40
    assert not {(r.partition, r.offset) for r in got_a} & {(r.partition, r.offset) for r in got_b}


def test_consumers_polled_in_turn_on_one_thread_never_wait_out_each_others_records():
    """The embedded engine thread polls prefill's consumer, then decode's (run_workers): they share
    a wake-up. A record for one, produced before or during the other's poll, ends that poll at
    once, so the thread's next poll takes it; a consumer of its own waits out its timeout."""
    bus = MemoryBus()
    bus.create_topics(["prefill", "decode"], 1)
    wakeup = bus.shared_wakeup()
    prefill, decode_ = bus.consumer(["prefill"], "p", wakeup=wakeup), bus.consumer(["decode"], "d", wakeup=wakeup)
    alone = bus.consumer(["decode"], "alone")

    bus.produce("prefill", "job-1", b"before")  # while the thread was busy elsewhere
    started = time.monotonic()
    assert decode_.poll(timeout=5.0) == []
    assert time.monotonic() - started < 2.0
    assert [r.value for r in prefill.poll(timeout=0)] == [b"before"]

    later = threading.Timer(0.2, lambda: bus.produce("prefill", "job-2", b"during"))
    later.start()
    started = time.monotonic()
    assert decode_.poll(timeout=5.0) == []
    assert time.monotonic() - started < 2.0
    assert [r.value for r in prefill.poll(timeout=0)] == [b"during"]
    later.join()

    bus.produce("prefill", "job-3", b"not for it")
    started = time.monotonic()
    assert alone.poll(timeout=0.5) == []
    assert time.monotonic() - started >= 0.4


def test_values_too_large_for_a_record_travel_as_claim_checks(bus):
    """A 3 MB value (over Kafka's default 1 MB record limit) is stored beside the bus and the
    record carries a claim for it: Kafka's own client reads a small record naming the bytes;
    ours hands back the whole value. A claim whose bytes are gone is a clear BadMessage."""
    topic = fresh(bus, partitions=1)
    big = Envelope(type="request", job_id="big", payload={"text": "x" * (3 << 20)}).encode()
    bus.produce(topic, "big", big)
    bus.produce(topic, "small", b"small")
    consumer = bus.consumer([topic], group=f"g-{uuid.uuid4().hex[:8]}")
    records = poll_until(consumer, 2)
    consumer.close()
    assert [(r.key, r.value) for r in records] == [("big", big), ("small", b"small")]
    digest = hashlib.sha256(big).hexdigest()
    assert (bus.claims.root / digest[:2] / digest).read_bytes() == big
    if isinstance(bus, KafkaBus):
        from kafka import KafkaConsumer

        raw = KafkaConsumer(
            topic, bootstrap_servers=bus.bootstrap, auto_offset_reset="earliest", consumer_timeout_ms=10_000
        )
        stored = [m.value for m in itertools.islice(raw, 2)]  # not the 10 s of silence after them
        raw.close()
        claim = json.loads(stored[0])
        assert len(stored[0]) < 1024 and claim["type"] == "claim" and claim["job_id"] == "big"
        assert claim["payload"]["sha256"] == digest and claim["payload"]["size"] == len(big)
        assert stored[1] == b"small"
    (bus.claims.root / digest[:2] / digest).unlink()
    consumer = bus.consumer([topic], group=f"g-{uuid.uuid4().hex[:8]}")
    gone = poll_until(consumer, 2)[0]
    consumer.close()
    with pytest.raises(BadMessage, match="missing or corrupt"):
        decode(gone.value)


def test_only_kafka_and_claimed_values_make_a_produce_wait(bus):
    """What the gateway's event loop asks before it produces a request itself (gateway/answers.py):
    Kafka's produce waits for the broker's acknowledgement; the in-process bus's waits on nothing
    but a claimed value's file."""
    small, claimed = 100, bus.claims.threshold + 1
    if isinstance(bus, KafkaBus):
        assert bus.produce_waits(small) and bus.produce_waits(claimed)
    else:
        assert not bus.produce_waits(small) and bus.produce_waits(claimed)
        assert not MemoryBus().produce_waits(claimed)  # no claim store: nothing written


def test_a_consumer_polling_between_engine_steps_has_its_commits_taken(bus):
    """A busy worker polls for a few milliseconds between engine steps and commits what it
    finished. kafka-python 3.0 never finished the group join under 2 ms polls: 4 of 1,212
    commits were taken, so a killed worker's replacement replayed everything since its start."""
    topic = fresh(bus, partitions=2)
    stop = threading.Event()

    def produce() -> None:
        i = 0
        while not stop.is_set():
            bus.produce(topic, f"k{i % 7}", b"x")
            i += 1
            time.sleep(0.01)

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    consumer = bus.consumer([topic], group=f"g-{uuid.uuid4().hex[:8]}")
    taken = tried = 0
    try:
        # the group join itself under busy polls: it finishes, though beside a loaded suite it
        # took most of the 6 s this test once counted commits over from the start
        joined_by = time.monotonic() + 10
        while not consumer.owned():
            assert time.monotonic() < joined_by, "the group join never finished under busy polls"
            consumer.poll(timeout=bus.busy_poll_timeout)
        deadline = time.monotonic() + (6 if isinstance(bus, KafkaBus) else 1)
        while time.monotonic() < deadline:
            records = consumer.poll(timeout=bus.busy_poll_timeout)
            if records:
                offsets = {(r.topic, r.partition): r.offset + 1 for r in records}
                tried += 1
                taken += consumer.commit(offsets)
    finally:
        stop.set()
        producer.join(timeout=10)
        consumer.close()
    assert tried >= 50 and taken >= 0.9 * tried, f"{taken} of {tried} commits taken"
