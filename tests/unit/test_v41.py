"""DeepSeek-V4.1 (`deepseek_v41`): its config, its checkpoints, and the engine running it.

The parts DeepInfer ships a plain-torch reference for (compression, candidate blocks, the Engram
vocabulary, primes and multipliers) are held against those references, called from DeepInfer's
own source (tests/support/deepinfer_reference.py). The engine's own invariants follow: chunked,
batched and one-token-at-a-time prompts compute the same thing; a prompt resumed from a stored
prefix gives the logits of a whole-prompt prefill (bounded replay); truncation changes what the
consumer layers see and nothing else."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import torch

from common.blocks import BLOCK_SIZE
from engine import LLMEngine, SamplingParams, SnapshotError, UnsupportedCheckpointError
from engine.checkpoint.make_model import make_model
from engine.config_v41 import V41Config
from engine.families import read_config
from engine.model.engram import compressed_vocabulary, hash_multipliers, table_primes
from engine.model.step_input import SeqSlice
from engine.model.v41 import Compressor, candidate_mask
from engine.state_cache import CompressorState
from prefill_svc.worker import anchor_positions
from tests.support.deepinfer_reference import StubbedKernelError, engram_metadata, requires_reference, tilelang_op


@pytest.fixture(scope="module")
def tiny_v41(tiny_v41_preset: Path) -> Path:
    return tiny_v41_preset


@pytest.fixture(scope="module")
def v41_model(tiny_v41: Path):
    return LLMEngine.from_pretrained(tiny_v41).model


def prompt(length: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 120_000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


# -- config ---------------------------------------------------------------------------------------


def test_nested_flat_and_sglang_layouts_read_the_same(tiny_v41: Path):
    nested = json.loads((tiny_v41 / "config.json").read_text())
    config = V41Config.from_dict(nested)
    flat = {**nested["text_config"], **{k: v for k, v in nested.items() if k != "text_config"}}
    assert V41Config.from_dict(flat) == config
    # SGLang's reading: top-level keys win over the text model's, and it names the HC shift differently
    overridden = copy.deepcopy(nested) | {"rms_norm_eps": 1e-5, "hc_pre_from_prev_sublayer": True}
    del overridden["text_config"]["hc_shifted"]
    assert V41Config.from_dict(overridden).rms_norm_eps == 1e-5
    assert config.yoco_boundary == 4 and config.prefill_keep_tokens == 140
    assert [config.kv_source(i) for i in range(1, 6)] == [1, 1, 1, 4, 4]
    assert [config.index_source(i) for i in range(1, 6)] == [1, 1, 3, 4, 5]
    assert [config.uses_candidates(i) for i in range(6)] == [False] * 5 + [True]
    assert read_config(tiny_v41, prefill_keep_tokens=0).prefill_keep_tokens == 0


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"compress_ratios": [0, 4, 2, 2, 1, 1]}, "unsupported ratios [4]"),
        ({"kv_source_layer_ids": [1, 5]}, "shares KV with layer 1 (ratio 2)"),
        ({"index_source_layer_ids": [1, 3, 5]}, "shares index with layer 3 (ratio 2)"),
        ({"engram_layer_ids": [4]}, "must be layers before the first YOCO consumer layer"),
        ({"hc_shifted": False}, "hc_shifted false"),
        ({"scoring_func": "softmax"}, "scoring_func 'softmax' is not supported"),
        ({"index_k_source_layer_ids": [1, 2, 4]}, "index_k_source_layer_ids other than kv_source_layer_ids"),
        ({"candidate_source_layer_id": 2}, "must be an index source"),
        ({"compress_ratios": [0, 2, 2, 2]}, "compress_ratios has 4 entries for 6 layers"),
    ],
)
def test_unsupported_layer_plans_are_refused_naming_the_problem(tiny_v41: Path, change, problem):
    raw = json.loads((tiny_v41 / "config.json").read_text())
    raw["text_config"].update(change)
    with pytest.raises(UnsupportedCheckpointError, match=re.escape(problem)):
        V41Config.from_dict(raw)


def test_a_missing_or_misshaped_tensor_is_named_before_any_request(tiny_v41: Path, tmp_path: Path):
    from safetensors.torch import load_file, save_file

    tensors = load_file(tiny_v41 / "model.safetensors")
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (broken / name).write_bytes((tiny_v41 / name).read_bytes())
    missing = {k: v for k, v in tensors.items() if k != "layers.3.attn.indexer.wq_b.weight"}
    save_file(missing, broken / "model.safetensors")
    with pytest.raises(
        UnsupportedCheckpointError, match=r"missing tensors the model needs: layers\.3\.attn\.indexer\.wq_b"
    ):
        LLMEngine.from_pretrained(broken)
    misshaped = dict(tensors) | {"layers.1.engram.wkv.weight": torch.zeros(3, 3)}
    save_file(misshaped, broken / "model.safetensors")
    with pytest.raises(UnsupportedCheckpointError, match=r"layers\.1\.engram\.wkv\.weight has shape \[3, 3\]"):
        LLMEngine.from_pretrained(broken)
    extra = dict(tensors) | {"layers.2.attn.indexer.wk.weight": torch.zeros(32, 64)}  # layer 2 shares layer 1's
    save_file(extra, broken / "model.safetensors")
    with pytest.raises(UnsupportedCheckpointError, match=r"layers\.2\.attn\.indexer\.wk\.weight has no place"):
        LLMEngine.from_pretrained(broken)


# -- against DeepInfer's references ------------------------------------------------------------------


@requires_reference
@pytest.mark.parametrize(("ratio", "chunks"), [(1, [5, 1, 6]), (2, [5, 1, 1, 9]), (2, [16])])
def test_compression_matches_deepinfer_in_any_chunking(ratio: int, chunks: list[int]):
    """Our compressor, fed a sequence in chunks (open windows carried between them), pools what
    DeepInfer's prefill reference pools from the whole sequence at once."""
    compress = tilelang_op("compress")
    config = V41Config(hidden_size=16, head_dim=16, compress_ratios=[ratio], kv_source_layer_ids=[0])
    compressor = Compressor(config, ratio)
    torch.nn.init.ones_(compressor.norm.weight)
    length, dim = sum(chunks), config.head_dim
    gen = torch.Generator().manual_seed(ratio * 100 + len(chunks))
    latent, score = torch.randn(length, dim, generator=gen), torch.randn(length, dim, generator=gen)
    ring = ratio + 3  # with room for 3 drafts past the computed tokens, as speculative decoding keeps
    state = CompressorState(
        ratio, dim, False, torch.zeros(2, 128 // ratio, dim), torch.zeros(2, ring, dim), torch.zeros(2, ring, dim)
    )
    ours, start = [], 0
    for n in chunks:
        closed = compressor.close_prefill(
            latent[start : start + n],
            score[start : start + n] if ratio > 1 else None,
            SeqSlice(0, start, n, [0]),
            state,
        )
        if closed is not None:
            ours.append(closed[1])
        start += n
    count = length // ratio
    cu = torch.tensor([0, length], dtype=torch.int32)
    # ratio 1 has no gate: its weights are the softmax of one score, 1
    reference = compress.compress_and_update_state_prefill_ref(
        score if ratio > 1 else torch.zeros_like(score),
        latent,
        torch.zeros(1, 8, 2, dim),
        torch.tensor([0], dtype=torch.int32),
        torch.zeros(count, dtype=torch.int32),
        cu,
        cu.clone(),
        torch.tensor([0, count], dtype=torch.int32),
        ratio,
    )
    norm = tilelang_op("norm")
    expected = norm.norm_ref(reference.float(), torch.ones(dim), config.rms_norm_eps)
    # DeepInfer rounds the pooled entry to bf16 before its norm; ours stays fp32 until the end
    torch.testing.assert_close(torch.cat(ours), expected.float(), rtol=2e-2, atol=2e-2)
    assert (torch.cat(ours) - expected.float()).abs().max() < 0.05


@requires_reference
def test_candidate_blocks_are_deepinfers_choice():
    """The candidate source keeps the best blocks by their best entry, always the newest block,
    as DeepInfer's `candidate_block_max_ref` scores them (scores bf16-exact, no ties)."""
    candidate_blocks = tilelang_op("candidate_blocks")
    gen = torch.Generator().manual_seed(7)
    rows, entries, block_size, topk_blocks = 6, 61, 8, 3
    scores = torch.randn(rows, entries, generator=gen).to(torch.bfloat16).float()
    counts = torch.tensor([61, 40, 17, 9, 8, 3])
    visible = torch.arange(entries).unsqueeze(0) < counts.unsqueeze(1)
    ours = candidate_mask(scores.masked_fill(~visible, float("-inf")), counts, block_size, topk_blocks)
    block_scores, valid_blocks = candidate_blocks.candidate_block_max_ref(
        scores.to(torch.bfloat16), counts.to(torch.int32), block_size
    )
    for row in range(rows):
        valid = int(valid_blocks[row])
        chosen = block_scores[row, :valid].float().topk(min(topk_blocks, valid)).indices.tolist()
        expected = torch.zeros(entries, dtype=torch.bool)
        for block in chosen:
            expected[block * block_size : (block + 1) * block_size] = True
        assert torch.equal(ours[row], expected), row


@requires_reference
def test_engram_vocabulary_primes_and_multipliers_are_deepinfers(tiny_v41: Path):
    metadata = engram_metadata()
    tokenizer = str(tiny_v41 / "tokenizer.json")
    reference = metadata.CompressedVocabulary(tokenizer)
    lookup, size = compressed_vocabulary(tokenizer)
    assert size == len(reference)
    assert torch.equal(torch.tensor(lookup), torch.as_tensor(reference.lookup_table).long())
    config = read_config(tiny_v41)
    n_sizes = len(config.engram_ngram_sizes)
    cfg = metadata.AttrDict(
        engram_max_ngram_size=config.engram_max_ngram_size,
        engram_layer_ids=[1, 7],
        vocab_size=[config.engram_vocab_size] * n_sizes,
        n_embed_per_ngram=[config.engram_head_dim * config.engram_n_heads] * n_sizes,
        n_head_per_ngram=[config.engram_n_heads] * n_sizes,
        enable_tokenizer_compression=True,
        tokenizer_name_or_path=tokenizer,
    )
    two_layers = copy.copy(config)
    two_layers.engram_layer_ids = [1, 7]
    layout = metadata.EngramLayout.from_cfg(cfg)
    assert table_primes(two_layers) == [layout.layer_vocab_sizes[layer] for layer in (1, 7)]
    # DeepInfer's hash mapping computes its multipliers, then needs a kernel for the offsets
    mapping = metadata.NgramHashMapping.__new__(metadata.NgramHashMapping)
    with pytest.raises(StubbedKernelError):
        mapping.__init__(cfg, device="cpu")
    assert torch.equal(hash_multipliers([1, 7], config.engram_max_ngram_size, size), mapping.ngram_multipliers)


# -- the engine on V4.1 ---------------------------------------------------------------------------


def test_chunked_batched_and_single_token_prompts_compute_the_same(v41_model):
    """With truncation on: a prompt in one pass, in chunks, or chunked so that one-token chunks fall
    right after its truncation point, has the same last logits; batching changes nothing."""
    prompts = [prompt(400, seed) for seed in range(3)]
    whole = LLMEngine(v41_model, max_num_batched_tokens=1024)
    expected = [whole.generate([p], SamplingParams(max_tokens=6, temperature=0))[0].token_ids for p in prompts]
    for chunk in (97, 128, 261):
        chunked = LLMEngine(v41_model, max_num_batched_tokens=chunk)
        outs = chunked.generate(prompts, SamplingParams(max_tokens=6, temperature=0))
        assert [o.token_ids for o in outs] == expected, chunk


def test_truncation_is_what_the_consumer_layers_see(tiny_v41: Path):
    """A prompt longer than KEEP gives other logits with truncation than without (its consumer
    layers' window no longer reaches back), and the same ones when it is shorter than KEEP."""
    truncated = LLMEngine.from_pretrained(tiny_v41, max_num_batched_tokens=1024)
    full = LLMEngine.from_pretrained(tiny_v41, prefill_keep_tokens=0, max_num_batched_tokens=1024)
    long, short = prompt(500, 3), prompt(120, 4)

    def last_logits(engine: LLMEngine, tokens: list[int]) -> torch.Tensor:
        engine.add_request("probe", tokens, SamplingParams(max_tokens=1, temperature=0, logprobs=5))
        while engine.has_unfinished_requests():
            outputs = engine.step()
        return outputs[0].new_logprobs

    assert last_logits(truncated, short) == last_logits(full, short)
    assert last_logits(truncated, long) != last_logits(full, long)


def test_a_prompt_resumed_from_a_stored_prefix_is_exact(v41_model):
    """Bounded replay: the state stored at an anchor by one request, loaded for another prompt
    with the same prefix, then the rest computed, gives the logits and the greedy continuation of
    the whole prompt in one pass. At block boundaries, and where the prefill service stores every
    prompt's state: its first kept row (`reusable_prefix`), here an odd position, inside a ratio-2
    compressor's window. A prefix that would leave fewer than KEEP tokens to compute is refused."""
    keep = v41_model.config.prefill_keep_tokens
    shared = prompt(451, 5)
    first, second = shared + prompt(keep, 6), shared + prompt(200, 7)
    producer = LLMEngine(v41_model, max_num_batched_tokens=1024)
    assert producer.reusable_prefix(len(first)) == len(shared)
    anchors = [256, 384, len(shared)]
    producer.add_request("first", first, SamplingParams(max_tokens=1, temperature=0), snapshot_at=anchors)
    snapshots = {}
    while producer.has_unfinished_requests():
        for out in producer.step():
            if out.prefix_state is not None:
                snapshots[out.prefix_state.num_computed] = out.prefix_state
    assert set(snapshots) == set(anchors)
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=3)
    expected = LLMEngine(v41_model).generate([second], params)[0]
    for cached in anchors:
        resumed = LLMEngine(v41_model, max_num_batched_tokens=1024)
        assert resumed.import_prefix("second", snapshots[cached], second, params)
        tokens, logprobs = [], []
        while resumed.has_unfinished_requests():
            for out in resumed.step():
                tokens += out.new_token_ids
                logprobs += out.new_logprobs
        assert tokens == expected.token_ids, cached
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(expected.logprobs), atol=1e-4, rtol=0)
    with pytest.raises(SnapshotError, match=f"replays at least the prompt's last {keep} tokens"):
        LLMEngine(v41_model).import_prefix("short", snapshots[len(shared)], shared + prompt(100, 8), params)


