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
import sys
from dataclasses import dataclass, field

import torch
from safetensors import TensorSpec, serialize
from safetensors.torch import load, save

from common.blocks import BLOCK_SIZE
from engine.config import ModelConfig
from engine.config_v41 import V41Config
from engine.errors import EngineError

FORMAT_VERSION = 2  # 2: the last computed token's hidden state


class SnapshotError(EngineError):
    """A snapshot this engine cannot use: unreadable, or of another layout."""


def layout_id(config: ModelConfig | V41Config, dtype: torch.dtype, weights: str = "") -> str:
    """Names everything a snapshot's bytes depend on (format, config, dtype, the checkpoint's
    weights, V4.1's prompt truncation); equal ids mean interchangeable state."""
    described = {
        "format": FORMAT_VERSION,
        "block": BLOCK_SIZE,
        "dtype": str(dtype),
        "config": config.to_dict(),
        "weights": weights,
    }
    if keep := getattr(config, "prefill_keep_tokens", 0):
        described["prefill_keep_tokens"] = keep
    described = json.dumps(described, sort_keys=True)
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
        tensors = {"blocks": self.blocks, **{f"slot.{k}": v for k, v in self.slot.items()}}
        if self.last_hidden is not None:
            tensors["last_hidden"] = self.last_hidden
        return safetensors_bytes(tensors, meta)

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

    # -- as a prefix cache entry: shareable full blocks apart from the rest ---------------------

    def split(self) -> tuple[list[int], bytes, list[bytes]]:
        """(tokens, head, block rows): the state of exactly the computed tokens, as the KV cache
        stores it. Each full 128-token block's row is its own blob, equal for every prompt that
        starts with the same blocks (the cache stores it once); the head holds the rest (the
        partial last block, the slot state, the last hidden state) and is canonical: it names no
        request (no generated tokens, seed 0)."""
        tokens = self.token_ids[: self.num_computed]
        full = len(tokens) // BLOCK_SIZE
        width = self.blocks.shape[1] if self.blocks.ndim == 2 else 0
        rows = [_row_bytes(self.blocks[i]) for i in range(full)] if width else [b""] * full
        head = StateSnapshot(
            self.layout,
            tokens,
            len(tokens),
            len(tokens),
            0,
            self.blocks[full:] if width else self.blocks,
            self.slot,
            self.last_hidden,
        )
        return tokens, head.to_bytes(), rows

    @classmethod
    def joined(cls, head: bytes, rows: list[bytes]) -> StateSnapshot:
        """The snapshot `split` took apart, or SnapshotError if the parts do not fit together.

        Put together as bytes, with no tensor operator: loads run on fetch threads, and an
        operator there would start a second OpenMP pool next to the engine's (see
        common.worker.run_workers).
        """
        snapshot = cls.from_bytes(head)
        tail = snapshot.blocks
        if len(rows) != snapshot.num_computed // BLOCK_SIZE:
            raise SnapshotError(f"{len(rows)} block rows for a state of {snapshot.num_computed} tokens")
        if not rows or tail.ndim != 2 or tail.shape[1] == 0:
            return snapshot
        row_size = tail.shape[1] * tail.element_size()
        if any(len(row) != row_size for row in rows):
            raise SnapshotError(f"a block row of the wrong size (expected {row_size} bytes)")
        data = bytearray(b"".join(rows) + _row_bytes(tail.reshape(-1)))
        snapshot.blocks = torch.frombuffer(data, dtype=tail.dtype).view(len(rows) + tail.shape[0], tail.shape[1])
        return snapshot


_NO_BYTES = torch.zeros(1, dtype=torch.uint8)  # where an empty tensor's data points: never at address 0


def safetensors_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """The bytes `safetensors.torch.save` writes, through the library's own `serialize` (the
    metadata's keys in whatever order it writes them: `save` fixes none either). `save` first
    checks every tensor's storage against the others' and wraps each in a NumPy array over ctypes:
    0.8 of the 0.9 ms a 16-token snapshot's 21 tensors took, on a fetch thread that holds the
    interpreter lock while the first token goes out. tests/unit/test_state_transfer.py holds these
    bytes to `save`'s."""
    # contiguous CPU tensors, which this dict keeps alive until `serialize` has copied them
    tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in tensors.items()}
    if sys.byteorder == "big":  # safetensors is little-endian: the library swaps each tensor's bytes
        return save(tensors, metadata=metadata)
    specs = {
        name: TensorSpec(
            dtype=str(tensor.dtype).split(".")[-1],
            shape=tensor.shape,
            data_ptr=tensor.data_ptr() if tensor.numel() else _NO_BYTES.data_ptr(),
            data_len=tensor.numel() * tensor.element_size(),
        )
        for name, tensor in tensors.items()
    }
    return serialize(specs, metadata=metadata)


def _row_bytes(row: torch.Tensor) -> bytes:
    """A tensor's raw bytes (its dtype and shape are the head's to say)."""
    return row.contiguous().view(torch.uint8).numpy().tobytes()
