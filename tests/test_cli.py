"""The `deepmesh` command: make-model and generate, run as a user would."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from engine.make_model import TOKENIZER_VOCAB


def deepmesh(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "deepmesh.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=600)


def _digest(path: Path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny_preset(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "tiny"
    result = deepmesh("make-model", str(path), "--preset", "tiny", "--seed", "7")
    assert result.returncode == 0, result.stderr
    return path


def test_make_model_writes_a_servable_checkpoint(tiny_preset):
    config = json.loads((tiny_preset / "config.json").read_text())
    assert config["model_type"] == "deepseek_v4" and config["architectures"] == ["DeepseekV4ForCausalLM"]
    assert config["vocab_size"] == TOKENIZER_VOCAB
    tokenizer = Tokenizer.from_file(str(tiny_preset / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == TOKENIZER_VOCAB
    assert (tiny_preset / "tokenizer_config.json").is_file()


def test_make_model_is_deterministic(tiny_preset, tmp_path):
    again = tmp_path / "again"
    other = tmp_path / "other"
    assert deepmesh("make-model", str(again), "--preset", "tiny", "--seed", "7").returncode == 0
    assert deepmesh("make-model", str(other), "--preset", "tiny", "--seed", "8").returncode == 0
    assert _digest(again) == _digest(tiny_preset)
    assert _digest(other) != _digest(tiny_preset)


def test_generate_prints_text_and_speed(tiny_preset):
    result = deepmesh("generate", "--model", str(tiny_preset), "--prompt", "Hello, DeepSeek", "--max-tokens", "12")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()  # random weights, but real tokens decoded to real text
    assert "12 generated" in result.stderr and "tok/s" in result.stderr


def test_generate_reports_bad_input_clearly(tiny_preset, tmp_path):
    result = deepmesh("generate", "--model", str(tmp_path), "--prompt", "x")
    assert result.returncode == 2 and "no tokenizer.json" in result.stderr
    result = deepmesh("generate", "--model", str(tiny_preset), "--prompt", "x", "--max-tokens", "0")
    assert result.returncode == 2 and "max_tokens must be a positive integer" in result.stderr
    assert "Traceback" not in result.stderr
