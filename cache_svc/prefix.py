"""Prefix keys and the index that finds the longest stored prefix of a prompt.

A prompt's full 128-token blocks form a hash chain: each link hashes the previous link and
the block's token ids, starting from the namespace (the engine's state layout and the
tenant), so equal prefixes give equal keys only for the same model, state format and
tenant, and one tenant's prompts never match another's. An anchor (a prefix of any length,
such as the end of a request's input) is keyed by the link of its full blocks, its tail
tokens and its length. The index remembers, under each link, the lengths of the anchors
stored there; a lookup walks the prompt's links from the longest down.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections.abc import Sequence

from engine.config import BLOCK_SIZE


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
    return "prefix/" + hashlib.sha256(link + length.to_bytes(8, "little") + _tokens_bytes(tail)).hexdigest()


class PrefixIndex:
    """Which anchors are stored, findable by any prompt that starts with them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lengths: dict[bytes, set[int]] = {}  # chain link -> lengths of the anchors stored under it
        self._anchors: dict[str, tuple[bytes, int]] = {}  # key -> (link, length)

    def add(self, token_ids: Sequence[int], namespace: str) -> str:
        links = chain(token_ids, namespace)
        key = anchor_key(token_ids, namespace, links)
        link = links[len(token_ids) // BLOCK_SIZE]
        with self._lock:
            self._lengths.setdefault(link, set()).add(len(token_ids))
            self._anchors[key] = (link, len(token_ids))
        return key

    def discard(self, key: str) -> None:
        with self._lock:
            anchor = self._anchors.pop(key, None)
            if anchor is None:
                return
            link, length = anchor
            lengths = self._lengths.get(link, set())
            lengths.discard(length)
            if not lengths:
                self._lengths.pop(link, None)

    def longest(self, token_ids: Sequence[int], namespace: str, below: int) -> tuple[str, int] | None:
        """The key and length of the longest stored anchor that is a prefix of `token_ids` and
        shorter than `below`, or None."""
        longest_allowed = min(below - 1, len(token_ids))
        links = chain(token_ids[:longest_allowed], namespace)
        with self._lock:
            for full in range(len(links) - 1, -1, -1):
                for length in sorted(self._lengths.get(links[full], ()), reverse=True):
                    if length > longest_allowed:
                        continue
                    key = anchor_key(token_ids[:length], namespace, links)
                    if key in self._anchors:
                        return key, length
        return None

    def __contains__(self, key: str) -> bool:
        return key in self._anchors

    def __len__(self) -> int:
        return len(self._anchors)
