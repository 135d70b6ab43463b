"""Synthetic prefix states: bytes that depend on the tokens the way an engine's state does, for
tests of the cache store that need no model."""

from __future__ import annotations

import hashlib

from common.blocks import BLOCK_SIZE
from common.cache_entries import StateBlobs

LAYOUT = "v1-test"
NS = f"{LAYOUT}/tenant-a"
ROW = 1024  # bytes per block blob


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def state_of(token_ids: list[int]) -> StateBlobs:
    """Bytes for the state after these tokens, all of them depending on the tokens: a block's
    on the tokens up to its end (so blocks of a common prefix are equal, as the engine's are),
    the head on all of them."""

    def digest(tokens: list[int], size: int) -> bytes:
        seed = hashlib.sha256(repr(tokens).encode()).digest()
        return (seed * (size // len(seed) + 1))[:size]

    blocks = [digest(token_ids[: (i + 1) * BLOCK_SIZE], ROW) for i in range(len(token_ids) // BLOCK_SIZE)]
    return StateBlobs(digest(token_ids, 300 + len(token_ids) % BLOCK_SIZE), blocks)
