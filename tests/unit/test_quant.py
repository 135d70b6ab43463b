"""Block-scaled FP8 and FP4: dequantization against the same math written out by hand, on
shapes with partial edge tiles, every scale storage, and quantization error bounds."""

from __future__ import annotations

import pytest
import torch

from engine.checkpoint.quant import dequantize_fp4, dequantize_fp8, quantize_fp4, quantize_fp8
from tests.support.models import dequantized_by_hand


def _random_fp8(shape, gen) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)


def test_fp8_blocks_with_partial_edge_tiles_in_both_dims():
    gen = torch.Generator().manual_seed(0)
    values = _random_fp8((300, 260), gen)  # 3 x 3 tiles of 128, the last ones partial
    scale = torch.exp2(torch.randint(-10, 3, (3, 3), generator=gen).float())
    expected = dequantized_by_hand(values, scale)
    assert torch.equal(dequantize_fp8(values, scale, (128, 128), torch.float32), expected)
    # the same powers of two as float8_e8m0fnu and as raw exponent bytes
    assert torch.equal(dequantize_fp8(values, scale.to(torch.float8_e8m0fnu), (128, 128), torch.float32), expected)
    exponent_bytes = (torch.log2(scale) + 127).to(torch.uint8)
    assert torch.equal(dequantize_fp8(values, exponent_bytes, (128, 128), torch.float32), expected)
    # stacked experts [E, N, K]: one grid per expert
    stacked = torch.stack([values, values.float().neg().to(torch.float8_e4m3fn)])
    out = dequantize_fp8(stacked, torch.stack([scale, 2 * scale]), (128, 128), torch.bfloat16)
    assert torch.equal(out[1], (-2 * expected).to(torch.bfloat16))


def test_fp4_groups_of_32():
    gen = torch.Generator().manual_seed(1)
    packed = torch.randint(-128, 128, (40, 48), generator=gen, dtype=torch.int8)  # 96 inputs: 3 groups a row
    scale = torch.exp2(torch.randint(-6, 2, (40, 3), generator=gen).float()).to(torch.float8_e8m0fnu)
    assert torch.equal(dequantize_fp4(packed, scale, torch.float32), dequantized_by_hand(packed, scale))


@pytest.mark.parametrize("scale_fmt", ["float", "ue8m0"])
def test_quantization_error_is_within_the_format(scale_fmt):
    weight = torch.randn(300, 260, generator=torch.Generator().manual_seed(2))
    values, scale = quantize_fp8(weight, (128, 128), scale_fmt)
    assert values.dtype == torch.float8_e4m3fn and scale.shape == (3, 3)
    step = dequantized_by_hand(torch.ones(300, 260).to(torch.float8_e4m3fn), scale)  # each value's scale
    error = (dequantize_fp8(values, scale, (128, 128), torch.float32) - weight).abs()
    # e4m3 keeps 3 mantissa bits (half a step is 1/16 of a value); below 2^-6 steps are 2^-9
    assert (error <= weight.abs() / 16 + step * 2**-10).all()

    packed, scale = quantize_fp4(weight, scale_fmt)
    assert packed.shape == (300, 130) and scale.shape == (300, 9)
    step = scale.float().repeat_interleave(32, dim=-1)[:, :260]
    error = (dequantize_fp4(packed, scale, torch.float32) - weight).abs()
    assert (weight.abs() <= 6 * step * (1 + 1e-6)).all()  # no value beyond e2m1's largest, 6
    assert (error <= step).all()  # e2m1's widest gap (4 -> 6) is 2 steps
