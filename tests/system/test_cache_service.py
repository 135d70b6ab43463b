"""The cache service as its own process: its HTTP API through StateClient, `deepmesh cache
stats`, and its maintenance run by a real Celery worker and beat over the stack's Redis."""

from __future__ import annotations

import http.server
import inspect
import os
import subprocess
import sys
import threading
import time
import uuid

import httpx
import pytest

from cache_svc import wire
from cache_svc.client import StateClient
from common.cache_entries import StateBlobs
from engine.prefix_store import PrefixStore
from tests.support.infra import CacheProcess, fresh_database, require_service, scratch_store
from tests.support.synthetic_states import NS, state_of, tokens


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache")
    env = {
        **os.environ,
        "DEEPMESH_DATABASE_URL": fresh_database(root),
        "DEEPMESH_REDIS_URL": require_service("DEEPMESH_REDIS_URL"),
        "DEEPMESH_TOPIC_PREFIX": f"test{uuid.uuid4().hex[:8]}.",
        "DEEPMESH_CACHE_MAINTENANCE_SECONDS": "0.5",
    }
    service = CacheProcess(root, env, "cache")
    env["DEEPMESH_CACHE_URL"] = service.url  # where the Celery worker sends the tasks
    yield env, service.start().url, root
    service.stop()


def test_the_client_and_the_store_are_what_the_engine_side_talks_to(tmp_path):
    """Both stores a worker can hand the engine's connector have every call of its PrefixStore,
    each taking the Protocol's parameters (names, order, defaults): the connector works with
    either, though the engine imports neither."""
    http_client = StateClient("http://127.0.0.1:9")  # nothing is sent until a call
    local_store = scratch_store(tmp_path)
    try:
        stores: list[PrefixStore] = [http_client, local_store]  # what a type checker checks
        for store in stores:
            assert isinstance(store, PrefixStore)
            for name, wanted in inspect.getmembers(PrefixStore, inspect.isfunction):
                if name.startswith("_"):
                    continue
                wanted_parameters = list(inspect.signature(wanted).parameters.values())
                given = list(inspect.signature(getattr(type(store), name)).parameters.values())
                where = f"{type(store).__name__}.{name}"
                assert [p.name for p in given[: len(wanted_parameters)]] == [p.name for p in wanted_parameters], where
                assert [p.default for p in given[: len(wanted_parameters)]] == [p.default for p in wanted_parameters]
                assert all(p.default is not inspect.Parameter.empty for p in given[len(wanted_parameters) :]), where
    finally:
        http_client.close()
        local_store.close()


def test_the_http_api_stores_finds_loads_and_pins(cache):
    _, url, _ = cache
    client = StateClient(url)
    stored = client.put_prefix(NS, tokens(300), state_of(tokens(300)), 600, lease_holder="job-9", lease_seconds=60)
    assert stored is not None and stored.num_tokens == 300
    match = client.lookup(NS, tokens(310), below=310)
    assert (match.key, match.num_tokens, match.shared_tokens) == (stored.key, 300, 256)
    state, reason = client.load(stored.key, release="job-9")
    assert reason is None and state == state_of(tokens(300))
    assert client.load("anchor-" + "0" * 64) == (None, "evicted")
    assert client.lookup(NS, tokens(50, 7000), below=50).miss_reason == "shorter_than_block"
    good = state_of(tokens(300))
    for namespace, body, problem in (
        (NS, b"not an entry", "no complete header"),
        (NS, b"\x05" + b"\x00" * 7 + b"{oops", "unreadable header"),
        (NS, wire.pack([good.head]), "one or more token ids"),
        (NS, wire.pack([]), "head blob"),
        (NS, wire.pack([good.head, *good.blocks], token_ids=tokens(300))[:-1], "the body has"),
        (f"{NS.split('/')[0]}/not a tenant", wire.pack([good.head, *good.blocks], token_ids=tokens(300)), "tenant"),
        (NS, wire.pack([good.head, good.blocks[0]], token_ids=tokens(300)), "1 block blobs for 300 tokens"),
    ):
        headers = {"X-Namespace": namespace, "X-TTL-Seconds": "60"}
        refused = httpx.post(f"{url}/v1/prefix", content=body, headers=headers)
        assert refused.status_code == 400 and problem in refused.json()["error"]["message"], problem
    assert client.put_prefix(NS, tokens(300), StateBlobs(b"", []), 60) is None  # refused: the client says so
    missing = httpx.post(f"{url}/v1/prefix", content=b"x")  # no namespace or TTL
    assert missing.status_code == 422
    assert httpx.post(f"{url}/v1/maintenance/nope").status_code == 404


