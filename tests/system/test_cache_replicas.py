"""Prefill replicas with cache services of their own that share a catalog (PostgreSQL) and a
shared tier (a directory, as a 3FS or NFS mount would be): replica B hits what replica A
stored, and a restarted cache service still has what it had written to disk."""

from __future__ import annotations

import os
import threading
import time
import uuid

import httpx
import pytest

from cache_svc.client import StateClient
from cache_svc.store import StateStore
from common.bus import MemoryBus
from common.messages import DecodePayload, Envelope, PrefillPayload, Sampling, decode, payload_of
from common.topics import Topic, all_topic_names, topic_name
from engine import LLMEngine, SamplingParams
from prefill_svc.worker import PrefillWorker
from tests.support.infra import CacheProcess, fresh_database, scratch_store
from tests.support.models import random_prompts


@pytest.fixture
def caches(tmp_path):
    env = {
        **os.environ,
        "DEEPMESH_DATABASE_URL": fresh_database(tmp_path),
        "DEEPMESH_CACHE_SHARED_DIR": str(tmp_path / "shared"),
    }
    a, b = CacheProcess(tmp_path, env, "a").start(), CacheProcess(tmp_path, env, "b").start()
    yield a, b
    a.stop()
    b.stop()


def prefill_once(
    engine: LLMEngine,
    cache: str | StateStore,
    prompt: list[int],
    tokens_per_second: float = 0.0,
    worker: PrefillWorker | None = None,
) -> DecodePayload:
    """One job through a real PrefillWorker (a new one, over an in-process bus, unless given),
    with a cache service (its URL) or a store of its own; returns its hand-over."""
    if worker is None:
        bus, prefix = MemoryBus(), f"r{uuid.uuid4().hex[:6]}."
        bus.create_topics(all_topic_names(prefix), 1)
        worker = PrefillWorker(bus, prefix, engine, StateClient(cache) if isinstance(cache, str) else cache)
        if tokens_per_second:  # as if measured: what a load is weighed against
            worker.compute_speed.observe(tokens_per_second)
    bus, prefix = worker.bus, worker.prefix
    handoffs = bus.consumer([topic_name(Topic.DECODE, prefix)], f"test-{uuid.uuid4().hex[:6]}", from_beginning=False)
    payload = PrefillPayload(
        endpoint="chat.completions",
        prompt_token_ids=prompt,
        sampling=Sampling(max_tokens=8, temperature=0, top_p=1),
    )
    job = uuid.uuid4().hex
    bus.produce(
        topic_name(Topic.PREFILL, prefix),
        job,
        Envelope(type="prefill", job_id=job, payload=payload.model_dump()).encode(),
    )
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            for record in handoffs.poll(timeout=0.2):
                if record.key == job:
                    return payload_of(decode(record.value, "decode"), DecodePayload)
        raise AssertionError("no hand-over from prefill")
    finally:
        stop.set()
        thread.join(timeout=30)


def test_replica_b_hits_what_replica_a_stored_and_a_restart_keeps_it(caches, tiny_checkpoint):
    a, b = caches
    engine_a = LLMEngine.from_pretrained(tiny_checkpoint)
    engine_b = LLMEngine.from_pretrained(tiny_checkpoint)  # another replica: same weights, same layout
    first, more = random_prompts([300, 40], seed=3)
    follow_up = [*first, *more]
    cold = engine_a.generate([follow_up], SamplingParams(max_tokens=1, temperature=0))[0].token_ids[0]

    assert prefill_once(engine_a, a.url, first).cached_tokens == 0
    assert StateClient(b.url).lookup(*lookup_args(engine_b, follow_up)).key is not None  # one catalog...
    httpx.post(f"{a.url}/v1/maintenance/flush").raise_for_status()  # ...and A's write-behind to the shared tier
    handoff = prefill_once(engine_b, b.url, follow_up)
    assert handoff.cached_tokens == len(first) and handoff.first_token == cold

    a.stop()
    a.start()  # memory is gone; the catalog, A's disk and the shared tier are not
    stats = httpx.get(f"{a.url}/v1/stats").json()
    assert {t["name"]: t["entries"] for t in stats["tiers"]}["memory"] == 0
    assert {t["name"]: t["entries"] for t in stats["tiers"]}["disk"] > 0
    again = prefill_once(LLMEngine.from_pretrained(tiny_checkpoint), a.url, [*first, 9, 9, 9])
    assert again.cached_tokens == len(first)  # the first prompt's state, from A's disk


