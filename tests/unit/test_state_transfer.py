"""State hand-over between engines: prefill in one, export, import into another, decode there."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load, save

from engine import (
    InvalidRequestError,
    LLMEngine,
    SamplingParams,
    SnapshotError,
    StateSnapshot,
    UnknownRequestError,
)
from engine.checkpoint.loader import load_model
from engine.state_transfer import safetensors_bytes
from tests.support.models import decode_to_end, prefill_and_export, prefill_and_snapshot, random_prompts

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


def as_written(data: bytes) -> tuple[dict, bytes]:
    """A safetensors file's header, parsed, and its data: the library writes the metadata's keys
    in no fixed order (two calls of its `save` on the same input differ there), all else in one."""
    header_len = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + header_len]), data[8 + header_len :]


def rewritten_by_safetensors(data: bytes, path) -> tuple[dict, bytes]:
    """What safetensors' own `save` writes for the tensors and metadata it reads from `data`."""
    path.write_bytes(data)
    with safe_open(path, "pt") as opened:
        metadata = opened.metadata()
    return as_written(save(load(data), metadata=metadata))


def test_a_snapshot_and_its_cache_head_are_the_bytes_safetensors_writes(tiny_model, tmp_path):
    """A snapshot is written through safetensors' `serialize` (engine.state_transfer.safetensors_bytes),
    not through its `save`, which takes ten times as long: the bytes must be `save`'s all the same,
    and hold the snapshot's own tensors. At 128 and 256 tokens the cache's head holds no block row."""
    engine = LLMEngine(tiny_model)
    params = SamplingParams(max_tokens=2, temperature=0)
    for length, prompt in zip([*LENGTHS, 256], random_prompts([*LENGTHS, 256], seed=31), strict=True):
        _, snapshot = prefill_and_snapshot(engine, f"r{length}", prompt, params)  # the engine's own tensors
        data = snapshot.to_bytes()
        assert as_written(data) == rewritten_by_safetensors(data, tmp_path / "state.safetensors"), length
        read = load(data)
        assert torch.equal(read.pop("blocks"), snapshot.blocks)
        assert torch.equal(read.pop("last_hidden"), snapshot.last_hidden)
        assert read.keys() == {f"slot.{name}" for name in snapshot.slot}
        assert all(torch.equal(read[f"slot.{name}"], tensor) for name, tensor in snapshot.slot.items())
        _, head, rows = snapshot.split()
        assert as_written(head) == rewritten_by_safetensors(head, tmp_path / "head.safetensors"), length
        assert len(rows) == length // 128 and load(head)["blocks"].shape[0] == (1 if length % 128 else 0)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int64, torch.int32, torch.bool]
)
def test_any_tensor_is_written_as_safetensors_save_writes_it(dtype):
    """Every dtype a state may hold, with a tensor of no elements, a scalar and a non-contiguous view
    beside a plain one: the same bytes as the library's `save` (given contiguous copies, which it
    requires), and read back equal."""
    generator = torch.Generator().manual_seed(3)
    plain = (torch.randn(5, 7, generator=generator) * 4).to(dtype)
    tensors = {
        "plain": plain,
        "transposed": plain.t(),
        "sliced": plain[1:4, ::2],
        "empty": plain[5:],
        "scalar": plain[0, 0],
    }
    metadata = {"layout": "v2-test", "token_ids": "[1, 2, 3]"}
    data = safetensors_bytes(tensors, metadata)
    copies = {name: tensor.contiguous().clone() for name, tensor in tensors.items()}  # as `save` requires
    assert as_written(data) == as_written(save(copies, metadata=metadata))
    read = load(data)
    for name, tensor in tensors.items():
        assert read[name].dtype == dtype and read[name].shape == tensor.shape
        assert torch.equal(read[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name
