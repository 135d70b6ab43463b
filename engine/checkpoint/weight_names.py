"""Tensor names: DeepSeek's own (the published checkpoints) and transformers' module names (ours).

The published DeepSeek-V4 checkpoints name tensors after DeepSeek's reference code
(`layers.3.attn.wq_a.weight`, `head.weight`, one tensor per routed expert); transformers
renames them on load to its module names (`model.layers.3.self_attn.q_a_proj.weight`,
`lm_head.weight`, experts fused into 3-D tensors), and its `save_pretrained` writes a mix of
the two under a `model.` prefix: DeepSeek's names for a model it built, its own for one it
loaded, with some leaves (`self_attn.norm.weight`) turned back. So names are read with
ordered renames, like transformers' own conversion rules, which take any mix to the
engine's parameter names (transformers' module names); the tables below are for writing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# (transformers / engine name, DeepSeek name), relative to a decoder layer
LAYER_NAMES: tuple[tuple[str, str], ...] = (
    ("self_attn.q_a_proj.weight", "attn.wq_a.weight"),
    ("self_attn.q_a_norm.weight", "attn.q_norm.weight"),
    ("self_attn.q_b_proj.weight", "attn.wq_b.weight"),
    ("self_attn.kv_proj.weight", "attn.wkv.weight"),
    ("self_attn.kv_norm.weight", "attn.norm.weight"),
    ("self_attn.o_a_proj.weight", "attn.wo_a.weight"),
    ("self_attn.o_b_proj.weight", "attn.wo_b.weight"),
    ("self_attn.sinks", "attn.attn_sink"),
    ("self_attn.compressor.kv_proj.weight", "attn.compressor.wkv.weight"),
    ("self_attn.compressor.gate_proj.weight", "attn.compressor.wgate.weight"),
    ("self_attn.compressor.position_bias", "attn.compressor.ape"),
    ("self_attn.compressor.kv_norm.weight", "attn.compressor.norm.weight"),
    ("self_attn.compressor.indexer.kv_proj.weight", "attn.indexer.compressor.wkv.weight"),
    ("self_attn.compressor.indexer.gate_proj.weight", "attn.indexer.compressor.wgate.weight"),
    ("self_attn.compressor.indexer.position_bias", "attn.indexer.compressor.ape"),
    ("self_attn.compressor.indexer.kv_norm.weight", "attn.indexer.compressor.norm.weight"),
    ("self_attn.compressor.indexer.q_b_proj.weight", "attn.indexer.wq_b.weight"),
    ("self_attn.compressor.indexer.scorer.weights_proj.weight", "attn.indexer.weights_proj.weight"),
    ("mlp.gate.weight", "ffn.gate.weight"),
    ("mlp.gate.tid2eid", "ffn.gate.tid2eid"),
    ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"),
    ("mlp.shared_experts.gate_proj.weight", "ffn.shared_experts.w1.weight"),
    ("mlp.shared_experts.down_proj.weight", "ffn.shared_experts.w2.weight"),
    ("mlp.shared_experts.up_proj.weight", "ffn.shared_experts.w3.weight"),
    ("input_layernorm.weight", "attn_norm.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
    ("attn_hc.fn", "hc_attn_fn"),
    ("attn_hc.base", "hc_attn_base"),
    ("attn_hc.scale", "hc_attn_scale"),
    ("ffn_hc.fn", "hc_ffn_fn"),
    ("ffn_hc.base", "hc_ffn_base"),
    ("ffn_hc.scale", "hc_ffn_scale"),
)

# (engine name, DeepSeek name) outside the layers
TOP_NAMES: tuple[tuple[str, str], ...] = (
    ("model.embed_tokens.weight", "embed.weight"),
    ("model.norm.weight", "norm.weight"),
    ("model.hc_head.hc_fn", "hc_head_fn"),
    ("model.hc_head.hc_base", "hc_head_base"),
    ("model.hc_head.hc_scale", "hc_head_scale"),
    ("lm_head.weight", "head.weight"),
)

# (engine name, DeepSeek name) inside a multi-token-prediction module, besides its decoder layer's
MTP_NAMES: tuple[tuple[str, str], ...] = (
    ("e_proj.weight", "e_proj.weight"),
    ("h_proj.weight", "h_proj.weight"),
    ("enorm.weight", "enorm.weight"),
    ("hnorm.weight", "hnorm.weight"),
    ("norm.weight", "norm.weight"),
    ("hc_head.hc_fn", "hc_head_fn"),
    ("hc_head.hc_base", "hc_head_base"),
    ("hc_head.hc_scale", "hc_head_scale"),
)

GATE_UP, DOWN = "gate_up_proj", "down_proj"
# the fused [E, ...] parameters (V4 engine names, then V4.1's)
EXPERT_PARAMS = (f".mlp.experts.{GATE_UP}", f".mlp.experts.{DOWN}", f".ffn.experts.{GATE_UP}", f".ffn.experts.{DOWN}")
# DeepSeek's per-expert projections: w1 (gate) and w3 (up) are the two halves of gate_up_proj
EXPERT_PARTS = {"w1": (GATE_UP, 0), "w3": (GATE_UP, 1), "w2": (DOWN, None)}

# Renames inside a layer, applied in order; each leaves an engine name as it is.
_LAYER_RENAMES = [
    (re.compile(pattern), replacement)
    for pattern, replacement in (
        (r"^attn\.", "self_attn."),
        (r"^ffn\.", "mlp."),
        (r"^attn_norm\.", "input_layernorm."),
        (r"^ffn_norm\.", "post_attention_layernorm."),
        (r"^hc_(attn|ffn)_(fn|base|scale)$", r"\1_hc.\2"),
        (r"^hc_head_(fn|base|scale)$", r"hc_head.hc_\1"),  # an MTP module's head
        (r"^self_attn\.indexer\.compressor\.", "self_attn.compressor.indexer."),
        (r"^self_attn\.indexer\.weights_proj\.", "self_attn.compressor.indexer.scorer.weights_proj."),
        (r"^self_attn\.indexer\.wq_b\.", "self_attn.compressor.indexer.q_b_proj."),
        (r"^self_attn\.(.*\.)?norm\.weight$", r"self_attn.\1kv_norm.weight"),
        (r"\.attn_sink$", ".sinks"),
        (r"\.ape$", ".position_bias"),
        (r"\.q_norm\.", ".q_a_norm."),
        (r"\.wq_a\.", ".q_a_proj."),
        (r"\.wq_b\.", ".q_b_proj."),
        (r"\.wkv\.", ".kv_proj."),
        (r"\.wgate\.", ".gate_proj."),
        (r"\.wo_a\.", ".o_a_proj."),
        (r"\.wo_b\.", ".o_b_proj."),
        (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
        (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
        (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
        (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
    )
]
_TOP_TO_ENGINE = {
    **{ours.removeprefix("model."): ours for ours, _ in TOP_NAMES},
    **{theirs: ours for ours, theirs in TOP_NAMES},
}
_LAYER = re.compile(r"^(layers|mtp)\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(w1|w2|w3)\.weight$")


@dataclass(frozen=True)
class Target:
    """Where a checkpoint tensor goes: an engine parameter, or one expert's slice of one."""

    name: str
    expert: int | None = None  # per-expert tensors: which row of the fused [E, ...] parameter
    half: int | None = None  # w1 / w3: which half of gate_up_proj's rows


