"""What a client of the gateway sees, whatever the deployment.

The same tests run against the embedded mode (tests/integration/test_gateway.py: every service in one
process over the in-process bus) and the distributed mode (tests/system/test_distributed.py:
every service in its own OS process over Apache Kafka and PostgreSQL). Both modules provide:

* `service`: url, model (checkpoint path), decode_running() and pinned_by(job_id) (cache leases),
  bus and prefix (the deployment's topics);
* `scripted`: url and stage, a gateway and tokenizer whose prefill and decode are a
  ScriptedModel (see there).
"""

from __future__ import annotations

import enum
import functools
import http.client
import io
import json
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Literal

import anthropic
import httpx
import numpy as np
import openai
import pydantic
import pytest
import torch
import uvicorn
from PIL import Image
from tokenizers import Tokenizer

from common.bus import Bus, MemoryBus
from common.claims import ClaimStore
from common.messages import Envelope, PrefillPayload, RequestPayload, ResultPayload, TokensPayload, decode
from common.topics import Topic, all_topic_names, topic_name
from engine import ImageSpan, SamplingParams, load_vision_encoder
from gateway.app import create_app
from tests.support.infra import free_port
from tests.support.models import reference_engine
from tokenizer_svc.conversion import Prompt
from tokenizer_svc.protocol import Codec
from tokenizer_svc.worker import TokenizerWorker

MODEL = "deepmesh-tiny"
QUESTION = [{"role": "user", "content": "What is a Kafka partition?"}]
GREEDY = {"temperature": 0, "extra_body": {"thinking": {"type": "disabled"}}}  # no thinking: 0 stays greedy
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
TOOL_CALL_MARKUP = (
    '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
)


class ServerThread:
    """An ASGI app served by uvicorn on a thread, on a free port."""

    def __init__(self, app):
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@contextmanager
def served_embedded(model: Path, root: Path, database_url: str | None = None) -> Iterator[str]:
    """The embedded mesh (`deepmesh serve`'s one process) on `model`, its cache and job state under
    `root` (or both in `database_url`'s database, as `serve` keeps them), behind the gateway on a
    free port: its URL (the benchmarks' served API)."""
    from cache_svc.store import StateStore
    from common.settings import Settings
    from deepmesh.mesh import Mesh
    from gateway.jobs import JobStore

    stores = {"database_url": database_url or f"sqlite:///{root}/cache.db", "cache_dir": str(root / "kv")}
    mesh = Mesh(model, MemoryBus(), StateStore.from_settings(Settings().model_copy(update=stores)), served_model=MODEL)
    mesh.start()
    jobs = JobStore(database_url or f"sqlite:///{root}/jobs.db")
    try:
        with ServerThread(create_app(mesh.bus, "deepmesh.", [MODEL], jobs, files_dir=str(root / "files"))) as server:
            yield server.url
    finally:
        mesh.stop()
        jobs.close()


def seconds_to_first_chunk(client: openai.OpenAI, content: str | list[dict]) -> float:
    """A streamed chat call of one user message, greedy, without thinking, two tokens asked (the
    first is not the last: the job goes through decode): seconds from the call to its first chunk
    (the benchmarks' time to first token)."""
    started = time.perf_counter()
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        max_tokens=2,
        temperature=0,
        stream=True,
        extra_body={"thinking": {"type": "disabled"}},
    )
    elapsed = None
    for _ in stream:
        elapsed = elapsed or time.perf_counter() - started
    assert elapsed is not None
    return elapsed


def one_process_answer(model: Path, body: dict, endpoint: str = "chat.completions") -> dict:
    """The complete response to a greedy request, computed by the engine in this process."""
    return one_process_answers(model, [(endpoint, body)])[0]


def one_process_answers(model: Path, requests: list[tuple[str, dict]]) -> list[dict]:
    """The complete responses to greedy (endpoint, body) requests, computed by the engine in this
    process as one batch: a step costs about the same for one sequence as for eight, so the
    answers to many requests take as long as the longest."""
    codec = Codec.for_model(model, MODEL)
    prompts = [codec.prompt(endpoint, body) for endpoint, body in requests]
    assert all(prompt.temperature == 0 for prompt in prompts), "compare greedy requests only"
    params = [SamplingParams(max_tokens=p.max_tokens, temperature=0, grammar=p.grammar) for p in prompts]
    images = [image_spans(model, prompt) for prompt in prompts]
    outputs = reference_engine(model).generate([p.token_ids for p in prompts], params, images)
    answers = []
    for (endpoint, body), prompt, out in zip(requests, prompts, outputs, strict=True):
        stream = codec.output(endpoint, body, "reference")
        stream.start(len(prompt.token_ids))
        stream.tokens(out.token_ids)
        stream.finish(out.finish_reason)
        answers.append(stream.body())
    return answers


def image_spans(model: Path, prompt: Prompt) -> list[ImageSpan]:
    """A prompt's images' rows, computed here by the checkpoint's vision tower from the bytes the
    tokenizer resolved (what the encoder service stores for prefill)."""
    if not prompt.images:
        return []
    encoder = load_vision_encoder(model)
    assert encoder is not None
    spans = []
    for placed in prompt.images:
        pixels = torch.from_numpy(np.asarray(Image.open(io.BytesIO(placed.image.data)).convert("RGB")).copy())
        spans.append(ImageSpan(placed.start, encoder.span_rows(pixels)))
    return spans


class ScriptedModel:
    """Stands in for prefill and decode: answers each prefill message with the tokens of `reply`.

    A random-weight model never decides to call a tool or to close its reasoning, so this
    stage writes what such a model would, as token ids on the `tokens` topic, the way decode
    does. Everything a client's request and its answer pass through (gateway, Kafka or the
    in-process bus, the tokenizer service with deepseek-recipe) is the real thing.
    """

    def __init__(self, bus: Bus, prefix: str, model: Path):
        self.bus, self.prefix = bus, prefix
        self.tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
        self.eos = json.loads((model / "config.json").read_text())["eos_token_id"]
        self.reply = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> ScriptedModel:
        self._consumer = self.bus.consumer([topic_name(Topic.PREFILL, self.prefix)], f"{self.prefix}scripted")
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                for record in self._consumer.poll(timeout=0.2):
                    envelope = decode(record.value)
                    if envelope.type != "prefill":  # a cancel: every job here has already been answered
                        continue
                    request = PrefillPayload.model_validate(envelope.payload)
                    ids = [*self.tokenizer.encode(self.reply, add_special_tokens=False).ids, self.eos]
                    first = TokensPayload(prompt_tokens=len(request.prompt_token_ids), token_ids=ids[:1])
                    rest = TokensPayload(token_ids=ids[1:], finished=True, finish_reason="stop")
                    for seq, payload in enumerate((first, rest)):
                        message = Envelope(type="tokens", job_id=envelope.job_id, seq=seq, payload=payload.model_dump())
                        self.bus.produce(topic_name(Topic.TOKENS, self.prefix), envelope.job_id, message.encode())
                self._consumer.commit()
        finally:
            self._consumer.close()


@contextmanager
def scripted_gateway(model: Path, jobs, claims: Path, **app_options) -> Iterator[SimpleNamespace]:
    """A gateway and a tokenizer over the in-process bus, whose prefill and decode are a
    ScriptedModel: url, app and stage."""
    bus, prefix = MemoryBus(ClaimStore(claims)), f"scripted{uuid.uuid4().hex[:6]}."
    bus.create_topics(all_topic_names(prefix), 2)
    tokenizer = TokenizerWorker(bus, prefix, Codec.for_model(model, MODEL))
    stop = threading.Event()
    thread = threading.Thread(target=tokenizer.run, args=(stop,), daemon=True)
    thread.start()
    stage = ScriptedModel(bus, prefix, model).start()
    app = create_app(bus, prefix, [MODEL], jobs, **app_options)
    try:
        with ServerThread(app) as server:
            yield SimpleNamespace(url=server.url, app=app, stage=stage, bus=bus, prefix=prefix)
    finally:
        stage.stop()
        stop.set()
        thread.join(timeout=30)


