"""Checkpoint loading: names, shards, dtypes, MTP modules, peak memory, and one clear error,
naming the file and the tensor, for each way a checkpoint can be broken."""

from __future__ import annotations

import json
import logging
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLMEngine, SamplingParams, UnsupportedCheckpointError
from engine.checkpoint.loader import load_model
from engine.checkpoint.make_model import preset_config, write_checkpoint
from engine.checkpoint.weight_names import LAYER_NAMES, MTP_NAMES, TOP_NAMES, Target, canonical_name
from tests.support.models import PARITY_CONFIGS, dequantized_by_hand, random_prompts, stored_tensors

SMALL = {**PARITY_CONFIGS["tiny-preset"], "torch_dtype": "bfloat16"}


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def _rewrite(path: Path, edit) -> None:
    """Load the single shard with safetensors, let `edit` change the dict, write it back."""
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> Path:
    """A tiny checkpoint in DeepSeek's published layout: FP8 with ue8m0 scales, FP4 experts, MTP."""
    return write_checkpoint(
        tmp_path_factory.mktemp("published") / "fp8-fp4", SMALL, 5, layout="deepseek", quant="fp8-fp4"
    )


def test_every_spelling_of_a_name_finds_the_same_parameter():
    q_b = Target("model.layers.3.self_attn.q_b_proj.weight")
    for name in (
        "layers.3.attn.wq_b.weight",  # DeepSeek's
        "model.layers.3.attn.wq_b.weight",  # DeepSeek's under transformers' save_pretrained prefix
        "model.layers.3.self_attn.q_b_proj.weight",  # transformers' module name
        "layers.3.self_attn.q_b_proj.weight",  # the same without the prefix
    ):
        assert canonical_name(name) == q_b, name
    assert canonical_name("head.weight") == canonical_name("lm_head.weight") == Target("lm_head.weight")
    assert canonical_name("hc_head_fn") == canonical_name("model.hc_head.hc_fn") == Target("model.hc_head.hc_fn")
    assert canonical_name("layers.0.attn.kv_norm.weight") == canonical_name("layers.0.attn.norm.weight")
    assert canonical_name("layers.1.ffn.experts.6.w3.weight") == Target("model.layers.1.mlp.experts.gate_up_proj", 6, 1)
    assert canonical_name("mtp.0.hc_head_scale") == Target("mtp.0.hc_head.hc_scale")
    assert canonical_name("mtp.0.attn.wq_a.weight") == Target("mtp.0.self_attn.q_a_proj.weight")
    # the mix transformers' save_pretrained writes for a model it loaded from its own names
    assert canonical_name("model.layers.1.self_attn.compressor.indexer.norm.weight") == Target(
        "model.layers.1.self_attn.compressor.indexer.kv_norm.weight"
    )
    assert canonical_name("rotary_emb.inv_freq") is None
    # what make-model writes as DeepSeek's names reads back as the engine's
    for ours, theirs in LAYER_NAMES:
        assert canonical_name(f"layers.7.{theirs}") == Target(f"model.layers.7.{ours}"), theirs
        assert canonical_name(f"mtp.0.{theirs}") == Target(f"mtp.0.{ours}"), theirs
    for ours, theirs in (*TOP_NAMES, *(("mtp.1." + o, "mtp.1." + t) for o, t in MTP_NAMES)):
        assert canonical_name(theirs) == canonical_name(ours) == Target(ours), theirs


