"""The pipeline end to end through its topics: requests in, results out, on both buses.

A client here is anyone who produces a documented request envelope to `requests` and reads
`results`, as the architecture allows; the gateway is one such client.
"""

from __future__ import annotations

import base64
import json
import threading
import time
import uuid

import pytest

from common import worker as worker_module
from common.bus import Bus, KafkaBus, MemoryBus
from common.messages import DeadLetter, Envelope, PrefillPayload, ResultPayload, Sampling, WarmPayload, decode
from common.topics import Topic, all_topic_names, topic_name
from deepmesh.mesh import Mesh
from engine import LLMEngine, StateSnapshot
from prefill_svc import worker as prefill_worker
from prefill_svc.worker import PrefillWorker
from tests.support.infra import require_service, scratch_store, thread_cpu_seconds
from tests.support.mesh_client import BODIES, collect, reference_body, submit
from tests.support.models import random_prompts

MODEL = "deepmesh-tiny"


@pytest.fixture(scope="module", params=["memory", "kafka"])
def mesh(request, tiny_preset, tmp_path_factory):
    if request.param == "memory":
        bus: Bus = MemoryBus()
    else:
        bus = KafkaBus(require_service("DEEPMESH_KAFKA_BOOTSTRAP"))
    prefix = f"test{uuid.uuid4().hex[:8]}."
    running = Mesh(
        tiny_preset, bus, scratch_store(tmp_path_factory.mktemp("state")), topic_prefix=prefix, partitions=2
    ).start()
    running.prefix = prefix
    yield running
    running.stop()
    bus.close()


def test_all_three_protocols_complete_and_match_one_process(mesh, tiny_preset):
    jobs = {submit(mesh, endpoint, body): endpoint for endpoint, body in BODIES.items()}
    results = collect(mesh, set(jobs))
    for job_id, endpoint in jobs.items():
        final = results[job_id][-1]
        assert final.status == 200 and final.done
        events = [e for r in results[job_id] for e in r.events]
        assert events, "a response streams events"
        expected = reference_body(tiny_preset, endpoint, BODIES[endpoint])
        if endpoint == "chat.completions":
            assert final.body["choices"][0]["message"] == expected["choices"][0]["message"]
            assert final.body["usage"]["completion_tokens"] == expected["usage"]["completion_tokens"] == 24
        elif endpoint == "messages":
            assert final.body["content"] == expected["content"]
        else:
            texts = [[c.get("text") for c in item.get("content", [])] for item in final.body["output"]]
            assert texts == [[c.get("text") for c in item.get("content", [])] for item in expected["output"]]
    assert mesh.decode.loaded >= 3  # state really went through the cache, not recomputed


def test_an_idle_mesh_waits_for_records_instead_of_polling(mesh):
    """Idle, the workers' threads wait on the bus until a record comes. On the in-process bus they
    woke every 5 ms (the engines' thread) and 10 ms (the tokenizer's) to find nothing: an idle
    `deepmesh serve` used 9% of a core, 7% in these two threads."""
    deadline = time.monotonic() + 30
    while any(w.busy for w in mesh.workers):  # what the tests before left in flight
        assert time.monotonic() < deadline, "the mesh never became idle"
        time.sleep(0.1)
    time.sleep(0.5)
    threads = [t for t in mesh._threads if t.name in ("tokenizer", "prefill+decode")]
    assert len(threads) == 2
    before = [thread_cpu_seconds(t) for t in threads]
    time.sleep(3)
    used = sum(thread_cpu_seconds(t) - b for t, b in zip(threads, before, strict=True))
    # 0.17 CPU-seconds on the in-process bus before; now 0.02, and 0.03-0.04 on Kafka (its client's polls)
    assert used < 0.1, f"the workers' threads used {used:.2f} CPU-seconds of 3 s idle"


