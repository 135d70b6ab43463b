"""The database going away under the embedded mesh (`deepmesh serve`'s one process) and coming
back: the job store and the cache catalog reach the stack's PostgreSQL through a relay the test
cuts (tests/support/relay.py), as a network or a restart cuts a service off its database."""

from __future__ import annotations

import time

import httpx
import pytest
from sqlalchemy import make_url

from tests.support.behaviour import MODEL, one_process_answer, served_embedded
from tests.support.infra import fresh_database
from tests.support.relay import TcpRelay

BODY = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Name the planets of the solar system."}],
    "max_tokens": 160,
    "temperature": 0,
}


@pytest.fixture
def served(tiny_preset, tmp_path):
    """The embedded mesh and its gateway, both databases behind one relay: (URL, relay)."""
    url = make_url(fresh_database(tmp_path))
    if url.get_backend_name() != "postgresql":
        pytest.skip("no PostgreSQL: scripts/stack up")
    with TcpRelay(url.host, url.port) as relay:
        through = url.set(host="127.0.0.1", port=relay.port).render_as_string(hide_password=False)
        with served_embedded(tiny_preset, tmp_path, through) as served_url:
            yield served_url, relay


def test_calls_that_need_the_database_while_it_is_away_get_503_and_an_accepted_job_finishes(served, tiny_preset):
    """An async job accepted just before the database goes away finishes once it is back, with the
    answer the engine gives alone. Meanwhile a call that needs the database (a new job, a job's
    status) is answered 503 with Retry-After in the protocol's shape, and the same connection
    serves the next call; calls that need no database are answered. Before, a new job got a 500
    and the server then closed the connection (the next call on it was reset)."""
    url, relay = served
    expected = one_process_answer(tiny_preset, BODY)["choices"][0]["message"]["content"]
    with httpx.Client(base_url=url, timeout=120) as client:
        accepted = client.post("/v1/jobs", json={"endpoint": "chat.completions", "body": BODY})
        assert accepted.status_code == 202, accepted.text
        job = accepted.json()["id"]
        relay.cut()
        for refused in (
            client.post("/v1/jobs", json={"endpoint": "chat.completions", "body": BODY}),
            client.get(f"/v1/jobs/{job}"),
        ):
            assert refused.status_code == 503, refused.text
            assert refused.headers["retry-after"].isdigit()
            assert refused.json()["error"]["type"] == "server_error"
        # a call that needs no database, on the same connection
        answered = client.post("/v1/chat/completions", json={**BODY, "max_tokens": 8})
        assert answered.status_code == 200 and answered.json()["choices"][0]["message"]["content"]
        relay.restore()
        deadline = time.monotonic() + 90
        while (status := client.get(f"/v1/jobs/{job}").json())["status"] not in ("succeeded", "failed"):
            assert time.monotonic() < deadline, status
            time.sleep(0.5)
    assert status["status"] == "succeeded"
    assert status["result"]["choices"][0]["message"]["content"] == expected
