"""The API under schemathesis: requests generated from the OpenAPI document the gateway serves.

The gateway and the tokenizer (deepseek-recipe) are the real ones, over the in-process bus;
prefill and decode are a ScriptedModel, which answers at once, so the examples exercise the
protocol layer rather than wait for a model. Every answer must be below 500, 4xx answers in
the protocol's error shape; afterwards the service still answers, and its memory has not run
away.
"""

from __future__ import annotations

import json
import os

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.config import SchemathesisConfig

from common.bus import MemoryBus
from gateway import schemas
from gateway.app import create_app
from gateway.jobs import JobStore
from tests.support.behaviour import GREEDY, MODEL, QUESTION, protocol_error_message, scripted_gateway

# schemathesis collects a test per operation, all under one id: pytest-xdist would run one of them.
# (Behind the other tests, at the lowest priority, it took 62 s instead of 21: it runs with `alone`.)
pytestmark = pytest.mark.alone

EXAMPLES = int(os.environ.get("DEEPMESH_FUZZ_EXAMPLES", "30"))  # per operation; more in a soak


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(scope="module")
def model(tiny_preset):
    return tiny_preset


@pytest.fixture(scope="module")
def gateway(model, tmp_path_factory):
    jobs = JobStore(f"sqlite:///{tmp_path_factory.mktemp('db')}/jobs.db")
    with scripted_gateway(model, jobs, tmp_path_factory.mktemp("claims"), result_timeout=30) as running:
        running.stage.reply = "A partition is an ordered log."
        running.rss_before = resident_bytes()
        yield running
    jobs.close()


# Examples from the document the gateway serves (it depends on no running part), valid and
# invalid ones; the exhaustive coverage phase (tens of thousands of calls) is for a soak.
FUZZING = SchemathesisConfig.from_dict(
    {
        "phases": {"coverage": {"enabled": False}, "stateful": {"enabled": False}},
        "generation": {"max-examples": EXAMPLES, "mode": "all"},
    }
)
document = create_app(MemoryBus(), "doc.", [MODEL], None).openapi()
schema = schemathesis.openapi.from_dict(document, config=FUZZING).include(method="POST")


def test_the_served_schemas_are_the_sdks_request_types():
    """api_schemas.json is what `python -m gateway.schemas` makes of the installed SDKs."""
    assert json.loads(json.dumps(schemas.generate(), sort_keys=True)) == json.loads(schemas.SCHEMA_FILE.read_text())


def test_the_openapi_document_declares_each_protocols_body(gateway):
    document = httpx.get(f"{gateway.url}/openapi.json").json()
    for path, component in (
        ("/v1/chat/completions", "ChatCompletionRequest"),
        ("/v1/responses", "ResponsesRequest"),
        ("/v1/messages", "MessagesRequest"),
        ("/v1/completions", "CompletionRequest"),
        ("/v1/jobs", "JobRequest"),
    ):
        body = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{component}"}
    assert {"messages", "model", "max_tokens"} <= set(document["components"]["schemas"]["MessagesRequest"]["required"])


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_generated_request_gets_a_5xx(case, gateway):
    response = case.call(base_url=gateway.url, timeout=60)
    assert response.status_code < 500, (case.body, response.status_code, response.text[:500])
    if response.status_code >= 400 and case.path != "/v1/jobs":
        assert protocol_error_message(case.path, response.json())


def test_the_service_is_healthy_after_fuzzing(gateway):
    answer = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        json={"model": MODEL, "messages": QUESTION, "max_tokens": 8, **GREEDY["extra_body"]},
        timeout=60,
    )
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"]
    grown = resident_bytes() - gateway.rss_before
    assert grown < 300 << 20, f"the process grew by {grown >> 20} MiB while fuzzed"
