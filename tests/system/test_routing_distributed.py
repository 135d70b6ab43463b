"""Routing in distributed mode: two prefill and two decode replicas of the real engine, each its
own OS process, over real Apache Kafka, driven by the official SDKs.

Which replica did what is read from the jobs' traces (the chosen replica is on each stage's
span) and the replicas' own load reports; answers are compared with one process's."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from common.bus import KafkaBus
from common.replicas import ReplicaTable, ReportListener
from common.routing import resident_tokens
from common.tracing import job_trace, read_spans
from tests.support.behaviour import MODEL, eventually, wait_for_status
from tests.support.cluster import Cluster
from tokenizer_svc.protocol import Codec

GREEDY = {"temperature": 0, "extra_body": {"thinking": {"type": "disabled"}}}


@pytest.fixture(scope="module")
def model(tiny_preset) -> Path:
    return tiny_preset


@pytest.fixture(scope="module")
def cluster(model, tmp_path_factory):
    running = Cluster(tmp_path_factory.mktemp("routed"), model)
    running.env["DEEPMESH_TOPIC_PARTITIONS"] = "4"
    running.env["DEEPMESH_LOG_LEVEL"] = "INFO"
    bus = KafkaBus(running.env["DEEPMESH_KAFKA_BOOTSTRAP"])
    running.replicas = ReplicaTable()
    listener = ReportListener(bus, running.prefix, running.replicas)
    listener.start()
    try:
        running.start(("cache", "gateway", "tokenizer", "prefill", "prefill", "decode", "decode"))
        wait_for_replicas(running, prefill=2, decode=2)
        yield running
    finally:
        listener.stop()
        for process in running.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)  # a test that stopped one and failed
        running.stop()
        bus.close()


def wait_for_replicas(cluster, prefill: int, decode: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while [len(cluster.replicas.live(s)) for s in ("prefill", "decode")] != [prefill, decode]:
        assert time.monotonic() < deadline, [r.model_dump() for r in cluster.replicas.all()]
        time.sleep(0.2)


def replica_of(cluster, stage: str, pid: int) -> str:
    return next(r.replica for r in cluster.replicas.all() if r.stage == stage and f"-{pid}-" in r.replica)


def process_of(cluster, replica: str):
    return next(p for p in cluster.processes.values() if p.poll() is None and f"-{p.pid}-" in replica)


def spans_of(cluster, job_id: str, names: set[str], timeout: float = 30) -> dict[str, list[dict]]:
    """The job's spans by name, once every one of `names` is written (spans are written as they end)."""
    deadline = time.monotonic() + timeout
    while True:
        found: dict[str, list[dict]] = {}
        for span in job_trace(read_spans(cluster.traces), job_id):
            found.setdefault(span["name"], []).append(span)
        if names <= set(found):
            return found
        assert time.monotonic() < deadline, f"spans missing from the trace of {job_id}: {names - set(found)}"
        time.sleep(0.1)


def job_of(completion) -> str:
    return completion.id.removeprefix("chatcmpl-")


def test_a_follow_up_goes_back_to_the_replica_that_holds_it_with_no_load(cluster, model):
    from tests.support.behaviour import one_process_answer

    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="none", max_retries=0)
    question = [{"role": "user", "content": "Which replica holds this conversation, and why? " * 6}]
    first = client.chat.completions.create(model=MODEL, messages=question, max_tokens=12, **GREEDY)
    spans = spans_of(cluster, job_of(first), {"prefill", "decode"})
    holder = spans["prefill"][0]["attributes"]["deepmesh.replica"]
    history = [*question, {"role": "assistant", "content": first.choices[0].message.content}]
    follow_up = [*history, {"role": "user", "content": "Say it again."}]
    deadline = time.monotonic() + 20
    while True:  # until the holder reports the answered conversation (decode stores it, the holder loads it)
        report = next(r for r in cluster.replicas.live("prefill") if r.replica == holder)
        longest = max((n for n, *_ in report.resident), default=0)
        if longest > first.usage.prompt_tokens:
            break
        assert time.monotonic() < deadline, f"{holder} holds only {longest} tokens"
        time.sleep(0.1)
    second = client.chat.completions.create(model=MODEL, messages=follow_up, max_tokens=12, **GREEDY)
    spans = spans_of(cluster, job_of(second), {"prefill", "send prefill"})
    prefill = spans["prefill"][0]["attributes"]
    assert spans["send prefill"][0]["attributes"]["deepmesh.route_reason"] == "prefix"
    assert prefill["deepmesh.replica"] == holder
    assert prefill["deepmesh.prefix_source"] == "resident"
    prefill_id = spans["prefill"][0]["span_id"]
    loads = [s for s in spans.get("cache.load", []) if s["parent_id"] == prefill_id]
    assert not loads, "the follow-up's prefill loaded state from the cache service"
    body = {"model": MODEL, "messages": follow_up, "max_tokens": 12, "temperature": 0}
    body["thinking"] = {"type": "disabled"}
    # what the holder reported of the follow-up's prompt: turn 1's prompt at least, and the answer
    # too when its text encodes to the tokens generated (random weights' text may not)
    tokens = Codec.for_model(model, MODEL).prompt("chat.completions", body).token_ids
    expected = resident_tokens([report], "default", tokens)[holder]
    assert first.usage.prompt_tokens <= expected < second.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens == expected
    assert second.choices[0].message.content == one_process_answer(model, body)["choices"][0]["message"]["content"]


