"""The engine's sweeps: hundreds of steps each on the tiny models, kept out of the unit tier.

Chunked prefill at every chunk size down to one token a step gives the greedy tokens of the
whole prompt in one step; a prefix hit gives the tokens of a cold run wherever the prefix ends
(inside a 128-token block or on its edge, before or after a compressor's window closes, inside
or beyond the sliding window), on every parity configuration.
"""

from __future__ import annotations

import random

import pytest

from engine import LLMEngine, SamplingParams, StateSnapshot
from tests.support.models import PARITY_CONFIGS, all_state_free, decode_to_end, prefill_and_export, random_prompts

pytestmark = pytest.mark.in_process  # no services, no deadline: behind the other tests

LENGTHS = (1, 17, 129, 300, 520)
GREEDY_24 = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
GREEDY = SamplingParams(max_tokens=24, temperature=0)


@pytest.fixture(scope="module")
def expected(tiny_model) -> dict[int, list[int]]:
    """Greedy outputs with the whole prompt in one step, one request at a time."""
    engine = LLMEngine(tiny_model, max_num_batched_tokens=4096)
    return {len(p): engine.generate([p], GREEDY_24)[0].token_ids for p in random_prompts(LENGTHS, seed=3)}


@pytest.mark.parametrize("chunk", [1, 5, 64, 128, 333])
def test_chunked_prefill_gives_same_greedy_output(tiny_model, expected, chunk):
    engine = LLMEngine(tiny_model, max_num_batched_tokens=chunk)
    outputs = engine.generate(random_prompts(LENGTHS, seed=3), GREEDY_24)
    assert {len(o.prompt_token_ids): o.token_ids for o in outputs} == expected
    assert all_state_free(engine)


@pytest.mark.parametrize("config", sorted(PARITY_CONFIGS))
def test_a_hit_at_any_anchor_gives_the_cold_tokens(checkpoints, config):
    engine = LLMEngine.from_pretrained(checkpoints[config], max_num_batched_tokens=256)
    rng = random.Random(config)
    for i, prompt in enumerate(random_prompts([300, 557, 129], seed=len(config))):
        cold = engine.generate([prompt], GREEDY)[0].token_ids
        # anchors: random ones, a block edge, one token left to compute, and the whole prompt (a repeat)
        anchors = {rng.randrange(1, len(prompt)), min(128, len(prompt) - 1), len(prompt) - 1, len(prompt)}
        for anchor in sorted(anchors):
            _, data = prefill_and_export(engine, f"prefix-{i}-{anchor}", prompt[:anchor], GREEDY)
            snapshot = StateSnapshot.from_bytes(data)
            assert snapshot.num_computed == anchor
            assert engine.import_prefix(f"hit-{i}-{anchor}", snapshot, prompt, GREEDY)
            hit = decode_to_end(engine)[f"hit-{i}-{anchor}"]
            assert hit == cold, f"{config}: prefix of {anchor} of {len(prompt)} tokens"
    assert engine.cache.block_allocator.num_free == engine.cache.num_blocks  # every block given back