def test_a_prompt_stores_its_state_where_a_repeat_resumes_once_that_saves_a_block(v41_model):
    """Where the prefill service stores a V4.1 prompt's state, and the engine steps that costs: at
    its first kept row (all a repeat or a next turn may start from), where that is a block in or
    more; a shorter prompt stores none there and computes in one step, as it did before anchors
    moved off block boundaries (each anchor splits a prompt's computation)."""
    engine = LLMEngine(v41_model, max_num_batched_tokens=1024)
    keep = v41_model.config.prefill_keep_tokens

    def anchors(length: int) -> list[int]:
        return anchor_positions(length, 0, 1024, engine.reusable_prefix(length))

    assert anchors(keep + BLOCK_SIZE - 1) == [] and anchors(keep + BLOCK_SIZE) == [BLOCK_SIZE]
    assert anchors(600) == [600 - keep] and anchors(2300) == [1024, 2048, 2300 - keep]
    for length, steps in ((keep + 100, 1), (600, 2)):
        engine.add_request(
            "p", prompt(length, 3), SamplingParams(max_tokens=1, temperature=0), snapshot_at=anchors(length)
        )
        taken = 0
        while engine.has_unfinished_requests():
            engine.step()
            taken += 1
        assert taken == steps, length


def test_the_published_format_loads_and_generates(tmp_path: Path):
    """FP8 projections with ue8m0 scales per 32 x 32, FP4 experts and an FP8 Engram table, read
    as DeepInfer reads them; the table stays memory-mapped."""
    path = make_model(tmp_path / "fp8", "tiny-v41", seed=1, quant="fp8-fp4")
    engine = LLMEngine.from_pretrained(path)
    table = engine.model.layers[1].engram.embed
    assert table.weight.dtype == torch.float8_e4m3fn and table.scale is not None
    # a view into the mapped file, not a copy of the table
    assert table.weight.untyped_storage().nbytes() == (path / "model.safetensors").stat().st_size
    outs = engine.generate([prompt(300, 9), prompt(50, 10)], SamplingParams(max_tokens=4, temperature=0))
    assert all(len(o.token_ids) == 4 for o in outs)


def test_prompts_of_a_v41_checkpoint_use_the_v41_encoding_whatever_its_served_name(tiny_v41: Path):
    """The tokenizer service encodes with deepseek-recipe's V4.1 encoding, which opens the system
    part with `<｜System｜>` (a token the V4 tokenizer lacks); the expected ids are the rendered
    V4.1 prompt read by the checkpoint's tokenizer itself."""
    from tokenizers import Tokenizer

    from tokenizer_svc.protocol import Codec

    codec = Codec.for_model(tiny_v41, "any-name-at-all")
    body = {
        "model": "any-name-at-all",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
        "thinking": {"type": "disabled"},
    }
    rendered = "<｜begin▁of▁sentence｜><｜System｜>Be brief.<｜User｜>Hello<｜Assistant｜></think>"
    tokenizer = Tokenizer.from_file(str(tiny_v41 / "tokenizer.json"))
    expected = tokenizer.encode(rendered, add_special_tokens=False).ids
    assert tokenizer.token_to_id("<｜System｜>") in expected
    assert codec.prompt("chat.completions", body).token_ids == expected
