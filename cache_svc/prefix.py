"""Cache keys: a hash chain over 128-token blocks, per namespace.

A prompt's full 128-token blocks form a hash chain: each link hashes the previous link and
the block's token ids, starting from the namespace (the engine's state layout and the
tenant), so equal prefixes give equal keys only for the same model, state format and
tenant, and one tenant's prompts never match another's. An anchor (a prefix of any length,
such as the end of a request's input) is keyed by the link of its full blocks, its tail
tokens and its length; the catalog (cache_svc/catalog.py) records each anchor under its link,
so that a lookup finds, among the anchors under a prompt's links, the longest that matches.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from common.blocks import BLOCK_SIZE


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
