"""DeepSeek-V4.1's vision tower (engine/model/vision.py) against DeepInfer's own modules and references.

The oracles are DeepInfer 0.1.0's: `rgb_pad_to_patches_ref`, `batch_downsample_ref` and
`replace_input_embeds_ref` (image_embed_ops.py), its image layout (`load_image_anyres`, which
also gives each patch's row and column for the rotary embedding), its checkpoint names
(hugging_face/names.py), its `MlpProjector` and its `VisionTransformer` module itself. The ViT's
module calls four CUDA kernels (GEMM, RMSNorm, rotary, flash attention); here they are replaced
by DeepInfer's `norm_ref` and by the plain-torch forms of what those kernels compute, so the
module's own structure (block order, the rotary table and its gather, the residuals, the fixed
constants) is what the tower is held against. A second reading of the layout is deepseek-recipe's:
the number of prompt tokens it charges an image is the span the tower fills.
"""

from __future__ import annotations

import base64
import io
import itertools
import types

import deepseek_recipe as recipe
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from common.images import ImageGrid
from engine.model.vision import VisionConfig, VisionEncoder, downsample, image_patches
from tests.support.deepinfer_reference import (
    checkpoint_names,
    image_processor,
    requires_reference,
    tilelang_op,
    vision_module,
)

TINY = VisionConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=176)


def random_pixels(width: int, height: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (height, width, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def random_encoder(config: VisionConfig, text_hidden: int, seed: int = 0) -> VisionEncoder:
    encoder = VisionEncoder(config, text_hidden)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in encoder.named_parameters():
            scale = 0.1 if name.endswith("norm.weight") or name.endswith(("norm1.weight", "norm2.weight")) else 0.05
            base = 1.0 if name.endswith("weight") and "norm" in name else 0.0
            parameter.copy_(base + scale * torch.randn(parameter.shape, generator=gen))
    return encoder


def png_data_url(width: int, height: int, seed: int = 0) -> str:
    buffer = io.BytesIO()
    Image.fromarray(random_pixels(width, height, seed).numpy()).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@requires_reference
@pytest.mark.parametrize(("width", "height"), [(42, 42), (630, 476), (14, 700), (1568, 1050), (28, 14)])
def test_the_span_is_deepinfers_layout(width: int, height: int):
    tokens, _, _, crop, positions, types_ = image_processor().load_image_anyres((width, height), 14, 3, 10**6)
    grid = ImageGrid.of(width, height, 14, 3)
    assert grid.num_tokens == tokens == len(types_)
    assert [grid.patches_w, grid.patches_h] == crop[0].tolist()
    # the patches' (row, column) in scanline order: what the rotary embedding turns by
    rows = torch.arange(grid.patches_h).repeat_interleave(grid.patches_w)
    assert torch.equal(positions, torch.stack([rows, torch.arange(grid.patches_w).repeat(grid.patches_h)], -1))


@pytest.mark.parametrize(("width", "height"), [(64, 48), (640, 480), (1000, 30), (3000, 2000), (5, 5)])
def test_deepseek_recipe_charges_an_image_the_span_the_tower_fills(width: int, height: int):
    """The recipe resizes the image (patch-aligned) and counts its tokens; the tower's span over the
    resized image must be that count, or prompt positions and rows would disagree."""
    resolver = recipe.ImageResolver(recipe.ReqwestImageFetcher(), recipe.OpenCvImagePreprocessor())
    resolved = resolver.resolve([recipe.DataUrlImageSource(png_data_url(width, height))], recipe.ImageQuota())
    (image,) = resolved.images
    assert image.width % 14 == 0 and image.height % 14 == 0
    decoded = Image.open(io.BytesIO(image.data))
    assert decoded.size == (image.width, image.height)
    assert ImageGrid.of(image.width, image.height, 14, 3).num_tokens == resolved.image_token_adjustment() + 1


@requires_reference
@pytest.mark.parametrize(("width", "height", "grid"), [(42, 42, (3, 3)), (37, 20, (3, 2)), (9, 40, (1, 3))])
def test_patches_are_rgb_pad_to_patches_ref(width: int, height: int, grid: tuple[int, int]):
    pixels = random_pixels(width, height, seed=width)
    layout = ImageGrid(grid[0], grid[1], 1, 1)
    reference = tilelang_op("image_embed_ops").rgb_pad_to_patches_ref(
        pixels.reshape(-1),
        torch.tensor([0, pixels.numel()]),
        torch.tensor([[width, height]]),
        torch.tensor([list(grid)]),
        torch.tensor([0, grid[0] * grid[1]]),
        grid[0] * grid[1],
        14,
        0.5,
        0.5,
        127.0,
    )
    assert torch.equal(image_patches(pixels, layout, VisionConfig()), reference)


@requires_reference
@pytest.mark.parametrize(("patches_w", "patches_h"), [(6, 9), (7, 5), (1, 1), (4, 4)])
def test_downsampling_is_batch_downsample_ref(patches_w: int, patches_h: int):
    grid = ImageGrid.of(patches_w * 14, patches_h * 14, 14, 3)
    features = torch.randn(patches_w * patches_h, 8, generator=torch.Generator().manual_seed(patches_w))
    reference = tilelang_op("image_embed_ops").batch_downsample_ref(features, torch.tensor([[patches_w, patches_h]]), 3)
    assert torch.equal(downsample(features, grid, 3), reference)


# -- DeepInfer's ViT module, its kernels replaced by their plain-torch forms -----------------------


def _linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, w, bias)


def _rotary_in_place(q: torch.Tensor, cos_sin: torch.Tensor, k: torch.Tensor, interleaved: bool) -> None:
    """tile_kernels' `apply_rotary(q, cos_sin, k)`: cos_sin [n, 2 * rotary_half] holds cos then sin
    of the rotary half-dimensions; rotate-half (not interleaved) over the first 2 * rotary_half dims."""
    assert not interleaved
    half = cos_sin.shape[-1] // 2
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]
    for x in (q, k):
        x1, x2 = x[..., :half].clone(), x[..., half : 2 * half].clone()
        x[..., :half] = x1 * cos - x2 * sin
        x[..., half : 2 * half] = x2 * cos + x1 * sin


