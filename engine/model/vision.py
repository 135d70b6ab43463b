"""DeepSeek-V4.1's vision tower: an image's pixels in, the embedding rows of its span of the prompt out.

An image occupies `h * (w + 1) + 2` prompt positions: `[START] + ([IMAGE] * w + [NEWLINE]) * h +
[END]`, where (w, h) is its grid of 14-pixel patches divided by the downsampling ratio (3),
rounded up. The text model reads, at those positions, not token embeddings but the rows this
module computes (`VisionEncoder.span_rows`):
- the image, patch-aligned by deepseek-recipe's preprocessing, is centred on its patch grid and
  normalised to [-1, 1] (`image_patches`);
- a ViT: a linear patch embedding, pre-norm blocks (RMSNorm, bidirectional attention with a 2-D
  rotary embedding of each patch's row and column, SwiGLU), a final norm;
- each 3 x 3 neighbourhood of patch features (zero-padded at the right and bottom edges) is
  concatenated (`downsample`) and projected into the text model's width by a two-layer MLP
  with GELU (the "aligner");
- those rows fill the IMAGE positions in scanline order, and three learned rows the START,
  NEWLINE and END positions (`image_start`, `image_newline`, `image_end`).

The math follows DeepInfer 0.1.0 (`models/vision_encoder/`, `deepseek_vl.py`, the `*_ref`
functions of `image_embed_ops.py`); SGLang 0.5.23 (`deepseek_v41_vit.py`) reads the tower's
sizes from `vision_config`, which lets a small model (`--preset tiny-v41`) have a small tower.
Parameter names are the checkpoint's (`vision.blocks.0.attn.wqkv.weight`, `aligner.w1.weight`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from common.images import ImageGrid
from engine.errors import UnsupportedCheckpointError


@dataclass(frozen=True)
class VisionConfig:
    """`vision_config` of a V4.1 config.json, under its own key names (SGLang's
    `configs/deepseek_v41.py` reads the same). Defaults are the published tower's: DeepInfer fixes
    the tower's as constants (its SwiGLU width is 1024 * 2.7 rounded up to a multiple of 128); the
    geometry's are those of DeepSeek-V4.1-Flash's config.json as others report it."""

    hidden_size: int = 1024
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    intermediate_size: int = 2816
    patch_size: int = 14
    downsample_ratio: int = 3
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    # the preprocessing's geometry: deepseek-recipe resizes images to it; an image's span of the
    # prompt (START, NEWLINE and END included) is at most `max_image_tokens`
    max_image_tokens: int = 1024
    min_pixels: int = 295936
    max_wh_ratio: float | None = None
    # pixels are normalised as (x / 255 - mean) / std with the same value for every channel;
    # padding is the mean's colour (DeepInfer: `image_transform` 0.5 / 0.5, no config key)
    pixel_mean: float = 0.5
    pixel_std: float = 0.5

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> VisionConfig:
        config = cls(**{name: raw[name] for name in cls.__dataclass_fields__ if name in raw})
        if config.hidden_size % config.num_attention_heads or (config.hidden_size // config.num_attention_heads) % 4:
            raise UnsupportedCheckpointError(
                "vision_config: hidden_size / num_attention_heads must be a multiple of 4 (2-D rotary embedding)"
            )
        return config

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def pad_value(self) -> int:
        """The padding's byte value: DeepInfer truncates mean * 255 (0.5 -> 127)."""
        return max(0, min(255, int(self.pixel_mean * 255)))


