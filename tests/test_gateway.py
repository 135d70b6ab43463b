"""The gateway over the embedded mesh, driven by the official openai and anthropic SDKs."""

from __future__ import annotations

import socket
import threading
import time

import anthropic
import httpx
import openai
import pytest
import uvicorn

from common.bus import MemoryBus
from deepmesh.mesh import Mesh
from gateway.app import create_app

MODEL = "deepmesh-tiny"
QUESTION = [{"role": "user", "content": "What is a Kafka partition?"}]


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    from engine.make_model import make_model

    model = make_model(tmp_path_factory.mktemp("gw") / "tiny", "tiny", seed=0)
    bus = MemoryBus()
    mesh = Mesh(model, bus, tmp_path_factory.mktemp("state"), served_model=MODEL).start()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(bus, "deepmesh.", [MODEL]), port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "gateway did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)
    mesh.stop()


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
