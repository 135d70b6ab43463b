"""Our engine against transformers' DeepseekV4ForCausalLM, the reference implementation."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV4ForCausalLM

from engine import LLMEngine, SamplingParams
from tests.support.models import NEW_TOKENS, PARITY_CONFIGS, random_prompts, reference_greedy

pytestmark = pytest.mark.in_process  # no services, no deadline: behind the other tests

LENGTHS = (1, 5, 17, 129, 300)


@pytest.fixture(scope="module", params=sorted(PARITY_CONFIGS))
def pair(request, checkpoints):
    path = checkpoints[request.param]
    reference = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return LLMEngine.from_pretrained(path, max_num_batched_tokens=4096), reference


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
