"""What the KV cache and the engine side exchange: plain data, no torch, no database.

The cache service (cache_svc/store.py, and its HTTP client cache_svc/client.py) answers in
these types, and the engine side (engine/prefix_connector.py) reads them; both import them
from here, so that neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StateBlobs:
    """An entry's bytes as the engine gave them: its head blob and one blob per full block."""

    head: bytes
    blocks: list[bytes]

    @property
    def size(self) -> int:
        return len(self.head) + sum(map(len, self.blocks))


@dataclass
class Stored:
    key: str
    checksum: str  # of the head blob
    num_tokens: int
    expires_at: float
    size: int  # the whole entry: its head and all its blocks
    new_bytes: int  # bytes written: the head and the blocks no other entry had stored


@dataclass
class PrefixMatch:
    """The longest usable stored prefix of a prompt (key None: none) and, beyond it, how many
    of the prompt's tokens are covered by blocks other prompts stored: where they diverge."""

    key: str | None = None
    num_tokens: int = 0
    shared_tokens: int = 0
    size: int = 0  # bytes to load: head and blocks
    load_seconds: float = 0.0  # estimated from the tiers holding it
    miss_reason: str | None = None