def stream_text(url: str, body: dict, into: dict, key: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    parts = []
    for chunk in client.chat.completions.create(**body, stream=True):
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
        into.setdefault(f"{key}.id", chunk.id)
    into[key] = "".join(parts)


def test_a_held_up_decode_replica_gets_no_new_jobs_and_its_jobs_finish_elsewhere(cluster, model):
    from tests.support.behaviour import one_process_answers

    bodies = [
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"Story number {i}, please."}],
            "max_tokens": 160,
            "temperature": 0,
            "extra_body": {"thinking": {"type": "disabled"}},
        }
        for i in range(4)
    ]
    answers: dict[str, str] = {}
    streams = [
        threading.Thread(target=stream_text, args=(cluster.url, body, answers, f"s{i}"))
        for i, body in enumerate(bodies)
    ]
    for stream in streams:
        stream.start()
    deadline = time.monotonic() + 120
    while len([k for k in answers if k.endswith(".id")]) < 4:  # every stream has its first token
        assert time.monotonic() < deadline, "the streams did not start"
        time.sleep(0.05)
    decoded_by = {}
    for i in range(4):
        spans = spans_of(cluster, answers[f"s{i}.id"].removeprefix("chatcmpl-"), {"send decode"})
        decoded_by[i] = spans["send decode"][0]["attributes"]["deepmesh.replica"]
    assert len(set(decoded_by.values())) == 2, f"four streams at once went to one decode replica: {decoded_by}"
    held_up = decoded_by[0]
    victim = process_of(cluster, held_up)
    victim.send_signal(signal.SIGSTOP)
    try:
        time.sleep(2.5)  # silent for longer than a report may be old: out of rotation
        assert held_up not in {r.replica for r in cluster.replicas.live("decode")}
        client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="none", max_retries=0, timeout=120)
        for i in range(3):
            reply = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Quick {i}?"}], max_tokens=4, **GREEDY
            )
            sent_to = spans_of(cluster, job_of(reply), {"send decode"})["send decode"][0]["attributes"]
            assert sent_to["deepmesh.replica"] != held_up
        for stream in streams:  # its own jobs move with its partitions (the group evicts it) and finish
            stream.join(timeout=180)
        assert not any(stream.is_alive() for stream in streams), "a stream of the held-up replica never finished"
        # the references while it is still stopped: the other processes are idle, the cores free
        references = [{**{k: v for k, v in b.items() if k != "extra_body"}, **b["extra_body"]} for b in bodies]
        expected = one_process_answers(model, [("chat.completions", reference) for reference in references])
    finally:
        victim.send_signal(signal.SIGCONT)
    for i, answer in enumerate(expected):
        assert answers[f"s{i}"] == answer["choices"][0]["message"]["content"]
    # resumed, it learns the group removed it and drops the job it held, which another replica
    # finished meanwhile, instead of decoding it to its end again (about ten seconds alone)
    deadline = time.monotonic() + 5
    while True:
        report = next((r for r in cluster.replicas.live("decode") if r.replica == held_up), None)
        if report is not None and report.running_jobs + report.queued_jobs == 0:
            break
        assert time.monotonic() < deadline, f"the resumed replica still decodes what it held: {report}"
        time.sleep(0.05)
    wait_for_replicas(cluster, prefill=2, decode=2)  # back in rotation


def test_a_killed_prefill_replica_loses_no_job(cluster, model):
    from tests.support.behaviour import one_process_answers

    bodies = [
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"Prompt {i}: " + "tell me more about routing. " * 100}],
            "max_tokens": 6,
            "temperature": 0,
            "thinking": {"type": "disabled"},
        }
        for i in range(6)
    ]
    replies: dict[int, dict] = {}

    def ask(i: int) -> None:
        """As a client does: a call refused for load (429, never accepted) is sent again when told."""
        for _ in range(10):
            response = httpx.post(f"{cluster.url}/v1/chat/completions", json=bodies[i], timeout=300)
            if response.status_code != 429:
                break
            time.sleep(float(response.headers.get("retry-after", 1)))
        replies[i] = response.json()

    askers = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
    for asker in askers:
        asker.start()
    victim_name = None
    deadline = time.monotonic() + 60
    while victim_name is None:  # a replica with prompts queued or running
        busy = [r for r in cluster.replicas.live("prefill") if r.queued_jobs + r.running_jobs > 0]
        victim_name = busy[0].replica if busy else None
        assert time.monotonic() < deadline, "no prefill replica took the prompts"
        time.sleep(0.02)
    victim = process_of(cluster, victim_name)
    victim.kill()
    victim.wait()
    for asker in askers:
        asker.join(timeout=240)
    cluster.spawn("prefill")  # back to two for the tests after this one
    assert sorted(replies) == list(range(6))
    expected = one_process_answers(model, [("chat.completions", body) for body in bodies])
    for i, answer in enumerate(expected):
        assert "choices" in replies[i], f"reply {i}: {replies[i]}"
        assert replies[i]["choices"] == answer["choices"]
    wait_for_replicas(cluster, prefill=2, decode=2)