def test_batch_work_waits_while_an_interactive_job_is_on_its_way_and_answers_in_one_message(mesh, monkeypatch):
    """Embedded, engines share a thread: from the moment the tokenizer sends an interactive prompt
    on until its first tokens are back, no engine starts a step with batch work in it, nor takes a
    batch job's state in (a decode engine's load is the engine thread's time). A batch
    job's answer, which nobody reads before it ends, comes as one results message."""
    steps: list[tuple[float, bool, set[int]]] = []  # when, held or not, the priorities stepped
    for worker in (mesh.prefill, mesh.decode):
        scheduler = worker.engine.scheduler

        def schedule(scheduler=scheduler, original=scheduler.schedule):
            held, began = scheduler.hold_low_priority, time.monotonic()
            step = original()
            if step is not None:
                steps.append((began, held, {s.params.priority for s in step.seqs}))
            return step

        monkeypatch.setattr(scheduler, "schedule", schedule)
    admitted: list[tuple[float, str]] = []  # when a job's state went into an engine, and its priority
    for worker in (mesh.prefill, mesh.decode):

        def admit(job_id, job, original=worker._admit) -> None:
            admitted.append((time.monotonic(), job.payload.priority))
            original(job_id, job)

        monkeypatch.setattr(worker, "_admit", admit)
    on_the_way: dict[str, list[float]] = {}  # job id: when the tokenizer added it, and took it off
    way = mesh.tokenizer.on_their_way
    for name in ("add", "discard"):
        call = getattr(way, name)

        def noted(job_id: str, call=call) -> None:
            on_the_way.setdefault(job_id, []).append(time.monotonic())
            call(job_id)

        monkeypatch.setattr(way, name, noted)
    body = {**BODIES["chat.completions"], "max_tokens": 40, "temperature": 0}
    batch = {submit(mesh, "chat.completions", body, priority="batch") for _ in range(6)}
    deadline = time.monotonic() + 60
    while not any(1 in kinds and len(kinds) == 1 for _, _, kinds in steps[-3:]):
        assert time.monotonic() < deadline, "the batch work never stepped"
        time.sleep(0.01)
    question = [{"role": "user", "content": f"A question nobody asked before: {uuid.uuid4().hex}"}]
    interactive = submit(mesh, "chat.completions", {**body, "messages": question, "max_tokens": 4})
    results = collect(mesh, batch | {interactive})
    sent, first_token = on_the_way[interactive][0], on_the_way[interactive][1]
    on_its_way = [(began, held, kinds) for began, held, kinds in steps if sent < began < first_token]
    assert any(held for _, held, _ in on_its_way), steps  # its own steps, at least, were held ones
    slack = 0.05  # a step that asked whether to hold just before the prompt was sent on
    assert all(held and 1 not in kinds for began, held, kinds in on_its_way if began > sent + slack), steps
    assert not [at for at, priority in admitted if sent + slack < at < first_token and priority == "batch"]
    assert any(1 in kinds for began, _, kinds in steps if began > first_token)  # and then it went on
    for job_id in batch:
        assert len(results[job_id]) == 1 and results[job_id][0].done and results[job_id][0].status == 200


def timed_decode_steps(mesh, monkeypatch) -> list[float]:
    """When each of decode's steps is scheduled, appended as they come."""
    steps: list[float] = []
    scheduler = mesh.decode.engine.scheduler

    def schedule(original=scheduler.schedule):
        step = original()
        if step is not None:
            steps.append(time.monotonic())
        return step

    monkeypatch.setattr(scheduler, "schedule", schedule)
    return steps


def slow_lookups(mesh, monkeypatch) -> dict[str, float]:
    """Prefill's prefix lookups, each made to take 50 ms: when each job's began."""
    began: dict[str, float] = {}

    def fetch(job_id, job, original=mesh.prefill._fetch):
        began[job_id] = time.monotonic()
        time.sleep(0.05)
        return original(job_id, job)

    monkeypatch.setattr(mesh.prefill, "_fetch", fetch)
    return began


def a_question_beside_a_long_answer(mesh, decode_steps: list[float], batch_beside: bool = False) -> str:
    """An interactive job answering 100 tokens (and, `batch_beside`, a batch job answering as long)
    and, once decode has stepped three times with all of them, a new question of its own: all
    answered; the question's job id."""
    body = {**BODIES["chat.completions"], "temperature": 0, "max_tokens": 100, "ignore_eos": True}
    answers = {submit(mesh, "chat.completions", body)}
    if batch_beside:
        answers.add(submit(mesh, "chat.completions", body, priority="batch"))
    deadline = time.monotonic() + 60
    while len(decode_steps) < 3 or len(mesh.decode.jobs) < len(answers):  # all of them decoding
        assert time.monotonic() < deadline, "the answers never decoded"
        time.sleep(0.01)
    question = [{"role": "user", "content": f"A question of its own: {uuid.uuid4().hex}"}]
    job_id = submit(mesh, "chat.completions", {**body, "messages": question, "max_tokens": 2})
    results = collect(mesh, answers | {job_id})
    assert all(results[j][-1].status == 200 for j in answers | {job_id})
    return job_id


