"""The cache service's HTTP API behind the same interface as StateStore (the engine side's
PrefixStore, engine/prefix_store.py), for prefill and decode replicas on other hosts. Every
call is best effort: an unreachable cache is a miss, never an error for the request.

Through urllib3's connection pool: a prefix lookup is on the way to every first token, and httpx
took 0.55 to 0.6 ms more a call on a kept-alive loopback connection (a bare GET 1.46-1.55 against
0.97-1.00 ms, a lookup that misses 3.41-4.40 against 2.83-3.80; benchmarks/cache_client.py)."""

from __future__ import annotations

import logging
from typing import Any

import urllib3
from opentelemetry import propagate

from cache_svc import wire
from common.cache_entries import PrefixMatch, StateBlobs, Stored

log = logging.getLogger(__name__)


class StateClient:
    def __init__(self, base_url: str, timeout: float = 60.0):
        # connections kept for the fetch threads that call at once; one more is opened when all
        # are busy. No retries: a call that fails is a miss, as a cache that is away
        self.http = urllib3.connection_from_url(
            base_url, maxsize=POOL_SIZE, timeout=urllib3.Timeout(total=timeout), retries=False
        )
        # the URL's own path, if any (a cache behind a proxy, under /cache): the pool keeps only
        # the host, so every call's path starts with it
        self.base_path = (urllib3.util.parse_url(base_url).path or "").rstrip("/")

    def put_prefix(
        self,
        namespace: str,
        token_ids: list[int],
        state: StateBlobs,
        ttl_seconds: float,
        lease_holder: str | None = None,
        lease_seconds: float = 0.0,
    ) -> Stored | None:
        headers = {"X-Namespace": namespace, "X-TTL-Seconds": str(ttl_seconds), **_trace_headers()}
        if lease_holder:
            headers |= {"X-Lease-Holder": lease_holder, "X-Lease-Seconds": str(lease_seconds)}
        data = wire.pack([state.head, *state.blocks], token_ids=token_ids)
        body = self._call("POST", "/v1/prefix", content=data, headers=headers)
        return Stored(**body) if body is not None else None

    def put_image(self, namespace: str, digest: str, rows: bytes, num_tokens: int, ttl_seconds: float) -> Stored | None:
        headers = {
            "X-Namespace": namespace,
            "X-Digest": digest,
            "X-Num-Tokens": str(num_tokens),
            "X-TTL-Seconds": str(ttl_seconds),
        }
        body = self._call("POST", "/v1/image", content=rows, headers=headers)
        return Stored(**body) if body is not None else None

    def lookup(self, namespace: str, token_ids: list[int], below: int) -> PrefixMatch:
        body = self._call(
            "POST", "/v1/prefix/lookup", json={"namespace": namespace, "token_ids": token_ids, "below": below}
        )
        return PrefixMatch(**body) if body is not None else PrefixMatch(miss_reason="unreachable")

    def load(
        self, key: str, renew_seconds: float = 0.0, release: str | None = None
    ) -> tuple[StateBlobs | None, str | None]:
        params: dict[str, str | float] = {"renew_seconds": renew_seconds}
        if release is not None:
            params["release"] = release
        try:
            response = self.http.request(
                "GET", f"{self.base_path}/v1/prefix/{key}", fields=params, headers=_trace_headers()
            )
        except urllib3.exceptions.HTTPError as err:
            log.warning("cache load %s failed: %r", key, err)
            return None, "unreachable"
        if response.status != 200:
            return None, _error_type(response) or "evicted"
        if wire.checksum_of(response.data) != response.headers.get("X-Checksum"):
            return None, "corrupt"
        try:
            parts, _ = wire.unpack(response.data)
        except ValueError:
            return None, "corrupt"
        return StateBlobs(parts[0], parts[1:]), None

    def renew(self, key: str, ttl_seconds: float) -> float | None:
        body = self._call("POST", f"/v1/prefix/{key}/renew", json={"ttl_seconds": ttl_seconds})
        return None if body is None else body["expires_at"]

    def lease(self, key: str, holder: str, seconds: float) -> bool:
        return self._call("POST", f"/v1/prefix/{key}/lease", json={"holder": holder, "seconds": seconds}) is not None

    def release(self, key: str, holder: str) -> bool:
        return self._call("DELETE", f"/v1/prefix/{key}/lease/{holder}") is not None

    def delete(self, key: str) -> None:
        self._call("DELETE", f"/v1/prefix/{key}")

    def stats(self) -> dict[str, Any] | None:
        return self._call("GET", "/v1/stats")

    def close(self) -> None:
        self.http.close()

    def _call(
        self,
        method: str,
        path: str,
        json: dict[str, Any] | None = None,
        content: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> dict[str, Any] | None:
        """The JSON answer of a 2xx, else None (logged: the caller treats it as a miss)."""
        headers = {**_trace_headers(), **(headers or {})}
        try:
            response = self.http.request(method, self.base_path + path, body=content, json=json, headers=headers)
        except urllib3.exceptions.HTTPError as err:
            log.warning("cache %s %s failed: %r", method, path, err)
            return None
        if response.status >= 300:
            if response.status != 404:
                log.warning("cache %s %s: %s %r", method, path, response.status, response.data[:200])
            return None
        return response.json() if response.data else {}


POOL_SIZE = 8  # a worker's fetch and store threads call at once (common/worker.py), and then some


def _error_type(response: urllib3.BaseHTTPResponse) -> str | None:
    try:
        return response.json()["error"]["type"]
    except (ValueError, KeyError, TypeError):
        return None


def _trace_headers() -> dict[str, str]:
    """The current span's context, so the cache service's span joins the job's trace."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier
