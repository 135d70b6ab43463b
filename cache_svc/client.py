"""The cache service's HTTP API behind the same interface as StateStore (the engine side's
PrefixStore, engine/prefix_store.py), for prefill and decode replicas on other hosts. Every
call is best effort: an unreachable cache is a miss, never an error for the request."""

from __future__ import annotations

import logging
from typing import Any

import httpx
from opentelemetry import propagate

from cache_svc import wire
from cache_svc.store import checksum_of
from common.cache_entries import PrefixMatch, StateBlobs, Stored

log = logging.getLogger(__name__)


class StateClient:
    def __init__(self, base_url: str, timeout: float = 60.0):
        self.http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout)

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
            response = self.http.get(f"/v1/prefix/{key}", params=params, headers=_trace_headers())
        except httpx.HTTPError as err:
            log.warning("cache load %s failed: %r", key, err)
            return None, "unreachable"
        if response.status_code != 200:
            return None, _error_type(response) or "evicted"
        if checksum_of(response.content) != response.headers.get("X-Checksum"):
            return None, "corrupt"
        try:
            parts, _ = wire.unpack(response.content)
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

    def _call(self, method: str, path: str, **kwargs: Any) -> dict[str, Any] | None:
        """The JSON answer of a 2xx, else None (logged: the caller treats it as a miss)."""
        kwargs["headers"] = {**_trace_headers(), **kwargs.get("headers", {})}
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as err:
            log.warning("cache %s %s failed: %r", method, path, err)
            return None
        if response.status_code >= 300:
            if response.status_code != 404:
                log.warning("cache %s %s: %s %s", method, path, response.status_code, response.text[:200])
            return None
        return response.json() if response.content else {}


def _error_type(response: httpx.Response) -> str | None:
    try:
        return response.json()["error"]["type"]
    except (ValueError, KeyError, TypeError):
        return None


def _trace_headers() -> dict[str, str]:
    """The current span's context, so the cache service's span joins the job's trace."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier
