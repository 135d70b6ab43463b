"""State blobs by key in two tiers: process memory (bounded, LRU) and a local-disk directory.

A put returns a handle with the blob's size, checksum and lease expiry. Memory overflow
demotes the least recently used blobs to disk rather than dropping them; a get checks the
checksum, and a corrupt or missing blob is a miss (the caller recomputes), never wrong data.
Leases keep in-flight state alive for a bounded time: a lapsed lease frees the blob.
Blobs stored as prefix anchors (put_prefix) are also indexed, so that a prompt can find the
longest stored state it starts with (cache_svc/prefix.py); they leave the index with the blob.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cache_svc.prefix import PrefixIndex, anchor_key


@dataclass
class _Entry:
    checksum: str
    lease_expires_at: float
    data: bytes | None  # None once demoted to disk


def checksum_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class StateStore:
    def __init__(
        self,
        directory: str | Path,
        memory_bytes: int = 1 << 30,
        clock: Callable[[], float] = time.time,
    ):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.memory_bytes = memory_bytes
        self.clock = clock
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._in_memory = 0
        self.stats = {"hits": 0, "misses": 0, "corrupt": 0, "demotions": 0, "expired": 0}
        self.prefixes = PrefixIndex()

    def put(self, key: str, data: bytes, lease_seconds: float) -> tuple[str, float]:
        """Store a blob; returns (checksum, lease expiry)."""
        _check_key(key)
        entry = _Entry(checksum_of(data), self.clock() + lease_seconds, data)
        with self._lock:
            self._drop(key)
            self._entries[key] = entry
            self._in_memory += len(data)
            self._demote_overflow()
        return entry.checksum, entry.lease_expires_at

    def put_prefix(self, namespace: str, token_ids: Sequence[int], data: bytes, ttl_seconds: float) -> str:
        """Store the state after exactly `token_ids` as an anchor that longer prompts can start from."""
        key = anchor_key(token_ids, namespace)
        self.put(key, data, ttl_seconds)
        self.index_prefix(namespace, token_ids, key)
        return key

    def index_prefix(self, namespace: str, token_ids: Sequence[int], key: str) -> None:
        if key != anchor_key(token_ids, namespace):
            raise ValueError("the key is not these tokens' anchor key")
        with self._lock:
            if key not in self._entries:
                raise KeyError(f"no state {key!r} to index")
            self.prefixes.add(token_ids, namespace)

    def longest_prefix(self, namespace: str, token_ids: Sequence[int], below: int) -> tuple[str, int] | None:
        """(key, length) of the longest stored anchor shorter than `below` that starts `token_ids`."""
        with self._lock:
            self._expire()
        return self.prefixes.longest(token_ids, namespace, below)

    def get(self, key: str) -> bytes | None:
        _check_key(key)
        with self._lock:
            self._expire()
            entry = self._entries.get(key)
            if entry is None:
                self.stats["misses"] += 1
                return None
            self._entries.move_to_end(key)
            data = entry.data
        if data is None:
            try:
                data = self._path(key).read_bytes()
            except FileNotFoundError:
                data = b""
        if checksum_of(data) != entry.checksum:
            with self._lock:
                self.stats["corrupt"] += 1
                self._drop(key)
            return None
        with self._lock:
            self.stats["hits"] += 1
        return data

    def delete(self, key: str) -> None:
        _check_key(key)
        with self._lock:
            self._drop(key)

    def renew(self, key: str, lease_seconds: float) -> float | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            entry.lease_expires_at = self.clock() + lease_seconds
            return entry.lease_expires_at

    def expires_at(self, key: str) -> float | None:
        """When a blob's lease (or a prefix's retention) lapses; None if there is no such blob."""
        with self._lock:
            entry = self._entries.get(key)
            return None if entry is None else entry.lease_expires_at

    def sweep(self) -> int:
        """Free blobs whose lease has lapsed; returns how many."""
        with self._lock:
            return self._expire()

    def __len__(self) -> int:
        return len(self._entries)

    def _expire(self) -> int:
        now = self.clock()
        lapsed = [k for k, e in self._entries.items() if e.lease_expires_at <= now]
        for key in lapsed:
            self._drop(key)
        self.stats["expired"] += len(lapsed)
        return len(lapsed)

    def _demote_overflow(self) -> None:
        for key, entry in self._entries.items():
            if self._in_memory <= self.memory_bytes:
                break
            if entry.data is None:
                continue
            path = self._path(key)
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(entry.data)
            os.replace(tmp, path)  # readers never see a half-written blob
            self._in_memory -= len(entry.data)
            entry.data = None
            self.stats["demotions"] += 1

    def _drop(self, key: str) -> None:
        self.prefixes.discard(key)
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        if entry.data is not None:
            self._in_memory -= len(entry.data)
        else:
            self._path(key).unlink(missing_ok=True)

    def _path(self, key: str) -> Path:
        return self.directory / f"{hashlib.sha256(key.encode()).hexdigest()}.blob"


def _check_key(key: str) -> None:
    if not key or len(key) > 512:
        raise ValueError("a key is 1 to 512 characters")