def _flash_attention(q, k, v, *, cu_seqlens_q, softmax_scale, causal, **_):
    assert softmax_scale is None and not causal
    out = torch.empty_like(q)
    bounds = cu_seqlens_q.tolist()
    for start, end in itertools.pairwise(bounds):
        out[start:end] = F.scaled_dot_product_attention(*(t[start:end].transpose(0, 1) for t in (q, k, v))).transpose(
            0, 1
        )
    return out, None


def _deepinfer_tower(
    config: VisionConfig, text_hidden: int, monkeypatch: pytest.MonkeyPatch
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """DeepInfer's VisionTransformer at `config`'s sizes (its module constants) and its MlpProjector;
    the kernels stay replaced for the rest of the test."""
    vit, projector = vision_module("vit"), vision_module("mlp_projector")
    norm_ref = tilelang_op("norm").norm_ref

    def norm(x, weight, residual=None, eps=1e-6):
        return norm_ref(x, weight, eps, residual)

    class CpuRotary(torch.nn.Module):  # DeepInfer's, with its frequencies built on the CPU
        def __init__(self, dim: int, theta: float = 10000.0):
            super().__init__()
            self.inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))

        forward = vit.VisionRotaryEmbedding.forward

    patched = {
        "EMBED_DIM": config.hidden_size,
        "DEPTH": config.num_hidden_layers,
        "NUM_HEADS": config.num_attention_heads,
        "MULTIPLE_OF": 16,  # with MLP_RATIO 2.7: 64 * 2.7 -> 176, TINY's intermediate_size
        "_linear": _linear,
        "norm": norm,
        "apply_rotary": _rotary_in_place,
        "_flash_attn_fwd": _flash_attention,
        "swiglu_forward": lambda x, dtype: F.silu(x.chunk(2, -1)[0]) * x.chunk(2, -1)[1],
        "dtype_to_str": str,
        "VisionRotaryEmbedding": CpuRotary,
    }
    for name, value in patched.items():
        monkeypatch.setattr(vit, name, value)
    tower = vit.VisionTransformer(recomputing_every_layer=2)
    cfg = types.SimpleNamespace(
        projector_type="downsample_mlp_gelu",
        input_dim=config.hidden_size,
        downsample_ratio=config.downsample_ratio,
        hidden_size=text_hidden,
        depth=2,
    )
    return tower, projector.MlpProjector(cfg)


@requires_reference
@pytest.mark.parametrize(("width", "height"), [(42, 42), (70, 28), (40, 30)])
def test_span_rows_are_deepinfers_from_pixels_to_prompt_rows(width: int, height: int, monkeypatch: pytest.MonkeyPatch):
    """One image end to end through DeepInfer's pipeline (patches, ViT, downsampling, aligner, the
    START / NEWLINE / END rows written into a prompt's embeddings) and through VisionEncoder."""
    text_hidden = 48
    ours = random_encoder(TINY, text_hidden, seed=width)
    tower, aligner = _deepinfer_tower(TINY, text_hidden, monkeypatch)
    names = checkpoint_names()
    theirs = {}
    for name, tensor in ours.state_dict().items():
        mapped = names.hf_to_model(name, n_layer=4)
        theirs[mapped] = tensor
    tower.load_state_dict(
        {
            n.removeprefix("vision_pipeline.aligner.visual_encoder."): t
            for n, t in theirs.items()
            if ".visual_encoder." in n
        }
    )
    aligner.load_state_dict(
        {n.removeprefix("vision_pipeline.aligner.aligner."): t for n, t in theirs.items() if ".aligner.aligner." in n}
    )

    ops, processor = tilelang_op("image_embed_ops"), image_processor()
    pixels = random_pixels(width, height, seed=height)
    grid = ours.grid(width, height)
    tokens, _, _, crop, positions, token_types = processor.load_image_anyres((width, height), 14, 3, 10**6)
    patches = ops.rgb_pad_to_patches_ref(
        pixels.reshape(-1),
        torch.tensor([0, pixels.numel()]),
        torch.tensor([[width, height]]),
        crop,
        torch.tensor([0, crop[0, 0] * crop[0, 1]]),
        int(crop[0, 0] * crop[0, 1]),
        14,
        0.5,
        0.5,
        127.0,
    )
    with torch.inference_mode():  # as DeepInfer runs it (its rotary writes q and k in place)
        features = tower(patches.float(), positions, torch.tensor([0, len(positions)]), len(positions))
        image_rows = aligner.layers(ops.batch_downsample_ref(features, crop, 3))
    prompt = torch.zeros(tokens, text_hidden)
    special = torch.tensor([5, 3, 4], dtype=torch.int32)  # TokenType: IMAGE_NEW_LINE, IMAGE_START, IMAGE_END
    rows = torch.stack([theirs[f"module.module.0.params.image_{n}"] for n in ("newline", "start", "end")])
    ops.replace_input_embeds_ref(prompt, token_types, image_rows, 2, special, rows)

    span = ours.span_rows(pixels)
    assert span.shape == (grid.num_tokens, text_hidden) == prompt.shape
    torch.testing.assert_close(span, prompt, rtol=1e-4, atol=1e-5)
