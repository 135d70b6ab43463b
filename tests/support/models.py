"""Models, prompts and references the tests share: the random configurations, the greedy
continuation of transformers' reference model, quantized weights dequantized by hand, and the
steps a prefill and a decode worker take."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import GenerationConfig

from engine import LLMEngine, SamplingParams
from engine.checkpoint.make_model import preset_config
from engine.config import CSA, HCA, SLIDING

NEW_TOKENS = 32  # of each greedy continuation compared with transformers'


@functools.cache
def reference_engine(model: Path) -> LLMEngine:
    """One engine per checkpoint for the answers tests compare with (what one process computes):
    loaded once, as generate() leaves an engine as it found it."""
    return LLMEngine.from_pretrained(model)


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


def random_prompts(lengths, vocab: int = 512, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def reference_greedy(reference, prompt: list[int]) -> list[int]:
    """transformers' greedy continuation with EOS an ordinary token, as the engine's ignore_eos makes it.
    Without clearing the model's own eos_token_id, min_new_tokens would forbid that token instead."""
    reference.generation_config.eos_token_id = None
    ids = torch.tensor([prompt])
    config = GenerationConfig(
        max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=None
    )
    with torch.no_grad():
        out = reference.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, len(prompt) :].tolist()


def dequantized_by_hand(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Quantized weights dequantized here, independently of the engine: FP8 values times their
    128 x 128 block's scale, or FP4 e2m1 pairs (low nibble first) times their 32-wide group's."""
    scale = scale.float()
    if values.dtype == torch.float8_e4m3fn:
        rows, cols = values.shape[-2:]
        scale = scale.repeat_interleave(128, dim=-2)[..., :rows, :].repeat_interleave(128, dim=-1)[..., :cols]
        return values.float() * scale
    e2m1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    codes = values.view(torch.uint8).long()
    unpacked = torch.stack([e2m1[codes & 15], e2m1[codes >> 4]], dim=-1).flatten(-2)
    return unpacked * scale.repeat_interleave(32, dim=-1)


def stored_tensors(path, prefix: str) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint whose name starts with `prefix`, read with safetensors' own reader."""
    out = {}
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys() if name.startswith(prefix)})  # noqa: SIM118
    return out


def prefill_and_snapshot(engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams):
    """Run a request until its first token, as a prefill worker does; returns (token, the state it
    exported: the engine's own tensors)."""
    engine.add_request(request_id, prompt, params)
    while True:
        outputs = [o for o in engine.step() if o.request_id == request_id]
        if outputs:
            break
    snapshot = engine.export_state(request_id)
    engine.abort(request_id)
    return outputs[0].new_token_ids[0], snapshot


def prefill_and_export(engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams):
    """`prefill_and_snapshot`, the state as the bytes a prefill worker stores: (token, bytes)."""
    token, snapshot = prefill_and_snapshot(engine, request_id, prompt, params)
    return token, snapshot.to_bytes()


def all_state_free(engine: LLMEngine) -> bool:
    """Every block and every state slot back with the engine: nothing a finished request held is left."""
    cache = engine.cache
    return cache.block_allocator.num_free == cache.num_blocks and cache.num_free_slots == cache.max_seqs


def decode_to_end(engine: LLMEngine, after_step: Callable[[LLMEngine], None] | None = None) -> dict[str, list[int]]:
    """Each request's new tokens, stepping until none is left; `after_step(engine)` after each step
    (to read what the step did: `last_step_drafted`, ...)."""
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if after_step is not None:
            after_step(engine)
    return tokens


def decode_until(
    engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams, count: int
) -> list[int]:
    """Add a request and step until it has `count` or more new tokens (still running): those tokens."""
    engine.add_request(request_id, prompt, params)
    produced: list[int] = []
    while len(produced) < count:
        for out in engine.step():
            if out.request_id == request_id:
                produced.extend(out.new_token_ids)
    return produced


def family_preset(request: pytest.FixtureRequest, family: str) -> Path:
    """The tiny preset of a model family ("deepseek_v4" or "deepseek_v41"), written once a session
    (tests/conftest.py): for the tests that hold on both families."""
    return request.getfixturevalue("tiny_preset" if family == "deepseek_v4" else "tiny_v41_preset")
