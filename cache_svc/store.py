"""The KV cache: prefix states stored once per block across tiers, found by the longest prefix.

An entry is the state after an exact prefix of tokens (an *anchor*): the end of a request's
input, the end of its output, or a block boundary inside a long input. The engine gives it as
bytes (StateBlobs): one blob per full 128-token block, each stored once keyed by the hash
chain up to it (so conversations with a common start share them), and a *head* blob with the
rest (the window, the partial last block). The store never looks inside them: it keeps bytes
and metadata, and the engine side (engine/prefix_connector.py) splits and joins its state.
Metadata lives in the catalog (SQL); bytes live in tiers, fastest first:

    T1 memory (bytes capacity, LRU) -> T2 local disk -> T3 shared (directory or Redis)

Writes go to T1 and reach the lower tiers by write-behind (`flush`); a hit in a lower tier is
promoted back to T1. A full tier demotes its least recently used blobs to the next one (making
sure they are there first); only the last tier drops them (an eviction), or expiry. Every
blob carries a sha256; a blob that fails it is removed with its entry and is a miss, so the
caller recomputes: never wrong state. Leases pin an entry (and its blocks) while a hand-over
is in flight: pinned entries are not evicted or expired until the lease is released or lapses.
"""

from __future__ import annotations

import logging
import re
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from cache_svc.catalog import Catalog, Record
from cache_svc.tiers import DirectoryTier, MemoryTier, RedisTier, Tier
from cache_svc.wire import checksum_of
from common import metrics
from common.api import TENANT_PATTERN
from common.blocks import BLOCK_SIZE
from common.cache_entries import PrefixMatch, StateBlobs, Stored
from common.images import image_key
from common.moving_average import MovingAverage
from common.prefixes import anchor_key, block_key, chain
from common.settings import Settings

log = logging.getLogger(__name__)

# Assumed read speeds (bytes/s) until a tier has been measured, for load-or-recompute.
ASSUMED_READ_SPEED = {"memory": 5e9, "disk": 1e9}
DEFAULT_READ_SPEED = 2e8


class InvalidEntry(ValueError):
    """What no engine could have sent: refused before it is stored for others to load."""


