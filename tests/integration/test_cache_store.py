"""The KV cache store: entries stored once per block, tiers, checksums, retention and leases.

Real tiers (a memory dict, real directories, a real Redis server) and a real catalog (the
stack's PostgreSQL under `make test`), with a controllable clock. The store keeps bytes: the
states here are synthetic bytes, and the store must return exactly what it was given. (How
the engine's state becomes these bytes: tests/unit/test_state_transfer.py.)
"""

from __future__ import annotations

import uuid

import pytest

from cache_svc.catalog import Catalog
from cache_svc.store import InvalidEntry, StateStore
from cache_svc.tiers import DirectoryTier, MemoryTier, RedisTier
from common.cache_entries import StateBlobs
from common.images import image_key
from common.prefixes import anchor_key, block_key, chain
from tests.support.infra import fresh_database, require_service
from tests.support.synthetic_states import LAYOUT, NS, state_of, tokens


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def database(tmp_path) -> str:
    return fresh_database(tmp_path)


def make_store(tmp_path, database, clock, memory=None, disk=None, shared=None, name="a") -> StateStore:
    tiers = [MemoryTier(memory), DirectoryTier(tmp_path / f"{name}-disk", disk)]
    if shared is not None:
        tiers.append(shared)
    return StateStore(Catalog(database), tiers, clock, replica=name)


def put(store: StateStore, token_ids: list[int], ttl: float = 600, namespace: str = NS, **lease) -> str:
    return store.put_prefix(namespace, token_ids, state_of(token_ids), ttl, **lease).key


def same(loaded: StateBlobs | None, token_ids: list[int]) -> bool:
    return loaded == state_of(token_ids)


