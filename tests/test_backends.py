"""The kernel-backend registry: the reference is always there, others are chosen by device."""

from __future__ import annotations

import pytest
import torch

from engine import EngineError, LLMEngine, SamplingParams
from engine.backends import TorchBackend, available_backends, register_backend, select_backend
from tests.conftest import random_prompts


def test_reference_backend_everywhere():
    assert "torch" in available_backends("cpu")
    assert isinstance(select_backend("cpu"), TorchBackend)
    with pytest.raises(EngineError, match="unknown kernel backend"):
        select_backend("cpu", "no-such-backend")


def test_a_registered_backend_is_used_for_its_devices_only(tiny_model):
    calls = {"attention": 0, "routed_experts": 0}

    class CountingBackend(TorchBackend):
        name = "counting"

        def attention(self, *args):
            calls["attention"] += 1
            return super().attention(*args)

        def routed_experts(self, *args):
            calls["routed_experts"] += 1
            return super().routed_experts(*args)

    register_backend("counting", CountingBackend, supports=lambda device: device.type == "cpu")
    try:
        prompt = random_prompts([20], seed=2)[0]
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        counted = LLMEngine(tiny_model, kernel_backend="counting")
        tokens = counted.generate([prompt], params)[0].token_ids
        layers = tiny_model.config.num_hidden_layers
        assert calls == {"attention": 4 * layers, "routed_experts": 4 * layers}
        reference = LLMEngine(tiny_model, kernel_backend="torch")
        assert reference.generate([prompt], params)[0].token_ids == tokens
        with pytest.raises(EngineError, match="does not support"):
            select_backend(torch.device("meta"), "counting")
    finally:
        from engine import backends

        backends._REGISTRY.pop("counting")
        tiny_model.use_backend(TorchBackend())
