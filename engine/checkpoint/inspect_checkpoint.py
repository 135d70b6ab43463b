"""`deepmesh inspect PATH`: what a checkpoint holds and whether this engine can serve it.

Everything here comes from config.json and the safetensors headers; no weight is read, so
a checkpoint of any size is inspected in seconds. The checks are the loader's own
(`plan_weights`): a checkpoint reported servable is one `LLMEngine.from_pretrained` loads.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.checkpoint.loader import (
    ENGRAM_TABLE,
    Piece,
    WeightPlan,
    parameter_dtype,
    plan_weights,
    resolve_dtype,
    unused_summary,
)
from engine.checkpoint.safetensors_files import CheckpointFiles, StoredTensor
from engine.checkpoint.weight_names import EXPERT_PARAMS
from engine.config import ModelConfig
from engine.config_v41 import V41Config
from engine.errors import UnsupportedCheckpointError
from engine.families import read_config
from engine.state_cache import StateLayout

_SHORT_DTYPES = {
    torch.float32: "f32",
    torch.bfloat16: "bf16",
    torch.float16: "f16",
    torch.float8_e4m3fn: "fp8-e4m3",
    torch.float8_e8m0fnu: "e8m0",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int8: "i8",
    torch.uint8: "u8",
}

# tensor groups, first match wins: (label, test on the engine name)
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("multi-token prediction", ("mtp.",)),
    ("Engram", (".engram.",)),
    ("embedding", ("embed_tokens", "embed.weight")),
    ("output head", ("lm_head", "head.weight")),
    ("routed experts", EXPERT_PARAMS),
    ("shared experts", (".shared_experts.",)),
    ("router", (".mlp.gate.", ".ffn.gate.")),
    ("compressors, indexer", (".compressor.", ".indexer.")),
    ("hyper-connections", ("attn_hc.", "ffn_hc.", "hc_head.", ".hc_attn_", ".hc_ffn_")),
    ("norms", ("norm.weight", "layernorm.weight")),
    ("attention", (".self_attn.", ".attn.")),
)


@dataclass
class TensorGroup:
    tensors: int = 0
    parameters: int = 0
    stored_bytes: int = 0
    loaded_bytes: int = 0
    stored_as: set[str] = field(default_factory=set)
    loaded_as: set[str] = field(default_factory=set)


@dataclass
class CheckpointReport:
    path: Path
    files: int
    bytes_on_disk: int
    stored_dtypes: Counter  # short dtype name -> tensors
    servable: bool
    reason: str = ""  # why not, when not servable
    config: ModelConfig | V41Config | None = None
    names: str = ""  # which naming the tensors use
    groups: dict[str, TensorGroup] = field(default_factory=dict)
    total_parameters: int = 0  # the main model (MTP modules apart)
    active_parameters: int = 0
    mtp_parameters: int = 0
    loaded_dtype: torch.dtype | None = None
    unused: str = ""

    @property
    def loaded_bytes(self) -> int:
        return sum(group.loaded_bytes for group in self.groups.values())


def _group(name: str) -> str:
    for label, needles in GROUPS:
        if any(needle in name for needle in needles):
            return label
    return "other"


def _stored_as(piece: Piece, quant_block: tuple[int, int] | None) -> str:
    if piece.quantization == "none":
        return _SHORT_DTYPES.get(piece.tensor.dtype, str(piece.tensor.dtype))
    scale = piece.scale.dtype
    scale_kind = "ue8m0" if scale in (torch.float8_e8m0fnu, torch.uint8) else _SHORT_DTYPES.get(scale, str(scale))
    if piece.target.name.endswith(ENGRAM_TABLE):
        return f"fp8-e4m3 ({scale_kind} scale per row and 32 columns, memory-mapped)"
    if piece.quantization == "fp8":
        return f"fp8-e4m3 ({scale_kind} scale per {quant_block[0]}x{quant_block[1]})"
    return f"fp4-e2m1 ({scale_kind} scale per 32)"


def _naming(plan: WeightPlan) -> str:
    if isinstance(plan.model.config, V41Config):  # the model's own names are the checkpoint's
        return "DeepSeek's (embed, layers.N.attn.wq_a, ...), as DeepInfer and SGLang read them"
    stored = [piece.tensor.name for pieces in plan.pieces.values() for piece in pieces]
    prefixed = sum(name.startswith("model.") for name in stored)
    renamed = sum(piece.tensor.name != name for name, pieces in plan.pieces.items() for piece in pieces)
    deepseek = renamed > len(stored) // 2
    kind = "DeepSeek's (embed, layers.N.attn.wq_a, ...)" if deepseek else "transformers' module names"
    if prefixed and deepseek:
        kind = "DeepSeek's under a model. prefix (as transformers' save_pretrained writes)"
    return kind


def inspect_checkpoint(path: str | Path, dtype: str | None = None) -> CheckpointReport:
    path = Path(path)
    try:
        files = CheckpointFiles(path)
    except UnsupportedCheckpointError as err:
        return CheckpointReport(path, 0, 0, Counter(), False, str(err))
    report = CheckpointReport(
        path,
        len(files.files),
        files.bytes_on_disk(),
        Counter(_SHORT_DTYPES.get(t.dtype, str(t.dtype)) for t in files.tensors.values()),
        servable=False,
    )
    try:
        report.config = config = read_config(path)
        report.loaded_dtype = resolve_dtype(config, dtype)
        plan = plan_weights(files, config)
    except UnsupportedCheckpointError as err:
        report.reason = str(err)
        return report
    report.servable = True
    report.names = _naming(plan)
    report.unused = unused_summary(plan)
    block = config.quantization_config.weight_block_size if config.quantization_config else None
    groups: dict[str, TensorGroup] = defaultdict(TensorGroup)
    expected = plan.expected
    for name, meta in expected.items():
        group = groups[_group(name)]
        loaded = parameter_dtype(name, meta, report.loaded_dtype, plan.model)
        if name.endswith(ENGRAM_TABLE) and plan.pieces[name][0].quantization == "fp8":
            loaded = plan.pieces[name][0].tensor.dtype  # stays as stored, mapped where it lies
        group.parameters += meta.numel()
        group.loaded_bytes += meta.numel() * loaded.itemsize
        group.loaded_as.add(_SHORT_DTYPES.get(loaded, str(loaded)))
        for piece in plan.pieces[name]:
            group.tensors += 1
            stored: list[StoredTensor] = [piece.tensor] + ([piece.scale] if piece.scale else [])
            group.stored_bytes += sum(t.nbytes for t in stored)
            group.stored_as.add(_stored_as(piece, block))
    report.groups = dict(sorted(groups.items(), key=lambda item: -item[1].loaded_bytes))
    report.mtp_parameters = report.groups.get("multi-token prediction", TensorGroup()).parameters
    report.total_parameters = sum(g.parameters for g in groups.values()) - report.mtp_parameters
    idle_experts = 1 - config.num_experts_per_tok / config.n_routed_experts
    routed = report.groups.get("routed experts", TensorGroup()).parameters
    embedding = report.groups.get("embedding", TensorGroup()).parameters
    # a token uses its k routed experts of each layer and one row of the embedding table (and a few rows
    # of each Engram table, left out: a few thousand parameters against the tables' billions)
    tables = sum(meta.numel() for name, meta in expected.items() if name.endswith(ENGRAM_TABLE))
    report.active_parameters = int(
        report.total_parameters - routed * idle_experts - embedding - tables + config.hidden_size
    )
    return report


def _human(count: float, unit: str = "") -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if count >= scale:
            return f"{count / scale:.2f} {suffix}{unit}"
    return f"{count:.0f} {unit}".rstrip()


def _layer_summary(config: ModelConfig | V41Config) -> str:
    if isinstance(config, V41Config):
        return _layer_plan_v41(config)
    short = {
        "sliding_attention": "sliding",
        "compressed_sparse_attention": "CSA",
        "heavily_compressed_attention": "HCA",
    }
    kinds = Counter(short[t] for t in config.layer_types)
    moe = Counter(config.mlp_layer_types)
    attention = ", ".join(f"{n} {k}" for k, n in kinds.items())
    routers = f"{moe['hash_moe']} hash-routed MoE, {moe['moe']} learned-router MoE"
    return f"{config.num_hidden_layers} layers ({attention}; {routers})"


def _layer_plan_v41(config: V41Config) -> str:
    """DeepSeek-V4.1's layer plan: ratios, sharing, YOCO, candidates and Engram."""
    ratios = Counter(config.compress_ratios)
    kinds = ", ".join(f"{ratios[r]} ratio {r}" for r in (0, 2, 1) if ratios[r])
    plan = [f"{config.num_hidden_layers} layers ({kinds}; every layer MoE)"]
    plan.append(f"KV sources {config.kv_source_layer_ids}, index sources {config.index_source_layer_ids}")
    if config.candidate_source is not None:
        plan.append(
            f"candidate blocks from layer {config.candidate_source} "
            f"({config.candidate_topk_blocks} x {config.candidate_block_size} entries)"
        )
    boundary = config.yoco_boundary
    if boundary < config.num_hidden_layers:
        keep = config.prefill_keep_tokens
        truncation = f"prompts keep their last {keep} rows there" if keep else "prompt truncation off"
        plan.append(f"YOCO consumers from layer {boundary} ({truncation})")
    if config.engram_layer_ids:
        sizes = f"{config.engram_ngram_sizes[0]}..{config.engram_ngram_sizes[-1]}"
        plan.append(f"Engram on layers {config.engram_layer_ids} (n-grams {sizes}, {config.engram_n_heads} heads)")
    plan.append("shifted hyper-connections" if config.hc_shifted else "hyper-connections")
    return ";\n                ".join(plan)


