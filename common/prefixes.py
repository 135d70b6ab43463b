"""Keys of token prefixes: the one place that says how a prefix of a prompt is named.

Two hashes live here, for two kinds of holder, both over the same token encoding (uint32 ids)
and the same 128-token block (common/blocks.py):

Cache keys (the KV cache service, cache_svc/store.py): a hash chain over full blocks. A
prompt's full 128-token blocks form a chain: each link hashes the previous link and the
block's token ids, starting from the namespace (`namespace_of`: the engine's state layout and
the tenant), so equal prefixes give equal keys only for the same model, state format and
tenant, and one tenant's prompts never match another's. A block's compressed state is stored
once under the link that ends it (`block_key`), shared by every conversation that starts the
same way. An anchor (a prefix of any length, such as the end of a request's input) is keyed by
the link of its full blocks, its tail tokens and its length (`anchor_key`); the catalog
(cache_svc/catalog.py) records each anchor under its link, so that a lookup finds, among the
anchors under a prompt's links, the longest that matches. Why a chain: blocks are stored once
and looked up by link in the catalog. These keys are persisted (catalog rows, blobs on disk
and in the shared tier): changing this hash would orphan every stored entry.

Resident keys (tier 0, engine/resident_prefixes.py, and the routers, common/routing.py): one
sha256 of the namespace (the tenant) and an exact token sequence (`prefix_key`). A report
lists each prefix with the key of its full blocks too (its first n // BLOCK_SIZE * BLOCK_SIZE
tokens, its "base"). A router hashes a prompt once at its block boundaries and checks a
prefix's own key only where the prompt has the same base: prefixes that share a long system
prompt with the prompt but not the conversation after it are ruled out by their base, so a
decision stays well under a millisecond however many prefixes sixteen replicas hold. Why a
flat hash: one incremental pass gives the keys at every length asked (`PromptKeys`), and
both sides must compute the same bytes. These keys live only in an engine's memory and in
load reports (gone within a minute), so nothing stored depends on them.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence

from common.blocks import BLOCK_SIZE

# -- cache keys: a hash chain over full blocks, per namespace (layout/tenant) ----------------------


def namespace_of(layout: str, tenant: str = "default") -> str:
    """Prefixes match only within one engine state layout and one tenant."""
    return f"{layout}/{tenant}"


def _tokens_bytes(token_ids: Sequence[int]) -> bytes:
    return array("I", token_ids).tobytes()


def chain(token_ids: Sequence[int], namespace: str) -> list[bytes]:
    """Links of the hash chain: [root, after block 1, after block 2, ...] over the full blocks."""
    links = [hashlib.sha256(namespace.encode()).digest()]
    for start in range(0, len(token_ids) - BLOCK_SIZE + 1, BLOCK_SIZE):
        links.append(hashlib.sha256(links[-1] + _tokens_bytes(token_ids[start : start + BLOCK_SIZE])).digest())
    return links


def anchor_key(token_ids: Sequence[int], namespace: str, links: list[bytes] | None = None) -> str:
    """The store key of the state after exactly these tokens."""
    length = len(token_ids)
    full = length // BLOCK_SIZE
    link = (links or chain(token_ids, namespace))[full]
    tail = token_ids[full * BLOCK_SIZE :]
    return "anchor-" + hashlib.sha256(link + length.to_bytes(8, "little") + _tokens_bytes(tail)).hexdigest()


def block_key(link: bytes) -> str:
    """The store key of a full block's compressed state: the chain link that ends with it."""
    return "block-" + link.hex()


# -- resident keys: one hash of a namespace's (tenant's) exact tokens, at any length --------------


def base_length(num_tokens: int) -> int:
    return num_tokens // BLOCK_SIZE * BLOCK_SIZE


def _start(namespace: str):
    return hashlib.sha256(namespace.encode() + b"\0")


def prefix_key(namespace: str, token_ids: Sequence[int]) -> bytes:
    """The key of a namespace's (a tenant's) exact token sequence."""
    digest = _start(namespace)
    digest.update(array("I", token_ids).tobytes())
    return digest.digest()


def prefix_keys(namespace: str, token_ids: Sequence[int], lengths: Iterable[int]) -> dict[int, bytes]:
    """The keys of the prompt's prefixes of these lengths (those it is long enough for), hashing
    the prompt once."""
    return PromptKeys(namespace, token_ids).at(lengths)


class PromptKeys:
    """A prompt's prefix keys at any lengths, from one encoding of its tokens."""

    def __init__(self, namespace: str, token_ids: Sequence[int]):
        self.namespace, self.num_tokens = namespace, len(token_ids)
        self.data = memoryview(array("I", token_ids).tobytes())
        self.width = array("I").itemsize  # bytes per token

    def at(self, lengths: Iterable[int]) -> dict[int, bytes]:
        keys, digest, done = {}, _start(self.namespace), 0
        for n in sorted(n for n in set(lengths) if 0 <= n <= self.num_tokens):
            digest.update(self.data[done * self.width : n * self.width])
            done = n
            keys[n] = digest.copy().digest()
        return keys


def reported(key: bytes) -> str:
    """A key as load reports carry it: 64 bits, enough to tell a replica's entries apart."""
    return key[:8].hex()


def reported_entry(namespace: str, token_ids: Sequence[int]) -> tuple[int, str, str]:
    """A prefix as a load report lists it: (tokens, base key, key)."""
    base = prefix_key(namespace, token_ids[: base_length(len(token_ids))])
    return len(token_ids), reported(base), reported(prefix_key(namespace, token_ids))
