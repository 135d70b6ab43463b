"""One sequence's inference state as a self-contained snapshot, for handing it between engines.

Prefill exports the state of a prompt; decode (another process, another machine) imports it
and continues exactly where prefill stopped. A snapshot holds the sequence's block rows
(compressed entries and indexer keys), its slot state (window rings, compressors' open
windows), the tokens the state was computed from and the sampling seed. It serialises to
safetensors bytes; its `layout` names the format version, model config and dtype, and an
engine refuses a snapshot whose layout is not its own.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import torch
from safetensors.torch import load, save

from engine.config import BLOCK_SIZE, ModelConfig
from engine.errors import EngineError

FORMAT_VERSION = 2  # 2: the last computed token's hidden state


class SnapshotError(EngineError):
    """A snapshot this engine cannot use: unreadable, or of another layout."""


def layout_id(config: ModelConfig, dtype: torch.dtype, weights: str = "") -> str:
    """Names everything a snapshot's bytes depend on (format, config, dtype, the checkpoint's
    weights); equal ids mean interchangeable state."""
    described = json.dumps(
        {
            "format": FORMAT_VERSION,
            "block": BLOCK_SIZE,
            "dtype": str(dtype),
            "config": config.to_dict(),
            "weights": weights,
        },
        sort_keys=True,
    )
    return f"v{FORMAT_VERSION}-{hashlib.sha256(described.encode()).hexdigest()[:16]}"


@dataclass
class StateSnapshot:
    layout: str
    token_ids: list[int]  # prompt, then the tokens generated so far
    prompt_len: int
    num_computed: int  # the state covers token_ids[:num_computed]
    seed: int
    blocks: torch.Tensor  # [ceil(num_computed / 128), block row]
    slot: dict[str, torch.Tensor] = field(default_factory=dict)  # window rings and open windows
    # the final hidden state of token num_computed - 1: its logits give the next token, so a
    # prompt that is exactly these tokens is answered without computing any of them again
    last_hidden: torch.Tensor | None = None

    def to_bytes(self) -> bytes:
        meta = {
            "layout": self.layout,
            "token_ids": json.dumps(self.token_ids),
            "prompt_len": str(self.prompt_len),
            "num_computed": str(self.num_computed),
            "seed": str(self.seed),
        }
        tensors = {"blocks": self.blocks.contiguous(), **{f"slot.{k}": v.contiguous() for k, v in self.slot.items()}}
        if self.last_hidden is not None:
            tensors["last_hidden"] = self.last_hidden.contiguous()
        return save(tensors, metadata=meta)

    @classmethod
    def from_bytes(cls, data: bytes) -> StateSnapshot:
        try:
            header_len = int.from_bytes(data[:8], "little")
            meta = json.loads(data[8 : 8 + header_len])["__metadata__"]
            tensors = load(data)
            last_hidden = tensors.pop("last_hidden", None)
            return cls(
                layout=meta["layout"],
                token_ids=json.loads(meta["token_ids"]),
                prompt_len=int(meta["prompt_len"]),
                num_computed=int(meta["num_computed"]),
                seed=int(meta["seed"]),
                blocks=tensors.pop("blocks"),
                slot={k.removeprefix("slot."): v for k, v in tensors.items()},
                last_hidden=last_hidden,
            )
        except Exception as err:  # any malformed input is the same problem for the caller
            raise SnapshotError(f"unreadable state snapshot: {err}") from err
