"""The minimal state store: tiers, checksums, leases (with a controllable clock)."""

from __future__ import annotations

import pytest

from cache_svc.store import StateStore, checksum_of


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_put_get_delete(tmp_path, clock):
    store = StateStore(tmp_path, clock=clock)
    checksum, expires = store.put("job-1/prefill", b"state", lease_seconds=60)
    assert checksum == checksum_of(b"state") and expires == 1060.0
    assert store.get("job-1/prefill") == b"state"
    store.delete("job-1/prefill")
    assert store.get("job-1/prefill") is None
    assert store.stats["hits"] == 1 and store.stats["misses"] == 1


def test_memory_overflow_demotes_to_disk_instead_of_dropping(tmp_path, clock):
    store = StateStore(tmp_path, memory_bytes=10, clock=clock)
    store.put("a", b"aaaaaa", 60)
    store.put("b", b"bbbbbb", 60)  # 12 bytes > 10: the least recently used ("a") goes to disk
    assert store.stats["demotions"] == 1
    assert len(list(tmp_path.glob("*.blob"))) == 1
    assert store.get("a") == b"aaaaaa" and store.get("b") == b"bbbbbb"
    store.delete("a")
    assert not list(tmp_path.glob("*.blob"))


def test_a_corrupt_blob_is_a_miss_and_is_removed(tmp_path, clock):
    store = StateStore(tmp_path, memory_bytes=0, clock=clock)  # everything on disk
    store.put("k", b"good bytes", 60)
    (blob,) = tmp_path.glob("*.blob")
    blob.write_bytes(b"bad bytes!")
    assert store.get("k") is None
    assert store.stats["corrupt"] == 1 and len(store) == 0 and not blob.exists()


def test_leases_lapse_and_renew(tmp_path, clock):
    store = StateStore(tmp_path, clock=clock)
    store.put("short", b"x", lease_seconds=10)
    store.put("long", b"y", lease_seconds=100)
    clock.now += 50
    assert store.renew("long", 100) == 1150.0
    assert store.get("short") is None  # lapsed
    assert store.sweep() == 0 and len(store) == 1
    clock.now += 200
    assert store.sweep() == 1 and store.get("long") is None


def test_keys_are_validated(tmp_path, clock):
    store = StateStore(tmp_path, clock=clock)
    with pytest.raises(ValueError):
        store.put("", b"x", 1)
