"""Paged inference state for DeepSeek-V4.

Two kinds of state, following the attention structure (see ARCHITECTURE.md):

* **Blocks** hold what grows with the sequence: the compressed entries of every CSA / HCA
  layer and the CSA indexer keys, for 128 tokens at a time. One physical block holds
  every layer's entries for its 128 tokens in one contiguous row of `blocks`, so a block
  is a single copy when it is persisted or handed to another worker. Blocks are
  reference counted so that the prefix cache can share them between sequences.
* **Slots** hold what is bounded per sequence: the sliding-window ring (the last W
  keys of every layer) and each compressor's pending tokens (projections of the tokens
  of the window not yet closed, plus, for CSA, the previous window, half of which the next
  entry overlaps with).

Slot state is kept in rings addressed by position: position p of a sequence sits at
p % size, and a reader asks for the positions it needs. With speculative decoding a step
computes drafted tokens the target may reject; `lookahead` rows more in every ring leave
room for them (DeepInfer's backtracking tokens): a rejected row's write lands where no
accepted token's reader looks, and is overwritten before anyone does, so a rejected draft
needs no undo. A slot's state leaves the engine (`read_slot`) as the positions it holds up
to the computed length, in rings of the plain size, whatever the lookahead: snapshots, hand
overs and the prefix cache never see the room or a rejected row.

Every layer's state is a tensor of its own (not a view into one shared pool): a compiled
decode step writes it in place, which a compiler can do for a tensor but not, without
copying the whole pool, for a view of one. Each pool has one row more than it hands out, a
scratch slot and a scratch block, where the padding rows of a fixed-size decode batch write.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from common.blocks import BLOCK_SIZE
from engine.config import CSA, SLIDING, ModelConfig
from engine.config_v41 import V41Config


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
    """One compressor's state: its entries (its part of every block) and its per-slot rings of the
    projections of the latest tokens: the open window's and, for CSA, the previous window's, whose
    first series the next entry overlaps with.

    `width` is the projection width per token: 2 * dim for the overlapping CSA series, dim for HCA.
    """

    rate: int
    dim: int
    overlap: bool
    entries: torch.Tensor  # [num_blocks + 1, BLOCK_SIZE // rate, dim]
    ring_kv: torch.Tensor | None  # [max_seqs + 1, ring, width] by position % ring; None: no open window to keep
    ring_gate: torch.Tensor | None  # [max_seqs + 1, ring, width], position bias already added

    @property
    def entries_per_block(self) -> int:
        return BLOCK_SIZE // self.rate

    @property
    def lookback(self) -> int:
        """Tokens before a window its entry reads: the previous window (CSA's overlap), or none."""
        return self.rate if self.overlap else 0

    @property
    def ring_size(self) -> int:
        return self.ring_kv.shape[1]

    def add_chunk(
        self, slot: int, start: int, kv: torch.Tensor, gate: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """A chunk of one sequence's projections from position `start` into its ring. Returns them
        after those the ring holds from `begin` on (the first position the entry open at `start`
        pools, less the lookback), and `begin`."""
        ring = self.ring_size
        begin = max(0, start // self.rate * self.rate - self.lookback)
        earlier = torch.arange(begin, start, device=kv.device) % ring
        joined_kv = torch.cat([self.ring_kv[slot, earlier], kv])
        joined_gate = torch.cat([self.ring_gate[slot, earlier], gate])
        keep = min(len(kv), ring)  # the last rows of a long chunk are all later tokens read
        rows = torch.arange(start + len(kv) - keep, start + len(kv), device=kv.device) % ring
        self.ring_kv[slot, rows] = kv[-keep:]
        self.ring_gate[slot, rows] = gate[-keep:]
        return joined_kv, joined_gate, begin

    def add_rows(
        self, slots: torch.Tensor, positions: torch.Tensor, kv: torch.Tensor, gate: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One row per sequence (or several, at consecutive positions) into the rings, every row
        before any is read; then each row's entry's window [n, lookback + rate, width], the
        lookback first (positions before 0 land on rows that an entry 0 masks)."""
        ring = self.ring_size
        self.ring_kv[slots, positions % ring] = kv
        self.ring_gate[slots, positions % ring] = gate
        span = torch.arange(-self.lookback, self.rate, device=positions.device)
        rows = ((positions // self.rate * self.rate).unsqueeze(1) + span) % ring
        return self.ring_kv[slots.unsqueeze(1), rows], self.ring_gate[slots.unsqueeze(1), rows]

    def block_index(self, entry_ids: torch.Tensor) -> torch.Tensor:
        """Which of a sequence's blocks (position in its block table) holds each entry."""
        return entry_ids // self.entries_per_block

    def store(self, block_ids: torch.Tensor, entry_ids: torch.Tensor, entries: torch.Tensor) -> None:
        """Write entries [n, dim]; block_ids are the physical blocks holding them."""
        self.entries[block_ids, entry_ids % self.entries_per_block] = entries


def _compressor_shapes(config: ModelConfig | V41Config) -> list[tuple[int, str, int, int, bool, bool]]:
    """(layer, role, rate, dim, overlap, pending) for every compressor in the model, in block-row
    order; `pending`: it keeps the projections of its open window per sequence."""
    shapes = []
    if isinstance(config, V41Config):
        # only source layers hold state; the others read theirs. Index keys come from the entries.
        for layer, rate in enumerate(config.compress_ratios):
            if config.owns_compressor(layer):
                shapes.append((layer, "compressor", rate, config.head_dim, False, rate > 1))
            if config.owns_index_keys(layer):
                shapes.append((layer, "indexer", rate, config.index_head_dim, False, False))
        return shapes
    for layer, layer_type in enumerate(config.layer_types):
        if layer_type == SLIDING:
            continue
        rate = config.compress_rate(layer)
        overlap = layer_type == CSA
        shapes.append((layer, "compressor", rate, config.head_dim, overlap, True))
        if overlap:
            shapes.append((layer, "indexer", rate, config.index_head_dim, True, True))
    return shapes


class StateLayout:
    """Sizes of the state for a config, and the theoretical minimum to compare against."""

    def __init__(self, config: ModelConfig | V41Config, dtype: torch.dtype):
        self.config = config
        self.element_size = torch.empty((), dtype=dtype).element_size()
        self.compressors = _compressor_shapes(config)
        self.block_numel = sum((BLOCK_SIZE // rate) * dim for _, _, rate, dim, _, _ in self.compressors)
        window = config.num_hidden_layers * config.sliding_window * config.head_dim
        pending = sum(2 * rate * (2 * dim if ov else dim) for _, _, rate, dim, ov, kept in self.compressors if kept)
        prev = sum(2 * rate * dim for _, _, rate, dim, ov, _ in self.compressors if ov)
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
        for _, _, rate, dim, overlap, pending in self.compressors:
            total += (num_tokens // rate) * dim
            width = 2 * dim if overlap else dim
            total += 2 * min(num_tokens, rate - 1) * width if pending else 0
            if overlap and num_tokens >= rate:
                total += 2 * rate * dim
        return total * self.element_size


class StateCache:
    """The engine's state memory: per-layer block and slot pools and their allocators.

    A block's row, as persisted and handed over (`read_blocks`), is every compressor's entries
    for its 128 tokens in model order, flattened and concatenated.
    """

    def __init__(
        self,
        config: ModelConfig | V41Config,
        num_blocks: int,
        max_seqs: int,
        dtype: torch.dtype,
        device: torch.device | str,
        lookahead: int = 0,
        draft_layers: int = 0,
    ):
        """`lookahead`: the most drafted tokens a step computes past a sequence's accepted ones;
        `draft_layers`: window rings for a drafter's sliding-window layers, after the model's."""
        self.config = config
        self.layout = StateLayout(config, dtype)
        self.num_blocks = num_blocks
        self.max_seqs = max_seqs
        self.scratch_slot, self.scratch_block = max_seqs, num_blocks  # never handed out
        self.block_allocator = BlockAllocator(num_blocks)
        self._free_slots: deque[int] = deque(range(max_seqs))
        self.lookahead = lookahead
        n_layers, window, head_dim = config.num_hidden_layers, config.sliding_window, config.head_dim
        slots = max_seqs + 1

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        # window[layer][slot, position % (W + lookahead)] = shared key/value of that position;
        # the rings past the model's layers are draft layers' (not part of the sequence's state)
        ring = window + lookahead
        self.window = [zeros(slots, ring, head_dim) for _ in range(n_layers + draft_layers)]
        self.compressors: dict[int, CompressorState] = {}
        self.indexers: dict[int, CompressorState] = {}
        self._entries: list[torch.Tensor] = []  # in block-row order
        for layer, role, rate, dim, overlap, pending in self.layout.compressors:
            width = 2 * dim if overlap else dim
            ring = (2 * rate if overlap else rate) + lookahead
            state = CompressorState(
                rate=rate,
                dim=dim,
                overlap=overlap,
                entries=zeros(num_blocks + 1, BLOCK_SIZE // rate, dim),
                ring_kv=zeros(slots, ring, width) if pending else None,
                ring_gate=zeros(slots, ring, width) if pending else None,
            )
            self._entries.append(state.entries)
            (self.compressors if role == "compressor" else self.indexers)[layer] = state

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of these blocks, one row each [n, block_numel]."""
        if not self._entries:
            return self.window[0].new_zeros(len(block_ids), 0)
        return torch.cat([entries[block_ids].flatten(1) for entries in self._entries], dim=1)

    def write_blocks(self, block_ids: list[int], rows: torch.Tensor) -> None:
        """Set these blocks from rows [n, block_numel] (as `read_blocks` gives them)."""
        offset = 0
        for entries in self._entries:
            width = entries[0].numel()
            entries[block_ids] = rows[:, offset : offset + width].view(-1, *entries.shape[1:]).to(entries.device)
            offset += width

    def copy_block(self, source: int, target: int) -> None:
        for entries in self._entries:
            entries[target] = entries[source]

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def allocate_slot(self) -> int:
        if not self._free_slots:
            raise OutOfBlocksError("no free sequence slot")
        return self._free_slots.popleft()

    def release_slot(self, slot: int) -> None:
        self._free_slots.append(slot)

    def _slot_rings(self, slot: int, num_computed: int) -> list[tuple[str, torch.Tensor, int, torch.Tensor, int]]:
        """One sequence's slot state by a stable name, as (name, its ring [ring, ...] (the window's a
        copy, [ring, layers, d]; the others views), plain ring size, positions held at this computed
        length, channels kept (0: all))."""
        window, device = self.config.sliding_window, self.window[0].device
        layers = torch.stack([ring[slot] for ring in self.window[: self.config.num_hidden_layers]], 1)
        held = torch.arange(max(0, num_computed - window), num_computed, device=device)
        rings = [("window", layers, window, held, 0)]
        for role, states in (("compressor", self.compressors), ("indexer", self.indexers)):
            for layer, state in states.items():
                if state.ring_kv is None:
                    continue
                opened = num_computed // state.rate * state.rate
                pending = torch.arange(opened, num_computed, device=device)
                closed = torch.arange(max(0, opened - state.rate), opened, device=device)
                for part, pool in (("kv", state.ring_kv), ("gate", state.ring_gate)):
                    rings.append((f"{layer}.{role}.pending_{part}", pool[slot], state.rate, pending, 0))
                    if state.overlap:
                        rings.append((f"{layer}.{role}.prev_{part}", pool[slot], state.rate, closed, state.dim))
        return rings

    def slot_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(t.shape) for name, t in self.read_slot(self.scratch_slot, 0).items()}

    def read_slot(self, slot: int, num_computed: int) -> dict[str, torch.Tensor]:
        """A copy of one sequence's slot state at this computed length, in rings of the plain size
        (window [layers, W, d]; compressors' open and previous windows [rate, width]), position p
        at p % size, zeros where no position is held."""
        state = {}
        for name, ring, size, positions, channels in self._slot_rings(slot, num_computed):
            held = ring[positions % ring.shape[0]]
            held = held[..., :channels] if channels else held
            plain = held.new_zeros(size, *held.shape[1:]).index_copy_(0, positions % size, held)
            state[name] = plain.transpose(0, 1).contiguous() if name == "window" else plain
        return state

    def write_slot(self, slot: int, values: dict[str, torch.Tensor], num_computed: int) -> None:
        """Set one sequence's slot state at this computed length from `read_slot`'s form."""
        for ring in self.window:
            ring[slot] = 0
        for states in (self.compressors, self.indexers):
            for state in states.values():
                if state.ring_kv is not None:
                    state.ring_kv[slot] = 0
                    state.ring_gate[slot] = 0
        for name, ring, size, positions, channels in self._slot_rings(slot, num_computed):
            rows = (
                values[name].transpose(0, 1)[positions % size] if name == "window" else values[name][positions % size]
            )
            ring_rows = positions % ring.shape[0]
            if name == "window":
                for layer, layer_ring in enumerate(self.window[: self.config.num_hidden_layers]):
                    layer_ring[slot, ring_rows] = rows[:, layer]
            elif channels:
                ring[ring_rows, :channels] = rows
            else:
                ring[ring_rows] = rows

    @staticmethod
    def blocks_needed(num_tokens: int) -> int:
        return -(-num_tokens // BLOCK_SIZE)

    @property
    def uses_blocks(self) -> bool:
        return self.layout.block_numel > 0
