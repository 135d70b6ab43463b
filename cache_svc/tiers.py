"""Where cache blobs live: process memory (T1), a local-disk directory (T2) and a store shared by
all replicas (T3: a POSIX directory, such as a 3FS, NFS or Lustre mount, or a Redis server).

A tier only stores bytes by key and keeps its own least-recently-used order and byte count;
what moves between tiers, and when, is the StateStore's decision (cache_svc/store.py).
"""

from __future__ import annotations

import os
import re
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import redis

KEY = re.compile(r"^(anchor|block|image)-[0-9a-f]{64}$")  # common/prefixes.py, common/images.py


class Tier:
    """Bytes by key, with a capacity (None: unbounded) and least-recently-used order."""

    def __init__(self, name: str, capacity_bytes: int | None, shared: bool = False):
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.shared = shared  # other replicas read and write it too
        self.lru: OrderedDict[str, int] = OrderedDict()  # key -> size, least recently used first
        self.used_bytes = 0

    def read(self, key: str) -> bytes | None:
        data = self._read(key)
        if data is None:
            self._forget(key)
        else:
            self._account(key, len(data))
        return data

    def write(self, key: str, data: bytes) -> None:
        self._write(key, data)
        self._account(key, len(data))

    def remove(self, key: str) -> None:
        self._remove(key)
        self._forget(key)

    def touch(self, key: str) -> None:
        """Mark a blob as just used (it was read from a faster tier)."""
        if key in self.lru:
            self.lru.move_to_end(key)

    def holds(self, key: str) -> bool:
        """Whether this replica knows the tier has it (another replica may have written it, too)."""
        return key in self.lru

    def exists(self, key: str) -> bool:
        """Whether the tier has it, asking the backend."""
        return self._exists(key)

    @property
    def over_capacity(self) -> bool:
        return self.capacity_bytes is not None and self.used_bytes > self.capacity_bytes

    def coldest(self) -> list[str]:
        return list(self.lru)

    def load(self) -> None:
        """Learn what a persistent tier already holds (after a restart), oldest first."""
        for key, size in self._scan():
            self._account(key, size)

    def _account(self, key: str, size: int) -> None:
        self.used_bytes += size - self.lru.pop(key, 0)
        self.lru[key] = size

    def _forget(self, key: str) -> None:
        self.used_bytes -= self.lru.pop(key, 0)

    # what a backend implements
    def _read(self, key: str) -> bytes | None:
        raise NotImplementedError

    def _write(self, key: str, data: bytes) -> None:
        raise NotImplementedError

    def _remove(self, key: str) -> None:
        raise NotImplementedError

    def _exists(self, key: str) -> bool:
        raise NotImplementedError

    def _scan(self) -> Iterator[tuple[str, int]]:
        return iter(())


class MemoryTier(Tier):
    def __init__(self, capacity_bytes: int | None, name: str = "memory"):
        super().__init__(name, capacity_bytes)
        self._blobs: dict[str, bytes] = {}

    def _read(self, key: str) -> bytes | None:
        return self._blobs.get(key)

    def _write(self, key: str, data: bytes) -> None:
        self._blobs[key] = data

    def _remove(self, key: str) -> None:
        self._blobs.pop(key, None)

    def _exists(self, key: str) -> bool:
        return key in self._blobs


class DirectoryTier(Tier):
    """One file per blob, written to a temporary name and renamed, so that a reader (another
    replica on a shared mount, too) never sees half a blob."""

    def __init__(self, directory: str | Path, capacity_bytes: int | None, name: str = "disk", shared: bool = False):
        super().__init__(name, capacity_bytes, shared)
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        if not KEY.match(key):
            raise ValueError(f"not a cache key: {key!r}")
        return self.directory / key

    def _read(self, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None

    def _write(self, key: str, data: bytes) -> None:
        path = self._path(key)
        tmp = path.with_name(f".{key}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)

    def _remove(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def _exists(self, key: str) -> bool:
        return self._path(key).exists()

    def _scan(self) -> Iterator[tuple[str, int]]:
        found = []
        for entry in os.scandir(self.directory):
            if KEY.match(entry.name):
                stat = entry.stat()
                found.append((stat.st_mtime, entry.name, stat.st_size))
        for _, key, size in sorted(found):
            yield key, size


class RedisTier(Tier):
    """Blobs as Redis strings under a key prefix."""

    def __init__(self, url: str, capacity_bytes: int | None, prefix: str = "deepmesh:kv:", name: str = "redis"):
        super().__init__(name, capacity_bytes, shared=True)
        self.client = redis.Redis.from_url(url)
        self.prefix = prefix

    def _read(self, key: str) -> bytes | None:
        return self.client.get(self.prefix + key)

    def _write(self, key: str, data: bytes) -> None:
        self.client.set(self.prefix + key, data)

    def _remove(self, key: str) -> None:
        self.client.delete(self.prefix + key)

    def _exists(self, key: str) -> bool:
        return bool(self.client.exists(self.prefix + key))

    def _scan(self) -> Iterator[tuple[str, int]]:
        for name in self.client.scan_iter(match=self.prefix + "*", count=1000):
            key = name.decode().removeprefix(self.prefix)
            if KEY.match(key):
                yield key, self.client.strlen(name)
