"""The DeepSeek-V4.1 model config (`model_type: deepseek_v41`), read from a Hugging Face `config.json`.

V4.1 is the model DeepSeek's engine (DeepInfer) runs. Its config.json nests the text model
under `text_config` (and the vision tower under `vision_config`); SGLang also accepts the same
keys flat, with top-level keys winning. Both layouts load here. Field names and defaults follow
DeepInfer's `hugging_face/config.py` (the keys it requires have no default here either) and
SGLang's `configs/deepseek_v41.py` for the keys only SGLang reads.

What the config derives (the "layer plan"):
- compression ratio per layer: 0 (sliding window only), 1 (one entry per token) or 2 (pairs);
  every compressed layer is sparse (attends to its query's top-`index_topk` entries);
- which layer computes each layer's compressed KV, index keys and top-k (`*_source_layer_ids`:
  a layer reuses the nearest source at or before it);
- the candidate-block source, whose indexer also picks blocks that later indexers search within;
- the YOCO boundary: the first ratio-1 layer. Layers from it on are consumers: the compressed KV
  they own is projected from the boundary layer's normalised input, and with prefill truncation
  a prompt's rows before its last `prefill_keep_tokens` skip them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from common.blocks import BLOCK_SIZE
from engine.config import QuantConfig
from engine.errors import UnsupportedCheckpointError

MODEL_TYPE = "deepseek_v41"
ARCHITECTURE = "DeepseekV41ForCausalLM"
# DeepInfer's README runs V4.1 with compact prefill truncation keeping 140 rows (>= window + room
# for rejected draft tokens); SGLang keeps truncation on by default too.
DEFAULT_PREFILL_KEEP_TOKENS = 140
# Keys the text model must state (DeepInfer indexes them without a default).
REQUIRED_KEYS = (
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "vocab_size",
    "head_dim",
    "qk_rope_head_dim",
    "q_lora_rank",
    "o_lora_rank",
    "o_groups",
    "sliding_window",
    "compress_ratios",
    "kv_source_layer_ids",
    "index_source_layer_ids",
    "moe_intermediate_size",
    "n_routed_experts",
    "num_experts_per_tok",
)


@dataclass
class V41Config:
    vocab_size: int = 129280
    hidden_size: int = 5120
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1536
    o_lora_rank: int = 1024
    o_groups: int = 8
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1.0e-6
    swiglu_limit: float = 10.0
    hidden_act: str = "silu"
    attention_bias: bool = False
    attention_dropout: float = 0.0
    tie_word_embeddings: bool = False
    sliding_window: int = 128
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: dict[str, Any] | None = None
    compress_ratios: list[int] = field(default_factory=list)
    index_topk: int = 512
    index_n_heads: int = 32
    index_head_dim: int = 128
    kv_source_layer_ids: list[int] = field(default_factory=list)
    index_source_layer_ids: list[int] = field(default_factory=list)
    index_k_source_layer_ids: list[int] | None = None  # DeepInfer: defaults to kv_source_layer_ids
    candidate_source_layer_id: int | None = None  # None (DeepInfer) or -1 (SGLang): no candidate blocks
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0
    moe_intermediate_size: int = 3072
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    routed_scaling_factor: float = 1.5
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    topk_method: str = "noaux_tc"
    hc_mult: int = 4
    hc_eps: float = 1.0e-6
    hc_sinkhorn_iters: int = 20
    hc_shifted: bool = True
    engram_layer_ids: list[int] = field(default_factory=list)
    engram_max_ngram_size: int = 1
    engram_vocab_size: int = 0
    engram_n_heads: int = 0
    engram_head_dim: int = 0
    engram_compressed_vocab_size: int = 0
    engram_pad_token_id: int = 2
    num_nextn_predict_layers: int = 0
    # top level
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    pad_token_id: int | None = 2
    image_token_id: int | None = None
    torch_dtype: str = "bfloat16"
    quantization_config: QuantConfig | None = None
    vision_config: dict[str, Any] | None = None
    dspark: dict[str, Any] = field(default_factory=dict)  # the DSpark draft model's keys, kept as read
    # not in config.json: how prompts run the YOCO consumer layers (0 = every row, no truncation)
    prefill_keep_tokens: int = DEFAULT_PREFILL_KEEP_TOKENS

    model_type = MODEL_TYPE

    # ---- what the layer plan derives
    @property
    def rope_head_dim(self) -> int:
        return self.qk_rope_head_dim

    # ---- DSpark, the draft model (engine/model/dspark.py): `num_nextn_predict_layers` stages
    @property
    def has_dspark(self) -> bool:
        return self.num_nextn_predict_layers > 0 and "dspark_target_layer_ids" in self.dspark

    @property
    def dspark_target_layer_ids(self) -> list[int]:
        """The layers whose attention input (the streams' mean) the draft model reads."""
        return [int(i) for i in self.dspark.get("dspark_target_layer_ids", [])]

    @property
    def dspark_markov_rank(self) -> int:
        return int(self.dspark.get("dspark_markov_rank", 0))

    @property
    def dspark_noise_token_id(self) -> int:
        """The token every draft row past the first reads: a fixed embedding, not random noise."""
        return int(self.dspark.get("dspark_noise_token_id", 0))

    @property
    def dspark_block_size(self) -> int:
        return int(self.dspark.get("dspark_block_size", 5))

    def dspark_stage_config(self) -> V41Config:
        """The config a draft stage's MoE is built from: its own expert count and top-k."""
        stage = replace(self)
        stage.n_routed_experts = int(self.dspark.get("dspark_n_routed_experts", self.n_routed_experts))
        stage.num_experts_per_tok = int(self.dspark.get("dspark_num_experts_per_tok", self.num_experts_per_tok))
        return stage

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return [self.eos_token_id] if isinstance(self.eos_token_id, int) else list(self.eos_token_id)

    def compress_rate(self, layer: int) -> int:
        return self.compress_ratios[layer]

    @property
    def yoco_boundary(self) -> int:
        """The first YOCO consumer layer: the first ratio-1 layer (num_hidden_layers when there is none)."""
        ratios = self.compress_ratios[: self.num_hidden_layers]
        return next((i for i, r in enumerate(ratios) if r == 1), self.num_hidden_layers)

    def is_consumer(self, layer: int) -> bool:
        return layer >= self.yoco_boundary

    def kv_source(self, layer: int) -> int:
        """The layer whose compressed KV this layer attends over."""
        return _nearest_source(self.kv_source_layer_ids, layer)

    def index_source(self, layer: int) -> int:
        """The layer whose indexer picks this layer's top-k entries."""
        return _nearest_source(self.index_source_layer_ids, layer)

    def index_k_source(self, layer: int) -> int:
        """The layer whose index keys this layer's indexer scores against."""
        ids = self.index_k_source_layer_ids if self.index_k_source_layer_ids is not None else self.kv_source_layer_ids
        return _nearest_source(ids, layer)

    @property
    def candidate_source(self) -> int | None:
        source = self.candidate_source_layer_id
        return None if source is None or source < 0 else source

    def candidate_block_size_for(self, layer: int) -> int:
        """Entries per candidate block on this layer (the source's block size, rescaled by ratio)."""
        source = self.candidate_source
        return self.candidate_block_size * self.compress_rate(source) // self.compress_rate(layer)

    def uses_candidates(self, layer: int) -> bool:
        """An index-source layer after the candidate source searches only inside its blocks."""
        source = self.candidate_source
        return source is not None and layer > source and self.index_source(layer) == layer

    @property
    def engram_ngram_sizes(self) -> list[int]:
        return list(range(2, self.engram_max_ngram_size + 1))

    def owns_compressor(self, layer: int) -> bool:
        return self.compress_rate(layer) > 0 and self.kv_source(layer) == layer

    def owns_index_keys(self, layer: int) -> bool:
        return self.compress_rate(layer) > 0 and self.index_k_source(layer) == layer

    def owns_indexer(self, layer: int) -> bool:
        return self.compress_rate(layer) > 0 and self.index_source(layer) == layer

    # ---- reading
    @classmethod
    def from_dict(cls, raw: dict[str, Any], prefill_keep_tokens: int | None = None) -> V41Config:
        if raw.get("model_type") != MODEL_TYPE:
            raise UnsupportedCheckpointError(f"model_type {raw.get('model_type')!r} is not {MODEL_TYPE!r}")
        architectures = raw.get("architectures") or [ARCHITECTURE]
        if architectures not in ([ARCHITECTURE], ["DeepseekV4ForCausalLM"]):
            raise UnsupportedCheckpointError(
                f"architectures {architectures!r} is not supported for {MODEL_TYPE}: expected [{ARCHITECTURE!r}]"
            )
        text = raw.get("text_config")
        if text is not None and not isinstance(text, dict):
            raise UnsupportedCheckpointError("text_config must be an object")
        top = {k: v for k, v in raw.items() if k not in ("text_config", "vision_config")}
        values = {**(text or {}), **top}  # SGLang's reading: top-level keys override the text model's
        missing = [key for key in REQUIRED_KEYS if key not in values]
        if missing:
            raise UnsupportedCheckpointError(f"config.json lacks {', '.join(missing)} (required for {MODEL_TYPE})")
        known = {f.name for f in fields(cls)} - {"quantization_config", "vision_config", "dspark", "torch_dtype"}
        cfg = cls(**{k: v for k, v in values.items() if k in known})
        if "hc_shifted" not in values and "hc_pre_from_prev_sublayer" in values:
            cfg.hc_shifted = bool(values["hc_pre_from_prev_sublayer"])  # SGLang's name for the same switch
        cfg.torch_dtype = str(values.get("dtype") or values.get("torch_dtype") or "bfloat16")
        cfg.vision_config = raw.get("vision_config")
        cfg.dspark = {k: v for k, v in values.items() if k.startswith("dspark_")}
        quant = values.get("quantization_config")
        if quant:
            if not isinstance(quant, dict):
                raise UnsupportedCheckpointError(f"quantization_config {quant!r} is not an object")
            cfg.quantization_config = QuantConfig.from_dict(quant)
        if prefill_keep_tokens is not None:
            cfg.prefill_keep_tokens = prefill_keep_tokens
        cfg.validate()
        return cfg

    @classmethod
    def from_pretrained(cls, path: str | Path, prefill_keep_tokens: int | None = None) -> V41Config:
        config_file = Path(path) / "config.json"
        try:
            return cls.from_dict(json.loads(config_file.read_text()), prefill_keep_tokens)
        except ValueError as err:
            raise UnsupportedCheckpointError(f"{config_file}: {err}") from None

    def validate(self) -> None:
        n = self.num_hidden_layers
        refuse = UnsupportedCheckpointError
        for key, expected in (
            ("hidden_act", "silu"),
            ("attention_bias", False),
            ("attention_dropout", 0.0),
            ("num_key_value_heads", 1),
            ("scoring_func", "sqrtsoftplus"),
            ("topk_method", "noaux_tc"),
            ("norm_topk_prob", True),
        ):
            if getattr(self, key) != expected:
                raise refuse(f"{key} {getattr(self, key)!r} is not supported (V4.1 uses {expected!r})")
        if len(self.compress_ratios) not in (n, n + self.num_nextn_predict_layers):
            raise refuse(f"compress_ratios has {len(self.compress_ratios)} entries for {n} layers")
        self.compress_ratios = [int(r) for r in self.compress_ratios[:n]]
        if bad := sorted(set(self.compress_ratios) - {0, 1, 2}):
            raise refuse(f"compress_ratios has unsupported ratios {bad} (V4.1 uses 0, 1 and 2)")
        if not self.hc_shifted:
            raise refuse("hc_shifted false (hyper-connections with an HC head) is not supported; V4.1 shifts them")
        if self.num_attention_heads % self.o_groups:
            raise refuse("num_attention_heads must be divisible by o_groups")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > min(self.head_dim, self.index_head_dim):
            raise refuse(f"qk_rope_head_dim {self.qk_rope_head_dim} does not fit head_dim / index_head_dim")
        self._validate_sources()
        if self.candidate_source is not None:
            self._validate_candidates()
        if self.engram_layer_ids:
            self._validate_engram()
        if self.has_dspark:
            self._validate_dspark()
        if self.prefill_keep_tokens and self.prefill_keep_tokens < self.sliding_window:
            raise refuse(
                f"prefill_keep_tokens {self.prefill_keep_tokens} must be at least the window {self.sliding_window}"
            )

    def _validate_sources(self) -> None:
        n, refuse = self.num_hidden_layers, UnsupportedCheckpointError
        compressed = [i for i, r in enumerate(self.compress_ratios) if r > 0]
        for name in ("kv_source_layer_ids", "index_source_layer_ids", "index_k_source_layer_ids"):
            ids = getattr(self, name)
            if ids is None:
                continue
            if not ids and compressed:
                raise refuse(f"{name} is empty but layers {compressed} are compressed")
            if sorted(set(ids)) != list(ids) or any(not 0 <= i < n for i in ids):
                raise refuse(f"{name} {ids} must be ascending layer ids below {n}")
            if not_compressed := [i for i in ids if self.compress_ratios[i] == 0]:
                raise refuse(f"{name} names sliding-window layers {not_compressed}")
        for layer in compressed:
            kv_source, index_source = self.kv_source(layer), self.index_source(layer)
            for what, source in (("KV", kv_source), ("index", index_source)):
                if self.compress_ratios[source] != self.compress_ratios[layer]:
                    raise refuse(
                        f"layer {layer} (ratio {self.compress_ratios[layer]}) shares {what} with "
                        f"layer {source} (ratio {self.compress_ratios[source]}); shared layers need equal ratios"
                    )
            if index_source < kv_source:
                raise refuse(f"layer {layer}: its index source {index_source} precedes its KV source {kv_source}")
            if self.index_k_source(layer) != kv_source:
                raise refuse(
                    f"layer {layer}: index keys from layer {self.index_k_source(layer)} but KV from layer "
                    f"{kv_source}; index_k_source_layer_ids other than kv_source_layer_ids are not supported"
                )
        boundary = self.yoco_boundary
        if boundary < n and self.compress_ratios[boundary] and self.kv_source(boundary) != boundary:
            raise refuse(f"layer {boundary}, the first YOCO consumer, must be a KV source (sharing may not cross it)")
        for layer, ratio in enumerate(self.compress_ratios):
            if ratio and BLOCK_SIZE % ratio:
                raise refuse(f"layer {layer}: ratio {ratio} must divide the state block size {BLOCK_SIZE}")

    def _validate_candidates(self) -> None:
        source, refuse = self.candidate_source, UnsupportedCheckpointError
        if not 0 <= source < self.num_hidden_layers or self.compress_ratios[source] == 0:
            raise refuse(f"candidate_source_layer_id {source} is not a compressed layer")
        if self.index_source(source) != source:
            raise refuse(f"candidate_source_layer_id {source} must be an index source")
        if self.candidate_block_size <= 0 or self.candidate_topk_blocks <= 0:
            raise refuse("candidate_block_size and candidate_topk_blocks must be positive")
        for layer in range(source + 1, self.num_hidden_layers):
            if not self.uses_candidates(layer):
                continue
            if self.compress_ratios[layer] != self.compress_ratios[source]:
                raise refuse(f"layer {layer} searches candidate blocks of layer {source} but has another ratio")
            if self.is_consumer(layer) != self.is_consumer(source):
                raise refuse(f"layer {layer} searches candidate blocks of layer {source} across the YOCO boundary")
            if self.candidate_topk_blocks * self.candidate_block_size_for(layer) < self.index_topk:
                raise refuse("candidate_topk_blocks * candidate_block_size must cover index_topk")

    def _validate_engram(self) -> None:
        refuse = UnsupportedCheckpointError
        if self.engram_max_ngram_size < 2 or self.engram_n_heads <= 0 or self.engram_head_dim <= 0:
            raise refuse("Engram needs engram_max_ngram_size >= 2, engram_n_heads and engram_head_dim")
        if self.engram_vocab_size <= 2:
            raise refuse("engram_vocab_size must be above 2")
        if late := [i for i in self.engram_layer_ids if not 0 <= i < min(self.yoco_boundary, self.num_hidden_layers)]:
            raise refuse(f"engram_layer_ids {late} must be layers before the first YOCO consumer layer")

    def _validate_dspark(self) -> None:
        refuse, targets, stages = (
            UnsupportedCheckpointError,
            self.dspark_target_layer_ids,
            self.num_nextn_predict_layers,
        )
        if len(targets) != stages:  # SGLang's rule: one stage per target layer
            raise refuse(f"dspark_target_layer_ids has {len(targets)} layers for {stages} stages")
        if bad := [i for i in targets if not 0 <= i < self.num_hidden_layers]:
            raise refuse(f"dspark_target_layer_ids {bad} are not layers of the model")
        if self.dspark_markov_rank <= 0:
            raise refuse("dspark_markov_rank must be positive: the draft model's Markov head needs it")
        if not self.dspark.get("dspark_target_attn_input", True):
            raise refuse("dspark_target_attn_input false is not supported (DeepInfer reads attention inputs only)")
        if not 0 <= self.dspark_noise_token_id < self.vocab_size:
            raise refuse(f"dspark_noise_token_id {self.dspark_noise_token_id} is outside the vocabulary")

    def to_dict(self) -> dict[str, Any]:
        """config.json in DeepInfer's nested layout."""
        text = asdict(self)
        top = {
            "architectures": [ARCHITECTURE],
            "model_type": MODEL_TYPE,
            "dtype": text.pop("torch_dtype"),
            "bos_token_id": text.pop("bos_token_id"),
            "eos_token_id": text.pop("eos_token_id"),
            "pad_token_id": text.pop("pad_token_id"),
        }
        for key in ("quantization_config", "vision_config", "dspark", "prefill_keep_tokens", "image_token_id"):
            text.pop(key)
        if text["index_k_source_layer_ids"] is None:  # DeepInfer defaults it only when the key is absent
            del text["index_k_source_layer_ids"]
        text.update(self.dspark)
        # DeepInfer lists a ratio for every draft stage too (window-only: 0)
        text["compress_ratios"] = [*self.compress_ratios, *[0] * self.num_nextn_predict_layers]
        text["model_type"] = MODEL_TYPE
        if self.image_token_id is not None:
            top["image_token_id"] = self.image_token_id
        if self.quantization_config is not None:
            top["quantization_config"] = self.quantization_config.to_dict()
        top["text_config"] = text
        if self.vision_config is not None:
            top["vision_config"] = self.vision_config
        return top


def _nearest_source(ids: list[int], layer: int) -> int:
    """The last source at or before `layer`; a layer before every source is its own (DeepInfer's `_source_map`)."""
    earlier = [i for i in ids if i <= layer]
    return earlier[-1] if earlier else layer
