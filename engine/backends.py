"""Kernel backends: the hot operations of the model, swappable per device.

The PyTorch reference backend is the default and is correct on every device. A faster
backend (Triton, FlashMLA, DeepGEMM on a GPU) registers itself with a `supports(device)`
check, so it is chosen only where its imports succeed and the hardware fits; any backend
must give the same results as the reference within the parity tests' tolerance.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.errors import EngineError


class TorchBackend:
    """Reference implementations in plain PyTorch."""

    name = "torch"

    @staticmethod
    def attention(
        q: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor, sinks: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        """Shared-KV attention with one sink logit per head.

        q [B, H, S, d], keys [B, K, d] (the single KV head: keys and values at once),
        bias [B, S, K] (0 or -inf) -> [B, S, H, d].
        """
        b, h, s, d = q.shape
        # heads and queries folded into one axis so the single KV head is never copied per head
        logits = torch.bmm(q.reshape(b, h * s, d), keys.transpose(1, 2)).view(b, h, s, -1)
        logits = logits * scaling + bias.unsqueeze(1)
        sink_logits = sinks.view(1, -1, 1, 1).expand(b, h, s, 1).to(logits.dtype)
        logits = torch.cat([logits, sink_logits], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = logits.softmax(dim=-1)[..., :-1].to(keys.dtype)
        return torch.bmm(probs.reshape(b, h * s, -1), keys).view(b, h, s, d).transpose(1, 2)

    @staticmethod
    def routed_experts(
        x: torch.Tensor,  # [T, D]
        indices: torch.Tensor,  # [T, k] expert ids
        weights: torch.Tensor,  # [T, k]
        gate_up: torch.Tensor,  # [E, 2I, D]: gate rows, then up rows
        down: torch.Tensor,  # [E, D, I]
        limit: float,
    ) -> torch.Tensor:
        """Clamped-SwiGLU experts, tokens grouped by expert so each expert runs one matmul pair."""
        top_k = indices.shape[1]
        flat = indices.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
        tokens_of = order // top_k
        flat_weights = weights.flatten()
        out = torch.zeros_like(x)
        begin = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = order[begin : begin + count]
            tokens = tokens_of[begin : begin + count]
            begin += count
            gate, up = F.linear(x[tokens], gate_up[expert]).chunk(2, dim=-1)
            hidden = F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)
            y = F.linear(hidden, down[expert]) * flat_weights[rows].unsqueeze(1)
            out.index_add_(0, tokens, y.to(out.dtype))
        return out


@dataclass
class _Entry:
    factory: Callable[[], object]
    supports: Callable[[torch.device], bool]


_REGISTRY: dict[str, _Entry] = {"torch": _Entry(TorchBackend, lambda device: True)}


def register_backend(name: str, factory: Callable[[], object], supports: Callable[[torch.device], bool]) -> None:
    """Make a backend selectable; later registrations are preferred over earlier ones."""
    _REGISTRY[name] = _Entry(factory, supports)


def available_backends(device: torch.device | str) -> list[str]:
    device = torch.device(device)
    return [name for name, entry in _REGISTRY.items() if entry.supports(device)]


def select_backend(device: torch.device | str, name: str | None = None):
    """The named backend, or the most recently registered one that supports the device."""
    device = torch.device(device)
    if name is not None:
        entry = _REGISTRY.get(name)
        if entry is None:
            raise EngineError(f"unknown kernel backend {name!r}; registered: {sorted(_REGISTRY)}")
        if not entry.supports(device):
            raise EngineError(f"kernel backend {name!r} does not support device {device}")
        return entry.factory()
    return _REGISTRY[available_backends(device)[-1]].factory()
