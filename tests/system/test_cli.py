"""The `deepmesh` command: make-model, inspect, generate and serve, run as a user would. The
commands that compute and exit (no services, no deadline) are `in_process`: `make test` runs
them behind the other tests, at the lowest priority; `serve` runs alone."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open
from tokenizers import Tokenizer

from engine.checkpoint.make_model import TOKENIZER_VOCAB


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


@pytest.mark.in_process
def test_make_model_writes_a_servable_checkpoint(tiny_preset):
    config = json.loads((tiny_preset / "config.json").read_text())
    assert config["model_type"] == "deepseek_v4" and config["architectures"] == ["DeepseekV4ForCausalLM"]
    assert config["vocab_size"] == TOKENIZER_VOCAB
    tokenizer = Tokenizer.from_file(str(tiny_preset / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == TOKENIZER_VOCAB
    assert (tiny_preset / "tokenizer_config.json").is_file()


@pytest.mark.in_process
def test_make_model_is_deterministic(tiny_preset, tmp_path):
    """The same seed makes the same bytes again (the command's tiny_preset, seed 7, and the
    function it runs, in this process); another seed another model."""
    from engine.checkpoint.make_model import make_model

    assert _digest(make_model(tmp_path / "again", "tiny", seed=7)) == _digest(tiny_preset)
    assert _digest(make_model(tmp_path / "other", "tiny", seed=8)) != _digest(tiny_preset)


@pytest.mark.in_process
def test_make_model_writes_the_published_layout_and_inspect_reads_it(tmp_path):
    path = tmp_path / "published"
    made = deepmesh("make-model", str(path), "--format", "deepseek", "--quant", "fp8-fp4", "--shards", "2")
    assert made.returncode == 0, made.stderr
    index = json.loads((path / "model.safetensors.index.json").read_text())
    dtypes = {}
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(str(path / file), framework="pt") as f:
            dtypes.update({name: f.get_slice(name).get_dtype() for name in f.keys()})  # noqa: SIM118
    assert dtypes["layers.0.attn.wq_a.weight"] == "F8_E4M3" and dtypes["layers.0.attn.wq_a.scale"] == "F8_E8M0"
    assert dtypes["layers.1.ffn.experts.7.w2.weight"] == "I8" and dtypes["layers.1.ffn.experts.7.w2.scale"] == "F8_E8M0"
    assert dtypes["layers.0.attn.compressor.wkv.weight"] == "BF16" and dtypes["embed.weight"] == "BF16"
    assert dtypes["layers.1.attn.indexer.weights_proj.weight"] == "BF16"
    assert dtypes["layers.1.attn.indexer.wq_b.weight"] == "F8_E4M3"
    assert dtypes["hc_head_fn"] == "F32" and dtypes["layers.0.attn.attn_sink"] == "F32"
    assert dtypes["mtp.0.e_proj.weight"] == "F8_E4M3"
    config = json.loads((path / "config.json").read_text())
    assert config["expert_dtype"] == "fp4"
    assert config["quantization_config"] == {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "scale_fmt": "ue8m0",
    }

    shown = deepmesh("inspect", str(path))
    assert shown.returncode == 0, shown.stderr
    for expected in (
        "DeepSeek's",
        "fp4-e2m1 (ue8m0 scale per 32)",
        "multi-token prediction",
        "B/token",
        "can serve       yes",
    ):
        assert expected in shown.stdout, expected
    generated = deepmesh("generate", "--model", str(path), "--prompt", "Hello", "--max-tokens", "4")
    assert generated.returncode == 0, generated.stderr

    # relabelled V4.1, it lacks V4.1's layer plan: not servable, saying what is missing
    config["model_type"] = "deepseek_v41"
    (path / "config.json").write_text(json.dumps(config))
    shown = deepmesh("inspect", str(path))
    assert shown.returncode == 1
    assert "can serve       no: " in shown.stdout and "Traceback" not in shown.stderr
    assert "lacks qk_rope_head_dim, compress_ratios" in shown.stdout and "required for deepseek_v41" in shown.stdout


@pytest.mark.in_process
def test_generate_prints_text_and_speed(tiny_preset):
    result = deepmesh("generate", "--model", str(tiny_preset), "--prompt", "Hello, DeepSeek", "--max-tokens", "12")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()  # random weights, but real tokens decoded to real text
    assert "12 generated" in result.stderr and "tok/s" in result.stderr


@pytest.mark.in_process
def test_generate_reports_bad_input_clearly(tiny_preset, tmp_path):
    result = deepmesh("generate", "--model", str(tmp_path), "--prompt", "x")
    assert result.returncode == 2 and "no tokenizer.json" in result.stderr
    result = deepmesh("generate", "--model", str(tiny_preset), "--prompt", "x", "--max-tokens", "0")
    assert result.returncode == 2 and "max_tokens must be a positive integer" in result.stderr
    assert "Traceback" not in result.stderr
    result = deepmesh("generate", "--model", str(tiny_preset), "--prompt", "")
    assert result.returncode == 2 and "the prompt is empty" in result.stderr and "Traceback" not in result.stderr


def test_serve_answers_while_its_decode_graphs_compile_and_cache_stats_reads_its_cache(tiny_preset, tmp_path):
    """`deepmesh serve` as `make run` starts it on a fresh machine (decode and prefill compiled,
    nothing in the compile cache): it answers before its decode graphs are compiled, shows their
    progress and the prefill pieces' (waiting for them) in /metrics, and `deepmesh cache stats`
    reads its cache."""
    import os
    import signal

    import httpx

    from tests.support.infra import free_port, wait_until_up

    port = free_port()
    env = {
        **os.environ,
        "DEEPMESH_DATABASE_URL": f"sqlite:///{tmp_path}/deepmesh.db",
        "DEEPMESH_CACHE_DIR": str(tmp_path / "kv"),
        "DEEPMESH_TRACE_EXPORTER": "none",
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),  # empty: every graph compiles from scratch
    }
    command = [sys.executable, "-m", "deepmesh.cli", "serve", "--port", str(port), "--model", str(tiny_preset)]
    command.append("--compile")
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "serve.log", "w"))  # noqa: SIM115
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(f"{url}/readyz", [server], 120, f"see {tmp_path / 'serve.log'}")
        body = {"model": "deepmesh-tiny", "messages": [{"role": "user", "content": "hello " * 150}], "max_tokens": 4}
        answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
        exported = httpx.get(f"{url}/metrics").text.splitlines()
        graphs, pieces = (
            {
                line.split('state="')[1].split('"')[0]: float(line.split()[-1])
                for line in exported
                if line.startswith(f"deepmesh_{step}_graphs{{")
            }
            for step in ("decode", "prefill")
        )
        # one graph per batch bucket up to 64 sequences, compiling from scratch: not all ready yet
        assert graphs["planned"] == 7 and graphs["ready"] < graphs["planned"]
        # the prefill pieces' token buckets, 16 to 1,024 (the default step), compile once the decode graphs are done
        assert pieces == {"ready": 0, "planned": 7}
        shown = deepmesh("cache", "stats", "--url", url)
        assert shown.returncode == 0, shown.stderr
        assert "memory" in shown.stdout and "anchors" in shown.stdout and "blocks" in shown.stdout
        assert "deepmesh_prefix_cache_tokens_total{outcome=miss}" in shown.stdout
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    assert server.returncode == 0
