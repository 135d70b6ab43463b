"""KVManager: the engine's state memory and what holds it.

Owns the StateCache (the block and slot pools and their allocators), the resident prefixes
kept in its free blocks (tier 0, engine/resident_prefixes.py) and the snapshots that copy a
sequence's state out or load one in. The scheduler takes blocks and slots from the same
allocators as it admits and grows sequences, and the model runner reads and writes their
contents; which sequences exist and run is the engine's and the scheduler's, never this one's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from common.blocks import BLOCK_SIZE
from engine.config import ModelConfig
from engine.config_v41 import V41Config
from engine.errors import InvalidRequestError
from engine.resident_prefixes import ResidentPrefix, ResidentPrefixes
from engine.sequence import Sequence
from engine.state_cache import StateCache
from engine.state_transfer import SnapshotError, StateSnapshot, layout_id


class KVManager:
    def __init__(
        self,
        config: ModelConfig | V41Config,
        dtype: torch.dtype,
        device: torch.device,
        *,
        max_num_seqs: int,
        max_model_len: int,
        num_blocks: int | None,
        state_memory_bytes: int,
        resident_prefix_bytes: int,
        weights: str,
        lookahead: int = 0,
        draft_layers: int = 0,
    ):
        """`num_blocks`: None sizes the block pool from `state_memory_bytes` (LLMEngine's arguments);
        `lookahead`, `draft_layers`: room for drafted tokens and a drafter's rings (StateCache)."""
        self.device = device
        self.dtype = dtype
        if num_blocks is None:
            # enough for every slot to hold a full-length sequence, within the memory budget
            cache_probe = StateCache(config, 0, 0, dtype, "meta")
            wanted = max_num_seqs * StateCache.blocks_needed(max_model_len)
            affordable = (state_memory_bytes - max_num_seqs * cache_probe.layout.slot_bytes) // max(
                cache_probe.layout.block_bytes, 1
            )
            num_blocks = max(1, min(wanted, affordable))
        self.cache = StateCache(config, num_blocks, max_num_seqs, dtype, device, lookahead, draft_layers)
        self.resident = ResidentPrefixes(resident_prefix_bytes)
        self.cache.block_allocator.on_reuse = self.resident.block_reused
        self.layout = layout_id(config, dtype, weights)

    def can_ever_hold(self, num_tokens: int) -> bool:
        """Whether a sequence of this many tokens fits in the block pool at all (running alone)."""
        return not self.cache.uses_blocks or self.cache.blocks_needed(num_tokens) <= self.cache.num_blocks

    # -- snapshots ------------------------------------------------------------------------------

    def snapshot(self, seq: Sequence, prefix_only: bool = False) -> StateSnapshot:
        """The sequence's state; with prefix_only, as the state of its computed tokens alone (a
        prefix cache entry), without the tokens that follow them."""
        n_blocks = self.cache.blocks_needed(seq.num_computed) if self.cache.uses_blocks else 0
        token_ids = seq.token_ids[: seq.num_computed] if prefix_only else seq.token_ids
        snapshot = StateSnapshot(
            layout=self.layout,
            token_ids=token_ids,
            prompt_len=len(token_ids) if prefix_only else len(seq.prompt_token_ids),
            num_computed=seq.num_computed,
            seed=seq.seed,
            blocks=self.cache.read_blocks(seq.block_table[:n_blocks]),
            slot=self.cache.read_slot(seq.slot, seq.num_computed),
            last_hidden=seq.last_hidden,
        )
        # the same state, where it already is: in this engine's blocks (tier 0)
        resident = ResidentPrefix(seq.num_computed, seq.block_table[:n_blocks], snapshot.slot, seq.last_hidden)
        self.resident.add(seq.params.prefix_namespace, seq.token_ids[: seq.num_computed], resident)
        return snapshot

    def check_snapshot(self, snapshot: StateSnapshot) -> None:
        if snapshot.layout != self.layout:
            raise SnapshotError(f"snapshot layout {snapshot.layout} is not this engine's ({self.layout})")
        if not (snapshot.prompt_len > 0 and 0 < snapshot.num_computed <= len(snapshot.token_ids)):
            raise SnapshotError(
                f"inconsistent snapshot: {len(snapshot.token_ids)} tokens, prompt {snapshot.prompt_len}, "
                f"computed {snapshot.num_computed}"
            )
        n_blocks = self.cache.blocks_needed(snapshot.num_computed) if self.cache.uses_blocks else 0
        if tuple(snapshot.blocks.shape) != (n_blocks, self.cache.layout.block_numel):
            raise SnapshotError(f"snapshot blocks {tuple(snapshot.blocks.shape)}, expected {n_blocks} rows")
        shapes = {name: tuple(t.shape) for name, t in snapshot.slot.items()}
        if shapes != self.cache.slot_shapes():
            raise SnapshotError("snapshot slot state does not match this engine's layout")

    def load(self, seq: Sequence, snapshot: StateSnapshot) -> bool:
        """Give a sequence the snapshot's state: a slot, blocks, its computed tokens and last hidden
        state. False, and the sequence left as it was, when there is no room now."""
        n_blocks = len(snapshot.blocks) if self.cache.uses_blocks else 0
        if self.cache.num_free_slots == 0 or n_blocks > self.cache.block_allocator.num_free:
            return False
        seq.slot = self.cache.allocate_slot()
        seq.block_table = [self.cache.block_allocator.allocate() for _ in range(n_blocks)]
        if n_blocks:
            self.cache.write_blocks(seq.block_table, snapshot.blocks)
        self.cache.write_slot(seq.slot, {k: v.to(self.device) for k, v in snapshot.slot.items()}, snapshot.num_computed)
        seq.num_computed = snapshot.num_computed
        if snapshot.last_hidden is not None:
            seq.last_hidden = snapshot.last_hidden.to(self.device, self.dtype)
        return True

    # -- resident prefixes ----------------------------------------------------------------------

    def resident_prefix(self, namespace: str, prompt: list[int], at_most: int) -> ResidentPrefix | None:
        """The longest prefix of the prompt, of at most `at_most` tokens, whose state this engine still
        holds in its own memory, in this namespace, if there is room now to start a sequence from it
        (`take_resident`)."""
        entry = self.resident.longest(namespace, prompt, at_most)
        if entry is None or entry.last_hidden is None:
            return None
        allocator = self.cache.block_allocator
        full = entry.num_tokens // BLOCK_SIZE if self.cache.uses_blocks else 0
        partial = entry.block_ids[full:]  # the block the next tokens write into: copied
        taken_from_free = sum(allocator.ref_counts[b] == 0 for b in entry.block_ids)
        if self.cache.num_free_slots == 0 or allocator.num_free - taken_from_free < len(partial):
            return None
        return entry

    def take_resident(self, seq: Sequence, entry: ResidentPrefix) -> None:
        """Give a sequence a resident prefix's state (one `resident_prefix` found just now): its full
        blocks are shared, its partial block copied, nothing loaded."""
        allocator, cached = self.cache.block_allocator, entry.num_tokens
        full = cached // BLOCK_SIZE if self.cache.uses_blocks else 0
        partial = entry.block_ids[full:]
        for block_id in entry.block_ids:  # first, so that allocating the copy cannot reuse them
            allocator.revive(block_id)
        table = entry.block_ids[:full]
        for block_id in partial:
            copy = allocator.allocate()
            self.cache.copy_block(block_id, copy)
            allocator.release(block_id)
            table.append(copy)
        seq.block_table = table
        seq.slot = self.cache.allocate_slot()
        self.cache.write_slot(seq.slot, entry.slot, cached)
        seq.num_computed, seq.last_hidden = cached, entry.last_hidden
        self.resident.hits += 1

    def keep_resident(self, namespace: str, snapshot: StateSnapshot) -> bool:
        """Hold a prefix's state in this engine's own memory without a request for it: loaded now,
        off any request's path, so that a later prompt starting with its tokens takes it back with
        no load (a conversation's answer, computed by a decode engine, for its next turn). Its
        blocks are written and freed at once: free blocks keep their content until reused, and
        nothing running is displaced. False when it is not a prefix state or there is no room."""
        self.check_snapshot(snapshot)
        allocator, n_blocks = self.cache.block_allocator, len(snapshot.blocks) if self.cache.uses_blocks else 0
        if snapshot.last_hidden is None or n_blocks > allocator.num_free or self.resident.max_bytes <= 0:
            return False
        block_ids = [allocator.allocate() for _ in range(n_blocks)]
        if n_blocks:
            self.cache.write_blocks(block_ids, snapshot.blocks)
        for block_id in block_ids:
            allocator.release(block_id)
        slot = {k: v.to(self.device) for k, v in snapshot.slot.items()}
        entry = ResidentPrefix(snapshot.num_computed, block_ids, slot, snapshot.last_hidden.to(self.device, self.dtype))
        self.resident.add(namespace, snapshot.token_ids[: snapshot.num_computed], entry)
        return True

    # -- state outside the scheduler ----------------------------------------------------------

    @contextmanager
    def scratch_state(self, num_tokens: int) -> Iterator[tuple[int, list[int]]]:
        """A slot and blocks for `num_tokens` tokens of no request (a prompt scored), given back
        on exit; InvalidRequestError when running requests hold the room."""
        n_blocks = self.cache.blocks_needed(num_tokens) if self.cache.uses_blocks else 0
        if self.cache.num_free_slots == 0 or n_blocks > self.cache.block_allocator.num_free:
            raise InvalidRequestError("not enough free state to score now; retry when running requests finish")
        slot = self.cache.allocate_slot()
        blocks = [self.cache.block_allocator.allocate() for _ in range(n_blocks)]
        try:
            yield slot, blocks
        finally:
            for block in blocks:
                self.cache.block_allocator.release(block)
            self.cache.release_slot(slot)
