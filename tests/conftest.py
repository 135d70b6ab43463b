"""Shared fixtures: small random checkpoints written once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from engine import LLMEngine
from engine.checkpoint.make_model import write_checkpoint
from tests.support.models import PARITY_CONFIGS

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))

# Every service the tests start decodes eager: compiling takes ~40 s a batch bucket on a fresh
# machine. tests/test_compiled_decode.py compiles once and checks the compiled step's tokens.
os.environ["DEEPMESH_COMPILE_DECODE"] = "0"


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
