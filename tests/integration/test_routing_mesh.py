"""Two prefill and two decode replicas of the real engine in one process, on both buses: where
the routers (tests/unit/test_routing.py) send follow-ups, new jobs and work a busy replica
would hold up. (tests/system/test_routing_distributed.py does the same with every replica its
own process.)"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from prometheus_client import REGISTRY

from common.bus import Bus, KafkaBus, MemoryBus
from common.routing import resident_tokens
from decode_svc.worker import DecodeWorker
from deepmesh.mesh import Mesh
from engine import LLMEngine
from prefill_svc.worker import PrefillWorker
from tests.support.behaviour import one_process_answer
from tests.support.infra import require_service, scratch_store
from tests.support.mesh_client import collect, submit
from tests.support.models import family_preset

MODEL = "deepmesh-tiny"


# both buses on DeepSeek-V4; V4.1 (whose follow-ups reuse a conversation up to its last KEEP
# tokens) on the in-process one: the transport is the same for both families
SETUPS = [("memory", "deepseek_v4"), ("kafka", "deepseek_v4"), ("memory", "deepseek_v41")]


@pytest.fixture(scope="module", params=SETUPS, ids=["-".join(setup) for setup in SETUPS])
def replicated(request, tmp_path_factory):
    """A mesh with a second prefill and a second decode replica: the first ones' engines share
    their weights, each with state of its own."""
    transport, family = request.param
    model = family_preset(request, family)
    bus: Bus = MemoryBus() if transport == "memory" else KafkaBus(require_service("DEEPMESH_KAFKA_BOOTSTRAP"))
    prefix = f"route{uuid.uuid4().hex[:8]}."
    mesh = Mesh(model, bus, scratch_store(tmp_path_factory.mktemp("state")), topic_prefix=prefix, partitions=4)
    mesh.prefix, mesh.model = prefix, model
    model, weights = mesh.prefill.engine.model, mesh.prefill.engine.weights
    second_prefill = PrefillWorker(bus, prefix, LLMEngine(model, weights=weights), mesh.store, replicas=mesh.replicas)
    second_decode = DecodeWorker(
        bus, prefix, LLMEngine(model, weights=weights, resident_prefix_bytes=0), mesh.store, replicas=mesh.replicas
    )
    mesh.prefills = [mesh.prefill, second_prefill]
    mesh.decodes = [mesh.decode, second_decode]
    mesh.start([mesh.tokenizer, *mesh.prefills, *mesh.decodes])
    deadline = time.monotonic() + 60
    while len([r for r in mesh.replicas.all() if r.partitions]) < 4:  # every replica owns a partition
        assert time.monotonic() < deadline, [r.model_dump() for r in mesh.replicas.all()]
        time.sleep(0.1)
    yield mesh
    mesh.stop()
    bus.close()


def chat(question: str, history: list[dict] | None = None) -> dict:
    return {
        "model": MODEL,
        "messages": [*(history or []), {"role": "user", "content": question}],
        "max_tokens": 8,
        "temperature": 0,
        "thinking": {"type": "disabled"},  # the history renders as the prompt was: a prefix of the next
    }


def loaded_from_cache_service() -> float:
    return REGISTRY.get_sample_value("deepmesh_prefix_cache_tokens_total", {"outcome": "hit"}) or 0.0


def test_a_follow_up_goes_back_to_the_replica_that_holds_its_conversation(replicated):
    """Turn 1's prompt stays in its prefill replica's memory, and decode sends the finished
    answer's state back there: the follow-up, routed to that replica, starts from the whole
    conversation (V4.1: from the longest part of it before its own last KEEP tokens) with no
    load from the cache service, and answers as one process would."""
    mesh = replicated
    # V4.1: a first turn long enough that a block of it lies before the follow-up's last KEEP tokens
    # (the random models' 8-token answers to these prompts encode back to the tokens they generated)
    repeats = 24 if mesh.prefill.engine.reusable_prefix(1000) < 1000 else 4
    first = chat("Tell me about replicas, partitions and the routers that choose between them. " * repeats)
    job = submit(mesh, "chat.completions", first)
    answer = collect(mesh, {job})[job][-1].body["choices"][0]["message"]["content"]
    follow_up = chat("And then?", [*first["messages"], {"role": "assistant", "content": answer}])
    prompt = mesh.tokenizer.codec.prompt("chat.completions", follow_up).token_ids
    turn_1 = len(mesh.tokenizer.codec.prompt("chat.completions", first).token_ids)

    def held(usable_only: bool = True) -> list[int]:
        """The longest prefix of the follow-up each prefill replica reports holding (and may
        start it from, unless `usable_only` is False: V4.1 computes a prompt's last KEEP tokens)."""
        reports = [p.report if usable_only else p.report.model_copy(update={"keep_tokens": 0}) for p in mesh.prefills]
        return list(resident_tokens(reports, "default", prompt).values())

    deadline = time.monotonic() + 10  # decode stores the answer, the holder loads it, and reports it
    while max(held(usable_only=False)) <= turn_1:
        assert time.monotonic() < deadline, f"no replica reports the answered conversation: {held(False)}"
        time.sleep(0.05)
    holding = held(usable_only=False)
    holder = mesh.prefills[holding.index(max(holding))]
    # what the holder may start from: all it holds (V4), or its longest prefix before the kept tokens
    # (V4.1); the router counts the same from its report
    expected = holder.engine.resident_tokens("default", prompt)
    assert 0 < expected <= holder.engine.reusable_prefix(len(prompt))
    assert held()[mesh.prefills.index(holder)] == expected
    hits_before, loaded_before = [p.engine.resident.hits for p in mesh.prefills], loaded_from_cache_service()
    job = submit(mesh, "chat.completions", follow_up)
    body = collect(mesh, {job})[job][-1].body
    hits = [p.engine.resident.hits - before for p, before in zip(mesh.prefills, hits_before, strict=True)]
    assert hits[mesh.prefills.index(holder)] == 1 and sum(hits) == 1
    assert loaded_from_cache_service() == loaded_before
    assert body["usage"]["prompt_tokens"] == len(prompt)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == expected
    assert body["choices"] == one_process_answer(mesh.model, follow_up)["choices"]


def test_jobs_spread_over_both_replicas_of_each_stage(replicated):
    mesh = replicated
    before = [len(w.watermarks.taken(w.topic(w.topics[0]))) for w in (*mesh.prefills, *mesh.decodes)]
    jobs = {submit(mesh, "chat.completions", chat(f"Question number {i}: what is a router?")) for i in range(8)}
    results = collect(mesh, jobs)
    assert all(r[-1].status == 200 for r in results.values())
    taken = [sum(w.watermarks.taken(w.topic(w.topics[0])).values()) for w in (*mesh.prefills, *mesh.decodes)]
    assert all(t > 0 for t in taken), f"every replica took jobs: {taken} (before: {before})"


def test_a_held_up_replica_gets_no_new_jobs(replicated):
    """A replica that stops reporting (here: its reporter is stopped, as a process stopped or
    cut off from the broker would be) is out of rotation within about two seconds."""
    mesh = replicated
    held_up = mesh.decodes[1]
    reporter = held_up._reporter
    reporter.stop()
    try:
        time.sleep(2.0)
        assert held_up.replica not in {r.replica for r in mesh.replicas.live("decode")}
        before = sum(held_up.watermarks.taken(held_up.topic(held_up.topics[0])).values())
        jobs = {submit(mesh, "chat.completions", chat(f"Held up {i}?")) for i in range(4)}
        assert all(r[-1].status == 200 for r in collect(mesh, jobs).values())
        assert sum(held_up.watermarks.taken(held_up.topic(held_up.topics[0])).values()) == before
    finally:
        held_up._reporter = None  # its next step starts a new one
        threading.Event().wait(0.5)