@pytest.fixture
def strict_gateway(cluster):
    """A second gateway of the cluster whose admission bound is one second."""
    import subprocess
    import sys

    from tests.support.infra import free_port, wait_until_up

    port = free_port()
    env = {**cluster.env, "DEEPMESH_ADMISSION_WAIT_SECONDS": "1"}
    log = open(cluster.root / "strict-gateway.log", "w")  # noqa: SIM115 (lives with the process)
    process = subprocess.Popen(
        [sys.executable, "-m", "deepmesh.cli", "gateway", "--port", str(port)], env=env, stdout=log, stderr=log
    )
    try:
        wait_until_up(f"http://127.0.0.1:{port}/readyz", [process], 120, f"see {cluster.root}")
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_over_the_admission_bound_a_call_is_refused_with_429_and_async_jobs_wait(cluster, strict_gateway):
    """A gateway refuses what no replica could start within DEEPMESH_ADMISSION_WAIT_SECONDS
    (1 here): a 429 with Retry-After that the official SDKs read as a rate limit. Async jobs
    are never refused: they queue and run."""
    url = strict_gateway

    def submit(i: int) -> str:
        # each its own from the first word: prompts that shared one would be mostly cached, and
        # the queue only a few hundred tokens deep
        long_prompt = [{"role": "user", "content": f"{i} " + "Summarise the history of message queues. " * 280}]
        body = {"model": MODEL, "messages": long_prompt, "max_tokens": 2}
        submitted = httpx.post(f"{url}/v1/jobs", json={"endpoint": "chat.completions", "body": body}, timeout=60)
        assert submitted.status_code == 202
        return submitted.json()["id"]

    def queued() -> list[tuple[str, int]]:
        """(replica, prompt tokens queued) as the replicas last reported them."""
        return [(r.replica, r.queued_tokens) for r in cluster.replicas.live("prefill")]

    def every_replica_busy(reported: list[tuple[str, int]]) -> bool:
        return len(reported) == 2 and all(tokens > 0 for _, tokens in reported)

    # some 27,000 prompt tokens ahead of any new call, seconds of prefill, sent at once: sent one
    # after another, on a loaded machine the replicas computed each before the next came and the
    # queue was never deep
    with ThreadPoolExecutor(12) as pool:
        job_ids = list(pool.map(submit, range(12)))
    # the soonest any replica could start a call is what admission weighs: every one busy
    eventually(lambda: every_replica_busy(queued()), 60, "the jobs never reached both prefill replicas")

    def refused_while_the_queue_is_deep(call: Callable[[], object], refusal: type[Exception], gave_up: type[Exception]):
        """Calls until one is refused. One that is not was admitted before its gateway had the
        reports that show the queue: it waits in it, and the client gives up after a second. Each
        such call must have met every replica busy, or the queue drained before any refusal."""
        seen = []
        while True:
            try:
                call()
            except refusal as err:
                return err
            except gave_up:
                pass
            seen.append(queued())
            assert every_replica_busy(seen[-1]), f"never refused while the queue was deep: {seen}"

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=1.0)
    refused = refused_while_the_queue_is_deep(
        lambda: client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2),
        openai.RateLimitError,
        openai.APITimeoutError,
    )
    assert int(refused.response.headers["retry-after"]) >= 1
    assert refused.body["type"] == "rate_limit_error" and "busy" in refused.body["message"]
    # the Anthropic SDK's refusal, with the same allowance: a single call, with the SDK's own time
    # limit (10 minutes), was once admitted and waited its turn
    messages = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=1.0)
    raised = refused_while_the_queue_is_deep(
        lambda: messages.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}]),
        anthropic.RateLimitError,
        anthropic.APITimeoutError,
    )
    assert raised.body["error"]["type"] == "rate_limit_error"
    for job_id in job_ids:
        assert wait_for_status(url, job_id, {"succeeded", "failed"}, timeout=300)["status"] == "succeeded"
    patient = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    ok = patient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert ok.choices[0].finish_reason is not None  # the queue drained: admitted again


def test_deepmesh_replicas_prints_the_live_table(cluster):
    import subprocess
    import sys

    printed = subprocess.run(
        [sys.executable, "-m", "deepmesh.cli", "replicas"], env=cluster.env, capture_output=True, text=True, timeout=60
    )
    assert printed.returncode == 0, printed.stderr
    lines = printed.stdout.splitlines()
    live = [line for line in lines[1:] if line.rstrip().endswith("live")]
    assert len([line for line in live if " prefill " in line]) == 2
    assert len([line for line in live if " decode " in line]) == 2
