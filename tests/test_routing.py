"""Routing across replicas: the choices (common/routing.py) on reports as replicas send them,
then two prefill and two decode replicas of the real engine in one process, on both buses.
(tests/test_routing_distributed.py does the same with every replica its own process.)"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from prometheus_client import REGISTRY

from common.bus import Bus, KafkaBus, MemoryBus
from common.prefixes import reported_entry
from common.replicas import Dispatch, LoadReport, ReplicaTable
from common.routing import Router, choose_decode, choose_prefill, resident_tokens
from decode_svc.worker import DecodeWorker
from deepmesh.mesh import Mesh
from engine import LLMEngine
from prefill_svc.worker import PrefillWorker
from tests.support.behaviour import one_process_answer
from tests.support.infra import require_service, scratch_store
from tests.support.mesh_client import collect, submit

MODEL = "deepmesh-tiny"


def prefill_report(name: str, partition: int, **load) -> LoadReport:
    return LoadReport(replica=name, stage="prefill", partitions=[partition], tokens_per_second=1000.0, **load)


def holding(tenant: str, prompt: list[int], n: int) -> list[tuple[int, str, str]]:
    return [reported_entry(tenant, prompt[:n])]


PROMPT = list(range(1000, 1600))  # 600 tokens


def test_a_prompt_goes_to_the_replica_that_holds_its_prefix():
    a = prefill_report("a", 0, resident=holding("acme", PROMPT, 512))
    b = prefill_report("b", 1)
    route = choose_prefill([a, b], {}, "job-1", "acme", PROMPT)
    assert (route.replica, route.partition, route.reason, route.resident_tokens) == ("a", 0, "prefix", 512)
    assert route.cost == 600 - 512  # what it still computes there
    # another tenant's identical tokens are not its prefix
    assert choose_prefill([a, b], {}, "job-1", "other", PROMPT).resident_tokens == 0
    assert resident_tokens([a, b], "acme", PROMPT[:300] + [7] * 300) == {"a": 0, "b": 0}


def test_a_holder_with_a_long_queue_loses_to_an_idle_replica():
    """A cache-aware choice that ignored load would pile every turn of a popular prefix onto one
    replica: the prediction weighs the queue against the tokens the prefix saves."""
    a = prefill_report("a", 0, resident=holding("acme", PROMPT, 512), queued_tokens=5000)
    b = prefill_report("b", 1)
    route = choose_prefill([a, b], {}, "job-1", "acme", PROMPT)
    assert (route.replica, route.reason) == ("b", "load")
    assert route.predicted_seconds == pytest.approx(0.6)
    # a replica that measured its loads from the cache service counts on loading the prefix
    quick = prefill_report("b", 1, load_tokens_per_second=51_200.0)
    loads = choose_prefill([a, quick], {}, "job-1", "acme", PROMPT)
    assert (loads.replica, loads.predicted_seconds) == ("b", pytest.approx(0.01 + 0.088))
    assert loads.cost == 88  # what it adds to b's work: the tokens past the prefix it loads


def test_a_burst_spreads_out_before_the_next_reports():
    """Work in flight counts from the moment it is sent: eight equal prompts sent between two
    reports go four and four, not all to the replica that looked idle."""
    table = ReplicaTable()
    for name, part in (("a", 0), ("b", 1)):
        table.update(prefill_report(name, part, consumed={part: 10}))
    router = Router(table, "prefill")
    chosen = []
    for i in range(8):
        route = router.prefill(f"job-{i}", "default", PROMPT)
        router.sent(route, (route.partition, 10 + i))
        chosen.append(route.replica)
    assert sorted(chosen) == ["a"] * 4 + ["b"] * 4
    # once a's report shows it has read them, they count as its queue instead
    table.update(prefill_report("a", 0, consumed={0: 100}, queued_tokens=2400))
    assert [len(table.in_flight(r)) for r in table.live("prefill")] == [0, 4]


def test_a_replica_that_stops_reporting_leaves_the_rotation():
    now = [1000.0]
    table = ReplicaTable(stale_after=1.5, clock=lambda: now[0])
    table.update(prefill_report("a", 0).model_copy(update={"sent_at": 1000.0}))
    table.update(prefill_report("b", 1).model_copy(update={"sent_at": 999.5}))
    now[0] = 1000.9
    assert {r.replica for r in table.live("prefill")} == {"a", "b"}
    now[0] = 1001.1
    assert [r.replica for r in table.live("prefill")] == ["a"]  # b has been silent for 1.6 s
    assert Router(table, "prefill").prefill("job", "default", PROMPT).reason == "only_choice"
    now[0] = 1010.0
    assert Router(table, "prefill").prefill("job", "default", PROMPT).replica is None  # by key: Kafka keeps it
    table.update(prefill_report("c", 2).model_copy(update={"partitions": []}))
    assert table.live("prefill") == []  # owning no partition, a replica cannot be sent to


def test_decode_goes_where_slots_and_blocks_are_free():
    def decode(name: str, part: int, **load) -> LoadReport:
        base = {"free_slots": 16, "max_slots": 16, "free_blocks": 100, "total_blocks": 100}
        return LoadReport(replica=name, stage="decode", partitions=[part], **{**base, **load})

    busy_slots = decode("a", 0, free_slots=2)
    assert choose_decode([busy_slots, decode("b", 1)], {}, "j", 500).replica == "b"
    short_of_blocks = decode("b", 1, free_blocks=5)
    assert choose_decode([decode("a", 0, free_slots=8), short_of_blocks], {}, "j", 500).replica == "a"
    sent = {"b": [Dispatch(1, 5, 60)]}  # 60 blocks on their way to b
    assert choose_decode([decode("a", 0, free_blocks=50), decode("b", 1)], sent, "j", 500).replica == "a"


def test_routers_that_read_the_same_reports_agree():
    """Several tokenizers need no shared state: the same reports and job give the same choice,
    ties included (broken by the job id), so a conversation's turns are not scattered."""
    reports = [prefill_report(name, i) for i, name in enumerate("abcd")]
    for job in (f"job-{i}" for i in range(20)):
        assert len({choose_prefill(reports, {}, job, "default", PROMPT).replica for _ in range(3)}) == 1
    spread = {choose_prefill(reports, {}, f"job-{i}", "default", PROMPT).replica for i in range(40)}
    assert spread == set("abcd")  # ties do not all go to one replica


