"""The gateway over the embedded mesh (every service in this process), driven by the official SDKs."""

from __future__ import annotations

import inspect
import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from common.bus import MemoryBus
from common.claims import ClaimStore
from common.topics import all_topic_names
from gateway.app import create_app
from gateway.auth import authenticate
from tests.support.batch_behaviour import BatchBehaviour
from tests.support.behaviour import MODEL, GatewayBehaviour, ModelOutputBehaviour, ServerThread
from tokenizer_svc.protocol import Codec


@pytest.fixture(scope="module")
def model(tiny_preset):
    return tiny_preset


class TestEmbedded(GatewayBehaviour):
    def test_an_image_to_a_model_that_reads_none_is_a_400_while_a_text_request_is_answered(self, oai):
        """DeepSeek-V4 has no vision tower: an image is refused by name, never silently dropped."""
        import threading

        import openai

        answered = []
        text = [{"role": "user", "content": "hello"}]
        beside = threading.Thread(
            target=lambda: answered.append(oai.chat.completions.create(model=MODEL, messages=text, max_tokens=2))
        )
        beside.start()
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
        with pytest.raises(openai.BadRequestError, match="does not read images"):
            oai.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": [{"type": "text", "text": "x"}, image]}],
                max_tokens=2,
            )
        beside.join(timeout=60)
        assert answered and answered[0].choices[0].message.content is not None


class TestEmbeddedModelOutput(ModelOutputBehaviour):
    pass


class TestEmbeddedBatches(BatchBehaviour):
    pass


def test_each_request_keeps_its_prefixes_as_long_as_its_retention_class_says(service, model):
    """Messages default to the agent class (3 days), the OpenAI protocols to chat (7 days); a header chooses."""
    import httpx

    from common.prefixes import anchor_key, namespace_of

    codec = Codec.for_model(model, MODEL)
    cases = [
        ("messages", {}, 3 * 86400),
        ("chat.completions", {}, 7 * 86400),
        ("messages", {"X-DeepMesh-Retention": "chat"}, 7 * 86400),
        ("chat.completions", {"body": "agent"}, 3 * 86400),  # the body field instead of the header
    ]
    for i, (endpoint, headers, ttl) in enumerate(cases):
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"retention {i}"}], "max_tokens": 3}
        if "body" in headers:
            body["deepmesh"] = {"retention": headers.pop("body")}
        path = {"messages": "/v1/messages", "chat.completions": "/v1/chat/completions"}[endpoint]
        started = time.time()
        assert httpx.post(service.url + path, json=body, headers=headers, timeout=60).status_code == 200
        body.pop("deepmesh", None)
        prompt = codec.prompt(endpoint, body).token_ids
        key = anchor_key(prompt, namespace_of(service.mesh.prefill.engine.layout))
        expires = service.mesh.store.expires_at(key)
        assert expires is not None and started + ttl <= expires <= time.time() + ttl
    assert service.mesh.decode.loaded > 0  # decode continues from prefill's stored state
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    for extension, headers in (
        ({"retention": "forever"}, {}),
        ({"ttl": 5}, {}),
        ({"retention": "agent"}, {"X-DeepMesh-Retention": "chat"}),
    ):
        answer = httpx.post(service.url + "/v1/chat/completions", json={**chat, "deepmesh": extension}, headers=headers)
        assert answer.status_code == 400 and answer.json()["error"]["type"] == "invalid_request_error", extension


class _BrokerAway(MemoryBus):
    """A bus whose broker does not take requests: what a client meets while Kafka restarts
    (tests/system/test_chaos.py restarts a real broker)."""

    def produce_batch(self, topic, records) -> list[tuple[int, int]]:
        if topic.endswith("requests"):
            raise TimeoutError("KafkaTimeoutError: batch for requests-0 expired")
        return super().produce_batch(topic, records)


def test_a_request_the_queue_cannot_take_is_a_503_to_retry(jobs):
    """Nothing is accepted, so nothing is lost: a 503 in the protocol's body with Retry-After,
    read by the official SDKs, and no async job left queued that nothing will run."""
    import anthropic
    import httpx
    import openai

    bus = _BrokerAway()
    bus.create_topics(all_topic_names("away."), 1)
    with ServerThread(create_app(bus, "away.", [MODEL], jobs)) as server:
        oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.InternalServerError) as caught:
            oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert caught.value.status_code == 503 and caught.value.response.headers["retry-after"] == "1"
        assert caught.value.body["type"] == "server_error" and "retry" in caught.value.body["message"]
        claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
        with pytest.raises(anthropic.APIStatusError) as refused:
            claude.messages.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "hi"}])
        assert refused.value.status_code == 503 and refused.value.body["error"]["type"] == "api_error"
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
        before = _job_count(jobs)
        submitted = httpx.post(f"{server.url}/v1/jobs", json={"endpoint": "chat.completions", "body": chat})
        assert submitted.status_code == 503 and submitted.headers["retry-after"] == "1"
        assert _job_count(jobs) == before  # no job left queued that nothing would run


class _ProducerThreads(MemoryBus):
    """The in-process bus, recording the thread each request is produced on; `waits`: it says a
    produce waits, as Kafka's does."""

    def __init__(self, claims: ClaimStore, waits: bool):
        super().__init__(claims)
        self.waits, self.threads = waits, []

    def produce_waits(self, size: int) -> bool:
        return self.waits or super().produce_waits(size)

    def produce_batch(self, topic, records) -> list[tuple[int, int]]:
        if topic.endswith("requests"):
            self.threads.append(threading.current_thread())
        return super().produce_batch(topic, records)