def render(report: CheckpointReport) -> str:
    lines = [f"checkpoint      {report.path}"]
    lines.append(f"files           {report.files} safetensors file(s), {_human(report.bytes_on_disk, 'B')} on disk")
    config = report.config
    if config is not None:
        family = "DeepSeek-V4.1 (deepseek_v41)" if isinstance(config, V41Config) else "DeepSeek-V4 (deepseek_v4)"
        lines.append(f"architecture    {family}: {_layer_summary(config)}")
        lines.append(
            f"                hidden {config.hidden_size}, {config.num_attention_heads} heads of {config.head_dim}, "
            f"window {config.sliding_window}, {config.n_routed_experts} routed experts "
            f"({config.num_experts_per_tok} per token) + {config.n_shared_experts} shared, vocab {config.vocab_size}"
        )
        quant = config.quantization_config
        if quant is None:
            lines.append(f"quantization    none (stored {config.torch_dtype})")
        else:
            lines.append(
                f"quantization    fp8 e4m3, {quant.weight_block_size[0]}x{quant.weight_block_size[1]} blocks, "
                f"{quant.scale_fmt} scales; routed experts {quant.expert_dtype}"
            )
    if not report.servable:
        dtypes = ", ".join(f"{n} {d}" for d, n in report.stored_dtypes.most_common())
        if dtypes:
            lines.append(f"tensors         {sum(report.stored_dtypes.values())} ({dtypes})")
        lines.append(f"can serve       no: {report.reason}")
        return "\n".join(lines)
    lines.append(f"tensor names    {report.names}")
    lines.append(
        f"parameters      {_human(report.total_parameters)} total, {_human(report.active_parameters)} active per token"
        + (f"; multi-token prediction {_human(report.mtp_parameters)} more" if report.mtp_parameters else "")
    )
    lines.append("")
    lines.append(f"{'group':<24}{'tensors':>8}{'params':>12}{'on disk':>12}{'loaded':>12}  stored as -> loaded as")
    for label, group in report.groups.items():
        lines.append(
            f"{label:<24}{group.tensors:>8}{_human(group.parameters):>12}{_human(group.stored_bytes, 'B'):>12}"
            f"{_human(group.loaded_bytes, 'B'):>12}  {', '.join(sorted(group.stored_as))} -> "
            f"{', '.join(sorted(group.loaded_as))}"
        )
    lines.append("")
    lines.append(
        f"loaded          {_human(report.loaded_bytes, 'B')} on any device "
        f"({_SHORT_DTYPES[report.loaded_dtype]}; fp32 where the reference keeps it)"
    )
    layout = StateLayout(config, report.loaded_dtype)
    per_token = {n: layout.allocated_bytes(n) / n for n in (4096, 65536) if n <= config.max_position_embeddings}
    lines.append(
        "state           "
        + ", ".join(f"{b:,.1f} B/token at {n // 1024}K tokens" for n, b in per_token.items())
        + f" ({_human(layout.block_bytes, 'B')} per 128-token block + {_human(layout.slot_bytes, 'B')} per sequence)"
    )
    if report.unused:
        lines.append(f"not used        {report.unused}")
    lines.append("can serve       yes")
    return "\n".join(lines)
