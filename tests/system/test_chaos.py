"""Every kind of service killed while jobs run, and the broker restarted, with real processes
over real Kafka (tests/chaos.py): no answer lost, hung or different from a single-process run.
One process of each kind: a killed worker's jobs wait for the one started in its place (jobs
moving to a second replica: tests/system/test_routing_distributed.py). benchmarks/chaos_soak.py
runs the same harness longer, with two replicas of each worker and random faults."""

from __future__ import annotations

import signal
import time

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


def test_services_stopped_while_the_broker_is_frozen_exit_within_their_grace(model, tmp_path):
    """An orchestrator stops services when the broker has gone away (a partition, a node lost): it
    sends SIGTERM, and SIGKILL after its own grace (Docker's 10 s). The broker here is frozen
    (SIGSTOP: connections stay open and nothing answers). Each service exits within its drain and
    STOP_GRACE_SECONDS instead of waiting out its Kafka client's timeouts (here, before that bound,
    the gateway took 57 s; with the stack stopped, prefill and decode 25 s); what it had not
    committed is done again."""
    from deepmesh.cli import STOP_GRACE_SECONDS
    from tests.support.chaos import broker_frozen
    from tests.support.cluster import Cluster
    from tests.support.infra import wait_until_up

    require_service("DEEPMESH_KAFKA_BOOTSTRAP")
    cluster = Cluster(tmp_path, model)
    cluster.env |= {"DEEPMESH_DRAIN_SECONDS": "2", "DEEPMESH_COMPILE_DECODE": "false"}
    gateway = cluster.spawn("gateway", "--port", str(cluster.gateway_port))
    workers = [cluster.spawn(name) for name in ("tokenizer", "decode")]
    try:
        wait_until_up(f"{cluster.url}/healthz", [gateway, *workers], 120, f"see {tmp_path}")
        logs = [tmp_path / f"{name}-{i + 1}.log" for i, name in enumerate(("tokenizer", "decode"))]
        deadline = time.monotonic() + 120
        while not all("worker running" in log.read_text() for log in logs):
            assert time.monotonic() < deadline and all(w.poll() is None for w in workers), f"see {tmp_path}"
            time.sleep(0.2)
        time.sleep(2)  # past their start: polling, heartbeats and reports under way
        with broker_frozen():
            time.sleep(3)  # their requests to it are under way and unanswered
            stopped = time.monotonic()
            for process in (gateway, *workers):
                process.send_signal(signal.SIGTERM)
            took = []
            for process in (gateway, *workers):
                process.wait(timeout=60)
                took.append(time.monotonic() - stopped)
    finally:
        cluster.stop()
    assert max(took) < 2 + STOP_GRACE_SECONDS + 3, f"exited after {took} s (see {tmp_path})"
    # one that had to be cut short says where it waited: every thread's stack, in its log
    cut_short = [log.read_text() for log in tmp_path.glob("*.log") if "still stopping after" in log.read_text()]
    assert cut_short, f"every service stopped before its grace ran out (see {tmp_path})"
    for text in cut_short:
        stacks = text.split("still stopping after", 1)[1]
        assert stacks.count("(most recent call first)") >= 2 and 'File "' in stacks, stacks[:2000]
