"""DeepSeek-V4.1's vision tower from a checkpoint: `vision.*`, `aligner.*` and the three learned rows
of an image's span (`image_start`, `image_newline`, `image_end`), in the checkpoint's own names.

The text model's loader leaves these tensors out (engine/checkpoint/weight_names.py); the image
encoder (encoder_svc, or the embedded server's) loads them here, alone: encoding an image needs
nothing of the text model but its width.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from engine.checkpoint.quant import dequantize_fp8
from engine.checkpoint.safetensors_files import CheckpointFiles
from engine.config_v41 import V41Config
from engine.errors import UnsupportedCheckpointError
from engine.families import read_config
from engine.model.vision import VisionConfig, VisionEncoder

logger = logging.getLogger(__name__)


def load_vision_encoder(
    path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> VisionEncoder | None:
    """The checkpoint's vision tower, or None when it has none. `dtype`: the checkpoint's own
    (bfloat16 as published) unless given; FP8 tensors with block scales are dequantized."""
    path = Path(path)
    config = read_config(path)
    if not isinstance(config, V41Config) or not config.vision_config:
        return None
    dtype = dtype or getattr(torch, config.torch_dtype)
    with torch.device("meta"):
        encoder = VisionEncoder(VisionConfig.from_dict(config.vision_config), config.hidden_size)
    expected = encoder.state_dict()
    weights: dict[str, torch.Tensor] = {}
    with CheckpointFiles(path) as files:
        stored = {name.removeprefix("model."): tensor for name, tensor in files.tensors.items()}
        for name, meta in expected.items():
            if name not in stored:
                raise UnsupportedCheckpointError(f"{path}: the vision tower lacks {name}")
            tensor = files.read(stored[name])
            if (scale := stored.get(name.removesuffix("weight") + "scale")) is not None:
                block = config.quantization_config.weight_block_size if config.quantization_config else (128, 128)
                tensor = dequantize_fp8(tensor, files.read(scale), tuple(block), torch.float32)
            if tuple(tensor.shape) != tuple(meta.shape):
                raise UnsupportedCheckpointError(
                    f"{stored[name].where()}: shape {tuple(tensor.shape)}, the vision tower needs {tuple(meta.shape)}"
                )
            weights[name] = tensor.to(device=device, dtype=dtype)
    encoder.load_state_dict(weights, assign=True)
    logger.info("%s: vision tower, %d blocks of width %d", path, len(encoder.vision.blocks), encoder.config.hidden_size)
    return encoder.eval()