def image_patches(pixels: torch.Tensor, grid: ImageGrid, config: VisionConfig) -> torch.Tensor:
    """[patches, 3, p, p] (bfloat16) from HWC uint8 `pixels`: centred on the grid's canvas of the
    padding colour, normalised through a table of the 256 byte values. DeepInfer's
    `rgb_pad_to_patches` writes bfloat16 whatever the tower's dtype; so does this."""
    p = config.patch_size
    height, width, _ = pixels.shape
    grid_w, grid_h = grid.patches_w * p, grid.patches_h * p
    if width > grid_w or height > grid_h:
        raise ValueError(f"an image of {width}x{height} does not fit its {grid_w}x{grid_h} patch grid")
    canvas = torch.full((grid_h, grid_w, 3), config.pad_value, dtype=torch.uint8)
    left, top = round((grid_w - width) * 0.5), round((grid_h - height) * 0.5)
    canvas[top : top + height, left : left + width] = pixels
    table = ((torch.arange(256, dtype=torch.float32) / 255.0 - config.pixel_mean) / config.pixel_std).bfloat16()
    chw = table[canvas.permute(2, 0, 1).long()]
    return (
        chw.reshape(3, grid.patches_h, p, grid.patches_w, p)
        .permute(1, 3, 0, 2, 4)
        .reshape(grid.patches_h * grid.patches_w, 3, p, p)
    )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (self.weight.float() * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class PatchEmbed(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.proj = nn.Linear(3 * config.patch_size**2, config.hidden_size)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.proj(patches.reshape(patches.shape[0], -1))


def rope_2d(grid: ImageGrid, config: VisionConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [patches, head_dim / 2] of each patch (scanline order): a quarter of the head's
    frequencies turn with the patch's row, the next quarter with its column; rotate-half pairs
    dimension d with d + head_dim / 2."""
    quarter = config.head_dim // 4
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, 2 * quarter, 2, dtype=torch.float32) / (2 * quarter)))
    rows = torch.arange(grid.patches_h).repeat_interleave(grid.patches_w)
    cols = torch.arange(grid.patches_w).repeat(grid.patches_h)
    angles = torch.cat([torch.outer(rows.float(), inv_freq), torch.outer(cols.float(), inv_freq)], dim=-1)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half (non-interleaved) rotary embedding of x [n, heads, head_dim]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.wqkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.wo = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.wqkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        # every patch of the image sees every other (no mask), softmax scale 1 / sqrt(head_dim)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        return self.wo(out.transpose(0, 1).reshape(x.shape[0], -1))


class SwiGLU(nn.Module):
    """w1 holds the gate's rows, then the up projection's: silu(gate) * up."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.w1 = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.norm1 = RMSNorm(config.hidden_size, config.norm_eps)
        self.attn = Attention(config)
        self.norm2 = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)

    def forward(self, patches: torch.Tensor, grid: ImageGrid) -> torch.Tensor:
        """[patches, hidden_size]: one image's patch features, scanline order."""
        cos, sin = rope_2d(grid, self.config)
        x = self.patch_embed(patches.to(self.patch_embed.proj.weight.dtype))
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x)


def downsample(features: torch.Tensor, grid: ImageGrid, ratio: int) -> torch.Tensor:
    """[rows_h * rows_w, hidden * ratio^2]: each ratio x ratio neighbourhood of patch features,
    channel by channel (F.unfold's order), the grid zero-padded at its right and bottom edges."""
    dim = features.shape[-1]
    image = features.reshape(grid.patches_h, grid.patches_w, dim)
    image = F.pad(image, (0, 0, 0, grid.rows_w * ratio - grid.patches_w, 0, grid.rows_h * ratio - grid.patches_h))
    return F.unfold(image.permute(2, 0, 1), kernel_size=ratio, stride=ratio).transpose(0, 1)


class Aligner(nn.Module):
    """The projector into the text model's width (`downsample_mlp_gelu`, depth 2)."""

    def __init__(self, config: VisionConfig, text_hidden: int):
        super().__init__()
        self.w1 = nn.Linear(config.hidden_size * config.downsample_ratio**2, text_hidden)
        self.w2 = nn.Linear(text_hidden, text_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class VisionEncoder(nn.Module):
    """The vision tower with its projector and the three learned rows of an image's span."""

    def __init__(self, config: VisionConfig, text_hidden: int):
        super().__init__()
        self.config = config
        self.vision = VisionTransformer(config)
        self.aligner = Aligner(config, text_hidden)
        self.image_start = nn.Parameter(torch.zeros(text_hidden))
        self.image_end = nn.Parameter(torch.zeros(text_hidden))
        self.image_newline = nn.Parameter(torch.zeros(text_hidden))

    def grid(self, width: int, height: int) -> ImageGrid:
        return ImageGrid.of(width, height, self.config.patch_size, self.config.downsample_ratio)

    @torch.inference_mode()
    def image_rows(self, pixels: torch.Tensor) -> torch.Tensor:
        """[rows_h * rows_w, text hidden]: the rows of the image's IMAGE positions, scanline order."""
        height, width, _ = pixels.shape
        grid = self.grid(width, height)
        features = self.vision(image_patches(pixels, grid, self.config), grid)
        return self.aligner(downsample(features, grid, self.config.downsample_ratio))

    @torch.inference_mode()
    def span_rows(self, pixels: torch.Tensor) -> torch.Tensor:
        """[span_length, text hidden]: every row of the image's span of the prompt."""
        height, width, _ = pixels.shape
        grid = self.grid(width, height)
        rows = self.image_rows(pixels).reshape(grid.rows_h, grid.rows_w, -1)
        newline = self.image_newline.to(rows.dtype).expand(grid.rows_h, 1, -1)
        lines = torch.cat([rows, newline], dim=1).reshape(-1, rows.shape[-1])
        return torch.cat([self.image_start.to(rows.dtype)[None], lines, self.image_end.to(rows.dtype)[None]])
