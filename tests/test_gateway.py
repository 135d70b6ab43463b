"""The gateway over the embedded mesh, driven by the official openai and anthropic SDKs."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from types import SimpleNamespace

import anthropic
import httpx
import openai
import pytest
import uvicorn

from common.bus import MemoryBus
from deepmesh.mesh import Mesh
from gateway.app import create_app
from gateway.jobs import JobStore
from tests.infra import require_service

MODEL = "deepmesh-tiny"
QUESTION = [{"role": "user", "content": "What is a Kafka partition?"}]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    from engine.make_model import make_model

    model = make_model(tmp_path_factory.mktemp("gw") / "tiny", "tiny", seed=0)
    bus = MemoryBus()
    mesh = Mesh(model, bus, tmp_path_factory.mktemp("state"), served_model=MODEL).start()
    # job state in the stack's PostgreSQL (make test), or SQLite when run by hand without it
    database = os.environ.get("DEEPMESH_DATABASE_URL") or f"sqlite:///{tmp_path_factory.mktemp('db')}/jobs.db"
    if os.environ.get("DEEPMESH_REQUIRE_INFRA") == "1":
        database = require_service("DEEPMESH_DATABASE_URL")
    jobs = JobStore(database)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    app = create_app(bus, "deepmesh.", [MODEL], jobs)
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "gateway did not start"
        time.sleep(0.05)
    yield SimpleNamespace(url=f"http://127.0.0.1:{port}", mesh=mesh, jobs=jobs)
    server.should_exit = True
    thread.join(timeout=10)
    mesh.stop()
    jobs.close()


@pytest.fixture
def base_url(gateway) -> str:
    return gateway.url


@pytest.fixture
def oai(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def claude(base_url) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0)


def test_chat_completions(oai):
    reply = oai.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, seed=3)
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 12 and reply.usage.prompt_tokens > 10
    assert (choice.message.content or "") + (getattr(choice.message, "reasoning_content", None) or "")

    stream = oai.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, seed=3, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    streamed = "".join(
        (c.choices[0].delta.content or "") + (getattr(c.choices[0].delta, "reasoning_content", None) or "")
        for c in chunks
        if c.choices
    )
    assert streamed == (choice.message.content or "") + (getattr(choice.message, "reasoning_content", None) or "")


def test_responses(oai):
    reply = oai.responses.create(model=MODEL, input="What is a Kafka partition?", max_output_tokens=10)
    assert reply.status in ("completed", "incomplete") and reply.usage.output_tokens == 10
    events = list(oai.responses.create(model=MODEL, input="Hi", max_output_tokens=6, stream=True))
    assert events[0].type == "response.created"
    assert events[-1].type in ("response.completed", "response.incomplete")


def test_messages(claude):
    reply = claude.messages.create(model=MODEL, max_tokens=10, messages=QUESTION)
    assert reply.stop_reason == "max_tokens" and reply.usage.output_tokens == 10
    with claude.messages.stream(model=MODEL, max_tokens=8, messages=QUESTION) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.usage.output_tokens == 8


def test_models_and_health(oai, base_url):
    assert [m.id for m in oai.models.list()] == [MODEL]
    assert httpx.get(f"{base_url}/healthz").json() == {"status": "ok"}
    assert httpx.get(f"{base_url}/readyz").status_code == 200


def test_errors_use_each_protocols_body(oai, claude, base_url):
    with pytest.raises(openai.BadRequestError, match="unknown-model"):
        oai.chat.completions.create(model="unknown-model", messages=QUESTION)
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=10**7)
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model=MODEL, max_tokens=5, messages=[])
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "invalid_request_error"
    malformed = httpx.post(f"{base_url}/v1/chat/completions", content=b"{not json", timeout=30)
    assert malformed.status_code == 400 and "malformed JSON" in malformed.json()["error"]["message"]
    listed = httpx.post(f"{base_url}/v1/messages", json=[1, 2], timeout=30)
    assert listed.status_code == 400 and listed.json()["type"] == "error"
    huge = httpx.post(f"{base_url}/v1/responses", content=b"x" * (9 << 20), timeout=30)
    assert huge.status_code == 413


def wait_for_status(base_url: str, job_id: str, wanted: set[str], timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = httpx.get(f"{base_url}/v1/jobs/{job_id}").json()
        if job["status"] in wanted:
            return job
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} still {job['status']}")


def sse_events(response: httpx.Response) -> list[tuple[str | None, str]]:
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            events.append((name, line.removeprefix("data: ")))
            name = None
    return events


def test_async_job_submit_poll_and_replay(base_url):
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 10, "stream": True}  # a job never streams
    submitted = httpx.post(f"{base_url}/v1/jobs", json={"endpoint": "chat.completions", "body": body}, timeout=30)
    assert submitted.status_code == 202
    job = submitted.json()
    assert job["status"] == "queued" and job["object"] == "job"
    done = wait_for_status(base_url, job["id"], {"succeeded", "failed"})
    assert done["status"] == "succeeded"
    assert done["result"]["object"] == "chat.completion" and done["usage"]["completion_tokens"] == 10
    assert done["started_at"] >= done["created_at"] and done["finished_at"] >= done["started_at"]
    for _ in range(2):  # replayable from the start, as often as asked
        with httpx.stream("GET", f"{base_url}/v1/jobs/{job['id']}/events", timeout=30) as response:
            events = sse_events(response)
        chunks = [json.loads(data) for name, data in events if name is None and data != "[DONE]"]
        assert chunks[0]["object"] == "chat.completion.chunk"
        assert ("job.succeeded" in [name for name, _ in events]) and (None, "[DONE]") in events


def test_cancelling_a_job_stops_decode_and_frees_its_state(gateway):
    base_url = gateway.url
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 3000, "thinking": {"type": "disabled"}}
    job = httpx.post(f"{base_url}/v1/jobs", json={"endpoint": "chat.completions", "body": body}).json()
    wait_for_status(base_url, job["id"], {"running"})
    cancelled = httpx.delete(f"{base_url}/v1/jobs/{job['id']}").json()
    assert cancelled["status"] == "cancelled"
    deadline = time.monotonic() + 30
    while job["id"] in gateway.mesh.decode.jobs or len(gateway.mesh.store):
        assert time.monotonic() < deadline, "decode kept the cancelled job"
        time.sleep(0.05)
    assert job["id"] not in gateway.mesh.decode.engine.seqs
    time.sleep(0.5)
    assert httpx.get(f"{base_url}/v1/jobs/{job['id']}").json()["status"] == "cancelled"


def test_job_errors(base_url):
    missing = httpx.get(f"{base_url}/v1/jobs/nope")
    assert missing.status_code == 404 and "no job nope" in missing.json()["error"]["message"]
    assert httpx.delete(f"{base_url}/v1/jobs/nope").status_code == 404
    assert httpx.get(f"{base_url}/v1/jobs/nope/events").status_code == 404
    bad = httpx.post(f"{base_url}/v1/jobs", json={"endpoint": "embeddings", "body": {}})
    assert bad.status_code == 400 and "endpoint must be" in bad.json()["error"]["message"]
    failing = httpx.post(
        f"{base_url}/v1/jobs", json={"endpoint": "messages", "body": {"model": MODEL, "max_tokens": 5, "messages": []}}
    ).json()
    failed = wait_for_status(base_url, failing["id"], {"succeeded", "failed"})
    assert failed["status"] == "failed" and "message" in json.dumps(failed["error"])