class StateStore:
    def __init__(
        self, catalog: Catalog, tiers: list[Tier], clock: Callable[[], float] = time.time, replica: str = "local"
    ):
        """`replica`: this cache replica's name, the same across its restarts (the catalog records
        which replica wrote each entry: see reconcile)."""
        if not tiers:
            raise ValueError("a store needs at least one tier")
        self.catalog = catalog
        self.tiers = tiers
        self.clock = clock
        self.replica = replica
        self._lock = threading.RLock()
        self._dirty: dict[str, None] = {}  # written to T1, not yet to the tiers below (ordered set)
        # each tier's read speed in bytes per second
        self.speeds = {t.name: MovingAverage(0.2, ASSUMED_READ_SPEED.get(t.name, DEFAULT_READ_SPEED)) for t in tiers}
        for tier in tiers:
            tier.load()
            metrics.CACHE_TIER_BYTES.labels(tier.name).set_function(lambda t=tier: t.used_bytes)
            metrics.CACHE_TIER_ENTRIES.labels(tier.name).set_function(lambda t=tier: len(t.lru))
        dropped = self.reconcile()
        if dropped:
            log.warning("cache: %d entries the catalog listed died with the last process; forgotten", dropped)

    @classmethod
    def from_settings(cls, settings: Settings, clock: Callable[[], float] = time.time) -> StateStore:
        """T1 memory, T2 the local directory, and T3 a shared directory or Redis server if one is set."""
        tiers: list[Tier] = [
            MemoryTier(settings.cache_memory_bytes),
            DirectoryTier(settings.cache_dir, settings.cache_disk_bytes or None),
        ]
        if settings.cache_shared_dir:
            tiers.append(DirectoryTier(settings.cache_shared_dir, settings.cache_shared_bytes or None, "shared", True))
        elif settings.cache_shared_redis_url:
            tiers.append(RedisTier(settings.cache_shared_redis_url, settings.cache_shared_bytes or None))
        replica = settings.cache_replica or f"{socket.gethostname()}:{Path(settings.cache_dir).resolve()}"
        return cls(Catalog(settings.database_url), tiers, clock, replica)

    # -- entries ----------------------------------------------------------------------------

    def put_prefix(
        self,
        namespace: str,
        token_ids: Sequence[int],
        state: StateBlobs,
        ttl_seconds: float,
        lease_holder: str | None = None,
        lease_seconds: float = 0.0,
    ) -> Stored:
        """Store the state after exactly `token_ids` as their anchor, in `namespace`
        (layout/tenant). With a lease holder it is pinned for lease_seconds (a hand-over)."""
        tenant = _check(namespace, token_ids, state)
        tokens = list(token_ids)
        links = chain(tokens, namespace)
        now = self.clock()
        blobs = {anchor_key(tokens, namespace, links): state.head}
        blobs |= {block_key(links[i + 1]): block for i, block in enumerate(state.blocks)}
        keys = list(blobs)
        entries = [
            Record(
                key=key,
                kind="anchor" if i == 0 else "block",
                tenant=tenant,
                link=links[len(tokens) // BLOCK_SIZE].hex() if i == 0 else key.removeprefix("block-"),
                num_tokens=len(tokens) if i == 0 else i * BLOCK_SIZE,
                size=len(blobs[key]),
                checksum=checksum_of(blobs[key]),
                blocks=keys[1:] if i == 0 else [],
                tiers="",
                leases={lease_holder: now + lease_seconds} if lease_holder else {},
                created_at=now,
                expires_at=now + ttl_seconds,
                hits=0,
                writer=self.replica,
            )
            for i, key in enumerate(keys)
        ]
        with self._lock:
            new = self.catalog.add(entries[0], entries[1:])
            for key in keys:
                if key in new:  # a known entry keeps the bytes it has
                    self.tiers[0].write(key, blobs[key])
                    self._dirty[key] = None
            self._make_room(0)
        size, written = sum(map(len, blobs.values())), sum(len(blobs[k]) for k in new)
        return Stored(keys[0], entries[0].checksum, len(tokens), now + ttl_seconds, size, written)

    def put_image(self, namespace: str, digest: str, rows: bytes, num_tokens: int, ttl_seconds: float) -> Stored:
        """Store an image's encoder rows (the span of `num_tokens` prompt positions it fills) under
        its content `digest`, in `namespace` (the encoder's weights and the tenant); loaded by
        its key (common.images.image_key) like an anchor with no blocks."""
        layout, _, tenant = namespace.partition("/")
        if not layout or not TENANT_PATTERN.fullmatch(tenant):
            raise InvalidEntry(f"namespace {namespace!r} is not <encoder layout>/<tenant id>")
        if not IMAGE_DIGEST.fullmatch(digest) or num_tokens < 1 or not rows:
            raise InvalidEntry("an image entry is rows for one or more positions, under a sha256 hex digest")
        now, key = self.clock(), image_key(namespace, digest)
        entry = Record(
            key=key,
            kind="image",
            tenant=tenant,
            link="",
            num_tokens=num_tokens,
            size=len(rows),
            checksum=checksum_of(rows),
            blocks=[],
            tiers="",
            leases={},
            created_at=now,
            expires_at=now + ttl_seconds,
            hits=0,
            writer=self.replica,
        )
        with self._lock:
            if key in self.catalog.add(entry, []):
                self.tiers[0].write(key, rows)
                self._dirty[key] = None
            self._make_room(0)
        return Stored(key, entry.checksum, num_tokens, now + ttl_seconds, len(rows), len(rows))

    def lookup(self, namespace: str, token_ids: Sequence[int], below: int) -> PrefixMatch:
        """The longest live anchor shorter than `below` that starts `token_ids`."""
        longest_allowed = min(below - 1, len(token_ids))
        tokens = list(token_ids[:longest_allowed])
        links = chain(tokens, namespace)
        now = self.clock()
        match = PrefixMatch()
        candidates = self.catalog.anchors_under([link.hex() for link in links], longest_allowed)
        found: Record | None = None
        for n in sorted(set(candidates.values()), reverse=True):
            key = anchor_key(tokens[:n], namespace, links)
            if key not in candidates:  # another prompt's anchor of this length under the same link
                continue
            entry = self.catalog.get([key]).get(key)
            if entry is None:  # removed since
                continue
            if entry.expired(now):
                match.miss_reason = match.miss_reason or "expired"
                continue
            found = entry
            break
        block_keys = [block_key(link) for link in links[1:]]
        live = self.catalog.live(block_keys, now) if block_keys else set()
        shared_blocks = 0
        while shared_blocks < len(block_keys) and block_keys[shared_blocks] in live:
            shared_blocks += 1
        match.shared_tokens = shared_blocks * BLOCK_SIZE
        if found is None:
            short = len(token_ids) < BLOCK_SIZE
            match.miss_reason = match.miss_reason or ("shorter_than_block" if short else "no_prefix")
            metrics.CACHE_MISSES.labels(match.miss_reason).inc()
            return match
        match.key, match.num_tokens, match.miss_reason = found.key, found.num_tokens, None
        entries = [found, *self.catalog.get(found.blocks).values()]
        match.size = sum(e.size for e in entries)
        match.load_seconds = sum(e.size / self._speed_of(e.key) for e in entries)
        return match

    def load(
        self, key: str, renew_seconds: float = 0.0, release: str | None = None
    ) -> tuple[StateBlobs | None, str | None]:
        """An anchor's bytes, or (None, reason) for a miss. A hit counts in the catalog and
        keeps the entry for at least renew_seconds more (its retention class's TTL). `release`
        names a lease holder whose pin the load ends (a hand-over: its loss is "lease_lost")."""
        state, reason = self._load(key, renew_seconds)
        if release is not None:
            self.catalog.lease(key, release, None)
            if reason in ("evicted", "expired"):
                reason = "lease_lost"
        if reason is not None:
            metrics.CACHE_MISSES.labels(reason).inc()
        return state, reason

    def _load(self, key: str, renew_seconds: float) -> tuple[StateBlobs | None, str | None]:
        now = self.clock()
        anchor = self.catalog.get([key]).get(key)
        if anchor is None:
            return None, "evicted"
        if anchor.expired(now):
            return None, "expired"
        entries = self.catalog.get(anchor.blocks)
        if len(entries) < len(anchor.blocks):
            self._remove([anchor.key])
            return None, "evicted"
        blobs = []
        for entry in [anchor, *(entries[k] for k in anchor.blocks)]:
            data, reason = self._read(entry)
            if data is None:
                if reason == "corrupt" or self._lost(entry):
                    # the bad or lost blob too: else a block stays known, and is never written again
                    self._remove(list({anchor.key, entry.key}))
                return None, reason
            blobs.append(data)
        self.catalog.hit(key, now, now + renew_seconds)
        return StateBlobs(blobs[0], blobs[1:]), None

    def renew(self, key: str, ttl_seconds: float) -> float | None:
        return self.catalog.renew(key, self.clock() + ttl_seconds)

    def lease(self, key: str, holder: str, seconds: float) -> bool:
        return self.catalog.lease(key, holder, self.clock() + seconds)

    def release(self, key: str, holder: str) -> bool:
        return self.catalog.lease(key, holder, None)

    def delete(self, key: str) -> None:
        """Forget an anchor; its blocks stay for the other anchors that use them (or until expiry)."""
        self._remove([key])

    def expires_at(self, key: str) -> float | None:
        entry = self.catalog.get([key]).get(key)
        return None if entry is None else entry.expires_at

    def __len__(self) -> int:
        return sum(part["entries"] for part in self.catalog.summary().values())

    # -- maintenance (Celery tasks, or a thread in the embedded mode: cache_svc/maintenance.py) --

    def flush(self) -> int:
        """Write-behind: copy newly written blobs down to every lower tier."""
        with self._lock:
            keys, self._dirty = list(self._dirty), {}
        flushed = 0
        for key in keys:
            with self._lock:
                holders = [t for t in self.tiers if t.holds(key)]
                data = holders[0].read(key) if holders else None
                if data is None:  # removed meanwhile
                    continue
                for tier in self.tiers[self.tiers.index(holders[0]) + 1 :]:
                    if not tier.holds(key):
                        tier.write(key, data)
                self.catalog.set_tiers(key, [t.name for t in self.tiers if t.holds(key)])
            flushed += 1
        return flushed

    def rebalance(self) -> tuple[int, int]:
        """Bring every tier within its capacity: demote downwards, evict from the last tier.
        Returns (demoted, evicted)."""
        demoted = evicted = 0
        with self._lock:
            for level in range(len(self.tiers)):
                d, e = self._make_room(level)
                demoted, evicted = demoted + d, evicted + e
        return demoted, evicted

    def sweep(self) -> int:
        """Remove expired, unpinned entries from every tier; returns how many."""
        now = self.clock()
        expired = [e.key for e in self.catalog.expired(now) if e.expired(now)]
        self._remove(expired)
        metrics.CACHE_EXPIRED.inc(len(expired))
        return len(expired)

    def reconcile(self) -> int:
        """At start: forget the entries this replica wrote that no tier holds any more (a process
        killed before write-behind took them along), and the anchors that needed them. Else the
        catalog lists them, a lookup finds them, and their load fails: a miss instead of the
        next-best prefix that did survive. Returns how many entries were dropped."""
        shared = [t for t in self.tiers if t.shared]
        gone = [
            key
            for key in self.catalog.written_by(self.replica)
            if not any(t.holds(key) for t in self.tiers) and not any(t.exists(key) for t in shared)
        ]
        self.catalog.remove(gone)
        broken = self.catalog.anchors_missing_blocks() if gone else []
        self._remove(broken)
        return len(gone) + len(broken)

    def collect_orphans(self) -> int:
        """Remove blobs no catalog entry names (a crash between a write and its record, or an
        entry removed by another replica), entries whose blobs are gone from the shared tier,
        and anchors that lost a block (evicted); returns how many."""
        locations = self.catalog.locations()
        removed = 0
        with self._lock:
            held: set[str] = set()
            for tier in self.tiers:
                for key in list(tier.lru):
                    if key not in locations and key not in self._dirty:
                        tier.remove(key)
                        removed += 1
                    else:
                        held.add(key)
        # With only local tiers, an entry this replica does not hold may be in another's memory:
        # only one that had reached the shared tier and is no longer there is known to be lost.
        shared = [t for t in self.tiers if t.shared]
        lost = [
            key
            for key, tiers in locations.items()
            if key not in held and any(t.name in tiers for t in shared) and not any(t.exists(key) for t in shared)
        ]
        broken = self.catalog.anchors_missing_blocks()
        self.catalog.remove(lost)
        self._remove(broken)
        return removed + len(lost) + len(broken)

    def stats(self) -> dict:
        """What `deepmesh cache stats` and /v1/stats show."""
        return {
            "catalog": self.catalog.summary(),
            "tiers": [
                {
                    "name": t.name,
                    "shared": t.shared,
                    "entries": len(t.lru),
                    "bytes": t.used_bytes,
                    "capacity_bytes": t.capacity_bytes,
                    "read_bytes_per_second": round(self.speeds[t.name].value),
                }
                for t in self.tiers
            ],
            "pending_write_behind": len(self._dirty),
        }

    def close(self) -> None:
        self.catalog.close()

    # -- internals --------------------------------------------------------------------------

    def _read(self, entry: Record) -> tuple[bytes | None, str | None]:
        """A blob from the fastest tier holding it, checked, and promoted to T1 on a lower-tier hit."""
        for level, tier in enumerate(self.tiers):
            with self._lock:
                if not (tier.holds(entry.key) or tier.shared):
                    continue
                started = time.perf_counter()
                data = tier.read(entry.key)
            if data is None:
                continue
            seconds = time.perf_counter() - started
            metrics.CACHE_LOAD_SECONDS.labels(tier.name).observe(seconds)
            if len(data) >= 4096 and seconds > 0:  # tiny reads measure overheads, not speed
                self.speeds[tier.name].observe(len(data) / seconds)
            if checksum_of(data) != entry.checksum:
                log.warning("cache blob %s in %s fails its checksum: removed", entry.key, tier.name)
                return None, "corrupt"
            with self._lock:
                for other in self.tiers:  # recency is global: a hot entry is the last to go anywhere
                    other.touch(entry.key)
            if level > 0:
                with self._lock:
                    self.tiers[0].write(entry.key, data)
                    metrics.CACHE_PROMOTIONS.labels(tier.name).inc()
                    self._make_room(0)
            return data, None
        return None, "evicted"

    def _lost(self, entry: Record) -> bool:
        """Whether a blob this replica cannot find is gone for good. With a shared tier, only if it
        had reached that tier: until its write-behind, it may be in the writer's own memory."""
        shared = [t.name for t in self.tiers if t.shared]
        return not shared or any(name in shared for name in entry.tier_names)

    def _speed_of(self, key: str) -> float:
        for tier in self.tiers:
            if tier.holds(key):
                return self.speeds[tier.name].value
        return self.speeds[self.tiers[-1].name].value

    def _make_room(self, level: int) -> tuple[int, int]:
        """Demote T[level]'s least recently used blobs until it fits (or drop them, from the last tier)."""
        tier = self.tiers[level]
        demoted = evicted = 0
        if not tier.over_capacity:
            return 0, 0
        last = level == len(self.tiers) - 1
        coldest = tier.coldest()
        for start in range(0, len(coldest), 256):
            if not tier.over_capacity:
                break
            batch = coldest[start : start + 256]
            now = self.clock()
            pinned = {k for k, e in self.catalog.get(batch).items() if e.pinned(now)} if last else set()
            for key in batch:
                if not tier.over_capacity:
                    break
                if last:
                    if key not in pinned:  # a pinned entry waits for its lease
                        self._remove([key])  # an anchor that needs it is a miss when next loaded
                        metrics.CACHE_EVICTIONS.labels(tier.name).inc()
                        evicted += 1
                    continue
                below = self.tiers[level + 1]
                if not below.holds(key):
                    data = tier.read(key)
                    if data is not None:
                        below.write(key, data)
                tier.remove(key)
                metrics.CACHE_DEMOTIONS.labels(tier.name).inc()
                demoted += 1
        if not last and self.tiers[level + 1].over_capacity:
            d, e = self._make_room(level + 1)
            demoted, evicted = demoted + d, evicted + e
        return demoted, evicted

    def _remove(self, keys: list[str]) -> None:
        """Drop blobs from every tier and their entries from the catalog."""
        with self._lock:
            for key in keys:
                for tier in self.tiers:
                    tier.remove(key)
                self._dirty.pop(key, None)
            self.catalog.remove(keys)


IMAGE_DIGEST = re.compile(r"[0-9a-f]{64}")


def _check(namespace: str, token_ids: Sequence[int], state: StateBlobs) -> str:
    """Refuse what no engine could have sent, before it is stored for others to load; returns
    the namespace's tenant."""
    layout, _, tenant = namespace.partition("/")
    if not layout or not TENANT_PATTERN.fullmatch(tenant):
        raise InvalidEntry(f"namespace {namespace!r} is not <state layout>/<tenant id>")
    if not token_ids or not all(isinstance(t, int) and 0 <= t < 1 << 32 for t in token_ids):
        raise InvalidEntry("an entry is the state after one or more token ids")
    full = len(token_ids) // BLOCK_SIZE
    if len(state.blocks) != full:
        raise InvalidEntry(f"{len(state.blocks)} block blobs for {len(token_ids)} tokens ({full} full blocks)")
    if len({len(block) for block in state.blocks}) > 1:
        raise InvalidEntry("block blobs of different sizes")
    return tenant