def lookup_args(engine: LLMEngine, prompt: list[int]) -> tuple[str, list[int], int]:
    from common.prefixes import namespace_of

    return namespace_of(engine.layout), prompt, len(prompt)


def test_a_corrupted_entry_is_detected_and_the_prompt_recomputed(tmp_path, tiny_checkpoint):
    from prometheus_client import REGISTRY

    store = scratch_store(tmp_path, memory_bytes=0)
    engine = LLMEngine.from_pretrained(tiny_checkpoint)
    first, more = random_prompts([300, 40], seed=4)
    follow_up = [*first, *more]
    cold = engine.generate([follow_up], SamplingParams(max_tokens=1, temperature=0))[0].token_ids[0]
    prefill_once(engine, store, first)
    blob = max((tmp_path / "kv").iterdir(), key=lambda p: p.stat().st_size)  # the head: the window snapshot
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit of state
    blob.write_bytes(bytes(data))
    corrupt_before = REGISTRY.get_sample_value("deepmesh_cache_misses_total", {"reason": "corrupt"}) or 0
    # another replica (this one still holds the state in its own memory)
    handoff = prefill_once(LLMEngine(engine.model, weights=engine.weights), store, follow_up)
    assert handoff.cached_tokens == 0 and handoff.first_token == cold  # computed again, never from bad state
    assert REGISTRY.get_sample_value("deepmesh_cache_misses_total", {"reason": "corrupt"}) == corrupt_before + 1
    assert not blob.exists()


def test_a_prefix_slower_to_load_than_to_compute_is_computed(tmp_path, tiny_checkpoint):
    from prometheus_client import REGISTRY

    store = scratch_store(tmp_path)
    engine = LLMEngine.from_pretrained(tiny_checkpoint)
    first, more = random_prompts([300, 40], seed=5)
    prefill_once(engine, store, first)
    too_slow = REGISTRY.get_sample_value("deepmesh_cache_misses_total", {"reason": "too_slow"}) or 0
    # another replica, which computes a trillion tokens a second: no load can beat that
    other = LLMEngine(engine.model, weights=engine.weights)
    assert prefill_once(other, store, [*first, *more], tokens_per_second=1e12).cached_tokens == 0
    assert REGISTRY.get_sample_value("deepmesh_cache_misses_total", {"reason": "too_slow"}) == too_slow + 1
    # one token a second: loading wins (in a replica that holds nothing itself)
    slow = LLMEngine(engine.model, weights=engine.weights, resident_prefix_bytes=0)
    assert prefill_once(slow, store, [*first, *more, 1], tokens_per_second=1.0).cached_tokens > 0


def test_a_failing_cache_loses_no_job(tmp_path, tiny_checkpoint):
    """The catalog's table gone (a real database error on every cache call): prefill still hands
    the job over, without state, and decode would recompute it."""
    from sqlalchemy import text

    store = scratch_store(tmp_path)
    with store.catalog.engine.begin() as connection:
        connection.execute(text("DROP TABLE cache_entries"))
    engine = LLMEngine.from_pretrained(tiny_checkpoint)
    (prompt,) = random_prompts([200], seed=6)
    cold = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0))[0].token_ids[0]
    handoff = prefill_once(engine, store, prompt)
    assert handoff.kv is None and handoff.cached_tokens == 0 and handoff.first_token == cold


