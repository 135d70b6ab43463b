"""Routing across replicas: the choices (common/routing.py) on reports as replicas send them.
(tests/integration/test_routing_mesh.py runs them with two replicas of each engine stage.)"""

from __future__ import annotations

import pytest

from common.prefixes import reported_entry
from common.replicas import Dispatch, LoadReport, ReplicaTable
from common.routing import Router, choose_decode, choose_encoder, choose_prefill, resident_tokens

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


def test_a_prefix_within_the_tokens_a_replica_always_computes_is_not_counted():
    """A V4.1 replica computes a prompt's last KEEP tokens itself (keep_tokens in its report): of
    what it holds, only a prefix that ends before them saves it anything, as the engine's own
    reusable_prefix says. Counting a longer one sent a follow-up there for a saving it never made."""
    v41 = prefill_report("a", 0, resident=holding("acme", PROMPT, 512), keep_tokens=140)
    other = prefill_report("b", 1)
    assert resident_tokens([v41, other], "acme", PROMPT) == {"a": 0, "b": 0}  # 512 > 600 - 140
    assert choose_prefill([v41, other], {}, "job-1", "acme", PROMPT).resident_tokens == 0
    both = holding("acme", PROMPT, 384) + holding("acme", PROMPT, 512)
    v41 = prefill_report("a", 0, resident=both, keep_tokens=140)
    route = choose_prefill([v41, other], {}, "job-1", "acme", PROMPT)
    assert (route.replica, route.reason, route.resident_tokens, route.cost) == ("a", "prefix", 384, 600 - 384)


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


def test_images_go_to_the_encoder_with_the_fewest_ahead_and_a_burst_spreads():
    """Encoder replicas report the images they hold (`queued_tokens`); a job goes where fewest are
    ahead of it, counting what was sent there since its report, and a silent one is left out."""
    table = ReplicaTable()
    for name, part, queued in (("a", 0, 7), ("b", 1, 0)):
        table.update(
            LoadReport(replica=name, stage="encoder", partitions=[part], consumed={part: 5}, queued_tokens=queued)
        )
    router = Router(table, "encoder")
    chosen = []
    for i in range(4):
        route = router.encoder(f"job-{i}", 3)
        router.sent(route, (route.partition, 5 + i))
        chosen.append(route.replica)
    assert chosen == ["b", "b", "b", "a"]  # b has 0, 3, then 6 ahead, fewer than a's 7; then 9
    assert choose_encoder([], {}, "job", 1).reason == "no_replica"
    assert table.live("prefill") == []  # the stages' reports stay apart
