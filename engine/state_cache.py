"""Paged inference state for DeepSeek-V4.

Two kinds of state, following the attention structure (see ARCHITECTURE.md):

* **Blocks** hold what grows with the sequence: the compressed entries of every CSA / HCA
  layer and the CSA indexer keys, for 128 tokens at a time. One physical block holds
  every layer's entries for its 128 tokens in one contiguous row of `blocks`, so a block
  is a single copy when it is persisted or handed to another worker. Blocks are
  reference counted so that the prefix cache can share them between sequences.
* **Slots** hold what is bounded per sequence: the sliding-window ring (the last W
  keys of every layer) and each compressor's pending tokens (projections of the tokens
  of the window not yet closed, plus, for CSA, the previous window's half that the next
  entry overlaps with).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from common.blocks import BLOCK_SIZE
from engine.config import CSA, SLIDING, ModelConfig


class OutOfBlocksError(RuntimeError):
    """No free block or slot; the scheduler preempts instead of letting this escape."""


class BlockAllocator:
    """Free list plus reference counts over block ids 0..num_blocks-1.

    A released block keeps its content until it is allocated again, and the free list hands
    out the longest-free block first: state that has just been freed is the last to go, and
    `revive` can take it back as long as it is intact (the engine's resident prefixes,
    engine/resident_prefixes.py, which `on_reuse` tells when one of their blocks is reused).
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.on_reuse: Callable[[int], None] = lambda block_id: None

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfBlocksError("no free state block")
        block_id, _ = self._free.popitem(last=False)
        self.ref_counts[block_id] = 1
        self.on_reuse(block_id)  # its old content is about to be overwritten
        return block_id

    def share(self, block_id: int) -> None:
        if self.ref_counts[block_id] <= 0:
            raise ValueError(f"block {block_id} is not allocated")
        self.ref_counts[block_id] += 1

    def revive(self, block_id: int) -> None:
        """Take a reference to a block whether it is in use or free with its content intact."""
        if self.ref_counts[block_id] > 0:
            self.share(block_id)
            return
        del self._free[block_id]  # KeyError: a block that was never allocated is no one's state
        self.ref_counts[block_id] = 1

    def release(self, block_id: int) -> None:
        if self.ref_counts[block_id] <= 0:
            raise ValueError(f"block {block_id} released more often than allocated")
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            self._free[block_id] = None


@dataclass
class CompressorState:
    """One compressor's state: its entries (views into the block pool) and its per-slot pending tokens.

    `width` is the projection width per token: 2 * dim for the overlapping CSA series, dim for HCA.
    """

    rate: int
    dim: int
    overlap: bool
    entries: torch.Tensor  # [num_blocks, BLOCK_SIZE // rate, dim]
    pending_kv: torch.Tensor  # [max_seqs, rate, width]
    pending_gate: torch.Tensor  # [max_seqs, rate, width], position bias already added
    prev_kv: torch.Tensor | None  # [max_seqs, rate, dim]: first series of the last closed window (CSA)
    prev_gate: torch.Tensor | None

    @property
    def entries_per_block(self) -> int:
        return BLOCK_SIZE // self.rate

    def block_index(self, entry_ids: torch.Tensor) -> torch.Tensor:
        """Which of a sequence's blocks (position in its block table) holds each entry."""
        return entry_ids // self.entries_per_block

    def store(self, block_ids: torch.Tensor, entry_ids: torch.Tensor, entries: torch.Tensor) -> None:
        """Write entries [n, dim]; block_ids are the physical blocks holding them."""
        self.entries[block_ids, entry_ids % self.entries_per_block] = entries


def _compressor_shapes(config: ModelConfig) -> list[tuple[int, str, int, int, bool]]:
    """(layer, role, rate, dim, overlap) for every compressor in the model, in block-row order."""
    shapes = []
    for layer, layer_type in enumerate(config.layer_types):
        if layer_type == SLIDING:
            continue
        rate = config.compress_rate(layer)
        overlap = layer_type == CSA
        shapes.append((layer, "compressor", rate, config.head_dim, overlap))
        if overlap:
            shapes.append((layer, "indexer", rate, config.index_head_dim, True))
    return shapes