# -- two replicas of each engine stage, in one process ---------------------------------------------


@pytest.fixture(scope="module", params=["memory", "kafka"])
def replicated(request, tiny_preset, tmp_path_factory):
    """A mesh with a second prefill and a second decode replica: the first ones' engines share
    their weights, each with state of its own."""
    bus: Bus = MemoryBus() if request.param == "memory" else KafkaBus(require_service("DEEPMESH_KAFKA_BOOTSTRAP"))
    prefix = f"route{uuid.uuid4().hex[:8]}."
    mesh = Mesh(tiny_preset, bus, scratch_store(tmp_path_factory.mktemp("state")), topic_prefix=prefix, partitions=4)
    mesh.prefix = prefix
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


def test_a_follow_up_goes_back_to_the_replica_that_holds_its_conversation(replicated, tiny_preset):
    """Turn 1's prompt stays in its prefill replica's memory, and decode sends the finished
    answer's state back there: the follow-up, routed to that replica, starts from the whole
    conversation with no load from the cache service, and answers as one process would."""
    mesh = replicated
    first = chat("Tell me about replicas, partitions and the routers that choose between them. " * 4)
    job = submit(mesh, "chat.completions", first)
    answer = collect(mesh, {job})[job][-1].body["choices"][0]["message"]["content"]
    follow_up = chat("And then?", [*first["messages"], {"role": "assistant", "content": answer}])
    prompt = mesh.tokenizer.codec.prompt("chat.completions", follow_up).token_ids
    turn_1 = len(mesh.tokenizer.codec.prompt("chat.completions", first).token_ids)

    def held() -> list[int]:  # the longest prefix of the follow-up each prefill replica reports holding
        reports = [p.report for p in mesh.prefills]
        return list(resident_tokens(reports, "default", prompt).values())

    deadline = time.monotonic() + 10  # decode stores the answer, the holder loads it, and reports it
    while max(held()) <= turn_1:
        assert time.monotonic() < deadline, f"no replica reports the answered conversation: {held()}"
        time.sleep(0.05)
    expected = max(held())
    holder = mesh.prefills[held().index(expected)]
    hits_before, loaded_before = [p.engine.resident.hits for p in mesh.prefills], loaded_from_cache_service()
    job = submit(mesh, "chat.completions", follow_up)
    body = collect(mesh, {job})[job][-1].body
    hits = [p.engine.resident.hits - before for p, before in zip(mesh.prefills, hits_before, strict=True)]
    assert hits[mesh.prefills.index(holder)] == 1 and sum(hits) == 1
    assert loaded_from_cache_service() == loaded_before
    assert body["usage"]["prompt_tokens"] == len(prompt)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == expected
    assert body["choices"] == one_process_answer(tiny_preset, follow_up)["choices"]


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