def test_celery_beat_runs_the_write_behind_and_cache_stats_shows_it(cache):
    env, url, root = cache
    client = StateClient(url)
    client.put_prefix(NS, tokens(600, 50_000), state_of(tokens(600, 50_000)), 600)
    tiers = {t["name"]: t for t in client.stats()["tiers"]}
    assert tiers["disk"]["entries"] < tiers["memory"]["entries"]  # nothing runs maintenance yet
    log = open(root / "celery.log", "w")  # noqa: SIM115 (lives with the process)
    celery = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "cache_svc.maintenance",
            "worker",
            "--beat",
            "--pool",
            "solo",
            "--loglevel",
            "INFO",
            "--schedule",
            str(root / "beat-schedule"),
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while client.stats()["pending_write_behind"] or client.stats()["tiers"][1]["entries"] < 6:
            assert celery.poll() is None and time.monotonic() < deadline, f"no write-behind: see {root}/celery.log"
            time.sleep(0.5)
    finally:
        celery.terminate()
        celery.wait(timeout=30)
    assert "deepmesh.cache.flush" in (root / "celery.log").read_text()
    shown = subprocess.run(
        [sys.executable, "-m", "deepmesh.cli", "cache", "stats", "--url", url],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    ).stdout
    assert "disk" in shown and "memory" in shown and "anchors" in shown and "blocks" in shown
    assert "deepmesh_cache_misses_total{reason=shorter_than_block}" in shown


def test_a_cache_that_is_away_is_a_miss_and_a_restarted_one_is_found_again(tmp_path):
    """What a replica's client does when the cache service is killed: every call answers as a miss
    (nothing raises into the request), and once a new process listens on the same address, the
    client's pooled connections to the dead one are replaced, not reused: its next calls work."""
    env = {**os.environ, "DEEPMESH_DATABASE_URL": fresh_database(tmp_path)}
    service = CacheProcess(tmp_path, env, "cache").start()
    client = StateClient(service.url)
    try:
        stored = client.put_prefix(NS, tokens(300), state_of(tokens(300)), 600)
        assert stored is not None and client.lookup(NS, tokens(310), below=310).key == stored.key
        service.process.kill()
        service.process.wait(timeout=30)
        assert client.lookup(NS, tokens(310), below=310).miss_reason == "unreachable"
        assert client.load(stored.key) == (None, "unreachable")
        assert client.put_prefix(NS, tokens(300), state_of(tokens(300)), 600) is None
        assert client.renew(stored.key, 60) is None and client.lease(stored.key, "job-1", 60) is False
        assert client.stats() is None
        service.start()
        again = client.put_prefix(NS, tokens(300), state_of(tokens(300)), 600)
        assert again is not None and again.key == stored.key
        assert client.load(again.key) == (state_of(tokens(300)), None)
    finally:
        client.close()
        service.stop()


def test_a_cache_url_with_a_path_keeps_it_on_every_call():
    """A cache behind a proxy, under a path of its own (DEEPMESH_CACHE_URL=http://proxy/cache): each
    call goes to that path, not to the host's root. The proxy here is a plain HTTP server that
    records what it was asked and answers as the cache would for a key it does not hold."""
    asked: list[tuple[str, str]] = []

    class Proxy(http.server.BaseHTTPRequestHandler):
        def answer(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            asked.append((self.command, self.path))
            body = b'{"error": {"type": "evicted", "message": "not held"}}'
            self.send_response(404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = do_DELETE = answer

        def log_message(self, *args) -> None:  # quiet
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = StateClient(f"http://127.0.0.1:{server.server_port}/cache/")
    try:
        assert client.lookup(NS, tokens(310), below=310).miss_reason == "unreachable"  # any 4xx: a miss
        assert client.load("anchor-1", renew_seconds=5) == (None, "evicted")
        assert client.renew("anchor-1", 60) is None
        client.delete("anchor-1")
    finally:
        client.close()
        server.shutdown()
    assert [path.split("?")[0] for _, path in asked] == [
        "/cache/v1/prefix/lookup",
        "/cache/v1/prefix/anchor-1",
        "/cache/v1/prefix/anchor-1/renew",
        "/cache/v1/prefix/anchor-1",
    ]
    assert [method for method, _ in asked] == ["POST", "GET", "POST", "DELETE"]
    assert asked[1][1].endswith("?renew_seconds=5")
