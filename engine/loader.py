"""Hugging Face safetensors checkpoints: single file or sharded with an index."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.errors import UnsupportedCheckpointError
from engine.model import FP32_PARAMETER_SUFFIXES, DeepseekV4ForCausalLM

# Weights the upstream checkpoints carry for parts this engine does not run (multi-token prediction).
_IGNORED_PREFIXES = ("mtp.", "model.mtp.")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise UnsupportedCheckpointError(
        f"{path}: no model.safetensors or model.safetensors.index.json (only safetensors checkpoints load)"
    )


def resolve_dtype(config: ModelConfig, dtype: torch.dtype | str | None) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = (dtype or config.torch_dtype or "float32").replace("torch.", "")
    if name not in _DTYPES:
        raise UnsupportedCheckpointError(f"dtype {name!r} is not supported (float32, bfloat16, float16)")
    return _DTYPES[name]


def load_model(
    path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype | str | None = None
) -> DeepseekV4ForCausalLM:
    path = Path(path)
    config = ModelConfig.from_pretrained(path)
    dtype = resolve_dtype(config, dtype)
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(config)
    expected = model.state_dict()
    loaded: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                if name.startswith(_IGNORED_PREFIXES):
                    continue
                if name.endswith(("weight_scale_inv", ".scale_inv", "input_scale")):
                    raise UnsupportedCheckpointError(
                        f"{file.name}: {name} is a quantization scale; FP8 is not supported"
                    )
                tensor = f.get_tensor(name)
                if tensor.dtype.is_floating_point and tensor.element_size() == 1:
                    raise UnsupportedCheckpointError(f"{file.name}: {name} is {tensor.dtype}; FP8 is not supported")
                loaded[name] = tensor
    if config.tie_word_embeddings and "lm_head.weight" not in loaded and "model.embed_tokens.weight" in loaded:
        loaded["lm_head.weight"] = loaded["model.embed_tokens.weight"]
    missing = sorted(set(expected) - set(loaded))
    unexpected = sorted(set(loaded) - set(expected))
    if missing or unexpected:
        raise UnsupportedCheckpointError(
            f"{path}: checkpoint does not match the DeepSeek-V4 architecture; "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    for name, tensor in loaded.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise UnsupportedCheckpointError(
                f"{name}: shape {tuple(tensor.shape)} in checkpoint, {tuple(expected[name].shape)} expected by config"
            )
        if tensor.dtype.is_floating_point:
            target = torch.float32 if name.endswith(FP32_PARAMETER_SUFFIXES) else dtype
            loaded[name] = tensor.to(device=device, dtype=target)
        else:
            loaded[name] = tensor.to(device=device, dtype=expected[name].dtype)
    model.load_state_dict(loaded, assign=True)
    return model.eval()


def weights_id(path: str | Path) -> str:
    """A fingerprint of a checkpoint's weights (each file's name, size, first and last 64 KiB):
    state computed by one checkpoint must never be taken for another's with the same config."""
    digest = hashlib.sha256()
    for file in checkpoint_files(Path(path)):
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with file.open("rb") as f:
            digest.update(f.read(1 << 16))
            f.seek(max(0, size - (1 << 16)))
            digest.update(f.read(1 << 16))
    return digest.hexdigest()[:16]
