"""Shared fixtures: small random checkpoints written once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from engine import LLMEngine
from engine.checkpoint.make_model import preset_config, write_checkpoint
from engine.config import CSA, HCA, SLIDING

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))

# Every service the tests start decodes eager: compiling takes ~40 s a batch bucket on a fresh
# machine. tests/test_compiled_decode.py compiles once and checks the compiled step's tokens.
os.environ["DEEPMESH_COMPILE_DECODE"] = "0"

# Three random configurations that together use every attention kind, both router kinds, both
# scoring functions transformers implements (sqrtsoftplus, sigmoid), YaRN, hc_mult 2..4, and
# windows / rates that short prompts cross.
# 16 indexer heads keep exact score ties (which the reference breaks arbitrarily) out of the way.
PARITY_CONFIGS: dict[str, dict] = {
    "tiny-preset": preset_config("tiny", vocab_size=512, index_n_heads=16),
    "yarn-hc3": preset_config(
        "tiny",
        vocab_size=512,
        num_hidden_layers=3,
        layer_types=[SLIDING, HCA, CSA],
        mlp_layer_types=["hash_moe", "hash_moe", "moe"],
        hc_mult=3,
        sliding_window=64,
        compress_rates={CSA: 4, HCA: 32},
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
        index_n_heads=16,
        index_topk=4,
    ),
    "sigmoid-hc4": preset_config(
        "tiny",
        vocab_size=512,
        num_hidden_layers=5,
        layer_types=[CSA, HCA, CSA, SLIDING, HCA],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe", "moe"],
        hc_mult=4,
        scoring_func="sigmoid",
        sliding_window=32,
        compress_rates={CSA: 8, HCA: 64},
        n_routed_experts=6,
        num_experts_per_tok=3,
        num_attention_heads=8,
        o_groups=4,
        index_n_heads=16,
        index_topk=16,
    ),
}


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {
        name: write_checkpoint(root / name, config, seed=seed)
        for seed, (name, config) in enumerate(PARITY_CONFIGS.items(), start=1)
    }


@pytest.fixture(scope="session")
def tiny_preset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset as `make run` makes it (seed 0, the V4 tokenizer): what the mesh, the
    gateway and the distributed tests serve. Written once; nothing writes into it."""
    from engine.checkpoint.make_model import make_model

    return make_model(tmp_path_factory.mktemp("preset") / "tiny", "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_checkpoint(checkpoints: dict[str, Path]) -> Path:
    return checkpoints["tiny-preset"]


@pytest.fixture(scope="session")
def tiny_model(tiny_checkpoint: Path):
    return LLMEngine.from_pretrained(tiny_checkpoint).model


@pytest.fixture
def engine(tiny_model) -> LLMEngine:
    """A fresh engine (scheduler and state) over the shared tiny model."""
    return LLMEngine(tiny_model, max_num_seqs=16, max_num_batched_tokens=512)


def random_prompts(lengths, vocab: int = 512, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]
