"""The DeepSeek-V4 model config, read from a Hugging Face `config.json`.

Field names and defaults follow transformers' `DeepseekV4Config` so a checkpoint saved by
transformers loads as is, including the legacy keys older checkpoints ship
(`compress_ratios`, `num_hash_layers`, `qk_rope_head_dim`, ...).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from common.blocks import BLOCK_SIZE
from engine.errors import UnsupportedCheckpointError

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_LAYER_TYPES = ("hash_moe", "moe")
_RATIO_TO_LAYER_TYPE = {0: SLIDING, 4: CSA, 128: HCA}


@dataclass
class QuantConfig:
    """`quantization_config` of a block-scaled FP8 checkpoint, as transformers' fine-grained FP8
    path reads it: e4m3 weights with one scale per `weight_block_size` tile, routed experts in
    FP8 or in FP4 (`expert_dtype`), scales float32 or powers of two (`scale_fmt: ue8m0`)."""

    weight_block_size: tuple[int, int] = (128, 128)
    scale_fmt: str = "float"
    expert_dtype: str = "fp8"

    @classmethod
    def from_dict(cls, raw: dict[str, Any], expert_dtype: str | None = None) -> QuantConfig:
        def refuse(what: str) -> UnsupportedCheckpointError:
            return UnsupportedCheckpointError(
                f"quantization_config {what} is not supported; this engine loads block-scaled FP8 "
                "(quant_method fp8, activation_scheme dynamic, scale_fmt float or ue8m0, expert_dtype fp8 or fp4)"
            )

        method = raw.get("quant_method")
        if method != "fp8":
            raise refuse(f"quant_method {method!r}")
        if raw.get("activation_scheme", "dynamic") != "dynamic":
            raise refuse(f"activation_scheme {raw['activation_scheme']!r}")
        if raw.get("fmt", "e4m3") != "e4m3":
            raise refuse(f"fmt {raw['fmt']!r}")
        block = raw.get("weight_block_size") or (128, 128)
        if not (isinstance(block, list | tuple) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
            raise refuse(f"weight_block_size {block!r}")
        scale_fmt = raw.get("scale_fmt") or "float"
        if scale_fmt not in ("float", "ue8m0"):
            raise refuse(f"scale_fmt {scale_fmt!r}")
        experts = raw.get("expert_dtype") or expert_dtype or "fp8"
        if experts not in ("fp8", "fp4"):
            raise refuse(f"expert_dtype {experts!r}")
        return cls(tuple(block), scale_fmt, experts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "weight_block_size": list(self.weight_block_size),
            "scale_fmt": self.scale_fmt,
            "expert_dtype": self.expert_dtype,
        }


@dataclass
class ModelConfig:
    vocab_size: int = 129280
    hidden_size: int = 4096
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    q_lora_rank: int = 1024
    num_experts_per_tok: int = 6
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    layer_types: list[str] = field(default_factory=list)
    mlp_layer_types: list[str] = field(default_factory=list)
    compress_rates: dict[str, int] = field(default_factory=dict)
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1.0e-6
    swiglu_limit: float = 10.0
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    hidden_act: str = "silu"
    rms_norm_eps: float = 1.0e-6
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    tie_word_embeddings: bool = False
    partial_rotary_factor: float = 64 / 512
    rope_parameters: dict[str, dict[str, Any]] = field(default_factory=dict)
    torch_dtype: str = "float32"
    num_nextn_predict_layers: int = 1  # multi-token-prediction modules (`mtp.N.*`), as transformers counts them
    quantization_config: QuantConfig | None = None

    model_type = "deepseek_v4"

    @property
    def rope_head_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return [self.eos_token_id] if isinstance(self.eos_token_id, int) else list(self.eos_token_id)

    def compress_rate(self, layer_idx: int) -> int:
        """Tokens per compressed entry for a layer; 0 for sliding-only layers."""
        layer_type = self.layer_types[layer_idx]
        return 0 if layer_type == SLIDING else self.compress_rates[layer_type]

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        raw = dict(raw)
        model_type = raw.get("model_type", "deepseek_v4")
        if model_type == "deepseek_v41":
            raise UnsupportedCheckpointError(
                "model_type 'deepseek_v41' is DeepSeek-V4.1: its config is engine/config_v41.py's "
                "(engine.families.read_config picks the family)"
            )
        if model_type != "deepseek_v4":
            raise UnsupportedCheckpointError(
                f"model_type {model_type!r} is not supported: this engine runs DeepSeek-V4 "
                "(transformers' `deepseek_v4`) checkpoints only"
            )
        known = set(cls.__dataclass_fields__) - {"rope_parameters", "quantization_config"}
        cfg = cls(**{k: v for k, v in raw.items() if k in known})
        quant = raw.get("quantization_config")
        if quant:
            if not isinstance(quant, dict):
                raise UnsupportedCheckpointError(f"quantization_config {quant!r} is not an object")
            # the published V4 config.json has expert_dtype at the top level; V4.1 moved it inside
            cfg.quantization_config = QuantConfig.from_dict(quant, raw.get("expert_dtype"))
        if "dtype" in raw and "torch_dtype" not in raw:
            cfg.torch_dtype = str(raw["dtype"])
        n = cfg.num_hidden_layers

        rates = {CSA: 4, HCA: 128, **(raw.get("compress_rates") or {})}
        if raw.get("compress_rate_csa") is not None:
            rates[CSA] = raw["compress_rate_csa"]
        if raw.get("compress_rate_hca") is not None:
            rates[HCA] = raw["compress_rate_hca"]
        cfg.compress_rates = rates

        if not raw.get("layer_types") and raw.get("compress_ratios") is not None:
            cfg.layer_types = [_RATIO_TO_LAYER_TYPE[r] for r in raw["compress_ratios"]]
        if not cfg.layer_types:
            interleave = [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
            cfg.layer_types = [HCA] * min(n, 2) + interleave
        cfg.layer_types = list(cfg.layer_types[:n])
        if not cfg.mlp_layer_types:
            n_hash = raw.get("num_hash_layers", 3)
            cfg.mlp_layer_types = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
        cfg.mlp_layer_types = list(cfg.mlp_layer_types[:n])

        if raw.get("partial_rotary_factor") is None:
            legacy_rope_dim = raw.get("qk_rope_head_dim")
            cfg.partial_rotary_factor = legacy_rope_dim / cfg.head_dim if legacy_rope_dim else 64 / 512
        cfg.rope_parameters = _nest_rope_parameters(cfg, raw.get("rope_parameters") or raw.get("rope_scaling"))
        cfg.validate()
        return cfg

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise UnsupportedCheckpointError(f"{path}: no config.json (is this a Hugging Face checkpoint?)")
        try:
            return cls.from_dict(json.loads(config_file.read_text()))
        except ValueError as err:  # UnsupportedCheckpointError, or JSON that does not parse
            raise UnsupportedCheckpointError(f"{config_file}: {err}") from None

    def validate(self) -> None:
        n = self.num_hidden_layers
        for name, types, allowed in (
            ("layer_types", self.layer_types, LAYER_TYPES),
            ("mlp_layer_types", self.mlp_layer_types, MLP_LAYER_TYPES),
        ):
            if len(types) != n:
                raise UnsupportedCheckpointError(f"len({name}) = {len(types)} but num_hidden_layers = {n}")
            bad = sorted(set(types) - set(allowed))
            if bad:
                raise UnsupportedCheckpointError(f"{name} has unsupported entries {bad}")
        for layer_type in (CSA, HCA):
            rate = self.compress_rates[layer_type]
            if layer_type in self.layer_types and (rate <= 0 or BLOCK_SIZE % rate):
                raise UnsupportedCheckpointError(
                    f"compress rate {rate} for {layer_type} must divide the state block size {BLOCK_SIZE}"
                )
        if self.num_key_value_heads != 1:
            raise UnsupportedCheckpointError("DeepSeek-V4 uses a single shared KV head (num_key_value_heads=1)")
        if self.num_attention_heads % self.o_groups:
            raise UnsupportedCheckpointError("num_attention_heads must be divisible by o_groups")
        if self.scoring_func not in ("sqrtsoftplus", "softmax", "sigmoid"):
            raise UnsupportedCheckpointError(f"unknown scoring_func {self.scoring_func!r}")
        if self.hidden_act != "silu":
            raise UnsupportedCheckpointError(f"hidden_act {self.hidden_act!r} is not supported (silu only)")
        if self.rope_head_dim % 2 or self.rope_head_dim > self.head_dim:
            raise UnsupportedCheckpointError(f"bad rotary dim {self.rope_head_dim} for head_dim {self.head_dim}")
        for label, params in self.rope_parameters.items():
            if params.get("rope_type", "default") not in ("default", "yarn"):
                raise UnsupportedCheckpointError(f"rope_type {params['rope_type']!r} ({label}) is not supported")

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(model_type="deepseek_v4", architectures=["DeepseekV4ForCausalLM"])
        if self.quantization_config is None:
            del out["quantization_config"]
        else:
            out["quantization_config"] = self.quantization_config.to_dict()
        return out


def _nest_rope_parameters(cfg: ModelConfig, rp: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """Rope settings keyed by rope type: `main` (sliding layers) and `compress` (CSA / HCA layers).

    YaRN scaling applies to the compress branch only, and its cos/sin are not scaled
    (`attention_factor` = 1) unless the config says otherwise, as in the V4 reference.
    """
    rp = dict(rp or {})
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        return {"main": dict(rp["main"]), "compress": dict(rp["compress"])}
    main = {"rope_type": "default", "rope_theta": cfg.rope_theta, "partial_rotary_factor": cfg.partial_rotary_factor}
    compress = {
        **{k: v for k, v in rp.items() if k not in ("main", "compress", "type")},
        "rope_theta": cfg.compress_rope_theta,
        "partial_rotary_factor": cfg.partial_rotary_factor,
    }
    compress["rope_type"] = rp.get("rope_type", rp.get("type", "default"))
    if compress["rope_type"] == "yarn":
        compress.setdefault("attention_factor", 1.0)
    return {"main": main, "compress": compress}