def test_a_request_goes_onto_the_in_process_bus_from_the_event_loop_and_onto_one_that_waits_from_a_thread(
    jobs, tmp_path
):
    """Each thread hop before a job is on its way adds to its time to first token, where the
    threads share the interpreter lock with the engine's. So a request goes onto the in-process
    bus from the gateway's event loop, and onto a bus that waits (Kafka's acknowledgement, a large
    value's claim file) from a thread, which keeps the loop free. No dependency or endpoint of the
    app is a plain function either: FastAPI would run it on its thread pool, a hop there and back."""
    for waits in (False, True):
        bus = _ProducerThreads(ClaimStore(tmp_path / f"claims-{waits}", threshold=4096), waits)
        bus.create_topics(all_topic_names("hops."), 1)
        with ServerThread(create_app(bus, "hops.", [MODEL], jobs)) as server:
            for text in ("short", "x" * 8192):  # the second one's value is claimed: a file written
                chat = {"model": MODEL, "messages": [{"role": "user", "content": text}]}
                submitted = httpx.post(f"{server.url}/v1/jobs", json={"endpoint": "chat.completions", "body": chat})
                assert submitted.status_code == 202, submitted.text
        on_the_loop = [thread is server.thread for thread in bus.threads]
        assert on_the_loop == ([False, False] if waits else [True, False])

    def calls(dependant):
        for dependency in dependant.dependencies:
            yield dependency.call
            yield from calls(dependency)

    def api_routes(routes):  # FastAPI >= 0.160 wraps an included router's routes
        for route in routes:
            if hasattr(route, "original_router"):
                yield from api_routes(route.original_router.routes)
            elif hasattr(route, "dependant"):
                yield route

    app = create_app(MemoryBus(), "hops.", [MODEL], jobs)
    routes = list(api_routes(app.routes))
    functions = [d.dependency for d in app.router.dependencies]
    functions += [f for route in routes for f in (route.endpoint, *calls(route.dependant))]
    plain = {f.__qualname__ for f in functions if not inspect.iscoroutinefunction(f)}
    assert len(routes) > 30 and authenticate in functions and not plain, plain


def test_a_synchronous_calls_results_are_never_looked_up_in_the_job_store(service, jobs, monkeypatch):
    """The job recorder stores async jobs' results; a synchronous call has no job row, and its
    handler says so before producing it, so that no database query takes the interpreter lock
    beside its first token on the way to the client. An async job is still recorded."""
    import openai

    from tests.support.behaviour import wait_for_status

    looked_up = []
    record = jobs.record
    monkeypatch.setattr(jobs, "record", lambda job_id, *rest: looked_up.append(job_id) or record(job_id, *rest))
    client = openai.OpenAI(base_url=f"{service.url}/v1", api_key="unused", max_retries=0)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}
    answered = client.chat.completions.create(**chat)
    streamed = [chunk.id for chunk in client.chat.completions.create(**chat, stream=True)]
    submitted = httpx.post(f"{service.url}/v1/jobs", json={"endpoint": "chat.completions", "body": chat}).json()
    assert wait_for_status(service.url, submitted["id"], {"succeeded", "failed"})["status"] == "succeeded"
    synchronous = {answered.id.removeprefix("chatcmpl-"), streamed[0].removeprefix("chatcmpl-")}
    assert submitted["id"] in looked_up and not synchronous & set(looked_up), looked_up


def _job_count(jobs) -> int:
    from sqlalchemy import func, select

    from gateway.jobs import Job

    with jobs.session() as session:
        return session.scalar(select(func.count()).select_from(Job))


CLIENT_FIXTURES = Path(__file__).parents[1] / "fixtures" / "clients"
CLIENT_REQUESTS = [
    pytest.param(request, id=f"{path.stem}-{i}")
    for path in sorted(CLIENT_FIXTURES.glob("*.json"))
    for i, request in enumerate(json.loads(path.read_text())["requests"])
]


def sse_chunks(text: str) -> list[dict]:
    data = [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]
    return [json.loads(d) for d in data if d != "[DONE]"]


@pytest.mark.parametrize("sent", CLIENT_REQUESTS)
def test_what_benchmark_and_eval_clients_send_is_answered_in_full(service, sent):
    """The requests guidellm, aiperf and lm-eval sent, as recorded (scripts/compat): each gets a
    200, a non-empty answer and, where the client fixes the length (ignore_eos), exactly the
    tokens it asked for, with the usage where it asked for it."""
    body = sent["body"]
    # (lm-eval sends "Bearer " with no key: httpx refuses a value that ends in a space, so trimmed)
    headers = {k: v.strip() for k, v in sent["headers"].items() if k.lower() not in ("host", "content-length")}
    response = httpx.post(f"{service.url}{sent['path']}", json=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    asked = body.get("max_completion_tokens", body.get("max_tokens"))
    chat = sent["path"] == "/v1/chat/completions"
    if body.get("stream"):
        chunks = sse_chunks(response.text)
        text = "".join(
            (c["delta"].get("content") or "") if chat else c["text"] for chunk in chunks for c in chunk["choices"]
        )
        usage = chunks[-1]["usage"]
        if (body.get("stream_options") or {}).get("continuous_usage_stats"):
            assert all(chunk["usage"] is not None for chunk in chunks)
    else:
        answer = response.json()
        choice = answer["choices"][0]
        text, usage = (choice["message"]["content"] if chat else choice["text"]), answer["usage"]
        if body.get("echo") and body.get("logprobs") is not None:  # lm-eval's loglikelihood: the prompt's logprobs
            assert len(choice["logprobs"]["token_logprobs"]) == usage["prompt_tokens"] + usage["completion_tokens"]
    assert text.strip(), "an empty answer"
    if body.get("ignore_eos"):
        assert usage["completion_tokens"] == asked
    else:
        assert 0 < usage["completion_tokens"] <= asked
