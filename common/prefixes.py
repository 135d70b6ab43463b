"""Keys of token prefixes, as tier 0 (engine/resident_prefixes.py) files them and as a router
looks for them in a replica's load report: both sides must compute the same bytes.

A report lists each prefix with the key of its full blocks too (its first n // BLOCK_SIZE *
BLOCK_SIZE tokens, its "base"). A router hashes a prompt once at its block boundaries and
checks a prefix's own key only where the prompt has the same base: prefixes that share a long
system prompt with the prompt but not the conversation after it are ruled out by their base,
so a decision stays well under a millisecond however many prefixes sixteen replicas hold."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence

from common.blocks import BLOCK_SIZE


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
