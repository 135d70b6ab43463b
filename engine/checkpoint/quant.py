"""Block-scaled FP8 and FP4 weights, as DeepSeek publishes its checkpoints.

- FP8: e4m3 values; one scale per `block` (128 x 128) tile of the last two dims, the last
  tiles partial when a dim is not a multiple of the block. A weight is value * scale.
- FP4 (routed experts, `expert_dtype: fp4`): e2m1 values packed two per byte, the first
  of each pair in the low nibble, with one scale per 32 consecutive inputs of a row.
- Scales are float32 (`scale_fmt: float`) or powers of two (`ue8m0`), stored as
  float8_e8m0fnu, as raw exponent bytes (uint8, value 2^(b-127)) or as float32 values.

The engine dequantizes at load (`dequantize_*`); `quantize_*` exist for `deepmesh
make-model`, which writes checkpoints in these layouts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
FP4_GROUP = 32
FP4_MAX = 6.0
# e2m1 code -> value (bit 3 is the sign)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e8m0fnu, torch.uint8)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def scale_values(scale: torch.Tensor) -> torch.Tensor:
    """A scale tensor as float32, whichever way it is stored."""
    if scale.dtype == torch.uint8:  # ue8m0 exponent bytes
        return torch.exp2(scale.float() - 127.0)
    return scale.float()


def fp8_scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    return (*shape[:-2], ceil_div(shape[-2], block[0]), ceil_div(shape[-1], block[1]))


def fp4_scale_shape(unpacked_shape: tuple[int, ...]) -> tuple[int, ...]:
    return (*unpacked_shape[:-1], ceil_div(unpacked_shape[-1], FP4_GROUP))


def _apply_block_scales(values: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """values [..., N, K] (float32) times one scale per block tile, in place where it can."""
    *lead, n, k = values.shape
    bn, bk = block
    pad_n, pad_k = ceil_div(n, bn) * bn - n, ceil_div(k, bk) * bk - k
    if pad_n or pad_k:
        values = F.pad(values, (0, pad_k, 0, pad_n))
    tiles = values.view(*lead, ceil_div(n, bn), bn, ceil_div(k, bk), bk)
    tiles.mul_(scales.unsqueeze(-1).unsqueeze(-3))
    return values[..., :n, :k] if pad_n or pad_k else values


def dequantize_fp8(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """e4m3 weight [..., N, K] and its block scales [..., ceil(N/bn), ceil(K/bk)] -> `dtype`."""
    return _apply_block_scales(weight.float(), scale_values(scale), block).to(dtype)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """int8/uint8 [..., K/2] holding two e2m1 codes per byte -> float32 [..., K]."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    codes = packed.view(torch.uint8)
    pairs = torch.stack([table[(codes & 0x0F).long()], table[(codes >> 4).long()]], dim=-1)
    return pairs.flatten(-2)


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Packed e2m1 weight [..., N, K/2] and its scales [..., N, ceil(K/32)] -> `dtype` [..., N, K]."""
    return _apply_block_scales(unpack_fp4(packed), scale_values(scale), (1, FP4_GROUP)).to(dtype)


def _round_scales(amax: torch.Tensor, top: float, scale_fmt: str) -> torch.Tensor:
    scales = torch.where(amax > 0, amax / top, torch.ones_like(amax))
    if scale_fmt == "ue8m0":  # the next power of two up, so no value overflows
        scales = torch.exp2(torch.ceil(torch.log2(scales)))
    return scales


def _stored_scales(scales: torch.Tensor, scale_fmt: str) -> torch.Tensor:
    return scales.to(torch.float8_e8m0fnu) if scale_fmt == "ue8m0" else scales


def quantize_fp8(
    weight: torch.Tensor, block: tuple[int, int] = (128, 128), scale_fmt: str = "float"
) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., N, K] -> (e4m3 values, block scales) with weight ~= value * scale."""
    *lead, n, k = weight.shape
    bn, bk = block
    padded = F.pad(weight.float(), (0, ceil_div(k, bk) * bk - k, 0, ceil_div(n, bn) * bn - n))
    tiles = padded.view(*lead, ceil_div(n, bn), bn, ceil_div(k, bk), bk)
    scales = _round_scales(tiles.abs().amax(dim=(-3, -1)), FP8_MAX, scale_fmt)
    values = (tiles / scales.unsqueeze(-1).unsqueeze(-3)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return values.view(padded.shape)[..., :n, :k].contiguous(), _stored_scales(scales, scale_fmt)


def quantize_fp4(weight: torch.Tensor, scale_fmt: str = "ue8m0") -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., N, K] (K even) -> (int8 [..., N, K/2] packed e2m1, scales [..., N, ceil(K/32)])."""
    *lead, n, k = weight.shape
    if k % 2:
        raise ValueError(f"FP4 packs two values per byte: the last dim ({k}) must be even")
    padded = F.pad(weight.float(), (0, ceil_div(k, FP4_GROUP) * FP4_GROUP - k))
    groups = padded.view(*lead, n, -1, FP4_GROUP)
    scales = _round_scales(groups.abs().amax(dim=-1), FP4_MAX, scale_fmt)
    scaled = (groups / scales.unsqueeze(-1)).flatten(-2)[..., :k]
    table = torch.tensor(E2M1_VALUES[:8])
    # nearest magnitude code, ties to the smaller one; sign in bit 3
    codes = (scaled.abs().unsqueeze(-1) - table).abs().argmin(dim=-1).to(torch.uint8)
    codes |= (scaled < 0).to(torch.uint8) << 3
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.view(torch.int8), _stored_scales(scales, scale_fmt)
