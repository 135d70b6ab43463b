"""The mesh as `deepmesh serve --speculative mtp` (DeepSeek-V4's MTP module) and `--speculative
dspark` (DeepSeek-V4.1's draft model) run it, its decode engine drafting with the checkpoint's
drafter, on checkpoints in the published layout, through the official OpenAI SDK: greedy
completions are the continuation one process computes without speculation, a stop sequence
ends them where it does there, and the speculation counters move."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from common.bus import MemoryBus
from common.claims import ClaimStore
from deepmesh.cli import _speculation, build_parser
from deepmesh.mesh import Mesh
from engine import LLMEngine, SamplingParams
from engine.checkpoint.make_model import make_model
from gateway.app import create_app
from tests.support.behaviour import MODEL, ServerThread
from tests.support.infra import scratch_store
from tests.support.models import random_prompts

NEW_TOKENS = 24


@pytest.fixture(scope="module", params=["mtp", "dspark"])
def published(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """A drafting method and its checkpoint, as `deepmesh make-model D --seed 3` writes it: the tiny
    preset with `--format deepseek` (an MTP module), or `--preset tiny-v41-dspark`."""
    directory = tmp_path_factory.mktemp(request.param)
    if request.param == "mtp":
        return "mtp", make_model(directory / "tiny", "tiny", seed=3, layout="deepseek")
    return "dspark", make_model(directory / "tiny-v41-dspark", "tiny-v41-dspark", seed=3)


def test_serve_and_decode_take_the_speculation_flags():
    from common.settings import Settings

    for command, method in ((["serve"], "mtp"), (["decode"], "dspark")):
        args = build_parser().parse_args([*command, "--speculative", method, "--speculative-tokens", "2"])
        assert _speculation(args, Settings()) == {
            "speculative": method,
            "speculative_tokens": 2,
            "speculative_max_batch": 4,
            "speculative_min_confidence": 0.0,
        }
    defaults = _speculation(build_parser().parse_args(["serve"]), Settings())
    assert defaults["speculative"] == "auto" and defaults["speculative_tokens"] == 3


def test_greedy_answers_with_speculation_are_those_without(published, jobs, tmp_path_factory):
    method, published_tiny = published
    prompts = random_prompts([7, 40, 150], vocab=20_000, seed=4)
    oracle = LLMEngine.from_pretrained(published_tiny, speculative="off")  # one process
    expected = oracle.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    decoder = Tokenizer.from_file(str(published_tiny / "tokenizer.json"))
    texts = [decoder.decode(out.token_ids) for out in expected]

    bus = MemoryBus(ClaimStore(tmp_path_factory.mktemp("claims")))
    speculation = {"speculative": method, "speculative_tokens": 3, "speculative_max_batch": 4}
    store = scratch_store(tmp_path_factory.mktemp("state"))
    mesh = Mesh(published_tiny, bus, store, served_model=MODEL, speculation=speculation).start()
    assert mesh.decode.engine.speculative_method == method and mesh.prefill.engine.drafter is None
    try:
        with ServerThread(create_app(bus, "deepmesh.", [MODEL], jobs)) as server:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
            for prompt, text in zip(prompts, texts, strict=True):
                answer = client.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, extra_body={"ignore_eos": True}
                )
                assert answer.choices[0].text == text
            # a stop sequence from the middle of the answer ends it where the oracle's text has it
            stop = texts[2][len(texts[2]) // 2 :][:3]
            answer = client.completions.create(
                model=MODEL,
                prompt=prompts[2],
                max_tokens=NEW_TOKENS,
                temperature=0,
                stop=[stop],
                extra_body={"ignore_eos": True},
            )
            assert answer.choices[0].text == texts[2][: texts[2].index(stop)]
            assert answer.choices[0].finish_reason == "stop"
            metrics = httpx.get(f"{server.url}/metrics").text
    finally:
        mesh.stop()
    counter = f'deepmesh_spec_draft_tokens_total{{method="{method}"}}'
    drafted = [line for line in metrics.splitlines() if line.startswith(counter)]
    assert drafted and float(drafted[0].split()[-1]) > 0, metrics[-2000:]
    assert f'deepmesh_spec_accepted_tokens_total{{method="{method}"}}' in metrics
