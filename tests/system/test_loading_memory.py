"""Loading a quantized checkpoint in a fresh process (benchmarks/load_checkpoint.py): its peak
memory, measured from outside."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.checkpoint.make_model import preset_config, write_checkpoint

pytestmark = pytest.mark.in_process  # no services, no deadline: behind the other tests

ROOT = Path(__file__).resolve().parents[2]


def test_peak_memory_while_loading_stays_near_the_weights(tmp_path):
    """FP8 + FP4 shards dequantized to bf16 in a fresh process: the RSS growth at its peak is at
    most 1.3x the loaded weights (a whole shard held beside them would be ~1.5x and more)."""
    config = {**preset_config("small", vocab_size=4096), "num_hidden_layers": 3}
    config.update(layer_types=config["layer_types"][:3], mlp_layer_types=config["mlp_layer_types"][:3])
    path = write_checkpoint(tmp_path / "fp8-fp4", config, 1, layout="deepseek", quant="fp8-fp4", shards=2)
    command = [sys.executable, "benchmarks/load_checkpoint.py", "--measure", "engine", str(path)]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    assert measured["weights"] > 50 << 20
    assert measured["peak_growth"] <= 1.3 * measured["weights"], measured


# -- broken checkpoints: one clear error at load, naming the file and the tensor ---------------