def canonical_name(name: str) -> Target | None:
    """The engine parameter a checkpoint tensor name stands for, or None outside the model's
    layers and top-level names. Multi-token-prediction modules are `mtp.N.`, as stored."""
    bare = name.removeprefix("model.")
    if bare in _TOP_TO_ENGINE:
        return Target(_TOP_TO_ENGINE[bare])
    match = _LAYER.match(bare)
    if match is None:
        return None
    scope, index, rest = match.groups()
    for pattern, replacement in _LAYER_RENAMES:
        rest = pattern.sub(replacement, rest)
    prefix = f"model.layers.{index}" if scope == "layers" else f"mtp.{index}"
    if expert := _EXPERT.match(rest):
        part, half = EXPERT_PARTS[expert.group(2)]
        return Target(f"{prefix}.mlp.experts.{part}", int(expert.group(1)), half)
    return Target(f"{prefix}.{rest}")


def deepseek_name(engine_name: str) -> str:
    """DeepSeek's name for an engine parameter (not for fused experts: see `deepseek_expert_names`)."""
    for ours, theirs in TOP_NAMES:
        if engine_name == ours:
            return theirs
    match = _LAYER.match(engine_name.removeprefix("model."))
    if match is None:
        raise KeyError(engine_name)
    scope, index, rest = match.groups()
    names = dict(LAYER_NAMES) if scope == "layers" else {**dict(LAYER_NAMES), **dict(MTP_NAMES)}
    return f"{scope}.{index}.{names[rest]}"


def deepseek_expert_name(engine_name: str, expert: int, part: str) -> str:
    """`model.layers.3.mlp.experts.gate_up_proj`, 5, "w1" -> `layers.3.ffn.experts.5.w1.weight`."""
    layer = re.split(r"\.(?:mlp|ffn)\.experts\.", engine_name.removeprefix("model."))[0]
    return f"{layer}.ffn.experts.{expert}.{part}.weight"


# the vision tower's tensors (engine/checkpoint/vision.py loads them): not the text model's
VISION_TENSORS = ("vision.", "aligner.", "image_start", "image_end", "image_newline")

_V41_EXPERT = re.compile(r"^((?:layers|mtp)\.\d+\.ffn\.experts)\.(\d+)\.(w1|w2|w3)\.weight$")


def canonical_name_v41(name: str) -> Target | None:
    """The V4.1 model's parameter for a checkpoint tensor. The model's modules carry the checkpoint's
    own names (DeepInfer's and SGLang's loaders read the same ones), so only the optional `model.`
    prefix goes and per-expert tensors find their row of the fused experts, DSpark's stages
    (`mtp.N.*`) included. The vision tower is not part of the text model: None."""
    bare = name.removeprefix("model.")
    if bare.startswith(VISION_TENSORS):
        return None
    if expert := _V41_EXPERT.match(bare):
        part, half = EXPERT_PARTS[expert.group(3)]
        return Target(f"{expert.group(1)}.{part}", int(expert.group(2)), half)
    return Target(bare)