def test_a_prefill_worker_stopped_and_run_again_still_loads_prefixes(tmp_path, tiny_checkpoint):
    """Stopping a worker closes it (its consumer, its fetch threads); running it again works."""
    store = scratch_store(tmp_path)
    bus, prefix = MemoryBus(), f"again{uuid.uuid4().hex[:6]}."
    bus.create_topics(all_topic_names(prefix), 1)
    engine = LLMEngine.from_pretrained(tiny_checkpoint, resident_prefix_bytes=0)  # every prefix from the cache
    worker = PrefillWorker(bus, prefix, engine, store)
    first, more = random_prompts([300, 40], seed=7)
    assert prefill_once(worker.engine, store, first, worker=worker).cached_tokens == 0
    assert prefill_once(worker.engine, store, [*first, *more], worker=worker).cached_tokens == len(first)


def test_a_prefix_the_replica_still_holds_is_taken_from_its_own_memory(tmp_path, tiny_checkpoint):
    """Tier 0: the replica that prefilled turn 1 serves turn 2's prefix from its own blocks,
    with no load from the cache service; another replica loads it; both give the cold token."""
    from prometheus_client import REGISTRY

    def sample(name: str, labels: dict[str, str]) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    store = scratch_store(tmp_path)
    engine = LLMEngine.from_pretrained(tiny_checkpoint)
    first, more = random_prompts([300, 40], seed=8)
    follow_up = [*first, *more]
    cold = engine.generate([follow_up], SamplingParams(max_tokens=1, temperature=0))[0].token_ids[0]
    prefill_once(engine, store, first)
    loaded, resident = (
        sample("deepmesh_state_bytes_total", {"direction": "get"}),
        sample("deepmesh_prefix_cache_tokens_total", {"outcome": "resident"}),
    )
    handoff = prefill_once(engine, store, follow_up)
    assert handoff.cached_tokens == len(first) and handoff.first_token == cold
    assert sample("deepmesh_state_bytes_total", {"direction": "get"}) == loaded  # nothing loaded
    assert sample("deepmesh_prefix_cache_tokens_total", {"outcome": "resident"}) == resident + len(first)
    other = prefill_once(LLMEngine(engine.model, weights=engine.weights), store, [*first, 7])
    assert other.cached_tokens == len(first)
    assert sample("deepmesh_state_bytes_total", {"direction": "get"}) > loaded  # that one loaded it


def test_a_longer_stored_prefix_is_loaded_only_if_that_beats_computing_what_it_adds(tmp_path, tiny_checkpoint):
    """A replica that holds turn 1's prompt (300 tokens) in its own memory, at a speed where
    computing the whole stored prefix is slower than loading it but computing what it adds to
    the 300 is quicker: the replica computes those and loads nothing. One that holds nothing
    loads it."""
    from common.prefixes import namespace_of

    store = scratch_store(tmp_path)
    first, more, rest = random_prompts([300, 40, 10], seed=9)
    prompt = [*first, *more, *rest]
    other = LLMEngine.from_pretrained(tiny_checkpoint)
    cold = other.generate([prompt], SamplingParams(max_tokens=1, temperature=0))[0].token_ids[0]
    prefill_once(other, store, [*first, *more])  # a 340-token anchor, in the cache service

    def speed_for(stored: int) -> float:
        """A speed at which computing the `stored` tokens takes twice their load, and computing the
        ones they add to the 300 held (40 or 50) under a third of it. Load times are estimates from the
        tiers' measured read speeds, so asked again each time."""
        match = store.lookup(namespace_of(other.layout), prompt, len(prompt) + 1)
        assert match.num_tokens == stored
        return stored / (2 * match.load_seconds)

    bare = LLMEngine(other.model, weights=other.weights, resident_prefix_bytes=0)
    assert prefill_once(bare, store, prompt, tokens_per_second=speed_for(340)).cached_tokens == 340
    engine = LLMEngine(other.model, weights=other.weights)
    prefill_once(engine, store, first)  # turn 1, held in this replica's memory
    handoff = prefill_once(engine, store, prompt, tokens_per_second=speed_for(350))  # 350 stored by `bare`
    assert handoff.cached_tokens == 300 and handoff.first_token == cold
