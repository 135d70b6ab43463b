"""Tier 0 of the KV cache: prefix states an engine keeps in its own state memory.

When the engine takes a copy of a sequence's state (a prompt handed over to decode, an
anchor inside a prompt, an answer's final state), it also notes where that state lives in
its own block pool: the blocks the sequence used, and the copy of its slot state (window
rings, open compressor windows) and last hidden state. The blocks go back to the free list
when the sequence ends, but keep their content until they are allocated again, and the free
list hands out the longest-free block first. A later prompt that starts with the same tokens
takes those blocks back (`BlockAllocator.revive`) instead of loading the state from the cache
service: no load at all. A block allocated again drops every entry that needed it, so running
requests always get the room they need, and an entry is never used with foreign content.

Full 128-token blocks are never written again, so a resumed sequence shares them; the
partial last block is copied, because the sequence writes its next entries there. Entries
are keyed by their namespace (the tenant: SamplingParams.prefix_namespace) and exact tokens
(sha256), and a lookup tries the lengths held, longest first, as the cache service does. The
slot copies count against `max_bytes` (LRU beyond it).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.prefixes import base_length, prefix_key, prefix_keys, reported


@dataclass
class ResidentPrefix:
    num_tokens: int
    block_ids: list[int]  # ceil(num_tokens / 128) blocks of the pool, free or in use
    slot: dict[str, torch.Tensor]  # a copy: slots are reused at once
    last_hidden: torch.Tensor | None
    base: bytes = b""  # the key of its full blocks' tokens (common/prefixes.py), for load reports

    @property
    def size(self) -> int:
        tensors = [*self.slot.values(), *([self.last_hidden] if self.last_hidden is not None else [])]
        return sum(t.numel() * t.element_size() for t in tensors)


class ResidentPrefixes:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.used_bytes = 0
        self._entries: OrderedDict[bytes, ResidentPrefix] = OrderedDict()  # least recently used first
        self._by_block: dict[int, set[bytes]] = {}
        self._lengths: dict[int, int] = {}  # num_tokens -> entries of that length
        self.hits = 0

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, namespace: str, token_ids: Sequence[int], entry: ResidentPrefix) -> None:
        if entry.size > self.max_bytes:
            return
        key = prefix_key(namespace, token_ids)
        entry.base = prefix_key(namespace, token_ids[: base_length(len(token_ids))])
        self._drop(key)
        self._entries[key] = entry
        self.used_bytes += entry.size
        self._lengths[entry.num_tokens] = self._lengths.get(entry.num_tokens, 0) + 1
        for block_id in entry.block_ids:
            self._by_block.setdefault(block_id, set()).add(key)
        while self.used_bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def longest(self, namespace: str, token_ids: Sequence[int], at_most: int) -> ResidentPrefix | None:
        """The longest entry of `namespace` whose tokens start `token_ids`, of at most `at_most` tokens."""
        held = prefix_keys(namespace, token_ids, (n for n in self._lengths if n <= at_most))  # one pass
        for _, key in sorted(held.items(), reverse=True):
            if key in self._entries:
                self._entries.move_to_end(key)
                return self._entries[key]
        return None

    def summary(self, limit: int = 256) -> list[tuple[int, str, str]]:
        """What a load report tells routers this engine holds: (tokens, base key, key) of its
        most recently used entries."""
        recent = list(reversed(self._entries.items()))[:limit]
        return [(entry.num_tokens, reported(entry.base), reported(key)) for key, entry in recent]

    def block_reused(self, block_id: int) -> None:
        """A block is being allocated again: the entries that needed its content are gone."""
        for key in self._by_block.pop(block_id, ()):
            self._drop(key)

    def _drop(self, key: bytes) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        self.used_bytes -= entry.size
        self._lengths[entry.num_tokens] -= 1
        if not self._lengths[entry.num_tokens]:
            del self._lengths[entry.num_tokens]
        for block_id in entry.block_ids:
            keys = self._by_block.get(block_id)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._by_block[block_id]