def sse_events(response: httpx.Response) -> list[tuple[str | None, str]]:
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            events.append((name, line.removeprefix("data: ")))
            name = None
    return events


def wait_for_status(url: str, job_id: str, wanted: set[str], timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = httpx.get(f"{url}/v1/jobs/{job_id}").json()
        if job["status"] in wanted:
            return job
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} still {job['status']}")


def eventually(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def hostile_bodies() -> list[tuple[str, bytes, str, int]]:
    """(path, body, content type, status): what clients and fuzzers send that no protocol allows."""
    chat = '{"model": "' + MODEL + '", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]'

    def nested(depth: int) -> bytes:
        return ('{"model": "' + MODEL + '", "messages": ' + "[" * depth + "]" * depth + "}").encode()

    return [
        ("/v1/chat/completions", nested(1_000), "application/json", 400),
        ("/v1/chat/completions", nested(200_000), "application/json", 400),
        ("/v1/chat/completions", chat.replace("hi", "\\ud800").encode(), "application/json", 400),
        ("/v1/chat/completions", (chat + ', "temperature": NaN}').encode(), "application/json", 400),
        ("/v1/chat/completions", (chat + ', "top_p": Infinity}').encode(), "application/json", 400),
        ("/v1/chat/completions", (chat + ', "temperature": 1e999}').encode(), "application/json", 400),
        ("/v1/chat/completions", (chat + f', "seed": {2**70}}}').encode(), "application/json", 400),
        (
            "/v1/chat/completions",
            chat.replace('"max_tokens": 2', f'"max_tokens": {10**30}').encode() + b"}",
            "application/json",
            400,
        ),
        ("/v1/chat/completions", (chat + "}").encode(), "text/plain", 415),
        ("/v1/chat/completions", b"{not json", "application/json", 400),
        ("/v1/chat/completions", b"\xff\xfe", "application/json", 400),
        ("/v1/messages", json.dumps({"model": MODEL, "messages": QUESTION}).encode(), "application/json", 400),
        ("/v1/messages", b"[1, 2]", "application/json", 400),
        ("/v1/responses", b"x" * (9 << 20), "application/json", 413),
        ("/v1/jobs", b'{"endpoint": "chat.completions", "body": {"temperature": NaN}}', "application/json", 400),
    ]


class RawConnection:
    """One HTTP/1.1 connection, kept: a request on it after a server that closed it fails."""

    def __init__(self, url: str):
        host, port = url.removeprefix("http://").split(":")
        self.http = http.client.HTTPConnection(host, int(port), timeout=60)
        self.http.auto_open = 0  # never reconnect behind the test's back
        self.http.connect()

    def post(self, path: str, body: bytes, content_type: str) -> tuple[int, dict, dict]:
        headers = {"Content-Type": content_type} if content_type else {}
        self.http.request("POST", path, body=body, headers=headers)
        response = self.http.getresponse()
        data = response.read()
        return response.status, dict(response.getheaders()), json.loads(data) if data else {}

    def close(self) -> None:
        self.http.close()


def clients_that_left(service) -> float:
    """The gateway's count of chat calls whose client left before the answer (status 499)."""
    scraped = httpx.get(f"{service.url}/metrics", timeout=10).text
    sample = 'deepmesh_requests_total{endpoint="chat.completions",status="499"} '
    return next((float(line.removeprefix(sample)) for line in scraped.splitlines() if line.startswith(sample)), 0.0)


def call_with(url: str, body: dict, timed_out: list, timeout: float = 3) -> None:
    """POST, as a client that gives up after `timeout` seconds (noted in `timed_out`)."""
    try:
        httpx.post(url, json=body, timeout=timeout)
    except httpx.TimeoutException as err:
        timed_out.append(err)


def lm_eval_reading(logprobs: dict, ctxlen: int) -> tuple[float, bool]:
    """What lm-evaluation-harness' local-completions model takes from an echoed prompt's legacy
    logprobs (LocalCompletionsAPI.parse_logprobs): the continuation's total logprob, and whether
    each of its tokens was the most likely one (by exact equality with the top logprob)."""
    token_logprobs = logprobs["token_logprobs"][ctxlen:-1]
    top_logprobs = logprobs["top_logprobs"][ctxlen:-1]
    is_greedy = all(token == max(top.values()) for token, top in zip(token_logprobs, top_logprobs, strict=True))
    return sum(token_logprobs), is_greedy


def reusable_ends(service: SimpleNamespace, ends: tuple[int, ...], prompt_tokens: int) -> tuple[int, ...]:
    """The cached-token counts a follow-up of `prompt_tokens` may report when the turns before it
    stored their state at `ends`: those the model may start from (all of them for DeepSeek-V4;
    for V4.1, those before the prompt's last KEEP tokens), or none (0) when no end is."""
    return tuple(end for end in ends if end <= service.reusable(prompt_tokens)) or (0,)


def reference_log_softmax(model: Path, token_ids: list[int]) -> torch.Tensor:
    """Log-probabilities [T, vocab] of the checkpoint at `model` for one prompt, computed by an
    implementation that is not ours: transformers' for DeepSeek-V4, the oracle assembled from
    DeepInfer's and SGLang's code for V4.1 (tests/support/v41_reference.py)."""
    if json.loads((model / "config.json").read_text())["model_type"] == "deepseek_v41":
        from tests.support.v41_reference import reference_logits

        return reference_logits(model, token_ids).log_softmax(dim=-1)
    from transformers import DeepseekV4ForCausalLM

    reference = DeepseekV4ForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        return reference(torch.tensor([token_ids])).logits[0].log_softmax(dim=-1)


def protocol_error_message(path: str, body: dict) -> str:
    """The message of an error body, asserting the endpoint's own shape."""
    if path.startswith("/v1/messages"):
        assert body["type"] == "error", body
        return body["error"]["message"]
    assert set(body) == {"error"} and {"message", "type"} <= set(body["error"]), body
    return body["error"]["message"]


class City(pydantic.BaseModel):
    """A structured answer, bounded so that a random-weight model under its grammar finishes it
    (a pattern: strict mode drops maxLength, as OpenAI's strict subset has none)."""

    name: str = pydantic.Field(pattern=r"^[A-Za-z ]{1,12}$")
    population: int = pydantic.Field(ge=0, le=10_000_000)
    coastal: bool
    kind: Literal["town", "city"]


class Forecast(pydantic.BaseModel):
    """A tool's arguments, bounded as City is."""

    city: Literal["Paris", "Oslo"]
    days: int = pydantic.Field(ge=1, le=9)


class Size(enum.Enum):
    SMALL = "small"
    LARGE = "large"


class Address(pydantic.BaseModel):
    city: Literal["Paris", "Oslo"]
    floor: int = pydantic.Field(ge=0, le=9)


class Office(pydantic.BaseModel):
    desks: int = pydantic.Field(ge=1, le=9)


class Home(pydantic.BaseModel):
    """What pydantic writes with `$defs` and `$ref`s (an enum, nested models) and an `anyOf` of
    objects: the schemas of most real pydantic models, which the recipe's strict form loses
    the definitions of."""

    size: Size
    address: Address
    workplace: Address | Office


def reply_parsed(oai: openai.OpenAI) -> City | None:
    """The non-streamed parse of the same greedy request, to compare the streamed one with."""
    reply = oai.chat.completions.parse(model=MODEL, messages=QUESTION, response_format=City, max_tokens=120, **GREEDY)
    return reply.choices[0].message.parsed


class SDKClients:
    """The official SDKs pointed at the gateway under test (subclasses say which, as `url`)."""

    @pytest.fixture
    def oai(self, url) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)

    @pytest.fixture
    def claude(self, url) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120)


