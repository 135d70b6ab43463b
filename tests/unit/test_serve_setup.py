"""What `deepmesh serve` and the services settle before they serve: how many intra-op threads
torch gets in a process that runs an engine (one less than the process's cores by default, so
that the HTTP, tokenizer and bus threads beside the engine, and other processes, never hold a
core that the engine's thread team waits for at every operator; DEEPMESH_TORCH_THREADS or
OMP_NUM_THREADS decide otherwise), and the context length GET /v1/models reports."""

from __future__ import annotations

import os

import pytest
import torch

from deepmesh import cli
from engine.checkpoint.make_model import make_model
from engine.families import read_config


@pytest.fixture(autouse=True)
def threads_restored():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_by_default_an_engine_leaves_a_core_to_the_rest(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("DEEPMESH_TORCH_THREADS", raising=False)
    expected = max(1, len(os.sched_getaffinity(0)) - 1)
    torch.set_num_threads(expected + 1)
    cli.set_engine_threads()
    assert torch.get_num_threads() == expected


def test_the_setting_decides_over_the_default_and_omp_num_threads(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("DEEPMESH_TORCH_THREADS", "3")
    cli.set_engine_threads()
    assert torch.get_num_threads() == 3


def test_omp_num_threads_alone_is_left_to_torch(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("DEEPMESH_TORCH_THREADS", raising=False)
    torch.set_num_threads(2)  # whatever torch runs with is left as it is
    cli.set_engine_threads()
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize("preset", ["tiny", "tiny-v41"])
def test_the_models_list_reports_the_checkpoints_context_length(preset, tmp_path):
    """Benchmark clients (guidellm) size their prompts by /v1/models' max_model_len; read without
    an engine, it must be what the engine reads from the same config.json (a V4.1 checkpoint
    nests it in text_config: it was reported as null)."""
    checkpoint = make_model(tmp_path / preset, preset, seed=0)
    assert cli._context_length(checkpoint) == read_config(checkpoint).max_position_embeddings > 0


def test_prefill_compiles_as_asked_and_says_so(capsys):
    """`deepmesh prefill --compile` (and serve): the prefill step compiles as pieces, on either
    family, and the line says so; a flag off compiles nothing."""
    import argparse

    from common.settings import Settings

    assert cli._compile_prefill(argparse.Namespace(compile=True), Settings()) is True
    assert "compiling the prefill step's pieces" in capsys.readouterr().err
    assert cli._compile_prefill(argparse.Namespace(compile=False), Settings()) is False
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("preset", ["tiny", "tiny-v41"])
def test_generate_tokenizes_a_text_prompt_as_transformers_does(preset, tmp_path):
    """`deepmesh generate --prompt TEXT` takes the ids POST /v1/completions takes for TEXT (the same
    function): transformers' tokenizer of the same checkpoint gives them too. The command put a
    BOS token first that neither adds, so its text continued another prompt."""
    from transformers import AutoTokenizer

    checkpoint = make_model(tmp_path / preset, preset, seed=0)
    text = "The mesh answers, token by token."
    assert cli.text_prompt_ids(checkpoint, text) == AutoTokenizer.from_pretrained(checkpoint)(text).input_ids