def test_an_entry_comes_back_exactly_and_shares_its_blocks(tmp_path, database, clock):
    store = make_store(tmp_path, database, clock)
    prompt = tokens(700)
    first = store.put_prefix(NS, prompt[:300], state_of(prompt[:300]), 600)
    second = store.put_prefix(NS, prompt, state_of(prompt), 600)
    assert first.key == anchor_key(prompt[:300], NS) and first.num_tokens == 300
    loaded, reason = store.load(second.key)
    assert reason is None and same(loaded, prompt)
    assert same(store.load(first.key)[0], prompt[:300])
    catalog = store.catalog.summary()
    assert catalog["anchor"]["entries"] == 2 and catalog["block"]["entries"] == 5  # 2 + 3 new, not 2 + 5
    # the second wrote only its head and its 3 new blocks: not the 2 blocks the first stored
    head = next(e for e in store.catalog.get([second.key]).values())
    assert second.new_bytes == head.size + 3 * (catalog["block"]["bytes"] // 5)
    assert store.catalog.get([second.key])[second.key].blocks == [block_key(link) for link in chain(prompt, NS)[1:]]


def test_the_longest_live_prefix_and_the_shared_blocks_beyond_it(tmp_path, database, clock):
    store = make_store(tmp_path, database, clock)
    prompt = tokens(400)
    for length in (5, 128, 200, 256, 399):  # inside a block, on block edges, all but the last token
        put(store, prompt[:length])
    match = store.lookup(NS, prompt, below=len(prompt))
    assert (match.num_tokens, match.miss_reason) == (399, None)
    assert store.lookup(NS, prompt, below=256).num_tokens == 200
    assert store.lookup(NS, prompt[:130], below=130).num_tokens == 128
    assert store.lookup(NS, prompt, below=5).key is None
    assert store.lookup(NS, [7, *prompt[1:]], below=400).miss_reason == "no_prefix"  # differs in block 1
    assert store.lookup(NS, tokens(50, 5000), below=50).miss_reason == "shorter_than_block"
    diverging = prompt[:300] + tokens(100, 9000)
    match = store.lookup(NS, diverging, below=400)
    assert match.num_tokens == 256 and match.shared_tokens == 256
    # a prompt that shares two blocks with a stored one, but no anchor: where they diverge
    other = make_store(tmp_path, fresh_database(tmp_path), clock, name="b")
    put(other, tokens(300))
    match = other.lookup(NS, [*tokens(260), 1, 2, 3], below=263)
    assert match.key is None and match.shared_tokens == 256


def test_tenants_and_state_formats_never_share(tmp_path, database, clock):
    store = make_store(tmp_path, database, clock)
    prompt = tokens(300)
    put(store, prompt[:200])
    assert store.lookup(f"{LAYOUT}/tenant-b", prompt, below=300).key is None
    assert store.lookup(f"{LAYOUT}/tenant-b", prompt, below=300).shared_tokens == 0  # not even its blocks
    assert store.lookup("v2-other/tenant-a", prompt, below=300).key is None
    assert store.lookup(NS, prompt, below=300).num_tokens == 200


@pytest.mark.parametrize(
    "namespace, token_ids, state, problem",
    [
        (f"{LAYOUT}/not a tenant", tokens(300), state_of(tokens(300)), "tenant"),
        ("tenant-a", tokens(300), state_of(tokens(300)), "tenant"),
        (NS, [], state_of([]), "one or more token ids"),
        (NS, [1, -2], state_of([1, 2]), "one or more token ids"),
        (NS, tokens(300), StateBlobs(b"head", state_of(tokens(300)).blocks[:1]), "1 block blobs for 300 tokens"),
        (NS, tokens(300), StateBlobs(b"head", [b"a" * 10, b"b" * 11]), "different sizes"),
    ],
)
def test_what_no_engine_could_send_is_refused(tmp_path, database, clock, namespace, token_ids, state, problem):
    store = make_store(tmp_path, database, clock)
    with pytest.raises(InvalidEntry, match=problem):
        store.put_prefix(namespace, token_ids, state, 60)
    assert len(store) == 0


def test_a_corrupt_blob_is_a_miss_and_its_entry_is_removed(tmp_path, database, clock):
    store = make_store(tmp_path, database, clock, memory=0)  # everything demoted to disk at once
    key = put(store, tokens(300))
    block = block_key(chain(tokens(300), NS)[2])
    (tmp_path / "a-disk" / block).write_bytes(b"garbage")
    assert store.load(key) == (None, "corrupt")
    assert store.lookup(NS, [*tokens(300), 1], below=301).key is None
    # the bad block went too: storing the prefix again writes it anew, and it loads
    assert not (tmp_path / "a-disk" / block).exists()
    key = put(store, tokens(300))
    assert same(store.load(key)[0], tokens(300))


def test_ttl_expiry_renewal_on_hit_and_the_sweep(tmp_path, database, clock):
    store = make_store(tmp_path, database, clock)
    short, long = put(store, tokens(200), ttl=10), put(store, tokens(300), ttl=100)
    store.flush()
    clock.now += 50
    assert store.load(short) == (None, "expired")
    assert store.lookup(NS, tokens(250), below=250).miss_reason == "expired"
    assert store.load(long, renew_seconds=500)[0] is not None  # a hit keeps it 500 s more
    assert store.expires_at(long) == clock.now + 500
    assert store.sweep() == 1  # the short one's head: its block is the long one's too, and lives on
    clock.now += 501
    assert store.sweep() == 3  # the long one's head and both blocks
    assert len(store) == 0
    assert all(not tier.lru for tier in store.tiers) and not list((tmp_path / "a-disk").iterdir())


def test_a_lease_pins_an_entry_until_released_or_lapsed(tmp_path, database, clock):
    store = make_store(tmp_path, database, clock)
    key = put(store, tokens(300), ttl=10, lease_holder="job-1", lease_seconds=60)
    clock.now += 30  # past its TTL, inside its lease
    assert store.sweep() == 0 and store.load(key)[0] is not None
    clock.now += 31  # the lease lapsed too
    assert store.sweep() == 3
    key = put(store, tokens(300), ttl=10, lease_holder="job-2", lease_seconds=60)
    snapshot, _ = store.load(key, release="job-2")  # decode's load ends the hand-over's pin
    assert snapshot is not None
    clock.now += 11
    assert store.sweep() == 3
    assert store.load(key, release="job-2") == (None, "lease_lost")


def test_a_prefix_stored_again_keeps_its_bytes_both_leases_and_the_longer_life(tmp_path, database, clock):
    """Two hand-overs of one prompt, or a prompt stored by a second replica: the known entries are
    updated in place (not rewritten), each hand-over's pin holds until its own release, and the
    entries live until the later of the two expiries, never the earlier."""
    store = make_store(tmp_path, database, clock)
    prompt = tokens(300)
    first = store.put_prefix(NS, prompt, state_of(prompt), 100, lease_holder="job-1", lease_seconds=300)
    again = store.put_prefix(NS, prompt, state_of(prompt), 10, lease_holder="job-2", lease_seconds=60)
    assert again.key == first.key and first.new_bytes == first.size and again.new_bytes == 0
    assert len(store) == 3 and store.expires_at(first.key) == clock.now + 100  # not cut to 10 s
    assert store.load(first.key, release="job-2")[0] is not None
    clock.now += 200  # past both TTLs and job-2's lease; job-1 still holds it
    assert store.sweep() == 0 and store.load(first.key, release="job-1")[0] is not None
    assert store.sweep() == 3 and len(store) == 0
    later = store.put_prefix(NS, prompt, state_of(prompt), 50)
    assert later.new_bytes == later.size  # gone, so stored anew
    store.put_prefix(NS, prompt[:200], state_of(prompt[:200]), 500)  # shares the first block
    clock.now += 100
    assert store.sweep() == 2  # the 300-token head and its second block; the shared block lives on
    assert store.lookup(NS, prompt, below=300).num_tokens == 200


def test_full_tiers_demote_in_lru_order_and_only_the_last_tier_evicts(tmp_path, database, clock):
    shared = DirectoryTier(tmp_path / "shared", None, name="shared", shared=True)
    store = make_store(tmp_path, database, clock, shared=shared)
    keys = [put(store, tokens(100, 1000 * (i + 1))) for i in range(4)]  # equal heads, no full block
    size = store.tiers[0].lru[keys[0]]
    memory, disk = store.tiers[0], store.tiers[1]
    memory.capacity_bytes, disk.capacity_bytes, shared.capacity_bytes = 2 * size, 3 * size, 3 * size
    store.flush()  # write-behind: every blob in every tier
    assert all(disk.holds(k) and shared.holds(k) for k in keys)
    store.load(keys[0])  # now the most recently used
    assert store.rebalance() == (2 + 1, 1)  # memory: 1 and 2 demoted; disk: 1 demoted; shared: 1 evicted
    assert set(memory.lru) == {keys[3], keys[0]}
    assert keys[1] not in disk.lru and keys[1] not in shared.lru  # the least recently used went first
    assert store.load(keys[1]) == (None, "evicted")
    snapshot, _ = store.load(keys[2])  # from disk: promoted to memory
    assert snapshot is not None and memory.holds(keys[2])
    # a pinned entry is never evicted: it waits for its lease
    pinned = put(store, tokens(100, 9000), lease_holder="job", lease_seconds=60)
    store.flush()
    store.tiers[0].capacity_bytes = store.tiers[1].capacity_bytes = shared.capacity_bytes = 0
    store.rebalance()
    assert shared.holds(pinned) and len(shared.lru) == 1


def test_persisted_tiers_survive_a_restart(tmp_path, database, clock):
    store = make_store(tmp_path, database, clock)
    key = put(store, tokens(500))
    assert store.flush() == 4  # head + 3 blocks written behind to disk
    store.close()
    restarted = make_store(tmp_path, database, clock)  # memory is gone; disk and catalog are not
    assert restarted.tiers[1].used_bytes > 0 and not restarted.tiers[0].lru
    assert restarted.lookup(NS, tokens(501), below=501).key == key
    assert same(restarted.load(key)[0], tokens(500))


def test_a_restart_forgets_what_only_memory_held_and_only_its_own(tmp_path, database, clock):
    """A replica stopped before write-behind (killed): at its restart the catalog no longer lists
    what died with its memory, so a lookup finds the longest prefix that survived, not a dead
    one; another replica's entries, still only in that replica's memory, stay listed."""
    store = make_store(tmp_path, database, clock, name="a")
    other = make_store(tmp_path, database, clock, name="b")
    survivor = put(store, tokens(300))
    store.flush()
    lost = put(store, tokens(600))  # extends the survivor; never written behind
    theirs = put(other, tokens(400, start=10_000))
    restarted = make_store(tmp_path, database, clock, name="a")  # a's memory is gone
    assert restarted.lookup(NS, tokens(601), below=602).key == survivor
    assert same(restarted.load(survivor)[0], tokens(300))
    assert lost not in restarted.catalog.get([lost])
    assert theirs in restarted.catalog.get([theirs]) and other.load(theirs)[0] is not None


@pytest.mark.parametrize("backend", ["directory", "redis"])
def test_another_replica_hits_through_the_shared_tier(tmp_path, database, clock, backend):
    """Replicas with their own memory and disk, one catalog and one shared tier (a POSIX
    directory, or a real Redis server): what one stored, the other loads."""

    redis_prefix = f"test:{uuid.uuid4().hex}:"  # this run's own: a run stopped midway leaves its keys

    def shared_tier():
        if backend == "directory":
            return DirectoryTier(tmp_path / "shared", None, name="shared", shared=True)
        return RedisTier(require_service("DEEPMESH_REDIS_URL"), None, prefix=redis_prefix)

    a = make_store(tmp_path, database, clock, shared=shared_tier(), name="a")
    b = make_store(tmp_path, database, clock, shared=shared_tier(), name="b")
    key = put(a, tokens(400))
    assert b.load(key) == (None, "evicted")  # before write-behind it is only in A's memory...
    assert a.load(key)[0] is not None  # ...where it stays: B's miss did not remove it
    a.flush()
    match = b.lookup(NS, tokens(450), below=450)
    assert match.key == key
    snapshot, reason = b.load(key)
    assert reason is None and same(snapshot, tokens(400))
    assert b.tiers[0].holds(key)  # promoted into B's memory
    if backend == "redis":
        a.tiers[-1].client.delete(*[a.tiers[-1].prefix + k for k in a.tiers[-1].lru])


def test_orphans_are_collected(tmp_path, database, clock):
    store = make_store(tmp_path, database, clock)
    key = put(store, tokens(200))
    store.flush()
    stray = "block-" + "0" * 64
    store.tiers[1].write(stray, b"left by a crash")
    assert store.collect_orphans() == 1
    assert not (tmp_path / "a-disk" / stray).exists() and store.load(key)[0] is not None
    # an anchor whose block was evicted cannot be loaded any more: collected too
    broken = put(store, tokens(300, 5000))
    store._remove([block_key(chain(tokens(300, 5000), NS)[1])])  # as an eviction from the last tier does
    assert store.collect_orphans() == 1
    assert store.catalog.get([broken]) == {} and store.load(key)[0] is not None


@pytest.mark.parametrize("backend", ["directory", "redis"])
def test_image_rows_go_through_every_tier_as_prefixes_do(tmp_path, database, clock, backend):
    """An image's rows (an entry of its own kind, keyed by the image's content): written behind to
    disk and the shared tier, back exactly after a restart and from another replica, renewed and
    expired like a prefix, and never one tenant's answer to another's."""

    redis_prefix = f"test:{uuid.uuid4().hex}:"  # this run's own: a run stopped midway leaves its keys

    def shared_tier():
        if backend == "directory":
            return DirectoryTier(tmp_path / "shared", None, name="shared", shared=True)
        return RedisTier(require_service("DEEPMESH_REDIS_URL"), None, prefix=redis_prefix)

    digest, rows = "ab" * 32, bytes(range(256)) * 40
    store = make_store(tmp_path, database, clock, shared=shared_tier(), name="a")
    stored = store.put_image(f"{LAYOUT}/acme", digest, rows, 194, ttl_seconds=600)
    assert stored.key == image_key(f"{LAYOUT}/acme", digest) and stored.num_tokens == 194
    assert store.flush() == 1  # to disk and the shared tier, where a key of every kind can be written
    assert store.load(image_key(f"{LAYOUT}/other", digest)) == (None, "evicted")
    store.close()
    restarted = make_store(tmp_path, database, clock, shared=shared_tier(), name="a")
    assert restarted.load(stored.key) == (StateBlobs(rows, []), None)
    other = make_store(tmp_path, database, clock, shared=shared_tier(), name="b")
    assert other.load(stored.key) == (StateBlobs(rows, []), None)
    clock.now += 500
    assert other.renew(stored.key, 600) == clock.now + 600
    clock.now += 599
    assert other.sweep() == 0 and other.load(stored.key)[0] == StateBlobs(rows, [])
    clock.now += 601
    assert other.sweep() == 1 and other.load(stored.key) == (None, "evicted")
    with pytest.raises(InvalidEntry):
        store.put_image(f"{LAYOUT}/acme", "not-a-digest", rows, 194, ttl_seconds=600)
    if backend == "redis":
        other.tiers[-1].client.delete(*[other.tiers[-1].prefix + k for k in other.tiers[-1].lru] or ["none"])
