"""Checkpoint loading: sharded files, dtypes, and clear refusals of what the engine cannot run."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLMEngine, SamplingParams, UnsupportedCheckpointError
from engine.loader import load_model
from engine.make_model import preset_config, write_checkpoint
from tests.conftest import random_prompts


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


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


def test_quantized_config_is_refused(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint, tmp_path / "fp8")
    _edit_config(path, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    with pytest.raises(UnsupportedCheckpointError, match="quantized checkpoints \\(fp8\\)"):
        LLMEngine.from_pretrained(path)


def test_fp8_tensors_are_refused(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint, tmp_path / "fp8-tensors")
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.0.self_attn.q_b_proj.weight"
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(UnsupportedCheckpointError, match="FP8 is not supported"):
        load_model(path)


def test_other_architecture_is_refused(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint, tmp_path / "llama")
    _edit_config(path, model_type="llama")
    with pytest.raises(UnsupportedCheckpointError, match="'llama' is not supported"):
        load_model(path)


def test_missing_and_misshapen_weights_are_named(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint, tmp_path / "broken")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.norm.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(UnsupportedCheckpointError, match=re.escape("model.norm.weight")):
        load_model(path)
    _edit_config(path, hidden_size=256)
    with pytest.raises(UnsupportedCheckpointError):
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
