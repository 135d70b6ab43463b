"""The routing simulation (benchmarks/routing_sim.py): its replicas do what the cost model says,
the real router and admission control decide on its clock, and a policy changes where work
goes, never how much of it a replica does."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.routing_sim import (
    CENTRAL_QUEUE,
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


def test_the_central_queue_hands_a_job_to_a_replica_whose_next_step_has_room():
    """Three prompts at once on two replicas of 512-token steps: the first two go out at once; the
    third waits in the one queue until a replica holds less than a step, which the one computing
    the 200-token prompt does (the other holds 1,000 tokens), and is its next step."""
    sim = Simulation(2, COSTS, CENTRAL_QUEUE, seed=0, admission_wait=30.0)
    systems = [system_prompt(i, 100) for i in range(3)]  # none shares a prefix with another
    for index, tokens in enumerate((900, 100, 200)):
        sim.arrive(Session(index, [Turn(index, tokens, 2, 1.0)], systems), at=1.0)
    sim.run(horizon=100.0)
    long, short, third = sorted(sim.jobs, key=lambda job: job.session.index)
    assert long.replica is not short.replica and third.replica is short.replica
    assert short.ttft == pytest.approx(2 * COSTS.hop_seconds + 0.01 + 0.2)  # 200 tokens, one step
    assert third.ttft == pytest.approx(short.ttft + 0.01 + 0.3)  # the step after, 300 tokens
    assert long.ttft == pytest.approx(2 * COSTS.hop_seconds + (0.01 + 0.512) + (0.01 + 0.488))
    assert not sim.central


def test_of_the_replicas_with_room_the_central_queue_picks_the_one_holding_fewest_tokens():
    """400 and 100 tokens at once on two replicas; 200 more while both compute, both with room in
    their next step: they go to the replica holding 100, and are its next step."""
    sim = Simulation(2, COSTS, CENTRAL_QUEUE, seed=0, admission_wait=30.0)
    systems = [system_prompt(i, 50) for i in range(3)]
    for index, (tokens, at) in enumerate(((350, 1.0), (50, 1.0), (150, 1.05))):
        sim.arrive(Session(index, [Turn(index, tokens, 2, 1.0)], systems), at=at)
    sim.run(horizon=100.0)
    larger, smaller, later = sorted(sim.jobs, key=lambda job: job.session.index)
    assert larger.replica is not smaller.replica and later.replica is smaller.replica
    hop = COSTS.hop_seconds
    assert later.ttft == pytest.approx((1.0 + hop + 0.01 + 0.1) + (0.01 + 0.2) + hop - 1.05)


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
