"""Partial, interleaved rotary position embedding as DeepSeek-V4 uses it.

Only the trailing `rope_head_dim` channels of a head rotate, and they rotate in
adjacent pairs (2i, 2i+1). Sliding-only layers use the `main` frequencies, layers with
a compressor use the `compress` ones (larger theta, optionally YaRN-scaled).
"""

from __future__ import annotations

import math
from typing import Any

import torch


def inverse_frequencies(params: dict[str, Any], rope_dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """Per-pair inverse frequencies and the cos/sin scale for one rope type."""
    base = float(params["rope_theta"])
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.float32, device="cpu") / rope_dim
    inv_freq = 1.0 / (base**exponents)
    if params.get("rope_type", "default") != "yarn":
        return inv_freq, 1.0
    return _yarn(params, inv_freq, base, rope_dim, max_positions)


def _yarn(
    params: dict[str, Any], inv_freq: torch.Tensor, base: float, dim: int, max_positions: int
) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071): interpolate low frequencies, keep high ones, blend in between."""
    original_max = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_positions / original_max

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        if params.get("mscale") and params.get("mscale_all_dim"):
            attention_factor = mscale(factor, params["mscale"]) / mscale(factor, params["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original_max / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(params.get("beta_fast") or 32), correction_dim(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # share of the original (extrapolated) frequency
    inv_freq = (inv_freq / factor) * (1 - keep) + inv_freq * keep
    return inv_freq, float(attention_factor)


class RotaryEmbedding:
    """cos / sin for arbitrary absolute positions, one entry per rotating pair."""

    def __init__(self, params: dict[str, Any], rope_dim: int, max_positions: int):
        # computed on the CPU even while a model is built on the meta device
        self.inv_freq, self.scale = inverse_frequencies(params, rope_dim, max_positions)

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq
        return (freqs.cos() * self.scale).to(dtype), (freqs.sin() * self.scale).to(dtype)


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate, in place, the trailing `2 * cos.shape[-1]` channels of x; returns x.

    cos / sin broadcast over x[..., :half]. Only the rotating slice is touched, so the
    non-rotating channels (3/4 of a head in V4) are never copied.
    """
    half = cos.shape[-1]
    pairs = x[..., -2 * half :].unflatten(-1, (half, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    e, o, cos, sin = even.float(), odd.float(), cos.float(), sin.float()
    rotated_even, rotated_odd = e * cos - o * sin, o * cos + e * sin
    even.copy_(rotated_even)
    odd.copy_(rotated_odd)
    return x
