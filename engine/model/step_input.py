"""What the model computes in one step: a flat list of tokens from many sequences, and where
each sequence's tokens sit in the paged state. Shared by every model family of engine/model/."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SeqSlice:
    """The tokens of one sequence computed in this step: positions start .. start + length - 1."""

    slot: int
    start: int
    length: int
    block_table: list[int]


@dataclass
class StepInput:
    """The tokens of one step. A decode step (one token per sequence) is tensors only, so that a
    compiled step can take it as is; a prefill step also keeps its per-sequence slices."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slices: list[SeqSlice] = field(default_factory=list)  # prefill
    slots: torch.Tensor | None = None  # [B] (decode)
    block_tables: torch.Tensor | None = None  # [B, max_blocks] (decode): padded with any block

    @property
    def is_decode(self) -> bool:
        return self.slots is not None

    @classmethod
    def of(cls, input_ids: torch.Tensor, slices: list[SeqSlice]) -> StepInput:
        """The step computing these sequence slices: a decode step when each is one token."""
        device = input_ids.device
        positions = [p for s in slices for p in range(s.start, s.start + s.length)]
        step = cls(input_ids, torch.tensor(positions, dtype=torch.long, device=device), slices)
        if all(s.length == 1 for s in slices):
            width = max(1, max(len(s.block_table) for s in slices))
            table = [s.block_table + [0] * (width - len(s.block_table)) for s in slices]
            step.slots = torch.tensor([s.slot for s in slices], dtype=torch.long, device=device)
            step.block_tables = torch.tensor(table, dtype=torch.long, device=device)
        return step