def test_an_interactive_job_is_admitted_before_the_other_engine_steps_again(mesh, monkeypatch):
    """Embedded, where the engines take turns on one thread: an interactive prompt's prefix lookup
    runs on a fetch thread, and its engine waits for it rather than hand the thread to the other
    engine, whose step (of a batch, tens of ms) the prompt would otherwise wait out. Here the
    lookup takes 50 ms while decode has an interactive job to step."""
    monkeypatch.setattr(worker_module, "URGENT_FETCH_SECONDS", 2.0)  # past any lookup here, however slow
    monkeypatch.setattr(worker_module, "YIELD_SECONDS", 0.0)  # decode never leaves its turn: the wait alone
    decode_steps = timed_decode_steps(mesh, monkeypatch)
    began = slow_lookups(mesh, monkeypatch)
    admitted: dict[str, float] = {}

    def admit(job_id, job, original=mesh.prefill._admit) -> None:
        admitted[job_id] = time.monotonic()
        original(job_id, job)

    monkeypatch.setattr(mesh.prefill, "_admit", admit)
    job_id = a_question_beside_a_long_answer(mesh, decode_steps)
    assert admitted[job_id] - began[job_id] >= 0.05
    between = [at for at in decode_steps if began[job_id] < at < admitted[job_id]]
    assert not between, "decode stepped while the lookup ran"


@pytest.mark.parametrize("batch_beside", [True, False], ids=["beside-batch-work", "interactive-only"])
def test_decode_leaves_its_turns_to_a_first_token_while_it_holds_batch_work(mesh, monkeypatch, batch_beside):
    """Embedded, while decode holds batch work, its steps (of jobs that have their first tokens) wait
    while an interactive job is on its way to its own, which prefill computes on the same thread.
    Among interactive jobs alone it steps as before: under uniform traffic the yield cost time to
    first token (docs/benchmarks.md). Here the new job's lookup takes 50 ms and prefill gives the
    thread up at once, while decode has an interactive job to step."""
    monkeypatch.setattr(worker_module, "URGENT_FETCH_SECONDS", 0.0)  # prefill hands the thread over
    monkeypatch.setattr(worker_module, "YIELD_SECONDS", 5.0)  # past anything here, however slow
    decode_steps = timed_decode_steps(mesh, monkeypatch)
    began = slow_lookups(mesh, monkeypatch)
    first_token: dict[str, float] = {}

    def prefilled(out, job, original=mesh.prefill._prefilled) -> None:
        first_token.setdefault(out.request_id, time.monotonic())
        original(out, job)

    monkeypatch.setattr(mesh.prefill, "_prefilled", prefilled)
    job_id = a_question_beside_a_long_answer(mesh, decode_steps, batch_beside)
    assert first_token[job_id] - began[job_id] >= 0.05
    between = [at for at in decode_steps if began[job_id] < at < first_token[job_id]]
    if batch_beside:
        assert not between, f"decode stepped {len(between)} times between the lookup and the first token"
    else:
        assert between, "decode left its turns to the first token with no batch work to hold"
    assert any(at > first_token[job_id] for at in decode_steps)  # and it went on after


def test_an_interactive_job_loads_and_stores_its_state_past_batch_work(mesh):
    """Every fetch thread busy with batch jobs' loads and stores (a slow disk under a large batch):
    an interactive job's own still run at once, on threads of their own."""
    release = threading.Event()
    busy = [
        w.batch_fetcher.submit(release.wait, 60) for w in (mesh.prefill, mesh.decode) for _ in range(w.fetch_threads)
    ]
    try:
        question = [{"role": "user", "content": f"Another new question: {uuid.uuid4().hex}"}]
        job_id = submit(mesh, "chat.completions", {**BODIES["chat.completions"], "messages": question})
        assert collect(mesh, {job_id}, timeout=30)[job_id][-1].status == 200
        assert not any(task.done() for task in busy)  # it went past them
    finally:
        release.set()


