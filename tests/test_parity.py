"""Our engine against transformers' DeepseekV4ForCausalLM, the reference implementation."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV4ForCausalLM, GenerationConfig

from engine import LLMEngine, SamplingParams
from tests.conftest import PARITY_CONFIGS, random_prompts

LENGTHS = (1, 5, 17, 129, 300)
NEW_TOKENS = 32


@pytest.fixture(scope="module", params=sorted(PARITY_CONFIGS))
def pair(request, checkpoints):
    path = checkpoints[request.param]
    reference = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return LLMEngine.from_pretrained(path, max_num_batched_tokens=4096), reference


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


def test_checkpoint_loads_in_both_with_same_parameters(pair):
    engine, reference = pair
    ours = engine.model.state_dict()
    theirs = {k: v for k, v in reference.state_dict().items() if k in ours}
    assert set(theirs) == set(ours)
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


def test_full_prompt_logits_match(pair):
    engine, reference = pair
    for prompt in random_prompts(LENGTHS, seed=11):
        with torch.no_grad():
            expected = reference(torch.tensor([prompt])).logits[0]
        got = engine.score(prompt)
        assert got.shape == expected.shape
        diff = (got - expected).abs().max().item()
        assert diff <= 1e-3, f"length {len(prompt)}: max |diff| {diff}"
        # the check has teeth: logits vary far more across positions than the tolerance
        assert expected.std().item() > 1e-2


def test_greedy_matches_reference_one_at_a_time_and_batched(pair):
    engine, reference = pair
    prompts = random_prompts(LENGTHS, seed=12)
    expected = [reference_greedy(reference, p) for p in prompts]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    alone = [engine.generate([p], params)[0].token_ids for p in prompts]
    batched = [out.token_ids for out in engine.generate(prompts, params)]
    assert alone == expected
    assert batched == expected
