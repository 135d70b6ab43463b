"""State hand-over between engines: prefill in one, export, import into another, decode there."""

from __future__ import annotations

import pytest
import torch

from engine import (
    InvalidRequestError,
    LLMEngine,
    SamplingParams,
    SnapshotError,
    StateSnapshot,
    UnknownRequestError,
)
from engine.checkpoint.loader import load_model
from tests.support.models import decode_to_end, prefill_and_export, random_prompts

LENGTHS = (1, 17, 128, 129, 300, 520)


@pytest.fixture(scope="module")
def decode_model(tiny_checkpoint):
    """A second copy of the weights, as a decode worker in another process would load them."""
    return load_model(tiny_checkpoint)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=77, ignore_eos=True),
    ],
    ids=["greedy", "seeded"],
)
def test_handed_over_requests_continue_exactly(tiny_model, decode_model, params):
    prompts = random_prompts(LENGTHS, seed=21)
    expected = [o.token_ids for o in LLMEngine(tiny_model).generate(prompts, params)]
    prefill = LLMEngine(tiny_model, max_num_batched_tokens=256)
    decode = LLMEngine(decode_model)
    first_tokens = {}
    for i, prompt in enumerate(prompts):
        first_tokens[f"r{i}"], data = prefill_and_export(prefill, f"r{i}", prompt, params)
        assert decode.import_state(f"r{i}", StateSnapshot.from_bytes(data), params)
    continued = decode_to_end(decode)
    for i, want in enumerate(expected):
        assert [first_tokens[f"r{i}"], *continued[f"r{i}"]] == want
    assert prefill.cache.block_allocator.num_free == prefill.cache.num_blocks
    assert decode.cache.block_allocator.num_free == decode.cache.num_blocks


def test_import_without_room_recomputes_to_the_same_tokens(tiny_model):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompt = random_prompts([300], seed=22)[0]
    expected = LLMEngine(tiny_model).generate([prompt], params)[0].token_ids
    first, data = prefill_and_export(LLMEngine(tiny_model), "r", prompt, params)
    full = LLMEngine(tiny_model, num_blocks=3, max_num_seqs=1)
    full.add_request("busy", random_prompts([200], seed=23)[0], SamplingParams(max_tokens=4, temperature=0))
    full.step()  # "busy" now holds the only slot
    assert not full.import_state("r", StateSnapshot.from_bytes(data), params)
    assert [first, *decode_to_end(full)["r"]] == expected


def test_snapshots_of_another_layout_or_garbage_are_refused(tiny_model, checkpoints):
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    _, data = prefill_and_export(LLMEngine(tiny_model), "r", [5, 6, 7, 8], params)
    other = LLMEngine.from_pretrained(checkpoints["yarn-hc3"])
    with pytest.raises(SnapshotError, match="layout"):
        other.import_state("r", StateSnapshot.from_bytes(data), params)
    with pytest.raises(SnapshotError, match="unreadable"):
        StateSnapshot.from_bytes(data[: len(data) // 2])
    with pytest.raises(SnapshotError, match="unreadable"):
        StateSnapshot.from_bytes(b"not a snapshot")

    engine = LLMEngine(tiny_model)
    snapshot = StateSnapshot.from_bytes(data)
    snapshot.blocks = torch.cat([snapshot.blocks, snapshot.blocks])
    with pytest.raises(SnapshotError, match="blocks"):
        engine.import_state("r", snapshot, params)
    snapshot = StateSnapshot.from_bytes(data)
    snapshot.slot.pop("window")
    with pytest.raises(SnapshotError, match="slot state"):
        engine.import_state("r", snapshot, params)
    snapshot = StateSnapshot.from_bytes(data)
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        engine.import_state("r", snapshot, SamplingParams(max_tokens=1))
    assert engine.cache.num_free_slots == engine.cache.max_seqs  # nothing leaked by the refusals
    assert engine.import_state("r", snapshot, params)


def test_export_needs_a_running_request(engine):
    engine.add_request("w", [1, 2, 3], SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequestError, match="no computed state"):
        engine.export_state("w")  # still waiting: nothing computed
    with pytest.raises(UnknownRequestError):
        engine.export_state("nope")


def test_a_state_split_for_the_cache_and_joined_again_continues_exactly(tiny_model):
    """What the KV cache stores of a state: a blob per full block (equal for prompts that share
    the block: stored once) and a head. Joined again it is the same state: the longer prompt
    continues from it to the tokens a cold run gives."""
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    short, extra = random_prompts([300, 100], seed=24)
    longer = short + extra
    engine = LLMEngine(tiny_model)
    _, data = prefill_and_export(engine, "short", short, params)
    _, longer_data = prefill_and_export(engine, "longer", longer, params)
    tokens, head, rows = StateSnapshot.from_bytes(data).split()
    assert tokens == short and len(rows) == 2 and len(set(map(len, rows))) == 1

    joined = StateSnapshot.joined(head, rows)
    # the longer prompt's first two blocks: the same state (computed in another batch shape,
    # so up to rounding; the cache keeps whichever came first)
    longer_rows = StateSnapshot.from_bytes(longer_data).split()[2][:2]
    as_numbers = [torch.frombuffer(bytearray(b"".join(b)), dtype=joined.blocks.dtype) for b in (rows, longer_rows)]
    assert torch.allclose(*as_numbers, atol=1e-4)
    assert joined.token_ids == short and joined.seed == 0  # canonical: no request's seed or output
    assert torch.equal(joined.blocks, StateSnapshot.from_bytes(data).blocks)
    expected = LLMEngine(tiny_model).generate([longer], params)[0].token_ids
    assert engine.import_prefix("resumed", joined, longer, params)
    assert decode_to_end(engine)["resumed"] == expected

    with pytest.raises(SnapshotError, match="1 block rows for a state of 300 tokens"):
        StateSnapshot.joined(head, rows[:1])
    with pytest.raises(SnapshotError, match="wrong size"):
        StateSnapshot.joined(head, [rows[0], rows[1][:-2]])
    with pytest.raises(SnapshotError, match="unreadable"):
        StateSnapshot.joined(b"garbage", rows)