def test_sharded_checkpoint_loads_like_single_file(tiny_checkpoint, tmp_path):
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for name in ("config.json", "generation_config.json"):
        shutil.copy(tiny_checkpoint / name, sharded / name)
    tensors = load_file(str(tiny_checkpoint / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(sharded / file))
        weight_map.update(dict.fromkeys(keys, file))
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    prompt = random_prompts([40], seed=1)[0]
    single = LLMEngine.from_pretrained(tiny_checkpoint).score(prompt)
    assert torch.equal(LLMEngine.from_pretrained(sharded).score(prompt), single)


def test_bfloat16_checkpoint_keeps_fp32_where_the_reference_does(tmp_path):
    path = write_checkpoint(tmp_path / "bf16", preset_config("tiny", vocab_size=512, torch_dtype="bfloat16"), seed=3)
    model = load_model(path)
    assert model.lm_head.weight.dtype == torch.bfloat16
    layer = model.model.layers[0]
    assert layer.attn_hc.fn.dtype == torch.float32
    assert layer.self_attn.sinks.dtype == torch.float32
    assert layer.input_layernorm.weight.dtype == torch.float32
    out = LLMEngine(model).generate([[1, 2, 3] * 50], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 8
    assert load_model(path, dtype="float32").lm_head.weight.dtype == torch.float32


def test_quantized_weights_load_as_their_values_times_their_scales(published):
    """FP8 and FP4 tensors, read with safetensors' own reader and dequantized by hand."""
    model = load_model(published, dtype="float32")
    stored = stored_tensors(published, "layers.")
    assert stored["layers.1.attn.wq_b.weight"].dtype == torch.float8_e4m3fn
    assert stored["layers.1.attn.wq_b.scale"].dtype == torch.float8_e8m0fnu
    assert stored["layers.2.ffn.experts.5.w3.weight"].dtype == torch.int8
    q_b = dequantized_by_hand(stored["layers.1.attn.wq_b.weight"], stored["layers.1.attn.wq_b.scale"])
    assert torch.equal(model.model.layers[1].self_attn.q_b_proj.weight, q_b)
    up = dequantized_by_hand(stored["layers.2.ffn.experts.5.w3.weight"], stored["layers.2.ffn.experts.5.w3.scale"])
    assert torch.equal(model.model.layers[2].mlp.experts.gate_up_proj[5].chunk(2)[1], up)


def test_mtp_modules_are_loaded_and_named_once(published, caplog):
    with caplog.at_level(logging.INFO, logger="engine.checkpoint.loader"):
        model = load_model(published, dtype="float32")
    assert len(model.mtp) == 1
    stored = stored_tensors(published, "mtp.0.")
    assert torch.equal(model.mtp[0].enorm.weight, stored["mtp.0.enorm.weight"].float())
    assert torch.equal(model.mtp[0].hc_head.hc_fn, stored["mtp.0.hc_head_fn"])
    e_proj = dequantized_by_hand(stored["mtp.0.e_proj.weight"], stored["mtp.0.e_proj.scale"])
    assert torch.equal(model.mtp[0].e_proj.weight, e_proj)
    # the speculative decoding drafter: said once, not warned about
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 1 and "multi-token-prediction" in said[0] and "drafter" in said[0]


def test_a_tensor_the_engine_has_no_place_for(published, tmp_path, caplog):
    """Outside the layers it is named in the warning line; inside a layer it would change the
    layer's output if dropped, so it is an error."""
    path = _copy(published, tmp_path / "extra")
    _rewrite(path, lambda t: t.update({"rotary.inv_freq": torch.ones(4)}))
    with caplog.at_level(logging.WARNING, logger="engine.checkpoint.loader"):
        load_model(path)
    assert "rotary.inv_freq" in caplog.text
    _rewrite(path, lambda t: t.update({"layers.2.attn.wq_a.bias": torch.ones(64)}))
    with pytest.raises(
        UnsupportedCheckpointError,
        match=re.escape("model.safetensors: layers.2.attn.wq_a.bias has no place in the model"),
    ):
        load_model(path)


@pytest.mark.parametrize("how", ["built by transformers", "loaded from transformers' module names"])
def test_checkpoint_saved_by_transformers_loads_as_is(checkpoints, tmp_path, how):
    """save_pretrained writes DeepSeek's names under a model. prefix for a model it built, and
    keeps transformers' module names for one it loaded from them; both load, sharded."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    reference = DeepseekV4ForCausalLM.from_pretrained(checkpoints["sigmoid-hc4"], dtype=torch.float32).eval()
    if how == "built by transformers":
        built = DeepseekV4ForCausalLM(DeepseekV4Config.from_pretrained(checkpoints["sigmoid-hc4"])).eval()
        built.load_state_dict(reference.state_dict())
        reference = built
    reference.save_pretrained(tmp_path / "saved", max_shard_size="400KB")
    weight_map = json.loads((tmp_path / "saved" / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) > 1
    expected_names = (
        {"head.weight", "model.layers.0.attn.wq_a.weight"}
        if how == "built by transformers"
        else {
            "lm_head.weight",
            "model.layers.0.self_attn.q_a_proj.weight",
        }
    )
    assert expected_names <= set(weight_map)
    engine = LLMEngine.from_pretrained(tmp_path / "saved")
    prompt = random_prompts([70], seed=4)[0]
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0]
    assert (engine.score(prompt) - expected).abs().max().item() <= 1e-3


def test_truncated_shard(published, tmp_path):
    path = write_checkpoint(tmp_path / "sharded", SMALL, 5, layout="deepseek", quant="fp8", shards=3)
    shard = path / "model-00002-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])
    with pytest.raises(
        UnsupportedCheckpointError, match=r"model-00002-of-00003.safetensors: \S+ ends at byte .* \(truncated"
    ):
        load_model(path)
    shard.write_bytes(shard.read_bytes()[:5])
    with pytest.raises(
        UnsupportedCheckpointError, match=re.escape("model-00002-of-00003.safetensors: 5 bytes, too short")
    ):
        load_model(path)


def test_corrupt_header_and_index(published, tmp_path):
    path = _copy(published, tmp_path / "corrupt")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(struct.pack("<Q", 10) + b"{not json!" + data[18:])
    with pytest.raises(UnsupportedCheckpointError, match=re.escape("model.safetensors: unreadable safetensors header")):
        load_model(path)
    (path / "model.safetensors").write_bytes(data)
    index = {"weight_map": {"embed.weight": "model.safetensors", "head.weight": "model-2.safetensors"}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(UnsupportedCheckpointError, match=re.escape("names model-2.safetensors, which is missing")):
        load_model(path)
    index["weight_map"] = {"embed.weight": "model.safetensors", "not.there": "model.safetensors"}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        UnsupportedCheckpointError, match=re.escape("puts not.there in model.safetensors, which does not hold it")
    ):
        load_model(path)


def test_wrong_shape(published, tmp_path):
    path = _copy(published, tmp_path / "shape")
    _rewrite(path, lambda t: t.update({"layers.0.attn_norm.weight": torch.ones(100, dtype=torch.bfloat16)}))
    with pytest.raises(
        UnsupportedCheckpointError, match=r"model.safetensors: layers.0.attn_norm.weight has shape \[100\]"
    ):
        load_model(path)


def test_wrong_dtype(published, tmp_path):
    path = _copy(published, tmp_path / "dtype")
    _rewrite(path, lambda t: t.update({"norm.weight": t["norm.weight"].to(torch.int32)}))
    with pytest.raises(UnsupportedCheckpointError, match=re.escape("model.safetensors: norm.weight is torch.int32")):
        load_model(path)
    _rewrite(path, lambda t: t.update({"norm.weight": t["embed.weight"][0].to(torch.float8_e4m3fn)}))
    with pytest.raises(UnsupportedCheckpointError, match=re.escape("norm.weight is FP8 but has no scale")):
        load_model(path)
    _rewrite(
        path,
        lambda t: t.update(
            {"norm.weight": torch.ones(128), "layers.0.attn.wkv.weight": torch.zeros(64, 64, dtype=torch.int8)}
        ),
    )
    with pytest.raises(
        UnsupportedCheckpointError,
        match=re.escape("layers.0.attn.wkv.weight is torch.int8: only routed experts may be FP4"),
    ):
        load_model(path)


def test_missing_scale_and_misshapen_scale(published, tmp_path):
    path = _copy(published, tmp_path / "scale")
    _rewrite(path, lambda t: t.pop("layers.1.attn.wq_a.scale"))
    with pytest.raises(
        UnsupportedCheckpointError, match=r"model.safetensors: layers.1.attn.wq_a.weight is FP8 but has no scale"
    ):
        load_model(path)
    _rewrite(path, lambda t: t.update({"layers.1.attn.wq_a.scale": torch.ones(2, 2)}))
    with pytest.raises(
        UnsupportedCheckpointError, match=r"layers.1.attn.wq_a.scale has shape \[2, 2\]; \[1, 1\] expected"
    ):
        load_model(path)


def test_missing_expert_is_named_as_stored(published, tmp_path):
    path = _copy(published, tmp_path / "expert")
    _rewrite(path, lambda t: (t.pop("layers.3.ffn.experts.6.w3.weight"), t.pop("layers.3.ffn.experts.6.w3.scale")))
    with pytest.raises(
        UnsupportedCheckpointError, match=re.escape("missing tensors the model needs: layers.3.ffn.experts.6.w3.weight")
    ):
        load_model(path)


def test_quantized_tensors_without_a_quantization_config(published, tmp_path):
    path = _copy(published, tmp_path / "noquant")
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        UnsupportedCheckpointError, match=re.escape("is FP8 but config.json has no quantization_config")
    ):
        load_model(path)


@pytest.mark.parametrize(
    "quantization, problem",
    [
        ({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
        ({"quant_method": "fp8", "activation_scheme": "static"}, "activation_scheme 'static'"),
        ({"quant_method": "fp8", "scale_fmt": "e5m2"}, "scale_fmt 'e5m2'"),
        ({"quant_method": "fp8", "expert_dtype": "int4"}, "expert_dtype 'int4'"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size [128]"),
    ],
)
def test_unsupported_quantization_config(published, tmp_path, quantization, problem):
    path = _copy(published, tmp_path / "quant")
    _edit_config(path, quantization_config=quantization)
    with pytest.raises(UnsupportedCheckpointError, match=f"config.json: quantization_config {re.escape(problem)}"):
        load_model(path)


def test_other_architectures_are_refused(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint, tmp_path / "llama")
    _edit_config(path, model_type="llama")
    with pytest.raises(UnsupportedCheckpointError, match=re.escape("config.json: model_type 'llama' is not supported")):
        load_model(path)
    # a V4 config relabelled V4.1 lacks V4.1's layer plan: refused, naming what is missing
    _edit_config(path, model_type="deepseek_v41")
    with pytest.raises(UnsupportedCheckpointError, match=re.escape("lacks qk_rope_head_dim, compress_ratios")):
        load_model(path)
    _edit_config(path, model_type="deepseek_v41", architectures=["LlamaForCausalLM"])
    with pytest.raises(
        UnsupportedCheckpointError, match=re.escape("architectures ['LlamaForCausalLM'] is not supported")
    ):
        load_model(path)


def test_hash_routing_table_out_of_range(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint, tmp_path / "tid2eid")
    _rewrite(path, lambda t: t["model.layers.0.mlp.gate.tid2eid"].__setitem__((3, 0), 99))
    with pytest.raises(UnsupportedCheckpointError, match=re.escape("tid2eid: expert ids from 0 to 99, outside 0..7")):
        load_model(path)


def test_missing_and_misshapen_weights_are_named(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint, tmp_path / "broken")
    _rewrite(path, lambda t: t.pop("model.norm.weight"))
    with pytest.raises(
        UnsupportedCheckpointError, match=re.escape("missing tensors the model needs: model.norm.weight")
    ):
        load_model(path)
    _edit_config(path, hidden_size=256)
    with pytest.raises(UnsupportedCheckpointError, match=r"model.safetensors: \S+ has shape"):
        load_model(path)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(UnsupportedCheckpointError, match=re.escape("no config.json")):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(preset_config("tiny")))
    with pytest.raises(UnsupportedCheckpointError, match=re.escape("no model.safetensors")):
        load_model(tmp_path)


def test_compress_rate_must_divide_the_block(tmp_path):
    with pytest.raises(UnsupportedCheckpointError, match="must divide"):
        write_checkpoint(tmp_path / "odd", preset_config("tiny", compress_rates={"compressed_sparse_attention": 3}))
