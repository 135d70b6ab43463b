"""A worker that loses partitions to a new replica, and one whose step fails part way: every
job still completes with exactly the single-process answer, nothing lost or repeated."""

from __future__ import annotations

import json
import threading
import time
import uuid

import pytest

from common.bus import MemoryBus, partition_for
from common.topics import Topic, topic_name
from decode_svc.worker import DecodeWorker
from deepmesh.mesh import Mesh
from engine import LLMEngine, SamplingParams
from tests.support.infra import scratch_store
from tests.support.mesh_client import BODIES, collect, reference_body
from tests.support.models import random_prompts

BODY = {**BODIES["chat.completions"], "stream": True}


@pytest.fixture(scope="module")
def expected(tiny_preset) -> dict:
    return reference_body(tiny_preset, "chat.completions", BODY)["choices"][0]["message"]


def _answer(results) -> dict:
    """The final message, after checking the stream carried the same text."""
    chunks = [json.loads(e.data) for r in results for e in r.events]
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    message = results[-1].body["choices"][0]["message"]
    assert streamed == message["content"]
    assert results[-1].body["usage"]["completion_tokens"] == 24
    return message


def _job_ids_on_both_partitions(count: int) -> list[str]:
    ids, parts = [], []
    while len(ids) < count:
        job_id = uuid.uuid4().hex
        if parts.count(partition_for(job_id, 2)) < count // 2:
            ids.append(job_id)
            parts.append(partition_for(job_id, 2))
    return ids


def _submit(mesh, job_id: str) -> None:
    from common.messages import Envelope, RequestPayload

    envelope = Envelope(
        type="request", job_id=job_id, payload=RequestPayload(endpoint="chat.completions", body=BODY).model_dump()
    )
    mesh.bus.produce(topic_name(Topic.REQUESTS, mesh.prefix), job_id, envelope.encode())


def test_a_decode_worker_that_loses_a_partition_drops_its_jobs_to_the_new_owner(tiny_preset, tmp_path, expected):
    bus = MemoryBus()
    mesh = Mesh(tiny_preset, bus, scratch_store(tmp_path), topic_prefix=f"rebal{uuid.uuid4().hex[:6]}.", partitions=2)
    mesh.prefix = mesh.tokenizer.prefix
    mesh.start([mesh.tokenizer, mesh.prefill])
    first = mesh.decode
    second = DecodeWorker(bus, mesh.prefix, LLMEngine(first.engine.model, weights=first.engine.weights), mesh.store)
    jobs = _job_ids_on_both_partitions(4)
    try:
        for job_id in jobs:
            _submit(mesh, job_id)
        deadline = time.monotonic() + 60
        while not (len(first.jobs) == 4 and all(job.sent >= 5 for job in first.jobs.values())):
            first.run_once(timeout=0.01)
            assert time.monotonic() < deadline, "decode never held all four jobs"
        second.run_once(timeout=0.01)  # joins the group: one of the two partitions is its now
        first.run_once(timeout=0.01)
        kept = {
            job_id
            for job_id in jobs
            if (topic_name(Topic.DECODE, mesh.prefix), partition_for(job_id, 2)) in first._owned
        }
        assert set(first.jobs) == kept and len(kept) == 2  # the other two went with their partition
        assert not (set(first.engine.seqs) - kept)  # and their state is freed
        done = threading.Event()
        runner = threading.Thread(target=_alternate, args=([first, second], done), daemon=True)
        runner.start()
        results = collect(mesh, set(jobs))
        done.set()
        runner.join(timeout=30)
    finally:
        mesh.stop()
        bus.close()
    for job_id in jobs:
        assert _answer(results[job_id]) == expected
    assert second.loaded + second.recomputed == 2  # the new owner did the two it was given


def _alternate(workers, done: threading.Event) -> None:
    while not done.is_set():
        for worker in workers:
            worker.run_once(timeout=0.01)


class _TokensSendFailsOnce(MemoryBus):
    """A bus whose next send to `tokens` fails after `arm()`: a broker that did not acknowledge
    in time (tests/system/test_chaos.py stops a real broker)."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = threading.Event()
        self.failed = threading.Event()

    def produce_batch(self, topic, records) -> list[tuple[int, int]]:
        if topic.endswith(Topic.TOKENS.value) and self.armed.is_set():
            self.armed.clear()
            self.failed.set()
            raise TimeoutError("no acknowledgement from the broker")
        return super().produce_batch(topic, records)


def test_a_step_that_fails_part_way_is_really_done_again(tiny_preset, tmp_path, expected):
    bus = _TokensSendFailsOnce()
    mesh = Mesh(tiny_preset, bus, scratch_store(tmp_path), topic_prefix=f"fail{uuid.uuid4().hex[:6]}.", partitions=2)
    mesh.prefix = mesh.tokenizer.prefix
    mesh.start([mesh.tokenizer, mesh.prefill])
    jobs = _job_ids_on_both_partitions(2)
    try:
        for job_id in jobs:
            _submit(mesh, job_id)
        decode_worker = mesh.decode
        deadline = time.monotonic() + 60
        while not (len(decode_worker.jobs) == 2 and all(job.sent >= 5 for job in decode_worker.jobs.values())):
            decode_worker.run_once(timeout=0.01)
            assert time.monotonic() < deadline, "decode never held both jobs"
        bus.armed.set()  # the next step's tokens are not acknowledged
        mesh.start([decode_worker])  # run_workers: the failure, then recovery
        results = collect(mesh, set(jobs))
    finally:
        mesh.stop()
        bus.close()
    assert bus.failed.is_set()
    for job_id in jobs:
        assert _answer(results[job_id]) == expected


def test_an_id_taken_again_after_an_abort_is_a_new_request(tiny_checkpoint):
    engine = LLMEngine.from_pretrained(tiny_checkpoint)
    (prompt,) = random_prompts([30], seed=3)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    engine.add_request("job", prompt, params)
    engine.step()
    engine.abort("job")
    engine.add_request("job", prompt, params)  # dropped and taken again before the next step
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.finish_reason for o in outputs if o.finished] == ["length"]
    assert [t for o in outputs for t in o.new_token_ids] == engine.generate([prompt], params)[0].token_ids


def test_a_job_decode_refuses_is_answered_with_the_reason_not_left_to_time_out(tiny_preset, tmp_path):
    """A decode replica whose engine differs from prefill's (here a smaller context, as a
    misconfigured deployment would have): the job prefill took ends at once with a 500 naming
    why, in the protocol's shape, and the worker goes on serving."""
    bus = MemoryBus()
    mesh = Mesh(tiny_preset, bus, scratch_store(tmp_path), topic_prefix=f"refuse{uuid.uuid4().hex[:6]}.", partitions=2)
    mesh.prefix = mesh.tokenizer.prefix
    prefill = mesh.prefill.engine
    mesh.decode.engine = LLMEngine(prefill.model, weights=prefill.weights, grammars=prefill.grammars, max_model_len=120)
    mesh.start()
    try:
        from tests.support.mesh_client import submit

        long = submit(mesh, "chat.completions", {**BODIES["chat.completions"], "max_tokens": 118})
        result = collect(mesh, {long}, timeout=30)[long][-1]  # after the first token prefill sent
        assert result.done and result.status == 500
        assert "decode refused the job" in result.body["error"]["message"]
        assert "context" in result.body["error"]["message"]
        short = submit(mesh, "chat.completions", {**BODIES["chat.completions"], "max_tokens": 4})
        assert collect(mesh, {short}, timeout=30)[short][-1].status == 200
    finally:
        mesh.stop()
        bus.close()
