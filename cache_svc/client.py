"""The cache service's HTTP API behind the StateStore interface that prefill and decode use."""

from __future__ import annotations

import logging

import httpx
from opentelemetry import propagate

from cache_svc.prefix import anchor_key
from cache_svc.store import checksum_of

log = logging.getLogger(__name__)


class StateClient:
    def __init__(self, base_url: str, timeout: float = 60.0):
        self.http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout)

    def put(self, key: str, data: bytes, lease_seconds: float) -> tuple[str, float]:
        headers = {"X-Lease-Seconds": str(lease_seconds), **_trace_headers()}
        response = self.http.put(f"/v1/state/{key}", content=data, headers=headers)
        response.raise_for_status()
        body = response.json()
        return body["checksum"], body["lease_expires_at"]

    def get(self, key: str) -> bytes | None:
        """The blob, or None when it is missing, unreachable or fails its checksum (callers recompute)."""
        try:
            response = self.http.get(f"/v1/state/{key}", headers=_trace_headers())
        except httpx.HTTPError as err:
            log.warning("cache get %s failed: %r", key, err)
            return None
        if response.status_code != 200:
            return None
        if checksum_of(response.content) != response.headers.get("X-Checksum"):
            return None
        return response.content

    def put_prefix(self, namespace: str, token_ids: list[int], data: bytes, ttl_seconds: float) -> str | None:
        """Store and index a prefix anchor; best effort: a failure only means a later miss."""
        key = anchor_key(token_ids, namespace)
        body = {"namespace": namespace, "token_ids": token_ids, "key": key}
        try:
            self.put(key, data, ttl_seconds)
            self.http.post("/v1/prefix", json=body, headers=_trace_headers()).raise_for_status()
        except httpx.HTTPError as err:
            log.warning("storing prefix %s failed: %r", key, err)
            return None
        return key

    def longest_prefix(self, namespace: str, token_ids: list[int], below: int) -> tuple[str, int] | None:
        """The longest stored anchor, or None (also when the service cannot be reached: a miss)."""
        body = {"namespace": namespace, "token_ids": token_ids, "below": below}
        try:
            response = self.http.post("/v1/prefix/lookup", json=body, headers=_trace_headers())
        except httpx.HTTPError as err:
            log.warning("prefix lookup failed: %r", err)
            return None
        if response.status_code != 200:
            return None
        found = response.json()
        return found["key"], found["num_tokens"]

    def renew(self, key: str, lease_seconds: float) -> float | None:
        """Extend a blob's lease (a prefix's retention); None when it is gone or unreachable."""
        try:
            response = self.http.post(
                f"/v1/state/{key}/lease", headers={"X-Lease-Seconds": str(lease_seconds), **_trace_headers()}
            )
        except httpx.HTTPError as err:
            log.warning("cache renew %s failed: %r", key, err)
            return None
        return response.json()["lease_expires_at"] if response.status_code == 200 else None

    def delete(self, key: str) -> None:
        try:
            self.http.delete(f"/v1/state/{key}", headers=_trace_headers())
        except httpx.HTTPError as err:  # the lease reclaims it anyway
            log.warning("cache delete %s failed: %r", key, err)

    def close(self) -> None:
        self.http.close()


def _trace_headers() -> dict[str, str]:
    """The current span's context, so the cache service's span joins the job's trace."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier
