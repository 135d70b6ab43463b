"""The paged state: allocator, layout, and its size against the theoretical minimum."""

from __future__ import annotations

import pytest
import torch

from common.blocks import BLOCK_SIZE
from engine.checkpoint.make_model import preset_config
from engine.config import ModelConfig
from engine.state_cache import BlockAllocator, OutOfBlocksError, StateCache, StateLayout


def test_allocator_free_list_and_reference_counts():
    allocator = BlockAllocator(3)
    blocks = [allocator.allocate() for _ in range(3)]
    assert sorted(blocks) == [0, 1, 2] and allocator.num_free == 0
    with pytest.raises(OutOfBlocksError):
        allocator.allocate()
    allocator.share(blocks[0])  # a second owner, as the prefix cache will do
    allocator.release(blocks[0])
    assert allocator.num_free == 0  # still held by its other owner
    allocator.release(blocks[0])
    assert allocator.num_free == 1 and allocator.allocate() == blocks[0]
    allocator.release(blocks[1])
    with pytest.raises(ValueError, match="released more often"):
        allocator.release(blocks[1])
    with pytest.raises(ValueError, match="not allocated"):
        allocator.share(blocks[1])


@pytest.mark.parametrize(
    "config",
    [
        ModelConfig.from_dict(preset_config("tiny")),
        ModelConfig.from_dict(preset_config("small")),
        ModelConfig.from_dict({}),  # the full-size DeepSeek-V4 defaults: 43 layers, head_dim 512
    ],
    ids=["tiny", "small", "v4-defaults"],
)
@pytest.mark.parametrize("tokens", [4096, 32768])
def test_state_within_ten_percent_of_minimum(config, tokens):
    layout = StateLayout(config, torch.bfloat16)
    assert layout.allocated_bytes(tokens) <= 1.10 * layout.minimum_bytes(tokens)
    assert layout.allocated_bytes(tokens) >= layout.minimum_bytes(tokens)


def test_block_holds_every_layer_for_128_tokens_in_one_row():
    config = ModelConfig.from_dict(preset_config("tiny"))
    cache = StateCache(config, num_blocks=4, max_seqs=2, dtype=torch.float32, device="cpu")
    expected = 0
    for layer, rate in ((0, 128), (1, 4), (3, 4)):  # HCA, CSA, CSA (layer 2 is sliding-only)
        expected += (BLOCK_SIZE // rate) * config.head_dim
        if rate == 4:
            expected += (BLOCK_SIZE // rate) * config.index_head_dim
        # one more block than handed out: the scratch block padding rows write to
        assert cache.compressors[layer].entries.shape == (5, BLOCK_SIZE // rate, config.head_dim)
    assert cache.read_blocks([0, 1, 2, 3]).shape == (4, expected) and expected == cache.layout.block_numel
    # an entry written by a layer lands in that block's row and nowhere else
    cache.compressors[1].entries[2, 5] = 1.0
    rows = cache.read_blocks([0, 1, 2, 3])
    assert rows[2].count_nonzero() == config.head_dim
    assert rows[[0, 1, 3]].count_nonzero() == 0
    # and a row written back lands in the same place
    other = StateCache(config, num_blocks=4, max_seqs=2, dtype=torch.float32, device="cpu")
    other.write_blocks([3], rows[[2]])
    assert other.compressors[1].entries[3, 5].eq(1.0).all()
    assert other.read_blocks([3]).count_nonzero() == config.head_dim
    other.copy_block(3, 0)
    assert torch.equal(other.read_blocks([0]), rows[[2]])
    assert 2 not in cache.indexers  # sliding-only layer has no compressor


def test_sliding_only_model_needs_no_blocks():
    config = ModelConfig.from_dict(preset_config("tiny", layer_types=["sliding_attention"] * 4))
    cache = StateCache(config, num_blocks=0, max_seqs=1, dtype=torch.float32, device="cpu")
    assert not cache.uses_blocks and cache.layout.allocated_bytes(10_000) == cache.layout.slot_bytes
