"""Checkpoints as they are published and as transformers writes them, against transformers
reading the same files: DeepSeek's and transformers' tensor names x {bf16, FP8 with float
scales, FP8 with ue8m0 scales, FP8 with FP4 routed experts}, on every parity configuration."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import DeepseekV4ForCausalLM

from engine import LLMEngine, SamplingParams
from engine.checkpoint.make_model import write_checkpoint
from tests.support.models import (
    NEW_TOKENS,
    PARITY_CONFIGS,
    dequantized_by_hand,
    random_prompts,
    reference_greedy,
    stored_tensors,
)

pytestmark = pytest.mark.in_process  # no services, no deadline: behind the other tests

QUANTS = {
    "bf16": ("none", "ue8m0"),
    "fp8-float": ("fp8", "float"),
    "fp8-ue8m0": ("fp8", "ue8m0"),
    "fp8-fp4": ("fp8-fp4", "ue8m0"),
}
LAYOUTS = ("deepseek", "transformers")
COMBOS = [(config, layout, quant) for config in sorted(PARITY_CONFIGS) for layout in LAYOUTS for quant in QUANTS]


@pytest.fixture(scope="module", params=COMBOS, ids=["-".join(combo) for combo in COMBOS])
def published(request, tmp_path_factory):
    config_name, layout, quant_name = request.param
    quant, scale_fmt = QUANTS[quant_name]
    config = {**PARITY_CONFIGS[config_name], "torch_dtype": "bfloat16"}
    seed = sorted(PARITY_CONFIGS).index(config_name) + 10
    path = write_checkpoint(
        tmp_path_factory.mktemp("published") / layout,
        config,
        seed,
        layout=layout,
        quant=quant,
        scale_fmt=scale_fmt,
        shards=2,
    )
    engine = LLMEngine.from_pretrained(path, dtype="float32", max_num_batched_tokens=4096)
    # transformers 5.24 reads fused FP8 experts under its own names without applying their scales
    # (its dequantization runs only where it merges per-expert tensors) and refuses fused FP4
    # ones: it reads everything else from the same files, and those experts are dequantized here
    fused_quantized = layout == "transformers" and quant != "none"
    reference = DeepseekV4ForCausalLM.from_pretrained(
        path, dtype=torch.float32, ignore_mismatched_sizes=fused_quantized
    )
    if fused_quantized:
        for name, parameter in reference.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                stored = stored_tensors(path, name)
                parameter.data = dequantized_by_hand(stored[name], stored[name + "_scale_inv"])
    return engine, reference.eval(), path


def test_logits_match_transformers_on_the_same_files(published):
    engine, reference, _ = published
    for prompt in random_prompts((17, 300), seed=21):
        with torch.no_grad():
            expected = reference(torch.tensor([prompt])).logits[0]
        diff = (engine.score(prompt) - expected).abs().max().item()
        assert diff <= 1e-3, f"length {len(prompt)}: max |diff| {diff}"
        assert expected.std().item() > 1e-2


def test_greedy_continuations_match_transformers(published):
    engine, reference, _ = published
    prompts = random_prompts((5, 300), seed=22)  # shorter than every window and rate, and longer
    expected = [reference_greedy(reference, p) for p in prompts]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    assert [out.token_ids for out in engine.generate(prompts, params)] == expected


def test_the_layout_is_the_one_asked_for(published):
    """The files hold what the published checkpoints hold, read with safetensors' own reader."""
    engine, _, path = published
    layout, quant = path.name, json.loads((path / "config.json").read_text()).get("quantization_config")
    names: dict[str, str] = {}
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            names.update({name: f.get_slice(name).get_dtype() for name in f.keys()})  # noqa: SIM118
    attention = "layers.0.attn.wq_b.weight" if layout == "deepseek" else "model.layers.0.self_attn.q_b_proj.weight"
    expert = "layers.1.ffn.experts.0.w1.weight" if layout == "deepseek" else "model.layers.1.mlp.experts.gate_up_proj"
    assert (names[attention] == "F8_E4M3") == (quant is not None)
    assert (
        names[expert]
        == {None: "BF16", "fp8": "F8_E4M3", "fp4": "I8"}[quant and engine.config.quantization_config.expert_dtype]
    )
    assert any(name.startswith("mtp.0.") for name in names) == (layout == "deepseek")
    assert len(engine.model.mtp) == (1 if layout == "deepseek" else 0)
