"""Cancels reach whichever stage holds a job: one that comes before its job (it overtook it in
another stage) drops the job on arrival, one that comes while the job runs frees its state,
and a job that will never be loaded gives back the lease on its prompt's entry."""

from __future__ import annotations

import uuid

import pytest

from common.bus import MemoryBus
from common.messages import DecodePayload, Envelope, PrefillPayload, Sampling, decode
from common.topics import Topic, all_topic_names, topic_name
from decode_svc.worker import DecodeWorker
from engine import LLMEngine
from prefill_svc.worker import PrefillWorker
from tests.support.infra import scratch_store
from tests.support.models import random_prompts


@pytest.fixture
def stages(tiny_checkpoint, tmp_path):
    bus, prefix = MemoryBus(), f"cancel{uuid.uuid4().hex[:6]}."
    bus.create_topics(all_topic_names(prefix), 1)
    store = scratch_store(tmp_path)
    prefill = PrefillWorker(bus, prefix, LLMEngine.from_pretrained(tiny_checkpoint), store)
    decode_worker = DecodeWorker(bus, prefix, LLMEngine.from_pretrained(tiny_checkpoint), store)
    yield bus, prefix, store, prefill, decode_worker
    prefill.close()
    decode_worker.close()


def _send(bus, prefix, topic: Topic, envelope: Envelope) -> None:
    bus.produce(topic_name(topic, prefix), envelope.job_id, envelope.encode())


def _prefill(job_id: str, prompt_len: int, max_tokens: int = 500) -> Envelope:
    payload = PrefillPayload(
        endpoint="chat.completions",
        prompt_token_ids=random_prompts([prompt_len], seed=len(job_id))[0],
        sampling=Sampling(max_tokens=max_tokens, temperature=0, top_p=1),
    )
    return Envelope(type="prefill", job_id=job_id, payload=payload.model_dump())


def _handoffs(bus, prefix) -> list[DecodePayload]:
    consumer = bus.consumer([topic_name(Topic.DECODE, prefix)], f"reader-{uuid.uuid4().hex[:6]}")
    envelopes = [decode(r.value) for r in consumer.poll(timeout=0.1, max_records=1000)]
    consumer.close()
    return [e for e in envelopes if e.type == "decode"]


def _ended(bus, prefix) -> list[str]:
    """The jobs a stage said on `tokens` it ended unfinished (so the tokenizer lets their start go)."""
    consumer = bus.consumer([topic_name(Topic.TOKENS, prefix)], f"reader-{uuid.uuid4().hex[:6]}")
    envelopes = [decode(r.value) for r in consumer.poll(timeout=0.1, max_records=1000)]
    consumer.close()
    return [e.job_id for e in envelopes if e.type == "cancel"]


def _payload(envelope: Envelope) -> DecodePayload:
    return DecodePayload.model_validate(envelope.payload)


def _run(worker, until, steps: int = 400) -> None:
    for _ in range(steps):
        worker.run_once(timeout=0.01)
        if until():
            return
    raise AssertionError("the worker never got there")


def test_prefill_drops_a_job_cancelled_before_it_came(stages):
    bus, prefix, _, prefill, _ = stages
    _send(bus, prefix, Topic.PREFILL, Envelope(type="cancel", job_id="early"))
    _send(bus, prefix, Topic.PREFILL, _prefill("early", 300))
    _send(bus, prefix, Topic.PREFILL, _prefill("other", 30))
    _run(prefill, lambda: len(_handoffs(bus, prefix)) == 1)
    assert [h.job_id for h in _handoffs(bus, prefix)] == ["other"]
    assert "early" not in prefill.jobs and not prefill.engine.seqs
    assert prefill.watermarks.offsets()[(topic_name(Topic.PREFILL, prefix), 0)] == 3  # all of it done with
    assert _ended(bus, prefix) == ["early"]


def _free_state(engine: LLMEngine) -> tuple[int, int]:
    return engine.cache.block_allocator.num_free, engine.cache.num_free_slots


def test_prefill_frees_a_job_cancelled_while_it_prefills(stages, tiny_checkpoint):
    bus, prefix, store, _, _ = stages
    engine = LLMEngine.from_pretrained(tiny_checkpoint, max_num_batched_tokens=64)  # a prefill of many steps
    prefill = PrefillWorker(bus, prefix, engine, store)
    free = _free_state(engine)
    _send(bus, prefix, Topic.PREFILL, _prefill("long", 1500))
    _run(prefill, lambda: "long" in prefill.engine.seqs and prefill.engine.seqs["long"].num_computed > 0)
    _send(bus, prefix, Topic.PREFILL, Envelope(type="cancel", job_id="long"))
    prefill.run_once(timeout=0.01)
    assert "long" not in prefill.jobs and "long" not in prefill.engine.seqs
    assert _free_state(engine) == free  # its state is freed
    for _ in range(20):
        prefill.run_once(timeout=0.01)
    assert _handoffs(bus, prefix) == []  # and nothing went on to decode
    assert _ended(bus, prefix) == ["long"]
    prefill.close()


def test_decode_drops_a_job_cancelled_before_it_came_and_releases_its_lease(stages):
    bus, prefix, store, prefill, decode_worker = stages
    _send(bus, prefix, Topic.PREFILL, _prefill("queued", 200))
    _run(prefill, lambda: len(_handoffs(bus, prefix)) == 1)
    handoff = _payload(_handoffs(bus, prefix)[0])
    assert handoff.kv.key in store.catalog.pinned_by("queued")  # prefill's hand-over, leased to the job
    # the gateway's cancel reaches decode after the job's hand-over here; one that overtakes it
    # (sent while the job was still in prefill) is remembered: both orders are covered
    decode_worker.cancelled.add("queued")
    decode_worker.run_once(timeout=0.01)
    assert "queued" not in decode_worker.jobs and not decode_worker.engine.seqs
    assert store.catalog.pinned_by("queued") == []
    assert _ended(bus, prefix) == ["queued"]


def test_decode_frees_a_job_cancelled_while_it_decodes(stages):
    bus, prefix, store, prefill, decode_worker = stages
    _send(bus, prefix, Topic.PREFILL, _prefill("running", 100, max_tokens=3000))
    _run(prefill, lambda: len(_handoffs(bus, prefix)) == 1)
    free = _free_state(decode_worker.engine)
    _run(decode_worker, lambda: "running" in decode_worker.jobs and decode_worker.jobs["running"].sent > 5)
    _send(bus, prefix, Topic.DECODE, Envelope(type="cancel", job_id="running"))
    decode_worker.run_once(timeout=0.01)
    assert "running" not in decode_worker.jobs and not decode_worker.engine.seqs
    assert _free_state(decode_worker.engine) == free
    assert store.catalog.pinned_by("running") == []
    assert _ended(bus, prefix) == []  # it ends on `tokens` as finished (abort), like every started job