class GatewayBehaviour(SDKClients):
    @pytest.fixture
    def url(self, service) -> str:
        return service.url

    @pytest.mark.parametrize("thinking", ["enabled", "disabled"])
    def test_a_next_turn_starts_from_the_end_of_the_last_user_input(self, service, oai, claude, thinking):
        """A turn's prompt ends with the assistant tag and `<think>` (reasoning) or `</think>`; the
        next turn renders that turn as the tag, `</think>` and the answer, so the end of the first
        prompt is no prefix of the second in thinking mode. The state after the tag is stored, and
        the next turn starts there: all of the first prompt but its last token is cached, whichever
        protocol sends the turns (a long enough second input leaves it within V4.1's reusable part)."""
        mode = {"thinking": {"type": thinking}}
        history = [{"role": "user", "content": f"{thinking}: tell me about message queues. " * 20}]
        first = oai.chat.completions.create(model=MODEL, messages=history, max_tokens=4, temperature=0, extra_body=mode)
        answer = first.choices[0].message.content or "(no answer)"
        history += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And brokers? " * 60}]
        second = claude.messages.create(model=MODEL, messages=history, max_tokens=2, **mode)
        cached, prompt = second.usage.cache_read_input_tokens, second.usage.input_tokens
        prompt += cached
        assert prompt - 140 >= first.usage.prompt_tokens - 1  # within V4.1's reusable part too
        if thinking == "enabled":
            assert cached == first.usage.prompt_tokens - 1
        else:  # the first prompt's end is a prefix here: its state, or the one decode kept after the answer
            assert cached >= first.usage.prompt_tokens

    def test_chat_completions_stream_and_not_match_one_process(self, service, oai):
        body = {"model": MODEL, "messages": QUESTION, "max_tokens": 20, "temperature": 0}
        expected = one_process_answer(service.model, {**body, **GREEDY["extra_body"]})["choices"][0]
        reply = oai.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=20, **GREEDY)
        choice = reply.choices[0]
        assert choice.message.content == expected["message"]["content"]
        assert choice.finish_reason == expected["finish_reason"]
        assert reply.usage.completion_tokens == 20 and reply.usage.prompt_tokens > 5

        chunks = list(oai.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=20, stream=True, **GREEDY))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].choices[0].finish_reason == "length"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content

    def test_structured_outputs_follow_their_schema_stream_and_not(self, oai):
        """A pydantic model as `chat.completions.parse` and `responses.parse` send it (strict
        json_schema): the random-weight model's answer validates, streamed or not, because the
        engine decodes under the schema's grammar; json_object gives JSON."""
        in_json = [{"role": "user", "content": "Name a city, in JSON."}]  # json_object asks for the word
        for response_format in (City, {"type": "json_object"}):
            reply = oai.chat.completions.parse(
                model=MODEL, messages=in_json, response_format=response_format, max_tokens=120, **GREEDY
            )
            assert reply.choices[0].finish_reason == "stop", reply
            if response_format is City:
                assert isinstance(reply.choices[0].message.parsed, City)
            else:
                json.loads(reply.choices[0].message.content)
        with oai.chat.completions.stream(
            model=MODEL, messages=QUESTION, response_format=City, max_tokens=120, **GREEDY
        ) as stream:
            streamed = stream.get_final_completion()
        assert streamed.choices[0].message.parsed == reply_parsed(oai)
        answer = oai.responses.parse(  # effort "none": Responses' way to turn thinking off
            model=MODEL, input="Name a city.", text_format=City, max_output_tokens=120, reasoning={"effort": "none"}
        )
        assert isinstance(answer.output_parsed, City), answer

    def test_schemas_with_definitions_enums_nested_models_and_unions(self, oai):
        """`Home` has `$defs`: parsed in chat (streamed and not), in Responses and as a strict tool's
        arguments."""
        ask = [{"role": "user", "content": "Describe a home."}]
        reply = oai.chat.completions.parse(model=MODEL, messages=ask, response_format=Home, max_tokens=150, **GREEDY)
        assert isinstance(reply.choices[0].message.parsed, Home), reply
        with oai.chat.completions.stream(
            model=MODEL, messages=ask, response_format=Home, max_tokens=150, **GREEDY
        ) as stream:
            assert stream.get_final_completion().choices[0].message.parsed == reply.choices[0].message.parsed
        answer = oai.responses.parse(model=MODEL, input="Describe a home.", text_format=Home, max_output_tokens=150)
        assert isinstance(answer.output_parsed, Home), answer
        tool = openai.pydantic_function_tool(Home, name="describe")
        call = oai.chat.completions.parse(
            model=MODEL, messages=ask, tools=[tool], tool_choice="required", max_tokens=150, **GREEDY
        )
        assert isinstance(call.choices[0].message.tool_calls[0].function.parsed_arguments, Home), call

    def test_forced_and_strict_tool_calls_follow_their_schema(self, oai, claude):
        """A strict tool the call must use (`required`, or named), as `pydantic_function_tool`
        makes it: the random-weight model's call parses into the model, streamed or not, because
        the engine decodes under a grammar of DeepSeek-V4's tool-call markup; Anthropic's named
        tool too."""
        tool = openai.pydantic_function_tool(Forecast, name="forecast")
        for choice in ("required", {"type": "function", "function": {"name": "forecast"}}):
            reply = oai.chat.completions.parse(
                model=MODEL, messages=QUESTION, tools=[tool], tool_choice=choice, max_tokens=100, **GREEDY
            )
            assert reply.choices[0].finish_reason == "tool_calls", reply
            assert isinstance(reply.choices[0].message.tool_calls[0].function.parsed_arguments, Forecast)
        with oai.chat.completions.stream(  # sampled, one call: a random model stops after it
            model=MODEL,
            messages=QUESTION,
            tools=[tool],
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=100,
            temperature=0.9,
            seed=3,
            extra_body=GREEDY["extra_body"],
        ) as stream:
            streamed = stream.get_final_completion()
        (only,) = streamed.choices[0].message.tool_calls
        assert isinstance(only.function.parsed_arguments, Forecast)
        message = claude.messages.create(
            model=MODEL,
            max_tokens=100,
            messages=QUESTION,
            tools=[{"name": "forecast", "input_schema": Forecast.model_json_schema()}],
            tool_choice={"type": "tool", "name": "forecast"},
            extra_body={"temperature": 0, **GREEDY["extra_body"]},
        )
        Forecast.model_validate(next(block for block in message.content if block.type == "tool_use").input)
        parameters = openai.pydantic_function_tool(Forecast)["function"]["parameters"]
        answer = oai.responses.create(
            model=MODEL,
            input="What is the forecast?",
            tools=[{"type": "function", "name": "forecast", "parameters": parameters, "strict": True}],
            tool_choice="required",
            max_output_tokens=100,
            temperature=0,
            reasoning={"effort": "none"},
        )
        Forecast.model_validate_json(next(item for item in answer.output if item.type == "function_call").arguments)

    def test_anthropic_tool_choice_any_calls_one_of_the_tools(self, claude):
        """Anthropic's `tool_choice: {"type": "any"}`: the model must call one of the tools. The
        recipe reads it as `auto`, and the random-weight model answered in text; it is enforced as
        Chat Completions' `required` is, streamed or not. With thinking on it is refused, as the
        recipe refuses `required` and a named tool."""
        tools = [
            {"name": "forecast", "input_schema": Forecast.model_json_schema()},
            {"name": "office", "input_schema": Office.model_json_schema()},
        ]
        models = {"forecast": Forecast, "office": Office}
        request = dict(model=MODEL, max_tokens=100, messages=QUESTION, tools=tools, tool_choice={"type": "any"})
        greedy = {"temperature": 0, **GREEDY["extra_body"]}
        message = claude.messages.create(**request, extra_body=greedy)
        with claude.messages.stream(**request, extra_body=greedy) as stream:
            streamed = stream.get_final_message()
        assert [(b.name, b.input) for b in streamed.content] == [(b.name, b.input) for b in message.content]
        for answer in (message, streamed):
            assert answer.stop_reason == "tool_use", answer
            calls = [block for block in answer.content if block.type == "tool_use"]
            assert calls and all(models[call.name].model_validate(call.input) for call in calls), answer
        with pytest.raises(anthropic.BadRequestError, match="tool_choice"):
            claude.messages.create(**request, extra_body={"thinking": {"type": "enabled", "budget_tokens": 1024}})

    def test_count_tokens_is_the_prompt_a_message_reports(self, claude):
        """Anthropic's count_tokens, by its SDK: the input tokens the same Messages request
        reports in its usage (cached or not), system prompt and tools included; nothing runs."""
        request = {
            "messages": QUESTION,
            "system": "Answer briefly.",
            "tools": [{"name": "forecast", "input_schema": Forecast.model_json_schema()}],
            "extra_body": {"temperature": 0, **GREEDY["extra_body"]},
        }
        counted = claude.messages.count_tokens(model=MODEL, **request)
        usage = claude.messages.create(model=MODEL, max_tokens=2, **request).usage
        assert counted.input_tokens == usage.input_tokens + (usage.cache_read_input_tokens or 0) > 20
        with pytest.raises(anthropic.NotFoundError):
            claude.messages.count_tokens(model="no-such-model", messages=QUESTION)

    def test_logprobs_are_the_models_own_stream_and_not(self, service, oai):
        """`logprobs` / `top_logprobs` as the SDK parses them: each token's logprob and its three
        most likely alternatives equal engine.score's over the same tokens (an independent pass
        over the whole sequence), and the bytes spell the answer (seed 1 of tiny-v41 gives an unfinished character)."""
        request = {"model": MODEL, "messages": QUESTION, "max_tokens": 8, "logprobs": True, "top_logprobs": 3}
        reply = oai.chat.completions.create(**request, **GREEDY)
        content = reply.choices[0].logprobs.content
        # a random model may emit a byte token that starts a character no later token ends:
        # the answer's text has U+FFFD for it, as a client decoding the bytes gets
        spelled = b"".join(bytes(entry.bytes) for entry in content).decode(errors="replace")
        assert spelled == reply.choices[0].message.content
        streamed = [
            entry
            for chunk in oai.chat.completions.create(**request, stream=True, **GREEDY)
            if chunk.choices and chunk.choices[0].logprobs
            for entry in chunk.choices[0].logprobs.content
        ]
        assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
        codec = Codec.for_model(service.model, MODEL)
        prompt = codec.prompt("chat.completions", {**request, **GREEDY["extra_body"], "temperature": 0}).token_ids
        engine = reference_engine(service.model)
        tokens = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0))[0].token_ids
        scored = engine.score(prompt + tokens[:-1])[len(prompt) - 1 :].log_softmax(dim=-1)
        assert len(content) == len(tokens)
        for position, (entry, token) in enumerate(zip(content, tokens, strict=True)):
            assert abs(entry.logprob - scored[position, token].item()) < 1e-4
            best = scored[position].topk(3).values.tolist()
            assert [alternative.logprob for alternative in entry.top_logprobs] == pytest.approx(best, abs=1e-4)
        answer = oai.responses.create(  # Responses: asked for with `include`
            model=MODEL,
            input=QUESTION,
            max_output_tokens=8,
            include=["message.output_text.logprobs"],
            top_logprobs=3,
            temperature=0,
            reasoning={"effort": "none"},
        )
        text = answer.output[-1].content[0]
        assert [e.token for e in text.logprobs] == [e.token for e in content]
        assert [e.logprob for e in text.logprobs] == pytest.approx([e.logprob for e in content], abs=1e-4)

    def test_completions_as_the_sdk_sends_them_stream_and_not(self, service, oai):
        """A raw text prompt (no chat template): the greedy answer is the one-process one, streamed
        or not; a stop sequence ends it there; a seed makes a sampled answer repeat."""
        body = {"model": MODEL, "prompt": "Kafka partitions are", "max_tokens": 24, "temperature": 0}
        expected = one_process_answer(service.model, body, "completions")["choices"][0]
        reply = oai.completions.create(**body)
        assert reply.object == "text_completion" and reply.id.startswith("cmpl-")
        assert reply.choices[0].text == expected["text"] and len(expected["text"]) > 10
        assert reply.choices[0].finish_reason == "length" and reply.choices[0].logprobs is None
        assert reply.usage.completion_tokens == 24 and reply.usage.prompt_tokens == 4
        chunks = list(oai.completions.create(**body, stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == reply.choices[0].text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage.completion_tokens == 24 and not chunks[-1].choices

        text = reply.choices[0].text
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        stopped = oai.completions.create(**{**body, "max_tokens": 2000}, stop=[stop, "never appears"])
        assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].text == text[: text.index(stop)]
        usage = {"include_usage": True}
        streamed = list(
            oai.completions.create(**{**body, "max_tokens": 2000}, stop=stop, stream=True, stream_options=usage)
        )
        assert "".join(c.choices[0].text for c in streamed if c.choices) == text[: text.index(stop)]
        # the stream ends as the answer does: its finish reason, then its usage
        assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] == "stop"
        assert streamed[-1].usage.completion_tokens == stopped.usage.completion_tokens and not streamed[-1].choices

        sampled = {**body, "temperature": 1.0, "seed": 1234}
        assert oai.completions.create(**sampled).choices[0].text == oai.completions.create(**sampled).choices[0].text

    def test_completions_echo_logprobs_as_lm_evaluation_harness_reads_them(self, service, oai):
        """lm-evaluation-harness' loglikelihood request (local-completions: token ids, echo,
        logprobs 1, max_tokens 1), read the way it reads it: the continuation's logprobs are
        token_logprobs[ctxlen:-1], greedy when each is the largest of its top_logprobs. The numbers
        are an independent implementation's over the same checkpoint (reference_log_softmax)."""
        context, continuation = [671, 6102, 294, 8760, 344], [9474, 13, 1526]
        payload = {"model": MODEL, "prompt": [context + continuation], "temperature": 0, "max_tokens": 1}
        reply = oai.completions.create(**payload, logprobs=1, seed=1234, echo=True).model_dump()
        logprobs = reply["choices"][0]["logprobs"]
        ctxlen = len(context)
        assert len(logprobs["tokens"]) == len(context) + len(continuation) + 1 and logprobs["token_logprobs"][0] is None
        got = logprobs["token_logprobs"][ctxlen:-1]
        total, is_greedy = lm_eval_reading(logprobs, ctxlen)
        assert total == sum(got)

        expected = reference_log_softmax(service.model, context + continuation)
        wanted = [expected[ctxlen - 1 + i, token].item() for i, token in enumerate(continuation)]
        assert got == pytest.approx(wanted, abs=2e-3)
        best = expected[ctxlen - 1 : -1].argmax(dim=-1).tolist()
        assert is_greedy == (best == continuation)
        greedy_continuation = best[:1]  # the model's own choice is greedy by lm-eval's reading
        again = oai.completions.create(**{**payload, "prompt": [context + greedy_continuation]}, logprobs=1, echo=True)
        assert lm_eval_reading(again.model_dump()["choices"][0]["logprobs"], ctxlen)[1]

        # a batch of requests, as lm-eval sends it with --batch_size: one choice per prompt, in order
        batch = oai.completions.create(
            **{**payload, "prompt": [context + greedy_continuation, context + continuation]}, logprobs=1, echo=True
        ).model_dump()
        assert [choice["index"] for choice in batch["choices"]] == [0, 1]
        assert batch["choices"][1]["logprobs"]["token_logprobs"][:-1] == logprobs["token_logprobs"][:-1]
        assert batch["choices"][0]["logprobs"]["tokens"] == again.model_dump()["choices"][0]["logprobs"]["tokens"]
        assert batch["usage"]["prompt_tokens"] == 2 * len(context) + 1 + len(continuation)
        assert reply["choices"][0]["text"].startswith("".join(logprobs["tokens"][:-1]))

        # an answer past its first token: the prompt's logprobs go out with the first token (the
        # job's state leaves the engine before that pass), the rest comes from decode
        longer = oai.completions.create(
            **{**payload, "max_tokens": 3}, logprobs=1, echo=True, extra_body={"ignore_eos": True}
        )
        longer_logprobs = longer.model_dump()["choices"][0]["logprobs"]
        assert longer.usage.completion_tokens == 3 and len(longer_logprobs["tokens"]) == len(context + continuation) + 3
        assert longer_logprobs["token_logprobs"][: ctxlen + len(continuation)] == logprobs["token_logprobs"][:-1]

    def test_completions_refuse_what_they_cannot_do(self, service, oai):
        for options, status, words in [
            ({"n": 2}, 400, "n is not supported"),
            ({"logprobs": 21}, 400, "logprobs"),
            ({"extra_body": {"top_k": -2}}, 400, "top_k"),
            ({"extra_body": {"frobnicate": 1}}, 400, "frobnicate"),
            ({"max_tokens": 10**6}, 400, "maximum context length"),
            ({"prompt": ["one", "two"], "stream": True}, 400, "stream one prompt per request"),
            ({"prompt": ["one", "two", ""]}, 400, "empty"),
            ({"prompt": ["x"] * 257}, 400, "at most 256 prompts"),
            ({"prompt": [1, 10**9]}, 400, "vocabulary"),
            ({"prompt": ""}, 400, "empty"),
            ({"max_tokens": 0}, 400, "echo"),
        ]:
            body = {"model": MODEL, "prompt": "Hello", **options}
            with pytest.raises(openai.APIStatusError) as caught:
                oai.completions.create(**body)
            assert caught.value.status_code == status and words in caught.value.message, (options, caught.value)

    def test_an_output_constraint_that_cannot_be_enforced_is_a_400_naming_why(self, oai):
        schema = {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}
        with pytest.raises(openai.BadRequestError, match="if"):
            oai.chat.completions.create(
                model=MODEL,
                messages=QUESTION,
                response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
                **GREEDY,
            )

    def test_responses_stream_and_not(self, oai):
        # greedy: a sampled answer of a random-weight model may end early, at a sampled end of sequence
        greedy = {"temperature": 0, "reasoning": {"effort": "none"}}  # Responses' switch (not chat's `thinking`)
        reply = oai.responses.create(model=MODEL, input="What is a Kafka partition?", max_output_tokens=10, **greedy)
        assert reply.status in ("completed", "incomplete") and reply.usage.output_tokens == 10
        events = list(oai.responses.create(model=MODEL, input="Hi", max_output_tokens=6, stream=True, **greedy))
        assert events[0].type == "response.created"
        assert events[-1].type in ("response.completed", "response.incomplete")
        assert events[-1].response.usage.output_tokens == 6

    def test_a_stored_response_is_continued_fetched_listed_and_deleted(self, service, oai):
        """`store` (the default): GET returns what the create returned; `previous_response_id`
        puts the stored conversation before the new input (its prompt is the first turn's, from
        the cache, and its answer a cold run's over the whole conversation); input_items lists
        it; another tenant, an unknown id and a deleted one are 404s in OpenAI's shape."""
        options = {"model": MODEL, "temperature": 0, "reasoning": {"effort": "none"}}
        first = oai.responses.create(input=f"Name a message broker. ({service.url})", max_output_tokens=6, **options)
        assert first.store is True and first.previous_response_id is None
        assert oai.responses.retrieve(first.id).model_dump() == first.model_dump()
        second = oai.responses.create(
            input="And another?", previous_response_id=first.id, max_output_tokens=8, **options
        )
        assert second.previous_response_id == first.id
        cached = second.usage.input_tokens_details.cached_tokens
        if service.reusable(second.usage.input_tokens) >= first.usage.input_tokens:
            assert cached >= first.usage.input_tokens
        else:  # DeepSeek-V4.1: the prompt's last KEEP tokens are always computed
            assert cached <= service.reusable(second.usage.input_tokens)
        conversation = [
            {"role": "user", "content": f"Name a message broker. ({service.url})"},
            *[item.model_dump(exclude_none=True) for item in first.output],
            {"role": "user", "content": "And another?"},
        ]
        cold = {
            "model": MODEL,
            "input": conversation,
            "max_output_tokens": 8,
            "temperature": 0,
            "reasoning": {"effort": "none"},
        }
        expected = one_process_answer(service.model, cold, "responses")
        assert second.output_text == "".join(
            part["text"] for item in expected["output"] if item["type"] == "message" for part in item["content"]
        )
        items = oai.responses.input_items.list(second.id, order="asc")
        assert [item.type for item in items.data] == ["message", "message", "message"]
        assert items.data[-1].content[0].text == "And another?" and items.data[1].role == "assistant"
        assert [i.id for i in oai.responses.input_items.list(second.id, limit=1, order="asc").data] == [
            items.data[0].id
        ]

        other = openai.OpenAI(base_url=oai.base_url, api_key="unused", default_headers={"X-DeepMesh-Tenant": "other"})
        for call in (
            lambda: other.responses.retrieve(first.id),
            lambda: other.responses.create(input="Hi", previous_response_id=first.id, **options),
            lambda: oai.responses.retrieve("resp-unknown"),
        ):
            with pytest.raises(openai.NotFoundError) as caught:
                call()
            assert set(caught.value.body) >= {"message", "type"} and "not found" in caught.value.message
        unstored = oai.responses.create(input="Hi", store=False, max_output_tokens=2, **options)
        with pytest.raises(openai.NotFoundError):
            oai.responses.retrieve(unstored.id)
        oai.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            oai.responses.retrieve(first.id)
        with pytest.raises(openai.BadRequestError, match="background"):
            oai.responses.create(input="Hi", background=True, store=False, **options)

    def test_a_background_response_is_polled_resumed_by_sequence_number_and_cancelled(self, service, oai):
        """`background: true`: the create answers at once (queued); polling reaches the answer a
        plain call gives; its event stream, started live, dropped and resumed with
        `starting_after`, is the whole stream once, in order; cancel stops a running one."""
        options = {"model": MODEL, "temperature": 0, "reasoning": {"effort": "none"}, "input": "Tell me about Kafka."}
        plain = oai.responses.create(**options, max_output_tokens=24)
        queued = oai.responses.create(**options, max_output_tokens=24, background=True)
        assert queued.status in ("queued", "in_progress") and queued.background is True
        eventually(lambda: oai.responses.retrieve(queued.id).status not in ("queued", "in_progress"), 60, "never done")
        done = oai.responses.retrieve(queued.id)
        assert done.output_text == plain.output_text and done.background is True

        live = oai.responses.create(**options, max_output_tokens=24, background=True, stream=True)
        seen = []
        for event in live:
            seen.append(event)
            if len(seen) == 5:
                break
        live.close()  # the client leaves: a background response runs on
        rest = list(oai.responses.retrieve(seen[0].response.id, stream=True, starting_after=seen[-1].sequence_number))
        events = seen + rest
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert events[-1].type in ("response.completed", "response.incomplete")
        assert events[-1].response.output_text == plain.output_text
        replayed = list(oai.responses.retrieve(seen[0].response.id, stream=True))
        assert [e.model_dump() for e in replayed] == [e.model_dump() for e in events]

        long = oai.responses.create(**options, max_output_tokens=3000, background=True)
        eventually(lambda: oai.responses.retrieve(long.id).status == "in_progress", 60, "never started")
        cancelled = oai.responses.cancel(long.id)
        assert cancelled.status == "cancelled" and oai.responses.retrieve(long.id).status == "cancelled"
        eventually(lambda: service.decode_running() == 0, 20, "decode kept generating a cancelled response")
        with pytest.raises(openai.BadRequestError, match="background"):
            oai.responses.cancel(plain.id)

    def test_messages_stream_and_not(self, claude):
        greedy = {"extra_body": {"temperature": 0, **GREEDY["extra_body"]}}  # never an early sampled end
        reply = claude.messages.create(model=MODEL, max_tokens=10, messages=QUESTION, **greedy)
        assert reply.stop_reason == "max_tokens" and reply.usage.output_tokens == 10
        with claude.messages.stream(model=MODEL, max_tokens=8, messages=QUESTION, **greedy) as stream:
            kinds = [event.type for event in stream]
            final = stream.get_final_message()
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
        assert final.usage.output_tokens == 8

    def test_a_stop_sequence_ends_the_answer_and_its_decoding(self, service, oai):
        body = {"model": MODEL, "messages": QUESTION, "max_tokens": 40, "temperature": 0}
        text = one_process_answer(service.model, {**body, **GREEDY["extra_body"]})["choices"][0]["message"]["content"]
        stop = text[len(text) // 3 : len(text) // 3 + 4]
        assert stop.strip() and text.index(stop) > 0
        # far more tokens than the stop needs: the job must end at the stop, not at max_tokens
        reply = oai.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=3000, stop=[stop], **GREEDY)
        assert reply.choices[0].finish_reason == "stop"
        assert reply.choices[0].message.content == text[: text.index(stop)]
        eventually(lambda: service.decode_running() == 0, 10, "decode kept generating after the stop sequence")

    def test_a_follow_up_turn_starts_from_the_first_turns_stored_state(self, service, oai, claude):
        first = [{"role": "user", "content": f"Name a stream processor. ({service.url})"}]
        turn_1 = oai.chat.completions.create(model=MODEL, messages=first, max_tokens=6, **GREEDY)
        assert not turn_1.usage.prompt_tokens_details.cached_tokens  # nothing stored before it
        history = [*first, {"role": "assistant", "content": turn_1.choices[0].message.content}]
        second = [*history, {"role": "user", "content": "And another?"}]
        turn_2 = oai.chat.completions.create(model=MODEL, messages=second, max_tokens=12, **GREEDY)
        # loaded, not computed: the first turn's prompt, or all of the first turn but its last
        # token when the answer's text encodes back to the tokens generated; the answer is a cold run's
        usage = turn_1.usage
        ends = (usage.prompt_tokens, usage.prompt_tokens + usage.completion_tokens - 1)
        assert turn_2.usage.prompt_tokens_details.cached_tokens in reusable_ends(
            service, ends, turn_2.usage.prompt_tokens
        )
        cold = {"model": MODEL, "messages": second, "max_tokens": 12, "temperature": 0, **GREEDY["extra_body"]}
        expected = one_process_answer(service.model, cold)["choices"][0]["message"]["content"]
        assert turn_2.choices[0].message.content == expected

        third = [*second, {"role": "assistant", "content": turn_2.choices[0].message.content}]
        third.append({"role": "user", "content": "Thanks."})
        turn_3 = claude.messages.create(model=MODEL, max_tokens=4, messages=third, thinking={"type": "disabled"})
        usage = turn_2.usage
        ends = (usage.prompt_tokens, usage.prompt_tokens + usage.completion_tokens - 1)
        prompt_3 = turn_3.usage.input_tokens + turn_3.usage.cache_read_input_tokens
        assert turn_3.usage.cache_read_input_tokens in reusable_ends(service, ends, prompt_3)

    def test_tenants_never_share_prefixes(self, service, oai):
        first = [{"role": "user", "content": f"Which tenant am I? ({service.url})"}]
        second = [*first, {"role": "assistant", "content": "Unknown."}, {"role": "user", "content": "Guess."}]

        def ask(messages: list[dict], tenant: str) -> tuple[int, int]:
            reply = oai.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=2, extra_headers={"X-DeepMesh-Tenant": tenant}, **GREEDY
            )
            return reply.usage.prompt_tokens_details.cached_tokens or 0, reply.usage.prompt_tokens

        cached, first_prompt = ask(first, "tenant-a")
        assert cached == 0
        assert ask(second, "tenant-b")[0] == 0  # tenant-a's prompt is a prefix of this one, but not tenant-b's
        cached, second_prompt = ask(second, "tenant-a")
        if service.reusable(second_prompt) >= first_prompt:
            assert cached > 0
        else:  # DeepSeek-V4.1: the prompt's last KEEP tokens are always computed
            assert cached == 0
        for headers, problem in (
            ({"X-DeepMesh-Tenant": "no spaces allowed"}, "X-DeepMesh-Tenant"),
            ({"X-DeepMesh-Retention": "forever"}, "retention class must be one of agent, chat"),
        ):
            with pytest.raises(openai.BadRequestError, match=problem):
                oai.chat.completions.create(model=MODEL, messages=first, max_tokens=2, extra_headers=headers)

    def test_models_health_and_metrics(self, service, oai):
        [listed] = oai.models.list()
        assert listed.id == MODEL and listed.created > 0
        assert oai.models.retrieve(MODEL) == listed  # each model as the list has it
        with pytest.raises(openai.NotFoundError):
            oai.models.retrieve("unknown-model")
        assert httpx.get(f"{service.url}/healthz").json() == {"status": "ok"}
        assert httpx.get(f"{service.url}/readyz").status_code == 200
        oai.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2)
        scraped = httpx.get(f"{service.url}/metrics").text
        assert 'deepmesh_requests_total{endpoint="chat.completions",status="200"}' in scraped
        assert "deepmesh_time_to_first_token_seconds_bucket" in scraped

    def test_an_unknown_model_is_a_404_on_every_endpoint(self, oai, claude):
        """As OpenAI (`model_not_found`) and Anthropic (`not_found_error`) answer it. Completions
        answered 404 and the recipe's endpoints 400, so a client's handling depended on the endpoint."""
        calls = [
            lambda: oai.chat.completions.create(model="unknown-model", messages=QUESTION),
            lambda: oai.completions.create(model="unknown-model", prompt="Hi"),
            lambda: oai.responses.create(model="unknown-model", input="Hi"),
        ]
        for call in calls:
            with pytest.raises(openai.NotFoundError) as caught:
                call()
            assert caught.value.code == "model_not_found" and "unknown-model" in caught.value.message
        for call in (functools.partial(claude.messages.create, max_tokens=5), claude.messages.count_tokens):
            with pytest.raises(anthropic.NotFoundError) as caught:
                call(model="unknown-model", messages=QUESTION)
            assert caught.value.body["error"]["type"] == "not_found_error"

    def test_errors_use_each_protocols_body(self, service, oai, claude):
        with pytest.raises(openai.BadRequestError):
            oai.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=10**7)
        with pytest.raises(openai.BadRequestError):
            oai.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=-1)
        with pytest.raises(openai.BadRequestError, match="logprobs"):  # OpenAI's bound: 20
            oai.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2, logprobs=True, top_logprobs=21)
        with pytest.raises(openai.BadRequestError, match="logprobs"):
            oai.responses.create(model=MODEL, input="Hi", max_output_tokens=2, top_logprobs=21)
        with pytest.raises(openai.BadRequestError, match="Invalid schema"):
            bad_schema = {"type": "object", "properties": "not an object"}
            oai.chat.completions.create(
                model=MODEL,
                messages=QUESTION,
                tools=[{"type": "function", "function": {"name": "f", "parameters": bad_schema}}],
            )
        with pytest.raises(anthropic.BadRequestError) as caught:
            claude.messages.create(model=MODEL, max_tokens=5, messages=[])
        assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "invalid_request_error"
        with pytest.raises(anthropic.BadRequestError) as caught:
            claude.messages.create(
                model=MODEL,
                max_tokens=5,
                messages=QUESTION,
                tools=[{"name": "bad name!", "input_schema": {"type": "object"}}],
            )
        assert caught.value.body["type"] == "error"
        malformed = httpx.post(
            f"{service.url}/v1/chat/completions",
            content=b"{not json",
            headers={"Content-Type": "application/json"},
            timeout=30,
        )
        assert malformed.status_code == 400 and "malformed JSON" in malformed.json()["error"]["message"]
        listed = httpx.post(f"{service.url}/v1/messages", json=[1, 2], timeout=30)
        assert listed.status_code == 400 and listed.json()["type"] == "error"
        huge = httpx.post(
            f"{service.url}/v1/responses",
            content=b"x" * (9 << 20),
            headers={"Content-Type": "application/json"},
            timeout=30,
        )
        assert huge.status_code == 413

    def test_hostile_bodies_get_a_4xx_in_the_protocols_shape_on_a_connection_that_stays_usable(self, service):
        """Deep nesting, lone surrogates, NaN and Infinity, numbers out of range, the wrong
        Content-Type, an Anthropic request without max_tokens: each a 4xx with the protocol's
        error body, and the next request on the same connection is answered."""
        connection = RawConnection(service.url)
        good = json.dumps({"model": MODEL, "messages": QUESTION, "max_tokens": 2}).encode()
        try:
            for path, body, content_type, status in hostile_bodies():
                answer = connection.post(path, body, content_type)
                assert answer[0] == status, (path, body[:80], answer)
                assert protocol_error_message(path, answer[2]), answer
                assert answer[1].get("connection") != "close", (path, body[:80], answer[1])
                assert connection.post("/v1/chat/completions", good, "application/json")[0] == 200, (path, body[:80])
            # a surrogate pair is a character: accepted
            pair = good.replace(b"Kafka", b"\\ud83d\\ude00")
            assert connection.post("/v1/chat/completions", pair, "application/json; charset=utf-8")[0] == 200
            # no Content-Type at all (`requests.post(url, data=...)`) reads as JSON, as FastAPI reads it
            status, _, answer = connection.post("/v1/chat/completions", good, "")
            assert status == 200 and answer["object"] == "chat.completion"
        finally:
            connection.close()

    def test_a_request_that_breaks_the_protocol_layer_fails_alone(self, service, oai):
        """Requests produced straight to `requests` (a public interface, so past the gateway's
        checks) with numbers the recipe cannot hold and NaN sampling: each is answered with its
        error; normal requests sent with them are answered as usual."""
        requests_topic = topic_name(Topic.REQUESTS, service.prefix)
        results = service.bus.consumer([topic_name(Topic.RESULTS, service.prefix)], f"test-{time.time_ns()}")
        base = {"model": MODEL, "messages": QUESTION, "max_tokens": 2}
        poison = {
            "seed": {**base, "seed": 2**70},
            "max_tokens": {**base, "max_tokens": 10**30},
            "temperature": {**base, "temperature": float("nan")},
            "top_p": {**base, "top_p": float("inf")},
        }
        ids = {name: f"poison-{name}-{time.time_ns()}" for name in poison}
        for name, body in poison.items():
            envelope = Envelope(
                type="request",
                job_id=ids[name],
                payload=RequestPayload(endpoint="chat.completions", body={}).model_dump(),
            )
            raw = json.dumps({**envelope.model_dump(), "payload": {**envelope.payload, "body": body}}).encode()
            service.bus.produce(requests_topic, ids[name], raw)
        answers = []
        callers = [
            threading.Thread(target=lambda: answers.append(oai.chat.completions.create(**base))) for _ in range(6)
        ]
        for caller in callers:
            caller.start()
        errors: dict[str, ResultPayload] = {}
        deadline = time.monotonic() + 120
        try:
            while len(errors) < len(ids) and time.monotonic() < deadline:
                for record in results.poll(timeout=0.5):
                    if record.key in ids.values():
                        result = ResultPayload.model_validate(decode(record.value).payload)
                        if result.done:
                            errors[record.key] = result
        finally:
            results.close()
        for caller in callers:
            caller.join(timeout=120)
        assert len(answers) == 6 and all(a.choices[0].finish_reason for a in answers)
        assert sorted(errors) == sorted(ids.values()), "a request was never answered"
        for name, job_id in ids.items():
            assert errors[job_id].status == 400, (name, errors[job_id])
            assert protocol_error_message("/v1/chat/completions", errors[job_id].body), name

    def test_async_job_submit_poll_and_replay(self, service):
        body = {"model": MODEL, "messages": QUESTION, "max_tokens": 10, "stream": True}  # a job never streams
        body |= {"temperature": 0, **GREEDY["extra_body"]}  # greedy: no sampled end before the 10th token
        submitted = httpx.post(
            f"{service.url}/v1/jobs", json={"endpoint": "chat.completions", "body": body}, timeout=30
        )
        assert submitted.status_code == 202
        job = submitted.json()
        assert job["status"] == "queued" and job["object"] == "job"
        done = wait_for_status(service.url, job["id"], {"succeeded", "failed"})
        assert done["status"] == "succeeded"
        assert done["result"]["object"] == "chat.completion" and done["usage"]["completion_tokens"] == 10
        assert done["started_at"] >= done["created_at"] and done["finished_at"] >= done["started_at"]
        for _ in range(2):  # replayable from the start, as often as asked
            with httpx.stream("GET", f"{service.url}/v1/jobs/{job['id']}/events", timeout=30) as response:
                events = sse_events(response)
            chunks = [json.loads(data) for name, data in events if name is None and data != "[DONE]"]
            assert chunks[0]["object"] == "chat.completion.chunk"
            assert ("job.succeeded" in [name for name, _ in events]) and (None, "[DONE]") in events

    def test_a_jobs_replayed_events_are_its_live_stream_and_its_answer(self, service, oai):
        """One greedy request three ways: streamed live, answered whole, and as an async job whose
        events are replayed: the same text, finish and usage; the replay is the whole stream."""
        body = {"model": MODEL, "messages": QUESTION, "max_tokens": 60, **GREEDY["extra_body"], "temperature": 0}
        answer = oai.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=60, **GREEDY)
        live = list(oai.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=60, stream=True, **GREEDY))
        job = httpx.post(f"{service.url}/v1/jobs", json={"endpoint": "chat.completions", "body": body}).json()
        done = wait_for_status(service.url, job["id"], {"succeeded", "failed"})
        with httpx.stream("GET", f"{service.url}/v1/jobs/{job['id']}/events", timeout=30) as response:
            replayed = [json.loads(data) for name, data in sse_events(response) if name is None and data != "[DONE]"]

        def text(chunks) -> str:
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

        replayed_text = "".join(c["choices"][0]["delta"].get("content") or "" for c in replayed if c.get("choices"))
        assert (
            answer.choices[0].message.content
            == text(live)
            == replayed_text
            == done["result"]["choices"][0]["message"]["content"]
        )
        assert len(replayed) == len(live)  # every event once: none lost, none repeated
        assert [c["choices"][0]["finish_reason"] for c in replayed if c.get("choices")][-1] == "length"
        assert done["usage"]["completion_tokens"] == answer.usage.completion_tokens == 60

    def test_cancelling_a_job_stops_decode_and_frees_its_state(self, service):
        body = {"model": MODEL, "messages": QUESTION, "max_tokens": 3000, "thinking": {"type": "disabled"}}
        job = httpx.post(f"{service.url}/v1/jobs", json={"endpoint": "chat.completions", "body": body}).json()
        try:
            # running once its first token is out (prefill sends it, the hand-over follows)
            wait_for_status(service.url, job["id"], {"running"})
            eventually(lambda: service.decode_running() == 1, 30, "decode never took the job")
            # prefill's hand-over pinned the prompt's cache entry for this job; decode's load unpins it
            eventually(lambda: not service.pinned_by(job["id"]), 30, "decode's load left the hand-over pinned")
        finally:
            cancelled = httpx.delete(f"{service.url}/v1/jobs/{job['id']}").json()
        assert cancelled["status"] == "cancelled"
        eventually(lambda: service.decode_running() == 0, 30, "decode kept the cancelled job")
        time.sleep(0.5)
        assert httpx.get(f"{service.url}/v1/jobs/{job['id']}").json()["status"] == "cancelled"

    def test_a_client_that_leaves_stops_its_job(self, service):
        """A stream dropped after 5 chunks, and a plain call whose client times out: decode drops
        the job within a second or two of the client leaving, instead of decoding to max_tokens."""
        body = {"model": MODEL, "messages": QUESTION, "max_tokens": 3000, **GREEDY["extra_body"], "stream": True}
        eventually(lambda: service.decode_running() == 0, 60, "decode still busy with an earlier test's jobs")
        left_before = clients_that_left(service)
        with httpx.stream("POST", f"{service.url}/v1/chat/completions", json=body, timeout=60) as response:
            chunks = 0
            for line in response.iter_lines():
                chunks += line.startswith("data: ")
                if chunks == 5:
                    # still reading: the job is in decode. (Leaving this loop closes the connection:
                    # httpx closes the stream with the iterator, so this is the last moment to look.)
                    assert (running := service.decode_running()) == 1, f"decode runs {running} jobs"
                    break
        eventually(lambda: service.decode_running() == 0, 2, "decode went on with a stream nobody reads")
        # counted as a client that left (it was counted as answered, 200)
        eventually(lambda: clients_that_left(service) == left_before + 1, 5, "the dropped stream is not counted 499")

        # a plain call; a Completions request with a list of prompts, a job each: all of them stop
        prompts = {"model": MODEL, "prompt": ["One", "Two", "Three"], "max_tokens": 3000}
        for path, plain, jobs in (("chat/completions", {**body, "stream": False}, 1), ("completions", prompts, 3)):
            timed_out: list = []
            caller = threading.Thread(target=call_with, args=(f"{service.url}/v1/{path}", plain, timed_out))
            caller.start()
            eventually(lambda n=jobs: service.decode_running() == n, 30, f"{path}: the jobs never reached decode")
            caller.join()
            assert timed_out
            eventually(
                lambda: service.decode_running() == 0, 2, f"{path}: decode went on with answers nobody waits for"
            )

    def test_job_errors(self, service):
        url = service.url
        missing = httpx.get(f"{url}/v1/jobs/nope")
        assert missing.status_code == 404 and "no job nope" in missing.json()["error"]["message"]
        assert httpx.delete(f"{url}/v1/jobs/nope").status_code == 404
        assert httpx.get(f"{url}/v1/jobs/nope/events").status_code == 404
        bad = httpx.post(f"{url}/v1/jobs", json={"endpoint": "embeddings", "body": {}})
        assert bad.status_code == 400 and "endpoint must be" in bad.json()["error"]["message"]
        failing = {"endpoint": "messages", "body": {"model": MODEL, "max_tokens": 5, "messages": []}}
        failed = wait_for_status(url, httpx.post(f"{url}/v1/jobs", json=failing).json()["id"], {"succeeded", "failed"})
        assert failed["status"] == "failed" and "message" in json.dumps(failed["error"])


class ModelOutputBehaviour(SDKClients):
    """Tool calls and reasoning, as a model writes them, parsed into each protocol's shape."""

    @pytest.fixture
    def url(self, scripted) -> str:
        return scripted.url

    def test_tool_calls(self, scripted, oai, claude):
        scripted.stage.reply = TOOL_CALL_MARKUP
        no_thinking = {"thinking": {"type": "disabled"}}
        reply = oai.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, extra_body=no_thinking)
        assert reply.choices[0].finish_reason == "tool_calls"
        (call,) = reply.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}

        chunks = list(
            oai.chat.completions.create(
                model=MODEL, messages=QUESTION, tools=TOOLS, extra_body=no_thinking, stream=True
            )
        )
        streamed = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        assert streamed[0].function.name == "get_weather"
        assert json.loads("".join(tc.function.arguments or "" for tc in streamed)) == {"city": "Paris"}

        anthropic_tool = {"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}
        message = claude.messages.create(model=MODEL, max_tokens=64, messages=QUESTION, tools=[anthropic_tool])
        assert message.stop_reason == "tool_use"
        (use,) = [block for block in message.content if block.type == "tool_use"]
        assert use.name == "get_weather" and use.input == {"city": "Paris"}

        response = oai.responses.create(
            model=MODEL,
            input="What is the weather in Paris?",
            tools=[{"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}],
            reasoning={"effort": "none"},
        )
        (call,) = [item for item in response.output if item.type == "function_call"]
        assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}

    def test_reasoning_is_separated_from_the_answer(self, scripted, oai, claude):
        scripted.stage.reply = "The user wants the weather.</think>It is sunny in Paris."
        reply = oai.chat.completions.create(model=MODEL, messages=QUESTION, reasoning_effort="high")
        message = reply.choices[0].message
        assert message.reasoning_content == "The user wants the weather."
        assert message.content == "It is sunny in Paris." and reply.choices[0].finish_reason == "stop"

        answer = claude.messages.create(
            model=MODEL, max_tokens=64, messages=QUESTION, thinking={"type": "enabled", "budget_tokens": 32}
        )
        assert [block.type for block in answer.content] == ["thinking", "text"]
        assert answer.content[0].thinking == "The user wants the weather."
        assert answer.content[1].text == "It is sunny in Paris."

        with claude.messages.stream(
            model=MODEL, max_tokens=64, messages=QUESTION, thinking={"type": "enabled", "budget_tokens": 32}
        ) as stream:
            final = stream.get_final_message()
        assert [block.type for block in final.content] == ["thinking", "text"]
