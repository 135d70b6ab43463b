"""Every kind of service killed while jobs run, and the broker restarted, with real processes
over real Kafka (tests/chaos.py): no answer lost, hung or different from a single-process run.
One process of each kind: a killed worker's jobs wait for the one started in its place (jobs
moving to a second replica: tests/system/test_routing_distributed.py). benchmarks/chaos_soak.py
runs the same harness longer, with two replicas of each worker and random faults."""

from __future__ import annotations

import pytest

from tests.support.chaos import Faults, Outcome, body, expected_answers, run_jobs, run_streams, start_cluster, summary
from tests.support.infra import require_service


@pytest.fixture(scope="module")
def model(tiny_preset):
    return tiny_preset


def test_streams_and_jobs_survive_every_kind_of_kill_and_a_broker_restart(model, tmp_path):
    require_service("DEEPMESH_KAFKA_BOOTSTRAP")
    bodies = [body(i, max_tokens=16) for i in range(30)]
    expected = expected_answers(model, bodies)
    cluster = start_cluster(tmp_path, model, replicas=1)
    streams, jobs = Outcome(), Outcome()
    try:
        # streams (the gateway stays up): each worker kind, the cache and the broker, one after another
        with Faults(cluster, ["tokenizer", "prefill", "decode", "cache", "broker"], every=2.0) as faults:
            run_streams(cluster.url, bodies[:22], expected[:22], 180, streams, spacing=1.0, until=faults.finished)
        # async jobs: the gateway killed too, and a decode
        with Faults(cluster, ["gateway", "decode"], every=2.0) as job_faults:
            run_jobs(cluster.url, bodies[22:], expected[22:], timeout=180, outcome=jobs)
    finally:
        cluster.stop()
    assert faults.done == ["tokenizer", "prefill", "decode", "cache", "broker"], summary(faults.done)
    assert job_faults.done == ["gateway", "decode"]
    assert streams.sent >= 22 and streams.completed == streams.sent, f"{streams.line()}: {streams.problems}"
    assert (jobs.completed, jobs.sent) == (8, 8), f"{jobs.line()}: {jobs.problems}"
