"""The batch runner's rounds on the real database, with the bus replaced by what it would send:
fair shares between tenants and batches, requests the protocol refuses, a round cut short by a
broker that stops taking records, and a runner process killed at each point of its round."""

from __future__ import annotations

import multiprocessing
from collections import Counter
from pathlib import Path

import pytest

from gateway.batch_runner import BatchRunner
from gateway.batch_store import BatchStore
from gateway.files import FileStore
from gateway.jobs import JobStore
from tests.support.infra import fresh_database
from tests.support.killed_round import round_killed

PARAMS = {"model": "deepmesh-tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
ANSWER = {"usage": {"input_tokens": 5, "output_tokens": 4}, "content": []}


class Broker:
    """Records what the runner sends; refuses from the `fail_after`-th record on when set."""

    def __init__(self):
        self.sent: list[tuple[str, str]] = []  # (tenant, job id)
        self.fail_after: int | None = None

    def send(self, job_id: str, endpoint: str, body: dict, options: dict) -> None:
        if self.fail_after is not None and len(self.sent) >= self.fail_after:
            raise ConnectionError("the broker is away")
        assert options["priority"] == "batch" and body["stream"] is False
        self.sent.append((options["tenant"], job_id))


@pytest.fixture
def setup(tmp_path):
    jobs = JobStore(fresh_database(tmp_path))
    broker = Broker()
    runner = BatchRunner(jobs, FileStore(jobs.session, tmp_path / "files"), broker.send, lambda job_id: None, 6)
    yield jobs, broker, runner, BatchStore(jobs.session)
    jobs.close()


def answer(jobs: JobStore, job_ids: list[str]) -> None:
    for job_id in job_ids:
        assert jobs.record(job_id, 0, [], True, 200, ANSWER, None) == "stored"


def requests(prefix: str, count: int) -> list[tuple[str, dict]]:
    return [(f"{prefix}{i}", PARAMS) for i in range(count)]


def test_tenants_share_the_requests_in_flight_and_a_tenants_batches_share_its_part(setup):
    jobs, broker, runner, store = setup
    first = store.create("anthropic", "acme", "messages", requests=requests("a", 100))
    second = store.create("anthropic", "acme", "messages", requests=requests("b", 10))
    small = store.create("anthropic", "globex", "messages", requests=requests("g", 3))
    runner.advance()
    assert Counter(tenant for tenant, _ in broker.sent) == {"acme": 3, "globex": 3}
    # acme's three split between its two batches, the older one first
    assert [store.counts(b.id).get("sent", 0) for b in (first, second)] == [2, 1]
    answer(jobs, [job_id for _, job_id in broker.sent])
    runner.advance()  # globex's batch is done: acme takes every free place
    assert Counter(tenant for tenant, _ in broker.sent[6:]) == {"acme": 6}
    assert store.counts(small.id) == {"succeeded": 3}
    assert store.get("globex", small.id, "anthropic").status == "completed"


def test_a_request_the_protocol_refuses_ends_errored_without_running(setup):
    jobs, broker, runner, store = setup
    no_max_tokens = {k: v for k, v in PARAMS.items() if k != "max_tokens"}
    batch = store.create("anthropic", "acme", "messages", requests=[("ok", PARAMS), ("bad", no_max_tokens)])
    runner.advance()
    assert len(broker.sent) == 1
    answer(jobs, [broker.sent[0][1]])
    runner.advance()
    assert store.counts(batch.id) == {"succeeded": 1, "errored": 1}
    assert store.get("acme", batch.id, "anthropic").status == "completed"
    store.delete("acme", batch.id, "anthropic")
    assert store.counts(batch.id) == {}  # its requests went with it, in SQLite as in PostgreSQL


def test_requests_the_broker_did_not_take_are_sent_again(setup):
    jobs, broker, runner, store = setup
    batch = store.create("anthropic", "acme", "messages", requests=requests("a", 6))
    broker.fail_after = 2
    with pytest.raises(ConnectionError):
        runner.advance()  # two produced, four created but not produced: `sending`
    assert len(broker.sent) == 2 and store.counts(batch.id) == {"sent": 2, "sending": 4}
    broker.fail_after = None
    runner.advance()  # not yet: a `sending` request may still be on its way from another runner
    assert len(broker.sent) == 2
    runner.resend_after = 0
    runner.advance()
    assert len(broker.sent) == 6 and len({job_id for _, job_id in broker.sent}) == 6
    answer(jobs, [job_id for _, job_id in broker.sent])
    runner.advance()
    assert store.counts(batch.id) == {"succeeded": 6}


def test_a_restarted_embedded_runner_sends_at_once_all_its_predecessor_left_unfinished(setup):
    """Embedded, the runner is the only one and its bus died with the process: the next process's
    first round sends again what was `sent` and what was still `sending`, without waiting
    `resend_after` (which is for a distributed runner that may still be producing)."""
    jobs, broker, runner, store = setup
    batch = store.create("anthropic", "acme", "messages", requests=requests("a", 6))
    broker.fail_after = 2
    with pytest.raises(ConnectionError):
        runner.advance()
    assert store.counts(batch.id) == {"sent": 2, "sending": 4}
    broker.fail_after = None
    restarted = BatchRunner(jobs, runner.files, broker.send, lambda job_id: None, 6, resend_sent=True)
    assert restarted.resend_after > 0
    restarted.advance()
    assert len(broker.sent) == 2 + 6 and len({job_id for _, job_id in broker.sent}) == 6
    assert store.counts(batch.id) == {"sent": 6}
    restarted.advance()  # once only
    assert len(broker.sent) == 8
    answer(jobs, sorted({job_id for _, job_id in broker.sent}))
    restarted.advance()
    assert store.counts(batch.id) == {"succeeded": 6}


def test_a_batch_past_its_window_expires_keeping_what_finished(setup):
    jobs, broker, runner, store = setup
    batch = store.create("anthropic", "acme", "messages", requests=requests("a", 10))
    runner.advance()
    answer(jobs, [job_id for _, job_id in broker.sent[:2]])  # two of the six running finish
    with jobs.session.begin() as s:  # the 24 hours pass
        s.get(type(batch), batch.id).expires_at = 0
    runner.advance()
    assert store.counts(batch.id) == {"succeeded": 2, "expired": 8}
    ended = store.get("acme", batch.id, "anthropic")
    assert ended.status == "expired" and ended.expired_at is not None
    assert all(jobs.get(job_id).status == "cancelled" for _, job_id in broker.sent[2:])  # stopped, not left running


@pytest.mark.parametrize("kill_after", [0, 3, 6])
def test_a_runner_killed_at_any_point_of_its_round_loses_no_request(setup, tmp_path, kill_after):
    """Killed before producing, between two records, or after the last but before marking them
    sent: the jobs it produced run to their end and count once, the ones it did not are sent by
    the next runner, and the batch completes."""
    jobs, broker, runner, store = setup
    batch = store.create("anthropic", "acme", "messages", requests=requests("a", 8))
    produced = tmp_path / "produced"
    produced.touch()
    url = jobs.engine.url.render_as_string(hide_password=False)
    child = multiprocessing.get_context("spawn").Process(
        target=round_killed, args=(url, str(tmp_path / "files"), str(produced), kill_after)
    )
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 9
    ran = Path(produced).read_text().split()
    assert len(ran) == kill_after
    answer(jobs, ran)  # the mesh answers what reached it, with no runner to see it
    runner.resend_after = 0  # as if the minute had passed: what is still `sending` was lost
    for _ in range(10):
        runner.advance()
        answer(jobs, [job_id for _, job_id in broker.sent if jobs.get(job_id).status == "queued"])
        if store.get("acme", batch.id, "anthropic").status == "completed":
            break
    assert store.counts(batch.id) == {"succeeded": 8}
    assert not set(ran) & {job_id for _, job_id in broker.sent}  # none of the answered ones ran twice
