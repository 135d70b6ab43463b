"""Tier 0: prefix states an engine still holds in its own blocks, taken back without a load.

Every continuation is compared with a cold run of the same prompt in a fresh engine, on each
parity configuration (window-only, compressed, and hash-routed layers), greedy and seeded.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLMEngine, SamplingParams
from engine.checkpoint.loader import load_model
from engine.resident_prefixes import ResidentPrefix, ResidentPrefixes
from engine.state_cache import BlockAllocator
from tests.support.models import decode_to_end as run_to_end
from tests.support.models import random_prompts

pytestmark = pytest.mark.in_process  # no services, no deadline: behind the other tests

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=5, ignore_eos=True)


@pytest.fixture(scope="module", params=["tiny-preset", "yarn-hc3", "sigmoid-hc4"])
def model(request, checkpoints):
    return load_model(checkpoints[request.param])


def first_token_then_free(engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams) -> None:
    """What a prefill worker does: run a prompt to its first token, take its state, free it."""
    engine.add_request(request_id, prompt, params)
    while not any(o.request_id == request_id and o.new_token_ids for o in engine.step()):
        pass
    engine.export_state(request_id)
    engine.abort(request_id)
    engine.step()  # the abort's output


def cold(model, prompt: list[int], params: SamplingParams) -> list[int]:
    return LLMEngine(model).generate([prompt], params)[0].token_ids


def all_free(engine: LLMEngine) -> bool:
    return engine.cache.block_allocator.num_free == engine.cache.num_blocks and not engine.seqs


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_follow_up_and_a_repeat_resume_from_the_engines_own_blocks(model, params):
    first, extra = random_prompts([300, 45], seed=31)
    engine = LLMEngine(model)
    first_token_then_free(engine, "turn-1", first, params)
    assert engine.import_resident("turn-2", first + extra, params) == 300
    assert engine.import_resident("repeat", first, params) == 300  # the whole prompt: nothing computed
    assert run_to_end(engine) == {"turn-2": cold(model, first + extra, params), "repeat": cold(model, first, params)}
    assert engine.resident.hits == 2 and all_free(engine)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_state_computed_by_another_engine_is_held_and_resumed_like_its_own(model, params):
    """What a prefill replica does with a conversation decode finished: take its state into its
    own blocks without a request, then start the next turn from it with no load."""
    answered, extra = random_prompts([260, 30], seed=37)
    decoder = LLMEngine(model)
    first_token_then_free(decoder, "turn-1", answered, params)
    state = decoder.export_state  # the state a decode engine stores at the end of an answer
    decoder.import_resident("again", answered, params)
    snapshot = state("again")
    held_by = LLMEngine(model)
    assert held_by.keep_resident(params.prefix_namespace, snapshot)
    assert all_free(held_by)  # held in free blocks: nothing running is displaced
    assert held_by.import_resident("turn-2", answered + extra, params) == 260
    assert run_to_end(held_by) == {"turn-2": cold(model, answered + extra, params)}
    # another tenant's prompt with the same tokens does not find it
    assert held_by.import_resident("other", answered + extra, SamplingParams(max_tokens=2, prefix_namespace="x")) == 0


def test_tenants_never_share_what_an_engine_holds(model):
    prompt, extra = random_prompts([300, 20], seed=35)
    engine = LLMEngine(model)
    first_token_then_free(engine, "a", prompt, SamplingParams(max_tokens=4, prefix_namespace="tenant-a"))
    tenant_b = SamplingParams(max_tokens=4, prefix_namespace="tenant-b")
    assert engine.import_resident("b", prompt + extra, tenant_b) == 0 and "b" not in engine.seqs
    tenant_a = SamplingParams(max_tokens=4, prefix_namespace="tenant-a")
    assert engine.import_resident("a-again", prompt + extra, tenant_a) == 300


def test_an_anchor_inside_a_running_prompt_is_shared_while_that_prompt_goes_on(model):
    """The anchor's partial block is still being written by the prompt it came from: the
    prompt that resumes from it gets a copy, and both answers are the cold ones."""
    long_prompt, other_end = random_prompts([400, 30], seed=32)
    engine = LLMEngine(model, max_num_batched_tokens=128)
    engine.add_request("long", long_prompt, GREEDY, snapshot_at=[200])
    while engine.seqs["long"].num_computed < 200:
        engine.step()
    assert engine.import_resident("short", long_prompt[:200] + other_end, GREEDY) == 200
    assert run_to_end(engine) == {
        "long": cold(model, long_prompt, GREEDY),
        "short": cold(model, long_prompt[:200] + other_end, GREEDY),
    }
    assert all_free(engine)


def test_an_answers_final_state_serves_the_next_turn(model):
    prompt, next_message = random_prompts([150, 20], seed=33)
    engine = LLMEngine(model)
    keep = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, keep_final_state=True)
    engine.add_request("turn-1", prompt, keep)
    answer = run_to_end(engine)["turn-1"]
    turn_2 = prompt + answer + next_message
    assert engine.import_resident("turn-2", turn_2, GREEDY) == len(prompt) + len(answer) - 1
    assert run_to_end(engine)["turn-2"] == cold(model, turn_2, GREEDY)


def test_blocks_taken_by_running_requests_end_the_prefixes_that_needed_them(model):
    """Room for running requests comes first: once the freed blocks are allocated again, the
    prefix is gone (a miss, computed from scratch), never served with foreign content."""
    first, filler, extra = random_prompts([300, 380, 20], seed=34)
    engine = LLMEngine(model, num_blocks=4, max_num_seqs=2)
    first_token_then_free(engine, "turn-1", first, GREEDY)
    engine.add_request("filler", filler, GREEDY)  # needs 3 blocks: it takes turn 1's
    engine.step()
    assert engine.import_resident("turn-2", first + extra, GREEDY) == 0 and "turn-2" not in engine.seqs
    run_to_end(engine)
    engine.add_request("turn-2", first + extra, GREEDY)
    assert run_to_end(engine)["turn-2"] == cold(model, first + extra, GREEDY)
    assert all_free(engine)


def test_the_allocator_and_the_index_agree_on_what_is_intact():
    allocator, resident = BlockAllocator(3), ResidentPrefixes(max_bytes=1 << 20)
    allocator.on_reuse = resident.block_reused
    a, b = allocator.allocate(), allocator.allocate()
    slot = {"window": torch.zeros(4)}
    resident.add("t", [1, 2, 3], ResidentPrefix(3, [a], slot, torch.zeros(2)))
    resident.add("t", [1, 2, 3, 4], ResidentPrefix(4, [a, b], slot, torch.zeros(2)))
    allocator.release(a)
    allocator.release(b)  # both free, content intact: the longer prefix is found
    assert resident.longest("t", [1, 2, 3, 4, 5], 5).num_tokens == 4
    assert resident.longest("other tenant", [1, 2, 3, 4, 5], 5) is None
    assert allocator.allocate() not in (a, b)  # the block that was free longest goes first
    allocator.revive(a)  # taken back: no longer free
    assert allocator.num_free == 1 and allocator.ref_counts[a] == 1
    assert allocator.allocate() == b  # reused: the prefix that needed it is gone
    assert resident.longest("t", [1, 2, 3, 4, 5], 5).num_tokens == 3
    assert resident.longest("t", [1, 2, 3, 4, 5], 2) is None
    small = ResidentPrefixes(max_bytes=3 * 24)  # room for three entries' slot copies
    for n in range(1, 6):
        small.add("t", list(range(n)), ResidentPrefix(n, [], {"window": torch.zeros(4)}, torch.zeros(2)))
    assert len(small) == 3 and small.longest("t", list(range(5)), 5).num_tokens == 5  # least recently used went
