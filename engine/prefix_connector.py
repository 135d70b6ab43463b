"""The engine side of the KV cache: what prefill and decode ask of it, and what a failure means.

One place for the rules both stages share: which namespace a tenant's prefixes live in (the
engine's state layout and the tenant), how long they live (the request's retention class),
what a lookup does when the prefix it found cannot be loaded (the next-longest, up to
LOAD_ATTEMPTS), which bytes are counted, and the error policy: a cache that fails is a miss
or an entry not stored, never a failed job. The store is the cache service's HTTP client
or, in one process, the store itself; both have the methods of engine.prefix_store.PrefixStore
and deal in bytes: a state is split into the blobs the cache stores here (StateSnapshot.split,
.joined).

Every call does I/O: workers make them on their fetch threads, never on the engine's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from common import metrics
from common.cache_entries import PrefixMatch, StateBlobs, Stored
from common.prefixes import namespace_of
from common.retention import Retention
from common.tracing import SpanKind, job_span
from engine.prefix_store import PrefixStore
from engine.state_transfer import SnapshotError, StateSnapshot

log = logging.getLogger(__name__)

LOAD_ATTEMPTS = 3  # stored prefixes tried, longest first, before computing the whole prompt


class PrefixConnector:
    def __init__(self, store: PrefixStore, layout: str, retention: Retention | None = None):
        self.store = store
        self.layout = layout
        self.retention = retention or Retention()

    def namespace(self, tenant: str) -> str:
        return namespace_of(self.layout, tenant)

    def ttl(self, tenant: str, retention_class: str) -> float:
        return self.retention.ttl(tenant, retention_class)

    def fetch_prefix(
        self,
        job_id: str,
        tenant: str,
        retention_class: str,
        prompt: list[int],
        too_slow: Callable[[PrefixMatch], bool] = lambda match: False,
        held: int = 0,
        at_most: int | None = None,
    ) -> tuple[StateSnapshot | None, PrefixMatch]:
        """The longest stored prefix of a prompt (the whole prompt too: a repeat is answered
        from its last hidden state), loaded, and the match it came from. A prefix that fails to
        load is dropped by the store and the next-longest is tried; one that `too_slow` says
        would take longer to load than to compute is not loaded, nor one no longer than the
        `held` tokens the engine has in its own memory, nor one longer than `at_most` tokens (the
        engine's `reusable_prefix`). (None, match): nothing loaded."""
        namespace, ttl = self.namespace(tenant), self.ttl(tenant, retention_class)
        below = (len(prompt) if at_most is None else min(at_most, len(prompt))) + 1
        match = PrefixMatch()
        for _ in range(LOAD_ATTEMPTS):
            try:
                with job_span("cache.lookup", job_id, kind=SpanKind.CLIENT):
                    match = self.store.lookup(namespace, prompt, below=below)
                if match.key is None or match.num_tokens <= held:
                    return None, match
                if too_slow(match):
                    metrics.CACHE_MISSES.labels("too_slow").inc()  # the store counts the other reasons
                    return None, match
                with job_span("cache.load", job_id, kind=SpanKind.CLIENT, **{"deepmesh.bytes": match.size}):
                    state, _ = self.store.load(match.key, renew_seconds=ttl)  # a hit keeps it longer
                snapshot = self._joined(match.key, state)
            except Exception:  # a cache that fails is a miss, never a failed job
                log.exception("prefix lookup for %s failed", job_id)
                return None, PrefixMatch()
            if snapshot is not None:
                metrics.STATE_BYTES.labels("get").inc(match.size)
                return snapshot, match
            below = match.num_tokens  # that one is gone: a shorter one may not be
        return None, PrefixMatch(shared_tokens=match.shared_tokens)

    def load_handoff(self, job_id: str, key: str, layout: str, size: int, prompt: list[int]) -> StateSnapshot | None:
        """The state prefill left for a job under `key` (leased to it), loaded, which ends the
        lease; None when it is gone, of another layout or not this prompt's: recompute it."""
        if layout != self.layout:
            log.warning("state %s has layout %s, not this engine's %s", key, layout, self.layout)
            self.release(job_id, key)
            return None
        try:
            with job_span("cache.load", job_id, kind=SpanKind.CLIENT, **{"deepmesh.bytes": size}):
                state, _ = self.store.load(key, release=job_id)  # loaded (or gone): the pin is done
            snapshot = self._joined(key, state)
        except Exception:  # a cache that fails means recomputing, never a lost job
            log.exception("loading %s failed", key)
            return None
        if snapshot is None:
            return None
        if snapshot.num_computed != len(prompt) or snapshot.token_ids[: len(prompt)] != prompt:
            log.warning("state %s is not of this job's prompt", key)
            return None
        metrics.STATE_BYTES.labels("get").inc(size)
        return snapshot

    def save(
        self,
        job_id: str,
        tenant: str,
        retention_class: str,
        snapshot: StateSnapshot,
        lease_seconds: float = 0.0,
    ) -> Stored | None:
        """Store a state where a longer prompt that starts with its tokens can resume; with
        lease_seconds, pinned for this job until its hand-over is loaded. None if it failed."""
        holder = job_id if lease_seconds else None
        try:
            tokens, head, rows = snapshot.split()
            state = StateBlobs(head, rows)
            with job_span("cache.put_prefix", job_id, kind=SpanKind.CLIENT, **{"deepmesh.bytes": state.size}):
                stored = self.store.put_prefix(
                    self.namespace(tenant), tokens, state, self.ttl(tenant, retention_class), holder, lease_seconds
                )
        except Exception:  # a cache that fails is a later miss, never a lost job
            log.exception("storing a prefix of %s failed", job_id)
            return None
        metrics.STATE_BYTES.labels("put").inc(state.size)
        return stored

    def _joined(self, key: str, state: StateBlobs | None) -> StateSnapshot | None:
        """The snapshot an entry's bytes hold. Bytes that pass their checksums yet do not make a
        state of this layout (written by something else) are a miss, and the entry is dropped so
        that the next lookup finds the next-best prefix instead."""
        if state is None:
            return None
        try:
            snapshot = StateSnapshot.joined(state.head, state.blocks)
            if snapshot.layout != self.layout:
                raise SnapshotError(f"layout {snapshot.layout}, not this engine's {self.layout}")
        except SnapshotError as err:
            log.warning("cache entry %s unusable, dropped: %s", key, err)
            metrics.CACHE_MISSES.labels("corrupt").inc()
            self.store.delete(key)
            return None
        return snapshot

    def release(self, job_id: str, key: str) -> None:
        """Unpin an entry leased to a job that will not load it."""
        try:
            self.store.release(key, job_id)
        except Exception:  # a lease that cannot be released lapses on its own
            log.exception("releasing %s for %s failed", key, job_id)
