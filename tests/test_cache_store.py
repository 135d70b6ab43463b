"""The minimal state store: tiers, checksums, leases (with a controllable clock)."""

from __future__ import annotations

import pytest

from cache_svc.prefix import anchor_key
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


# -- prefix anchors -----------------------------------------------------------------------------

NS = "layout-v1/tenant-a"


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_the_longest_stored_prefix_shorter_than_the_prompt_is_found(tmp_path, clock):
    store = StateStore(tmp_path, clock=clock)
    prompt = tokens(400)
    for length in (5, 128, 200, 256, 399, 400):  # inside a block, on block edges, the whole prompt
        store.put_prefix(NS, prompt[:length], f"state-{length}".encode(), ttl_seconds=60)
    key, length = store.longest_prefix(NS, prompt, below=len(prompt))
    assert length == 399 and store.get(key) == b"state-399"
    assert store.longest_prefix(NS, prompt, below=256)[1] == 200
    assert store.longest_prefix(NS, prompt[:130], below=130)[1] == 128
    assert store.longest_prefix(NS, prompt, below=5) is None
    # one token different, in the first block: none of them is a prefix any more
    assert store.longest_prefix(NS, [7, *prompt[1:]], below=400) is None
    # different tokens after 256: the anchors up to 256 still are
    assert store.longest_prefix(NS, prompt[:300] + tokens(100, 9000), below=400)[1] == 256


def test_prefixes_belong_to_their_namespace(tmp_path, clock):
    store = StateStore(tmp_path, clock=clock)
    prompt = tokens(300)
    store.put_prefix(NS, prompt[:200], b"a's", ttl_seconds=60)
    assert store.longest_prefix("layout-v1/tenant-b", prompt, below=300) is None  # another tenant
    assert store.longest_prefix("layout-v2/tenant-a", prompt, below=300) is None  # another state format
    assert store.longest_prefix(NS, prompt, below=300)[1] == 200


def test_a_prefix_leaves_the_index_with_its_state(tmp_path, clock):
    store = StateStore(tmp_path, memory_bytes=0, clock=clock)
    prompt = tokens(300)
    kept = store.put_prefix(NS, prompt[:100], b"kept", ttl_seconds=1000)
    deleted = store.put_prefix(NS, prompt[:150], b"deleted", ttl_seconds=1000)
    expiring = store.put_prefix(NS, prompt[:200], b"expiring", ttl_seconds=10)
    corrupt = store.put_prefix(NS, prompt[:250], b"corrupt", ttl_seconds=1000)
    store._path(corrupt).write_bytes(b"garbage")
    assert store.longest_prefix(NS, prompt, below=300) == (corrupt, 250)
    assert store.get(corrupt) is None  # detected: gone from the store and the index
    clock.now += 20  # the 200-token anchor expires
    store.delete(deleted)
    assert store.longest_prefix(NS, prompt, below=300) == (kept, 100)
    assert len(store.prefixes) == 1 and expiring not in store.prefixes


def test_indexing_checks_the_key_and_the_state(tmp_path, clock):
    store = StateStore(tmp_path, clock=clock)
    with pytest.raises(KeyError):  # the right key, but no state stored under it
        store.index_prefix(NS, tokens(10), anchor_key(tokens(10), NS))
    key = store.put_prefix(NS, tokens(10), b"x", 60)
    with pytest.raises(ValueError, match="not these tokens"):
        store.index_prefix(NS, tokens(11), key)


def test_retention_classes_and_tenant_overrides():
    from cache_svc.retention import Retention, request_error

    retention = Retention(overrides={"acme": {"agent": 60}})
    assert retention.ttl("anyone", "agent") == 3 * 86400 and retention.ttl("anyone", "chat") == 7 * 86400
    assert retention.ttl("acme", "agent") == 60 and retention.ttl("acme", "chat") == 7 * 86400
    with pytest.raises(ValueError, match="unknown retention classes"):
        Retention(overrides={"acme": {"forever": 1}})
    with pytest.raises(ValueError, match="positive"):
        Retention({"agent": 0, "chat": 1})
    assert request_error("team-7.prod", "agent") is None and request_error(None, None) is None
    assert "X-DeepMesh-Tenant" in request_error("a b", None)
    assert "X-DeepMesh-Retention" in request_error(None, "week")
