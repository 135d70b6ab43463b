"""What a call to the cache service costs its caller: the service's HTTP client against httpx.

Starts `deepmesh cache` as a process of its own (on the stack's PostgreSQL when
DEEPMESH_DATABASE_URL is set, as a distributed mesh runs it; else an SQLite file) and times, from
this process, the calls a prefill replica makes on the way to every first token: a bare GET
(`/healthz`, the HTTP path alone) and a prefix lookup that misses, at 16 and 2,048 tokens. Each
call goes through StateClient (urllib3, as served) and through an httpx client with the same
keep-alive connection, one right after the other, which goes first alternating: only differences
measured that close together mean anything on a noisy machine. Prints medians and their ratio.

    python benchmarks/cache_client.py [--calls 200]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.support, as chaos_soak.py

NAMESPACE = "bench/default"


def timed(call: Callable[[], object]) -> float:
    started = time.perf_counter()
    call()
    return (time.perf_counter() - started) * 1000


def main() -> None:
    from cache_svc.client import StateClient
    from tests.support.infra import CacheProcess, fresh_database

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=200, help="calls of each kind through each client")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="cache-client-"))
    env = {**os.environ, "DEEPMESH_DATABASE_URL": fresh_database(root)}
    service = CacheProcess(root, env, "cache").start()
    ours = StateClient(service.url)
    theirs = httpx.Client(base_url=service.url, timeout=60)
    generator = random.Random(0)

    def through_httpx(token_ids: list[int]) -> None:
        if not token_ids:
            theirs.get("/healthz").raise_for_status()
            return
        body = {"namespace": NAMESPACE, "token_ids": token_ids, "below": len(token_ids) + 1}
        theirs.post("/v1/prefix/lookup", json=body).raise_for_status()

    def through_ours(token_ids: list[int]) -> None:
        if not token_ids:
            assert ours.http.request("GET", "/healthz").status == 200
            return
        assert ours.lookup(NAMESPACE, token_ids, below=len(token_ids) + 1).miss_reason != "unreachable"

    clients = {"httpx": through_httpx, "StateClient": through_ours}
    rows = []
    try:
        for name, length in (("GET /healthz", 0), ("lookup, 16 tokens", 16), ("lookup, 2,048 tokens", 2048)):
            times: dict[str, list[float]] = {side: [] for side in clients}
            for i in range(args.calls + 5):  # the first five of each: warm-up, left out
                token_ids = [generator.randrange(1000, 60_000) for _ in range(length)]  # a fresh miss each
                for side in ("httpx", "StateClient") if i % 2 else ("StateClient", "httpx"):
                    ms = timed(partial(clients[side], token_ids))
                    if i >= 5:
                        times[side].append(ms)
            before, after = statistics.median(times["httpx"]), statistics.median(times["StateClient"])
            rows.append((name, before, after))
    finally:
        ours.close()
        theirs.close()
        service.stop()
    print(f"cache service client, {args.calls} calls each, alternated (medians, ms)")
    print("| call | httpx | StateClient (urllib3) | ratio |")
    print("| --- | ---: | ---: | ---: |")
    for name, before, after in rows:
        print(f"| {name} | {before:.2f} | {after:.2f} | {after / before:.2f}x |")


if __name__ == "__main__":
    main()
