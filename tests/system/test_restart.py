"""Restarts of `deepmesh serve`, as operators do them: SIGTERM, and kill -9.

SIGTERM drains and exits within seconds, with the cache's write-behind done: after the restart
an identical repeat is served from the cache but for what the model always computes. kill -9
loses what only memory held: after that restart the catalog no longer lists it, and a
conversation resumes from the best anchor that did survive, never from none. Every answer equals
the greedy answer of one process that never restarted.

On DeepSeek-V4.1, whose prompts compute their last KEEP tokens whatever is stored: the stricter
case for the anchors. The cache's store and restarts are the same code for DeepSeek-V4, whose
full hits after a restart tests/system/test_cache_replicas.py checks.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.support.behaviour import GREEDY, MODEL, one_process_answer
from tests.support.infra import free_port, wait_until_up

TURN_1 = [{"role": "user", "content": "Tell me about Kafka partitions and offsets. " * 60}]


class Serve:
    """`deepmesh serve` as a process, over one cache directory and catalog across restarts."""

    def __init__(self, model: Path, root: Path):
        self.model, self.root, self.port = model, root, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "DEEPMESH_DATABASE_URL": f"sqlite:///{root}/deepmesh.db",
            "DEEPMESH_CACHE_DIR": str(root / "kv"),
            "DEEPMESH_CLAIM_DIR": str(root / "claims"),
            "DEEPMESH_CACHE_MAINTENANCE_SECONDS": "3600",  # write-behind only when the process stops
            "DEEPMESH_CACHE_ANCHOR_INTERVAL": "256",
            "DEEPMESH_TRACE_EXPORTER": "none",
        }
        self.process: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> Serve:
        self.starts += 1
        log = open(self.root / f"serve-{self.starts}.log", "w")  # noqa: SIM115 (lives with the process)
        command = [sys.executable, "-m", "deepmesh.cli", "serve", "--port", str(self.port), "--model", str(self.model)]
        self.process = subprocess.Popen(command, env=self.env, stdout=subprocess.DEVNULL, stderr=log)
        wait_until_up(f"{self.url}/readyz", [self.process], 120, f"see {self.root}")
        return self

    def chat(self, messages: list[dict]) -> dict:
        body = {"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0, **GREEDY["extra_body"]}
        answer = httpx.post(f"{self.url}/v1/chat/completions", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        return answer.json()

    def stop(self, sig: int) -> float:
        """Seconds from the signal to the exit."""
        assert self.process is not None
        started = time.monotonic()
        self.process.send_signal(sig)
        self.process.wait(timeout=60)
        return time.monotonic() - started


def cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def model(tiny_preset) -> Path:
    return tiny_preset


def test_sigterm_keeps_the_cache_and_kill_9_falls_back_to_what_survived(tiny_v41_preset, tmp_path):
    """A DeepSeek-V4.1 prompt always computes its last KEEP (140) tokens: a repeat starts where
    they begin, and the second turn from the first's stored state too."""
    model, keep = tiny_v41_preset, 140
    serve = Serve(model, tmp_path).start()
    try:
        first = serve.chat(TURN_1)
        assert cached(first) == 0
        seconds = serve.stop(signal.SIGTERM)
        assert serve.process.returncode == 0 and seconds < 10, f"SIGTERM took {seconds:.1f} s"

        serve.start()  # write-behind ran at the exit: every entry the catalog lists is on disk
        repeat = serve.chat(TURN_1)
        prompt_tokens = first["usage"]["prompt_tokens"]
        assert cached(repeat) == prompt_tokens - keep > 0
        assert repeat["choices"][0]["message"] == first["choices"][0]["message"]
        turn_2 = [*TURN_1, first["choices"][0]["message"], {"role": "user", "content": "And consumer groups?"}]
        second = serve.chat(turn_2)
        resumed_at = cached(second)  # from the first turn's stored state: what will survive the kill
        assert 0 < resumed_at <= second["usage"]["prompt_tokens"] - keep
        serve.stop(signal.SIGKILL)  # the second turn's own entries were in memory only

        serve.start()
        again = serve.chat(turn_2)
        assert cached(again) == resumed_at, "the best surviving anchor, not a miss"
        assert again["choices"][0]["message"] == second["choices"][0]["message"]
    finally:
        if serve.process is not None and serve.process.poll() is None:
            serve.stop(signal.SIGTERM)
    body = {"model": MODEL, "messages": turn_2, "max_tokens": 12, "temperature": 0, **GREEDY["extra_body"]}
    oracle = one_process_answer(model, body)
    assert again["choices"][0]["message"]["content"] == oracle["choices"][0]["message"]["content"]
    oracle_1 = one_process_answer(model, {**body, "messages": TURN_1})
    assert first["choices"][0]["message"]["content"] == oracle_1["choices"][0]["message"]["content"]


def test_a_batch_survives_the_server_being_killed_mid_batch(model, tmp_path):
    """`deepmesh serve` SIGKILLed while a batch runs: started again on the same database and
    files, it finishes the batch, every request answered once, as the request alone is."""
    import io
    import json
    import signal
    import subprocess
    import sys

    import openai

    from tests.support.batch_behaviour import PROMPTS, answers_alone, chat_line, jsonl, wait_for_batch
    from tests.support.infra import free_port, fresh_database, wait_until_up

    port = free_port()
    env = {
        **os.environ,
        "DEEPMESH_DATABASE_URL": fresh_database(tmp_path),
        "DEEPMESH_FILES_DIR": str(tmp_path / "files"),
        "DEEPMESH_CLAIM_DIR": str(tmp_path / "claims"),
        "DEEPMESH_CACHE_DIR": str(tmp_path / "kv"),
        "DEEPMESH_TRACE_EXPORTER": "none",
        "DEEPMESH_BATCH_ROUND_SECONDS": "0.2",
        "DEEPMESH_BATCH_IN_FLIGHT": "16",
    }
    command = [sys.executable, "-m", "deepmesh.cli", "serve", "--port", str(port), "--model", str(model)]
    command += ["--served-model-name", MODEL]
    url = f"http://127.0.0.1:{port}"

    def serve(n: int) -> subprocess.Popen:
        log = open(tmp_path / f"serve-{n}.log", "w")  # noqa: SIM115 (lives with the process)
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        wait_until_up(f"{url}/readyz", [process], 180, f"see {tmp_path}")
        return process

    server = serve(0)
    try:
        oai = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        lines = [chat_line(f"r{i}", PROMPTS[i % len(PROMPTS)], 8, thinking={"type": "disabled"}) for i in range(48)]
        upload = oai.files.create(file=("r.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
        batch = oai.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
        wait_for_batch(oai.batches.retrieve, batch.id, lambda b: b.request_counts and b.request_counts.completed >= 8)
        server.send_signal(signal.SIGKILL)
        server.wait(timeout=30)
        server = serve(1)
        batch = wait_for_batch(oai.batches.retrieve, batch.id, lambda b: b.status in ("completed", "failed"))
        assert batch.status == "completed" and batch.request_counts.completed == 48, batch
        output = [json.loads(x) for x in oai.files.content(batch.output_file_id).text.splitlines()]
        assert sorted(line["custom_id"] for line in output) == sorted(f"r{i}" for i in range(48))
        alone = answers_alone(oai, PROMPTS, max_tokens=8)
        for line in output:
            prompt = PROMPTS[int(line["custom_id"][1:]) % len(PROMPTS)]
            assert line["response"]["body"]["choices"][0]["message"]["content"] == alone[prompt]
    finally:
        server.send_signal(signal.SIGKILL)
        server.wait(timeout=30)
