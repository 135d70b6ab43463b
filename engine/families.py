"""The model families the engine runs, chosen by a checkpoint's `model_type`.

- `deepseek_v4`: DeepSeek-V4, as transformers defines it (engine/config.py, engine/model/v4.py);
- `deepseek_v41`: DeepSeek-V4.1, as DeepInfer defines it (engine/config_v41.py, engine/model/v41.py).
Both run behind the same engine API: a forward over a `StepInput` and the paged `StateCache`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.config import ModelConfig
from engine.config_v41 import MODEL_TYPE as V41_MODEL_TYPE
from engine.config_v41 import V41Config
from engine.errors import UnsupportedCheckpointError

if TYPE_CHECKING:
    from torch import nn

AnyConfig = ModelConfig | V41Config
MODEL_TYPES = ("deepseek_v4", V41_MODEL_TYPE)


def config_from_dict(raw: dict[str, Any], prefill_keep_tokens: int | None = None) -> AnyConfig:
    model_type = raw.get("model_type", "deepseek_v4")
    if model_type == V41_MODEL_TYPE:
        return V41Config.from_dict(raw, prefill_keep_tokens)
    if model_type == "deepseek_v4":
        return ModelConfig.from_dict(raw)
    raise UnsupportedCheckpointError(
        f"model_type {model_type!r} is not supported: this engine runs {', '.join(MODEL_TYPES)} checkpoints"
    )


def read_config(path: str | Path, prefill_keep_tokens: int | None = None) -> AnyConfig:
    """A checkpoint directory's config, of the family its config.json names."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise UnsupportedCheckpointError(f"{path}: no config.json (is this a Hugging Face checkpoint?)")
    try:
        return config_from_dict(json.loads(config_file.read_text()), prefill_keep_tokens)
    except ValueError as err:  # UnsupportedCheckpointError, or JSON that does not parse
        raise UnsupportedCheckpointError(f"{config_file}: {err}") from None


def build_model(config: AnyConfig, path: str | Path | None = None, mtp_modules: int = 0) -> nn.Module:
    """The family's model for a config, its weights unset (build it on the meta device to load them).
    V4.1's Engram hashes with the checkpoint's tokenizer.json, in `path`."""
    if isinstance(config, V41Config):
        from engine.model.v41 import DeepseekV41ForCausalLM

        tokenizer = Path(path) / "tokenizer.json" if path is not None else None
        return DeepseekV41ForCausalLM(config, tokenizer, mtp_modules if config.has_dspark else 0)
    from engine.model.v4 import DeepseekV4ForCausalLM

    return DeepseekV4ForCausalLM(config, mtp_modules)
