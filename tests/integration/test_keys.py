"""API keys, rate limits and the usage ledger, through the official SDKs and the `deepmesh` CLI.

The gateway requires keys here (as it does when it listens beyond loopback); the model
behind it is a ScriptedModel (tests/behaviour.py), the rest is the real thing: the
tokenizer with deepseek-recipe, the database (the stack's PostgreSQL under `make test`) and,
for limits shared by two gateway replicas, the stack's Redis.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
import uuid
from urllib.parse import urlsplit

import anthropic
import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.jobs import JobStore
from gateway.keys import REMEMBER_SECONDS
from gateway.quotas import MemoryQuotas, RedisQuotas
from tests.support.batch_behaviour import chat_line, jsonl, wait_for_batch
from tests.support.behaviour import MODEL, QUESTION, ServerThread, scripted_gateway
from tests.support.infra import fresh_database, require_service
from tests.support.relay import TcpRelay


@pytest.fixture(scope="module")
def database(tmp_path_factory) -> str:
    return fresh_database(tmp_path_factory.mktemp("db"))


@pytest.fixture(scope="module")
def gateway(tiny_preset, database, tmp_path_factory):
    jobs = JobStore(database)
    root = tmp_path_factory.mktemp("keys")
    options = {"require_keys": True, "files_dir": str(root / "files"), "batch_rounds": 0.2}
    with scripted_gateway(tiny_preset, jobs, root / "claims", **options) as running:
        running.stage.reply = "Partitions are ordered logs."
        yield running
    jobs.close()


NO_THINKING = {"thinking": {"type": "disabled"}}


def deepmesh(database: str, *args: str) -> str:
    """Run the CLI as a user would; its stdout."""
    env = {**os.environ, "DEEPMESH_DATABASE_URL": database}
    done = subprocess.run(
        [sys.executable, "-m", "deepmesh.cli", *args], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def new_key(database: str, tenant: str, *limits: str) -> str:
    return deepmesh(database, "keys", "create", "--tenant", tenant, *limits).strip()


def clients(url: str, key: str) -> tuple[openai.OpenAI, anthropic.Anthropic]:
    oai = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)
    claude = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=60)
    return oai, claude


def ask(oai: openai.OpenAI):
    return oai.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, extra_body=NO_THINKING)


def test_a_key_is_needed_decides_the_tenant_and_can_be_revoked(gateway, database):
    key = new_key(database, "acme")
    assert key.startswith("dm-") and len(key) > 40
    oai, claude = clients(gateway.url, key)
    assert ask(oai).choices[0].message.content == "Partitions are ordered logs."
    assert claude.messages.create(model=MODEL, max_tokens=8, messages=QUESTION).content

    bad_oai, bad_claude = clients(gateway.url, "dm-not-a-key")
    with pytest.raises(openai.AuthenticationError) as refused:
        ask(bad_oai)
    assert refused.value.status_code == 401 and refused.value.body["type"] == "invalid_request_error"
    with pytest.raises(anthropic.AuthenticationError) as refused:
        bad_claude.messages.create(model=MODEL, max_tokens=8, messages=QUESTION)
    assert refused.value.body["error"]["type"] == "authentication_error"
    # no key at all (the SDKs refuse to send none): each protocol's 401
    no_key = httpx.get(f"{gateway.url}/v1/models")
    assert no_key.status_code == 401 and no_key.json()["error"]["message"].startswith("an API key is required")
    body = {"model": MODEL, "max_tokens": 8, "messages": QUESTION}
    no_key = httpx.post(f"{gateway.url}/v1/messages", json=body)
    assert no_key.status_code == 401 and no_key.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{gateway.url}/healthz").status_code == 200  # probes need no key

    # the key decides the tenant: a tenant header names no one else's files
    other = new_key(database, "globex")
    uploaded = oai.files.create(file=("a.jsonl", io.BytesIO(jsonl([chat_line("a", "hi")]))), purpose="batch")
    other_oai, _ = clients(gateway.url, other)
    spoofed = other_oai.with_options(default_headers={"X-DeepMesh-Tenant": "acme"})
    with pytest.raises(openai.NotFoundError):
        spoofed.files.retrieve(uploaded.id)
    assert uploaded.id not in [f.id for f in spoofed.files.list()]
    assert oai.files.retrieve(uploaded.id).id == uploaded.id

    listed = deepmesh(database, "keys", "list")
    key_id = next(line.split()[0] for line in listed.splitlines() if " acme " in line)
    assert key not in listed  # the secret is never shown again
    assert "revoked" in deepmesh(database, "keys", "revoke", key_id)
    time.sleep(REMEMBER_SECONDS + 0.5)  # a gateway remembers a looked-up key this long
    with pytest.raises(openai.PermissionDeniedError) as refused:
        ask(oai)
    assert refused.value.status_code == 403
    with pytest.raises(anthropic.PermissionDeniedError):
        claude.messages.create(model=MODEL, max_tokens=8, messages=QUESTION)
    (revoked,) = [line.split() for line in deepmesh(database, "keys", "list").splitlines() if line.startswith(key_id)]
    assert len(revoked) == 8 and revoked[6] == time.strftime("%Y-%m-%d", time.gmtime())  # revoked today


def within_one_minute(seconds: float) -> None:
    """Wait for the next minute if this one has less than `seconds` left: limits count per minute."""
    if time.time() % 60 > 60 - seconds:
        time.sleep(60.5 - time.time() % 60)


def test_requests_per_minute_get_429_with_each_protocols_rate_limit_headers(gateway, database):
    key = new_key(database, "limited", "--rpm", "3")
    within_one_minute(20)
    oai, claude = clients(gateway.url, key)
    remaining = []
    for _ in range(2):
        raw = oai.chat.completions.with_raw_response.create(model=MODEL, messages=QUESTION, max_tokens=8)
        assert raw.headers["x-ratelimit-limit-requests"] == "3"
        remaining.append(int(raw.headers["x-ratelimit-remaining-requests"]))
    raw = claude.messages.with_raw_response.create(model=MODEL, max_tokens=8, messages=QUESTION)
    assert raw.headers["anthropic-ratelimit-requests-limit"] == "3"
    assert raw.headers["anthropic-ratelimit-requests-remaining"] == "0"
    assert remaining == [2, 1]
    with pytest.raises(openai.RateLimitError) as refused:
        ask(oai)
    headers = refused.value.response.headers
    assert 1 <= int(headers["retry-after"]) <= 60 and headers["x-ratelimit-remaining-requests"] == "0"
    assert refused.value.body["type"] == "rate_limit_error"
    with pytest.raises(anthropic.RateLimitError) as refused:
        claude.messages.create(model=MODEL, max_tokens=8, messages=QUESTION)
    assert refused.value.response.headers["anthropic-ratelimit-requests-remaining"] == "0"
    assert refused.value.body["error"]["type"] == "rate_limit_error"


def test_tokens_per_minute_count_what_answers_used(gateway, database):
    key = new_key(database, "frugal", "--tpm", "150")
    within_one_minute(20)
    oai, _ = clients(gateway.url, key)
    first = oai.chat.completions.with_raw_response.create(model=MODEL, messages=QUESTION, max_tokens=8)
    used = first.parse().usage.total_tokens
    # admitted on an estimate (body bytes / 4 + max_tokens), then corrected to what it used
    second = oai.chat.completions.with_raw_response.create(model=MODEL, messages=QUESTION, max_tokens=8)
    assert int(second.headers["x-ratelimit-remaining-tokens"]) < 150 - used
    with pytest.raises(openai.RateLimitError):
        for _ in range(10):
            ask(oai)


def test_two_gateways_share_a_keys_limits_through_redis(tiny_preset, database, tmp_path):
    url = require_service("DEEPMESH_REDIS_URL")
    prefix = f"test{uuid.uuid4().hex[:8]}."
    key = new_key(database, "shared", "--rpm", "4")
    jobs = JobStore(database)
    try:
        limits = {"require_keys": True, "quotas": RedisQuotas(url, prefix)}
        with scripted_gateway(tiny_preset, jobs, tmp_path / "claims", **limits) as first:
            # a second replica: its own process state, the same bus, database and Redis
            other = {"require_keys": True, "quotas": RedisQuotas(url, prefix)}
            with ServerThread(create_app(first.bus, first.prefix, [MODEL], jobs, **other)) as second:
                within_one_minute(20)
                for url_ in (first.url, second.url, first.url, second.url):
                    ask(clients(url_, key)[0])
                for url_ in (first.url, second.url):
                    with pytest.raises(openai.RateLimitError):
                        ask(clients(url_, key)[0])
        # in memory (one process) the same key would have its own count in each replica
        assert MemoryQuotas().admit("k", 4, None, 0).admitted
    finally:
        jobs.close()


def test_while_redis_is_away_a_limited_keys_calls_get_503_and_count_again_once_it_is_back(
    tiny_preset, database, tmp_path
):
    """Redis behind a relay the test cuts (tests/support/relay.py): a key with limits is answered
    503 with Retry-After in each protocol's shape, on a connection that stays open, then counted
    again once Redis is back. Before, the call was a 500 and the connection was closed."""
    redis_url = urlsplit(require_service("DEEPMESH_REDIS_URL"))
    key = new_key(database, "limited", "--rpm", "100")
    jobs = JobStore(database)
    try:
        with TcpRelay(redis_url.hostname, redis_url.port) as relay:
            through = redis_url._replace(netloc=f"127.0.0.1:{relay.port}").geturl()
            quotas = RedisQuotas(through, f"test{uuid.uuid4().hex[:8]}.")
            with scripted_gateway(tiny_preset, jobs, tmp_path / "claims", require_keys=True, quotas=quotas) as running:
                running.stage.reply = "Partitions are ordered logs."
                oai, claude = clients(running.url, key)
                assert ask(oai).choices[0].message.content == running.stage.reply
                relay.cut()
                with pytest.raises(openai.InternalServerError) as refused:
                    ask(oai)
                assert refused.value.status_code == 503 and refused.value.response.headers["retry-after"].isdigit()
                with pytest.raises(anthropic.InternalServerError) as refused:
                    claude.messages.create(model=MODEL, max_tokens=8, messages=QUESTION)
                assert refused.value.status_code == 503 and refused.value.body["error"]["type"] == "api_error"
                relay.restore()
                answered = oai.chat.completions.with_raw_response.create(
                    model=MODEL, messages=QUESTION, max_tokens=8, extra_body=NO_THINKING
                )
                assert int(answered.headers["x-ratelimit-remaining-requests"]) < 100
    finally:
        jobs.close()


def test_usage_per_tenant_model_day_and_priority(gateway, database):
    key = new_key(database, "ledger")
    oai, claude = clients(gateway.url, key)
    answers = [ask(oai).usage for _ in range(3)]
    message = claude.messages.create(model=MODEL, max_tokens=8, messages=QUESTION).usage
    upload = oai.files.create(
        file=("b.jsonl", io.BytesIO(jsonl([chat_line(f"b{i}", "hi") for i in range(4)]))), purpose="batch"
    )
    batch = oai.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    batch = wait_for_batch(oai.batches.retrieve, batch.id, lambda b: b.status == "completed", timeout=120)

    def report() -> dict[str, dict]:
        rows = httpx.get(f"{gateway.url}/v1/usage", headers={"Authorization": f"Bearer {key}"}).json()["data"]
        return {row["priority"]: row for row in rows}

    deadline = time.monotonic() + 30
    while set(report()) != {"interactive", "batch"} or report()["interactive"]["requests"] < 4:
        assert time.monotonic() < deadline, report()
        time.sleep(0.2)
    rows = report()
    assert {row["tenant"] for row in rows.values()} == {"ledger"}
    interactive = rows["interactive"]
    assert interactive["requests"] == 4 and interactive["model"] == MODEL
    # the oracle: what each answer's own usage said, as the SDKs parsed it
    assert interactive["output_tokens"] == sum(u.completion_tokens for u in answers) + message.output_tokens
    prompt = sum(u.prompt_tokens for u in answers) + message.input_tokens + (message.cache_read_input_tokens or 0)
    assert interactive["cached_input_tokens"] + interactive["uncached_input_tokens"] == prompt
    assert rows["batch"]["requests"] == 4 and rows["batch"]["output_tokens"] == batch.usage.output_tokens
    table = deepmesh(database, "usage")
    assert any(line.split()[:1] == ["ledger"] and "batch" in line for line in table.splitlines())
