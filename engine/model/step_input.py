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
    # DeepSeek-V4.1's prompt truncation: positions before this skip the YOCO consumer layers
    keep_from: int = 0


@dataclass
class StepInput:
    """The tokens of one step. A decode step (one token per sequence) is tensors only, so that a
    compiled step can take it as is; a prefill step also keeps its per-sequence slices."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slices: list[SeqSlice] = field(default_factory=list)  # prefill
    slots: torch.Tensor | None = None  # [B] (decode)
    block_tables: torch.Tensor | None = None  # [B, max_blocks] (decode): padded with any block
    # [T, n]: the n token ids before each token, nearest first, -1 before the sequence's start
    # (DeepSeek-V4.1's Engram n-gram windows; None for a model without them)
    ngram_context: torch.Tensor | None = None
    # [B] (decode): a prompt's one-token chunk may sit within a window of its truncation point,
    # where the consumer layers' window must not reach before it (None: nothing to hide)
    keep_from: torch.Tensor | None = None
    # DeepSeek-V4.1's images (common/images.py): which rows are positions of an image's span [T],
    # and the vision encoder's rows for them, in row order [image rows, hidden]
    image_rows: torch.Tensor | None = None
    image_embeds: torch.Tensor | None = None

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
            if any(s.keep_from for s in slices):
                step.keep_from = torch.tensor([s.keep_from for s in slices], dtype=torch.long, device=device)
        return step


def ngram_context(before: list[int], chunk: list[int], n: int) -> torch.Tensor:
    """[len(chunk), n]: for each token of `chunk`, the n token ids before it, nearest first, -1
    before the sequence's start; `before` holds the (up to n) tokens that precede the chunk."""
    tokens = [-1] * (n - len(before)) + list(before) + list(chunk)
    return torch.tensor([tokens[i + n - 1 :: -1][:n] for i in range(len(chunk))])
