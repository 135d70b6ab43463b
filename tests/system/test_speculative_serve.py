"""`deepmesh serve --speculative mtp` as a user runs it: on a checkpoint in the published layout
(with its MTP module), answers through the official OpenAI SDK are the greedy continuation one
process computes without speculation, a stop sequence ends them where it does there, and the
speculation counters move."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from engine import LLMEngine, SamplingParams
from engine.checkpoint.make_model import make_model
from tests.support.infra import free_port, wait_until_up
from tests.support.models import random_prompts

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def published_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset as `deepmesh make-model D --format deepseek --seed 3` writes it."""
    return make_model(tmp_path_factory.mktemp("spec") / "tiny", "tiny", seed=3, layout="deepseek")


def test_greedy_answers_through_serve_with_mtp_are_those_without_speculation(published_tiny, tmp_path):
    prompts = random_prompts([7, 40, 150], vocab=20_000, seed=4)
    oracle = LLMEngine.from_pretrained(published_tiny)  # one process, speculation off
    expected = oracle.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    decoder = Tokenizer.from_file(str(published_tiny / "tokenizer.json"))
    texts = [decoder.decode(out.token_ids) for out in expected]

    port = free_port()
    env = {
        **os.environ,
        "DEEPMESH_DATABASE_URL": f"sqlite:///{tmp_path}/deepmesh.db",
        "DEEPMESH_CACHE_DIR": str(tmp_path / "kv"),
        "DEEPMESH_TRACE_EXPORTER": "none",
    }
    command = [sys.executable, "-m", "deepmesh.cli", "serve", "--port", str(port), "--model", str(published_tiny)]
    command += ["--no-compile", "--speculative", "mtp", "--speculative-tokens", "3"]
    log = tmp_path / "serve.log"
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=open(log, "w"))  # noqa: SIM115
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(f"{url}/readyz", [server], 120, f"see {log}")
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        for prompt, text in zip(prompts, texts, strict=True):
            answer = client.completions.create(
                model="deepmesh-tiny",
                prompt=prompt,
                max_tokens=NEW_TOKENS,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert answer.choices[0].text == text
        # a stop sequence from the middle of the answer ends it where the oracle's text has it
        stop = texts[2][len(texts[2]) // 2 :][:3]
        answer = client.completions.create(
            model="deepmesh-tiny",
            prompt=prompts[2],
            max_tokens=NEW_TOKENS,
            temperature=0,
            stop=[stop],
            extra_body={"ignore_eos": True},
        )
        assert answer.choices[0].text == texts[2][: texts[2].index(stop)]
        assert answer.choices[0].finish_reason == "stop"
        metrics = httpx.get(f"{url}/metrics").text
        drafted = [
            line for line in metrics.splitlines() if line.startswith('deepmesh_spec_draft_tokens_total{method="mtp"}')
        ]
        assert drafted and float(drafted[0].split()[-1]) > 0, metrics[-2000:]
        assert 'deepmesh_spec_accepted_tokens_total{method="mtp"}' in metrics
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    assert server.returncode == 0
