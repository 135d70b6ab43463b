"""Distributed mode: every service in its own OS process, over real Apache Kafka and PostgreSQL."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from engine import LLMEngine, SamplingParams
from tests.infra import require_service
from tokenizer_svc.protocol import Codec

MODEL = "deepmesh-tiny"
QUESTION = [{"role": "user", "content": "Explain consumer groups."}]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Cluster:
    def __init__(self, root: Path, model: Path):
        self.root = root
        self.gateway_port, self.cache_port = free_port(), free_port()
        self.env = {
            **os.environ,
            "DEEPMESH_KAFKA_BOOTSTRAP": require_service("DEEPMESH_KAFKA_BOOTSTRAP"),
            "DEEPMESH_DATABASE_URL": require_service("DEEPMESH_DATABASE_URL"),
            "DEEPMESH_TOPIC_PREFIX": f"dist{uuid.uuid4().hex[:8]}.",
            "DEEPMESH_TOPIC_PARTITIONS": "2",
            "DEEPMESH_CACHE_URL": f"http://127.0.0.1:{self.cache_port}",
            "DEEPMESH_MODEL": str(model),
            "DEEPMESH_SERVED_MODEL_NAME": MODEL,
            "DEEPMESH_LOG_LEVEL": "DEBUG",
        }
        self.processes: dict[str, subprocess.Popen] = {}
        self.url = f"http://127.0.0.1:{self.gateway_port}"

    def spawn(self, name: str, *extra: str) -> subprocess.Popen:
        log = open(self.root / f"{name}-{len(self.processes)}.log", "w")  # noqa: SIM115 (lives with the process)
        process = subprocess.Popen(
            [sys.executable, "-m", "deepmesh.cli", name, *extra], env=self.env, stdout=log, stderr=subprocess.STDOUT
        )
        self.processes[f"{name}-{process.pid}"] = process
        return process

    def start(self) -> Cluster:
        self.spawn("cache", "--port", str(self.cache_port), "--dir", str(self.root / "state"))
        self.spawn("gateway", "--port", str(self.gateway_port))
        for name in ("tokenizer", "prefill", "decode"):
            self.spawn(name)
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(f"{self.url}/readyz").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            dead = [n for n, p in self.processes.items() if p.poll() is not None]
            assert not dead and time.monotonic() < deadline, f"cluster did not start (dead: {dead}); see {self.root}"
            time.sleep(0.5)
        return self

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from engine.make_model import make_model

    return make_model(tmp_path_factory.mktemp("dist") / "tiny", "tiny", seed=0)


@pytest.fixture(scope="module")
def cluster(model, tmp_path_factory):
    running = Cluster(tmp_path_factory.mktemp("cluster"), model)
    try:
        yield running.start()
    finally:
        running.stop()


def one_process_text(model: Path, body: dict) -> str:
    """The greedy answer of the same request computed by the engine in this process."""
    codec = Codec.for_model(model, MODEL)
    prompt = codec.prompt("chat.completions", body)
    engine = LLMEngine.from_pretrained(model)
    assert prompt.temperature == 0, "compare greedy requests only"
    out = engine.generate([prompt.token_ids], SamplingParams(max_tokens=prompt.max_tokens, temperature=0))[0]
    stream = codec.output("chat.completions", body, "ref")
    stream.start(len(prompt.token_ids))
    stream.tokens(out.token_ids)
    stream.finish(out.finish_reason)
    return stream.body()["choices"][0]["message"]["content"]


def test_every_protocol_through_separate_processes(cluster, model):
    oai = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=120)
    # greedy (temperature 0, no thinking), so the answer can be compared with one process's
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 20, "temperature": 0, "thinking": {"type": "disabled"}}
    sdk_args = {
        "model": MODEL,
        "messages": QUESTION,
        "max_tokens": 20,
        "temperature": 0,
        "extra_body": {"thinking": {"type": "disabled"}},
    }
    reply = oai.chat.completions.create(**sdk_args)
    assert reply.choices[0].message.content == one_process_text(model, body)
    streamed = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(**sdk_args, stream=True))
    assert streamed == reply.choices[0].message.content

    response = oai.responses.create(model=MODEL, input="Hello", max_output_tokens=8)
    assert response.usage.output_tokens == 8
    claude = anthropic.Anthropic(base_url=cluster.url, api_key="unused", max_retries=0, timeout=120)
    message = claude.messages.create(model=MODEL, max_tokens=8, messages=QUESTION)
    assert message.usage.output_tokens == 8
    with claude.messages.stream(model=MODEL, max_tokens=6, messages=QUESTION) as stream:
        assert [e.type for e in stream][-1] == "message_stop"

    job = httpx.post(f"{cluster.url}/v1/jobs", json={"endpoint": "chat.completions", "body": body}).json()
    deadline = time.monotonic() + 120
    while (state := httpx.get(f"{cluster.url}/v1/jobs/{job['id']}").json())["status"] not in ("succeeded", "failed"):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert state["status"] == "succeeded"
    assert state["result"]["choices"][0]["message"]["content"] == reply.choices[0].message.content


def test_killing_the_decode_process_mid_generation_loses_and_repeats_nothing(cluster, model):
    body = {
        "model": MODEL,
        "messages": QUESTION,
        "max_tokens": 400,
        "temperature": 0,
        "thinking": {"type": "disabled"},
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

    reader = threading.Thread(target=read_stream)
    reader.start()
    assert started.wait(timeout=120), "no tokens streamed"
    victim = next(p for n, p in cluster.processes.items() if n.startswith("decode") and p.poll() is None)
    victim.kill()  # SIGKILL mid-generation: no goodbye, no commit
    victim.wait()
    cluster.spawn("decode")
    reader.join(timeout=300)
    assert not reader.is_alive(), "the stream never finished"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert text == one_process_text(model, body)
