"""What the engine side asks of a KV cache: the store behind engine/prefix_connector.py.

The engine imports no service: this Protocol states, in bytes and plain data
(common/cache_entries.py), the calls the connector makes, and whoever runs the engine hands
it a store that has them. Two do: the cache service's HTTP client (cache_svc/client.py), for
prefill and decode replicas on other hosts, and the store itself (cache_svc/store.py), for
every service in one process. Neither is named here; both match by shape
(tests/unit/test_prefix.py checks that they do).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from common.cache_entries import PrefixMatch, StateBlobs, Stored


@runtime_checkable
class PrefixStore(Protocol):
    def lookup(self, namespace: str, token_ids: list[int], below: int) -> PrefixMatch:
        """The longest live stored prefix of `token_ids`, shorter than `below` tokens, in
        `namespace` (common.prefixes.namespace_of: the state layout and the tenant)."""
        ...

    def load(
        self, key: str, renew_seconds: float = 0.0, release: str | None = None
    ) -> tuple[StateBlobs | None, str | None]:
        """An entry's bytes, or (None, the reason it is a miss). A hit keeps the entry for at
        least `renew_seconds` more; `release` names a lease holder whose pin the load ends."""
        ...

    def put_prefix(
        self,
        namespace: str,
        token_ids: list[int],
        state: StateBlobs,
        ttl_seconds: float,
        lease_holder: str | None = None,
        lease_seconds: float = 0.0,
    ) -> Stored | None:
        """Store the state after exactly `token_ids`, pinned for `lease_holder` for
        `lease_seconds` if one is named (a hand-over); None if it was not stored."""
        ...

    def put_image(self, namespace: str, digest: str, rows: bytes, num_tokens: int, ttl_seconds: float) -> Stored | None:
        """Store an image's encoder rows under its content (common.images.image_key names them);
        `load` reads them back as an entry with no blocks. None if they were not stored."""
        ...

    def renew(self, key: str, ttl_seconds: float) -> float | None:
        """Keep an entry at least `ttl_seconds` more; its new expiry, or None if it is not stored."""
        ...

    def release(self, key: str, holder: str) -> bool:
        """Unpin an entry leased to `holder`."""
        ...

    def delete(self, key: str) -> None:
        """Forget an entry (its bytes were found unusable)."""
        ...
