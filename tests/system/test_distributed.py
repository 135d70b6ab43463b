"""Distributed mode: every service in its own OS process, over real Apache Kafka and PostgreSQL."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest

from common.bus import KafkaBus
from common.tracing import job_trace, read_spans
from tests.support.batch_behaviour import BatchBehaviour
from tests.support.behaviour import (
    MODEL,
    QUESTION,
    GatewayBehaviour,
    ModelOutputBehaviour,
    ScriptedModel,
    one_process_answers,
)
from tests.support.cluster import Cluster
from tests.support.infra import BrokerNames, wait_until_up


@pytest.fixture(scope="module")
def model(tiny_preset) -> Path:
    return tiny_preset


@pytest.fixture(scope="module")
def cluster(model, tmp_path_factory):
    running = Cluster(tmp_path_factory.mktemp("cluster"), model)
    try:
        yield running.start()
    finally:
        running.stop()


@pytest.fixture(scope="module")
def service(cluster, model):
    bus = KafkaBus(cluster.env["DEEPMESH_KAFKA_BOOTSTRAP"])
    yield SimpleNamespace(
        url=cluster.url,
        model=model,
        decode_running=cluster.decode_running,
        pinned_by=cluster.pinned_by,
        reusable=lambda prompt_tokens: prompt_tokens,  # DeepSeek-V4 starts from any stored prefix
        bus=bus,
        prefix=cluster.prefix,
    )
    bus.close()


@pytest.fixture(scope="module")
def scripted(model, tmp_path_factory):
    """A gateway and a tokenizer process whose prefill and decode are a ScriptedModel in this process."""
    running = Cluster(tmp_path_factory.mktemp("scripted"), model)
    bus = KafkaBus(running.env["DEEPMESH_KAFKA_BOOTSTRAP"])
    stage = None
    try:
        running.start(("gateway", "tokenizer"))
        stage = ScriptedModel(bus, running.prefix, model).start()
        yield SimpleNamespace(url=running.url, stage=stage)
    finally:
        if stage is not None:
            stage.stop()
        running.stop()
        bus.close()


class TestDistributed(GatewayBehaviour):
    # Checked in the embedded mode only: what they check happens in the gateway or the tokenizer
    # service, whose code is the same in both modes, and nothing of it depends on the transport
    # (the distributed runs of the tests above carry each kind of payload over Kafka).
    test_hostile_bodies_get_a_4xx_in_the_protocols_shape_on_a_connection_that_stays_usable = None
    test_errors_use_each_protocols_body = None
    test_an_output_constraint_that_cannot_be_enforced_is_a_400_naming_why = None
    test_completions_refuse_what_they_cannot_do = None
    test_completions_as_the_sdk_sends_them_stream_and_not = None
    test_forced_and_strict_tool_calls_follow_their_schema = None
    test_count_tokens_is_the_prompt_a_message_reports = None
    # a schema's grammar travels to decode as test_structured_outputs' does: which schema it is
    # matters to the grammar compiler, the same code in both modes
    test_schemas_with_definitions_enums_nested_models_and_unions = None


class TestDistributedModelOutput(ModelOutputBehaviour):
    pass


class TestDistributedBatches(BatchBehaviour):
    pass


def test_one_job_is_one_trace_across_the_processes(cluster):
    reply = httpx.post(
        f"{cluster.url}/v1/chat/completions",
        json={"model": MODEL, "messages": QUESTION, "max_tokens": 8},
        timeout=120,
    ).json()
    job_id = reply["id"].removeprefix("chatcmpl-")
    wanted = {"gateway", "tokenizer", "prefill", "cache", "decode"}
    stages = {"answer chat.completions", "send requests", "tokenizer.prompt", "send prefill", "prefill"}
    stages |= {"cache.lookup", "POST /v1/prefix/lookup", "cache.put_prefix", "POST /v1/prefix", "send decode"}
    stages |= {"decode", "cache.load", "GET /v1/prefix/{key}", "tokenizer.output"}
    deadline = time.monotonic() + 30
    while True:  # spans are written as they end, some (the root among them) after the answer has left
        spans = job_trace(read_spans(cluster.traces), job_id)
        ids = {s["span_id"] for s in spans}
        orphans = {s["name"] for s in spans if s["parent_id"] is not None and s["parent_id"] not in ids}
        missing = stages - {s["name"] for s in spans}
        if not missing and not orphans and any(s["parent_id"] is None for s in spans):
            break
        assert time.monotonic() < deadline, f"missing spans: {missing}; spans whose parent never came: {orphans}"
        time.sleep(0.1)
    assert {s["service"].removeprefix("deepmesh-") for s in spans} == wanted
    assert len({(s["service"], s["pid"]) for s in spans}) == 5
    assert len({s["trace_id"] for s in spans}) == 1
    roots = [s for s in spans if s["parent_id"] is None]
    assert [r["name"] for r in roots] == ["POST /v1/chat/completions"]
    by_name = {s["name"]: s for s in spans}
    assert by_name["decode"]["parent_id"] == by_name["send decode"]["span_id"]
    assert by_name["send decode"]["parent_id"] == by_name["prefill"]["span_id"]

    # the services' logs are JSON lines that name the job and its trace (besides one plain start-up line)
    logs = [line for log in cluster.root.glob("*.log") for line in log.read_text().splitlines()]
    assert all(line.startswith("{") for line in logs if "running" not in line and " on http" not in line)
    logged = [json.loads(line) for line in logs if line.startswith("{")]
    lines = [entry for entry in logged if entry.get("job_id") == job_id]
    assert {entry["service"] for entry in lines} >= {"tokenizer", "prefill", "decode"}
    assert {entry["trace_id"] for entry in lines} == {spans[0]["trace_id"]}

    printed = subprocess.run(
        [sys.executable, "-m", "deepmesh.cli", "trace", job_id, "--file", str(cluster.traces)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert printed.splitlines()[1].startswith("POST /v1/chat/completions")
    for service in wanted:
        assert f"deepmesh-{service}[" in printed
    assert "  decode" in printed  # indented under its parent


def test_the_consumer_groups_on_the_broker_are_the_stages_shared_ones(cluster):
    """Each stage's replicas share a group, and the gateways one for the jobs they record. What a
    process reads for itself (the load reports, its own calls' results) it reads in no group: every
    process that ever ran would otherwise leave one on the broker (kafka-python's admin lists them)."""
    shared = {f"{cluster.prefix}{name}" for name in ("tokenizer", "prefill", "decode", "gateway-jobs")}
    bootstrap = cluster.env["DEEPMESH_KAFKA_BOOTSTRAP"]
    deadline = time.monotonic() + 120
    while True:  # the gateway is ready before prefill and decode have loaded their model and joined
        groups = {g for g in BrokerNames(bootstrap).groups if g.startswith(cluster.prefix)}
        if groups >= shared or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert groups == shared


def test_killing_the_decode_process_mid_generation_loses_and_repeats_nothing(cluster, model):
    """SIGKILL decode mid-answer, an answer under a JSON schema: the new decode recomputes the
    state and the grammar's from the tokens so far, and the stream goes on as one process's.
    A background response running meanwhile ends as one process's answer too, its stored
    events each once, in order."""
    notes = {"type": "array", "items": {"type": "string", "pattern": "^[a-z ]{0,24}$"}, "minItems": 500}
    schema = {"type": "object", "properties": {"notes": notes}, "required": ["notes"], "additionalProperties": False}
    body = {
        "model": MODEL,
        "messages": QUESTION,
        "max_tokens": 160,  # a kill after 20: the rest from a state the new decode recomputes
        "temperature": 0,
        "thinking": {"type": "disabled"},
        "response_format": {"type": "json_schema", "json_schema": {"name": "notes", "schema": schema}},
        "stream": True,
    }
    chunks: list[dict] = []
    started = threading.Event()

    def read_stream() -> None:
        with httpx.stream("POST", f"{cluster.url}/v1/chat/completions", json=body, timeout=300) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line.removeprefix("data: ")))
                    if len(chunks) >= 20:
                        started.set()

    background = {"model": MODEL, "input": QUESTION, "max_output_tokens": 120, "temperature": 0}
    background |= {"reasoning": {"effort": "none"}, "background": True}
    oai = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=60)
    queued = oai.responses.create(**background)
    reader = threading.Thread(target=read_stream)
    reader.start()
    assert started.wait(timeout=120), "no tokens streamed"
    assert oai.responses.retrieve(queued.id).status == "in_progress"
    victim = next(p for n, p in cluster.processes.items() if n.startswith("decode") and p.poll() is None)
    victim.kill()  # SIGKILL mid-generation: no goodbye, no commit
    victim.wait()
    cluster.spawn("decode")
    reader.join(timeout=300)
    assert not reader.is_alive(), "the stream never finished"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert text.startswith('{"notes":["')  # under its schema all along
    deadline = time.monotonic() + 300
    while (answer := oai.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, "the background response never finished"
        time.sleep(0.2)
    expected_chat, expected_response = one_process_answers(
        model, [("chat.completions", body), ("responses", {**background, "background": False})]
    )
    assert text == expected_chat["choices"][0]["message"]["content"]
    assert answer.output_text == expected_response["output"][-1]["content"][0]["text"]
    events = list(oai.responses.retrieve(queued.id, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output_text == answer.output_text


def test_a_batch_survives_its_gateway_and_its_runner_being_killed(cluster):
    """The gateway and the Celery worker running the batch SIGKILLed mid-batch and started again:
    the batch finishes with every request answered once, as the request alone is."""
    import io

    import openai

    from tests.support.batch_behaviour import PROMPTS, answers_alone, chat_line, jsonl, wait_for_batch

    oai = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=2, timeout=120)
    lines = [chat_line(f"r{i}", PROMPTS[i % len(PROMPTS)], 8, thinking={"type": "disabled"}) for i in range(100)]
    upload = oai.files.create(file=("r.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    batch = oai.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_for_batch(oai.batches.retrieve, batch.id, lambda b: b.request_counts and b.request_counts.completed >= 8)
    for name, process in list(cluster.processes.items()):
        if name.startswith(("gateway-", "batches-")) and process.poll() is None:
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=30)
    time.sleep(2)  # results keep arriving in Kafka with nobody to record them
    restarted = [cluster.spawn("batches"), cluster.spawn("gateway", "--port", str(cluster.gateway_port))]
    wait_until_up(f"{cluster.url}/readyz", restarted, 180, f"see {cluster.root}")
    batch = wait_for_batch(oai.batches.retrieve, batch.id, lambda b: b.status in ("completed", "failed"))
    assert batch.status == "completed" and batch.request_counts.completed == 100, batch
    output = [json.loads(x) for x in oai.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(line["custom_id"] for line in output) == sorted(f"r{i}" for i in range(100))
    alone = answers_alone(oai, PROMPTS, max_tokens=8)
    for line in output:
        prompt = PROMPTS[int(line["custom_id"][1:]) % len(PROMPTS)]
        assert line["response"]["body"]["choices"][0]["message"]["content"] == alone[prompt]