def test_bad_requests_become_failed_results(mesh):
    job_id = submit(
        mesh, "chat.completions", {"model": "unknown-model", "messages": [{"role": "user", "content": "x"}]}
    )
    (result,) = collect(mesh, {job_id})[job_id]
    assert result.done and result.status == 404
    assert "unknown-model" in result.body["error"]["message"]


def test_unparseable_records_go_to_the_dead_letter_topic(mesh):
    mesh.bus.produce(topic_name(Topic.REQUESTS, mesh.prefix), "garbage-1", b"\x00 not an envelope")
    consumer = mesh.bus.consumer([topic_name(Topic.DEAD_LETTER, mesh.prefix)], group=f"dlq-{uuid.uuid4().hex[:6]}")
    letters = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not letters:
        letters = [DeadLetter.model_validate_json(r.value) for r in consumer.poll(timeout=0.5) if r.key == "garbage-1"]
    consumer.close()
    assert letters and "not a deepmesh envelope" in letters[0].reason
    assert base64.b64decode(letters[0].value_base64) == b"\x00 not an envelope"
    # and the worker is still serving
    job_id = submit(mesh, "chat.completions", BODIES["chat.completions"])
    assert collect(mesh, {job_id})[job_id][-1].status == 200


def test_a_decode_worker_dying_mid_job_loses_and_repeats_nothing(tiny_preset, tmp_path):
    """In-process, on the in-process bus; tests/system/test_distributed.py kills a real decode process on Kafka."""
    from decode_svc.worker import DecodeWorker

    bus = MemoryBus()
    prefix = f"crash{uuid.uuid4().hex[:8]}."
    mesh = Mesh(tiny_preset, bus, scratch_store(tmp_path), topic_prefix=prefix, partitions=2)
    mesh.prefix = prefix
    mesh.start([mesh.tokenizer, mesh.prefill])
    replacement = None
    try:
        body = {**BODIES["chat.completions"], "stream": True}
        job_id = submit(mesh, "chat.completions", body)
        doomed = mesh.decode
        deadline = time.monotonic() + 60
        while not (job_id in doomed.jobs and doomed.jobs[job_id].sent >= 8):
            doomed.run_once()
            assert time.monotonic() < deadline, "decode never got the job"
        doomed._consumer.close()  # dies here: its job is neither finished nor committed

        replacement = DecodeWorker(
            bus, prefix, LLMEngine(doomed.engine.model, weights=doomed.engine.weights), mesh.store
        )
        mesh.start([replacement])
        results = collect(mesh, {job_id})[job_id]
    finally:
        mesh.stop()
        bus.close()

    chunks = [json.loads(e.data) for r in results for e in r.events]
    streamed = "".join(
        (c["choices"][0]["delta"].get("reasoning_content") or "") + (c["choices"][0]["delta"].get("content") or "")
        for c in chunks
        if c.get("choices")
    )
    message = results[-1].body["choices"][0]["message"]
    assert streamed == (message.get("reasoning_content") or "") + (message["content"] or "")
    expected = reference_body(tiny_preset, "chat.completions", body)
    assert message == expected["choices"][0]["message"]
    assert results[-1].body["usage"]["completion_tokens"] == 24
    assert replacement.loaded == 1  # the survivor resumed from the cached prefill state


class SlowHandOvers:
    """A KV cache whose stores of prompt states take `seconds` (a slow disk or network: a fault
    this test cannot make for real at will); everything else is the real store's."""

    def __init__(self, store, seconds: float):
        self.store, self.seconds = store, seconds

    def put_prefix(self, *args, **kwargs):
        time.sleep(self.seconds)
        return self.store.put_prefix(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.store, name)


def slow_exports(engine: LLMEngine, seconds: float) -> None:
    """The engine's copies of a request's state out of it take `seconds` (a long prompt's gigabytes
    of state: a fault this test cannot make for real with a tiny model); the copies are the real ones."""
    export = engine.export_state

    def slow_export(request_id: str) -> StateSnapshot:
        time.sleep(seconds)
        return export(request_id)

    engine.export_state = slow_export


def test_the_first_token_does_not_wait_for_the_hand_over(tiny_preset, tmp_path):
    """Prefill sends the first token as soon as it is sampled; copying the prompt's state out of
    the engine and storing it for decode (here 2 s each) delay the tokens after it, not the first."""
    bus = MemoryBus()
    prefix = f"overlap{uuid.uuid4().hex[:8]}."
    mesh = Mesh(tiny_preset, bus, SlowHandOvers(scratch_store(tmp_path), 2.0), topic_prefix=prefix, partitions=2)
    slow_exports(mesh.prefill.engine, 2.0)
    mesh.prefix = prefix
    mesh.start()
    try:
        results = bus.consumer([topic_name(Topic.RESULTS, prefix)], group="overlap-client")
        started = time.monotonic()
        job_id = submit(mesh, "chat.completions", {**BODIES["chat.completions"], "stream": True, "max_tokens": 4})
        first = done = None
        while done is None and time.monotonic() - started < 60:
            for record in results.poll(timeout=0.2):
                result = ResultPayload.model_validate(decode(record.value, "result").payload)
                if record.key != job_id:
                    continue
                if first is None and result.events:  # the role chunk: it goes out with the first token
                    first = time.monotonic() - started
                if result.done:
                    done = time.monotonic() - started
        results.close()
    finally:
        mesh.stop()
    assert done is not None and done >= 4.0  # the rest waited for the hand-over's copy and store
    assert first is not None and first < 1.5, first


def send_prefill(bus: Bus, prefix: str, job_id: str, prompt: list[int], max_tokens: int) -> None:
    sampling = Sampling(max_tokens=max_tokens, temperature=0, top_p=1)
    payload = PrefillPayload(endpoint="chat.completions", prompt_token_ids=prompt, sampling=sampling)
    envelope = Envelope(type="prefill", job_id=job_id, payload=payload.model_dump())
    bus.produce(topic_name(Topic.PREFILL, prefix), job_id, envelope.encode())


class SlowJobLookups:
    """A KV cache whose prefix lookups for prefill's jobs (on its fetch threads) take `seconds`;
    the warm thread's, and everything else, are the real store's."""

    def __init__(self, store, seconds: float):
        self.store, self.seconds = store, seconds

    def lookup(self, *args, **kwargs):
        if threading.current_thread().name.startswith("prefill-fetch"):
            time.sleep(self.seconds)
        return self.store.lookup(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.store, name)


def test_holding_a_finished_conversation_waits_for_a_first_token(tiny_checkpoint, tmp_path, monkeypatch):
    """A finished conversation's state (a warm message) is taken into the engine's memory on the
    engine's thread: while a job is on its way to its first token that waits, and happens once it
    is out. Here the state is loaded while the job's own lookup still runs (0.3 s)."""
    monkeypatch.setattr(prefill_worker, "WARM_WAIT_SECONDS", 30.0)  # only the first token ends the wait here
    bus, prefix = MemoryBus(), f"warm{uuid.uuid4().hex[:6]}."
    bus.create_topics(all_topic_names(prefix), 1)
    store = scratch_store(tmp_path)
    conversation = random_prompts([160], seed=3)[0]
    first = PrefillWorker(bus, prefix, LLMEngine.from_pretrained(tiny_checkpoint), store)
    send_prefill(bus, prefix, "turn", conversation, max_tokens=1)  # done at its first token: its state stored
    namespace = first.cache.namespace("default")
    deadline = time.monotonic() + 60
    while store.lookup(namespace, conversation, len(conversation) + 1).num_tokens < len(conversation):
        assert time.monotonic() < deadline, "the first turn's state was never stored"
        first.run_once(timeout=0.01)
    first.close()

    worker = PrefillWorker(bus, prefix, LLMEngine.from_pretrained(tiny_checkpoint), SlowJobLookups(store, 0.3))
    events: list[str] = []
    hold = worker.engine.keep_resident
    worker.engine.keep_resident = lambda *args: events.append("held") or hold(*args)
    send = worker.hop
    worker.hop = lambda topic, envelope, span: (
        events.append(f"{topic.value} {envelope.job_id}") or send(topic, envelope, span)
    )
    warm = Envelope(type="warm", job_id="warm", payload=WarmPayload(token_ids=conversation).model_dump())
    bus.produce(topic_name(Topic.PREFILL, prefix), "warm", warm.encode())
    send_prefill(bus, prefix, "next", random_prompts([40], seed=4)[0], max_tokens=4)
    deadline = time.monotonic() + 60
    while "held" not in events and time.monotonic() < deadline:
        worker.run_once(timeout=0.01)
    worker.close()
    assert events.index("tokens next") < events.index("held"), events
    assert worker.engine.resident_tokens("default", conversation) > 0
