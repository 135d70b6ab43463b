"""The routing simulation (benchmarks/routing_sim.py): its replicas do what the cost model says,
the real router and admission control decide on its clock, and a policy changes where work
goes, never how much of it a replica does."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.routing_sim import (
    POLICIES,
    Costs,
    Session,
    Simulation,
    Turn,
    agentic_trace,
    imbalance_p95,
    simulate,
    system_prompt,
)

COSTS = Costs(
    step_seconds=0.01,
    tokens_per_second=1000.0,
    step_tokens=512,
    load_tokens_per_second={"t1": 100_000.0, "t2": 10_000.0},
    load_latency_seconds=0.0,
    itl_seconds=0.01,
    hop_seconds=0.001,
)


def one_session(policy: str, replicas: int = 4) -> Simulation:
    """A 600-token system prompt and 100 tokens, a 20-token answer, then 300 tokens more."""
    sim = Simulation(replicas, COSTS, policy, seed=0, admission_wait=30.0)
    turns = [Turn(0, 100, 20, 1.0), Turn(None, 300, 20, 1.0)]
    sim.arrive(Session(0, turns, [system_prompt(0, 600)]), at=1.0)
    sim.run(horizon=100.0)
    return sim


def test_a_turn_on_idle_replicas_takes_its_steps_and_the_next_one_starts_where_the_answer_ended():
    first, second = one_session("deepmesh").jobs
    hops = 2 * COSTS.hop_seconds  # to the replica, and its first token back
    # 700 tokens from nothing: a full 512-token step, then 188
    assert first.source == "computed" and first.start == 0
    assert first.ttft == pytest.approx(hops + (0.01 + 0.512) + (0.01 + 0.188))
    # the router sends the next turn back to the replica holding the answer's end (decode's warm
    # message): 720 tokens from its own memory, the new 300 computed in one step
    assert second.replica is first.replica
    assert (second.source, second.start) == ("tier0", 720)
    assert second.ttft == pytest.approx(hops + 0.01 + 0.3)


def test_an_answer_decoded_on_a_decode_replica_takes_a_step_a_token_and_the_next_turn_follows_its_think_time():
    costs = dataclasses.replace(COSTS, decode_replicas=1, decode_step_seconds=0.05, decode_seq_seconds=0.01)
    sim = Simulation(4, costs, "deepmesh", seed=0, admission_wait=30.0)
    sim.arrive(Session(0, [Turn(0, 100, 20, 1.5), Turn(None, 300, 20, 1.0)], [system_prompt(0, 600)]), at=1.0)
    sim.run(horizon=100.0)
    first, second = sim.jobs
    # 19 tokens after prefill's first, one sequence a step; its end back to the client, then 1.5 s
    answered = first.sent + first.ttft + 19 * (0.05 + 0.01) + COSTS.hop_seconds
    assert second.sent == pytest.approx(answered + 1.5)


def test_a_turn_sent_elsewhere_loads_its_prefix_from_the_cache_service():
    """Hashing by job id sends the two turns of this session to different replicas (their ids'
    CRCs): the second loads the 720 tokens from the cache service's memory tier."""
    first, second = one_session("hashing").jobs
    assert second.replica is not first.replica
    assert (second.source, second.start) == ("t1", 720)
    load = 720 / COSTS.load_tokens_per_second["t1"]
    assert second.ttft == pytest.approx(2 * COSTS.hop_seconds + load + 0.01 + 0.3)


def test_on_one_replica_every_policy_gives_the_same_times():
    trace = agentic_trace(seed=3, count=200, scale=0.25)
    runs = [simulate(trace, 1, 0.5, policy, 20.0, COSTS) for policy in POLICIES]
    assert runs[0]["jobs"] > 10 and runs[0]["unanswered"] == 0
    for run in runs[1:]:
        assert (run["jobs"], run["ttft_p50"], run["ttft_p90"], run["ttft_p99"], run["computed_tokens"]) == (
            runs[0]["jobs"],
            runs[0]["ttft_p50"],
            runs[0]["ttft_p90"],
            runs[0]["ttft_p99"],
            runs[0]["computed_tokens"],
        )


def test_admission_refuses_past_its_wait_and_every_refused_turn_is_answered_after_its_retry():
    trace = agentic_trace(seed=1, count=400, scale=0.5)
    relaxed = simulate(trace, 2, 4.0, "deepmesh", 20.0, COSTS, admission_wait=600.0)
    strict = simulate(trace, 2, 4.0, "deepmesh", 20.0, COSTS, admission_wait=0.5)
    assert relaxed["refused_calls"] == 0 and strict["refused_calls"] > 0
    assert strict["unanswered"] == 0


def test_imbalance_is_the_busiest_replicas_share_over_the_mean_in_busy_seconds():
    busy = [[(0.0, 1.0), (1.0, 1.5)], [(0.0, 0.5), (1.2, 1.4)]]  # second 0: 1.0 and 0.5; second 1: 0.5 and 0.2
    assert imbalance_p95(busy, 0.0, 2.0) == pytest.approx(1.0 / 0.75)  # second 1 is under half busy: not counted
    assert imbalance_p95(busy, 0.0, 2.0, width=2.0) == pytest.approx(1.5 / 1.1)