class StateLayout:
    """Sizes of the state for a config, and the theoretical minimum to compare against."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        self.config = config
        self.element_size = torch.empty((), dtype=dtype).element_size()
        self.compressors = _compressor_shapes(config)
        self.block_numel = sum((BLOCK_SIZE // rate) * dim for _, _, rate, dim, _ in self.compressors)
        window = config.num_hidden_layers * config.sliding_window * config.head_dim
        pending = sum(2 * rate * (2 * dim if ov else dim) for _, _, rate, dim, ov in self.compressors)
        prev = sum(2 * rate * dim for _, _, rate, dim, ov in self.compressors if ov)
        self.slot_numel = window + pending + prev

    @property
    def block_bytes(self) -> int:
        return self.block_numel * self.element_size

    @property
    def slot_bytes(self) -> int:
        return self.slot_numel * self.element_size

    def allocated_bytes(self, num_tokens: int) -> int:
        """What this engine holds for one sequence of `num_tokens` tokens."""
        blocks = -(-num_tokens // BLOCK_SIZE) if self.block_numel else 0
        return blocks * self.block_bytes + self.slot_bytes

    def minimum_bytes(self, num_tokens: int) -> int:
        """The least state any exact implementation must keep for a sequence of this length.

        Compressed entries that exist (floor(L / rate) per compressor), the W - 1 window
        keys the next token attends to, and for every compressor the projections of the
        tokens of its open window (at most rate - 1) plus, for CSA, the first series of
        the last closed window.
        """
        cfg = self.config
        window = cfg.num_hidden_layers * min(num_tokens, cfg.sliding_window - 1) * cfg.head_dim
        total = window
        for _, _, rate, dim, overlap in self.compressors:
            total += (num_tokens // rate) * dim
            width = 2 * dim if overlap else dim
            total += 2 * min(num_tokens, rate - 1) * width
            if overlap and num_tokens >= rate:
                total += 2 * rate * dim
        return total * self.element_size


class StateCache:
    """The engine's state memory: a block pool, a slot pool and their allocators."""

    def __init__(
        self, config: ModelConfig, num_blocks: int, max_seqs: int, dtype: torch.dtype, device: torch.device | str
    ):
        self.config = config
        self.layout = StateLayout(config, dtype)
        self.num_blocks = num_blocks
        self.max_seqs = max_seqs
        self.blocks = torch.zeros(num_blocks, self.layout.block_numel, dtype=dtype, device=device)
        self.block_allocator = BlockAllocator(num_blocks)
        self._free_slots: deque[int] = deque(range(max_seqs))
        n_layers, window, head_dim = config.num_hidden_layers, config.sliding_window, config.head_dim
        # window[layer][slot, position % W] = shared key/value of that position
        self.window = torch.zeros(n_layers, max_seqs, window, head_dim, dtype=dtype, device=device)
        self.compressors: dict[int, CompressorState] = {}
        self.indexers: dict[int, CompressorState] = {}
        offset = 0
        for layer, role, rate, dim, overlap in self.layout.compressors:
            per_block = (BLOCK_SIZE // rate) * dim
            entries = self.blocks[:, offset : offset + per_block].view(num_blocks, BLOCK_SIZE // rate, dim)
            offset += per_block
            width = 2 * dim if overlap else dim
            state = CompressorState(
                rate=rate,
                dim=dim,
                overlap=overlap,
                entries=entries,
                pending_kv=torch.zeros(max_seqs, rate, width, dtype=dtype, device=device),
                pending_gate=torch.zeros(max_seqs, rate, width, dtype=dtype, device=device),
                prev_kv=torch.zeros(max_seqs, rate, dim, dtype=dtype, device=device) if overlap else None,
                prev_gate=torch.zeros(max_seqs, rate, dim, dtype=dtype, device=device) if overlap else None,
            )
            (self.compressors if role == "compressor" else self.indexers)[layer] = state

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def allocate_slot(self) -> int:
        if not self._free_slots:
            raise OutOfBlocksError("no free sequence slot")
        return self._free_slots.popleft()

    def release_slot(self, slot: int) -> None:
        self._free_slots.append(slot)

    def _slot_tensors(self) -> dict[str, torch.Tensor]:
        """Every per-slot pool by a stable name; index [slot] selects one sequence's part."""
        pools = {"window": self.window.transpose(0, 1)}  # [max_seqs, layers, W, head_dim]
        for role, states in (("compressor", self.compressors), ("indexer", self.indexers)):
            for layer, state in states.items():
                pools[f"{layer}.{role}.pending_kv"] = state.pending_kv
                pools[f"{layer}.{role}.pending_gate"] = state.pending_gate
                if state.overlap:
                    pools[f"{layer}.{role}.prev_kv"] = state.prev_kv
                    pools[f"{layer}.{role}.prev_gate"] = state.prev_gate
        return pools

    def slot_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(pool.shape[1:]) for name, pool in self._slot_tensors().items()}

    def read_slot(self, slot: int) -> dict[str, torch.Tensor]:
        """A copy of one sequence's slot state (window rings, compressors' open windows)."""
        return {name: pool[slot].clone() for name, pool in self._slot_tensors().items()}

    def write_slot(self, slot: int, values: dict[str, torch.Tensor]) -> None:
        """Set one sequence's slot state; `values` must have exactly `slot_shapes()`."""
        for name, pool in self._slot_tensors().items():
            pool[slot] = values[name]

    @staticmethod
    def blocks_needed(num_tokens: int) -> int:
        return -(-num_tokens // BLOCK_SIZE)

    @property
    def uses_blocks(self) -> bool:
        return self.layout.block_numel > 0
