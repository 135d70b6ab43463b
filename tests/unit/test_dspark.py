"""DSpark, DeepSeek-V4.1's draft model (engine/model/dspark.py), in the engine.

Its pieces against DeepInfer's: the tensor names its loader maps, the window a draft block reads
(`get_fused_dflash_get_input_ref`), the target features (`dflash_input_store_ref`) and the
confidence head (`confidence_head_fused_ref`). Then on a small-window V4.1 model with random
weights: greedy output with DSpark equals output without; drafts accepted and rejected in every
count (a scripted drafter's, verified by V4.1's target) leave every kind of V4.1 state exact;
and the drafts DSpark proposes after many such steps, from main keys written step by step and
overwritten where rows were rejected, are those it proposes from one prefill of the same tokens.
"""

from __future__ import annotations

import re
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engine import LLMEngine, SamplingParams
from engine.checkpoint import load_model
from engine.checkpoint.make_model_v41 import PRESETS_V41, write_checkpoint_v41
from engine.checkpoint.train_drafter import greedy_sequences
from engine.checkpoint.train_dspark import train_checkpoint_dspark, train_dspark
from engine.model.dspark import DraftRows, block_window
from engine.sequence import Sequence
from tests.support.deepinfer_reference import deepinfer_root, tilelang_op
from tests.support.drafters import ScriptedDrafter, counting_drafts
from tests.support.models import all_state_free, decode_to_end, decode_until, random_prompts

WINDOW = 16  # small, so that 30 tokens wrap every ring
LENGTHS = (3, 21, 170)  # the last one longer than KEEP (140): a truncated prompt
GREEDY = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
VOCAB = 129280


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    text = PRESETS_V41["tiny-v41-dspark"] | {"sliding_window": WINDOW}
    return write_checkpoint_v41(tmp_path_factory.mktemp("dspark") / "model", text, seed=3)


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_model(checkpoint)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(LENGTHS, 20_000, seed=2)


@pytest.fixture(scope="module")
def reference(model, prompts) -> dict[int, list[int]]:
    engine = LLMEngine(model, max_num_batched_tokens=64)
    return {len(p): engine.generate([p], GREEDY)[0].token_ids for p in prompts}


def test_the_stages_tensor_names_are_those_deepinfers_loader_maps(checkpoint):
    """Every `mtp.*` tensor the checkpoint holds is one DeepInfer's `hf_to_model` places, as a
    draft-model head or a decoder block part it knows; the heads are stage 0's projection and the
    last stage's norm, Markov and confidence heads (no HC head: V4.1 shifts its collapse)."""
    source = (deepinfer_root() / "deepinfer" / "hugging_face" / "names.py").read_text()
    namespace: dict = {}
    exec(compile(source, "names.py", "exec"), namespace)  # plain Python: re and dicts
    with safe_open(str(checkpoint / "model.safetensors"), "pt") as f:
        names = [n for n in f.keys() if n.startswith("mtp.")]  # noqa: SIM118
    assert names
    extras, blocks = set(), set()
    for name in names:
        assert namespace["hf_to_model"](name, n_layer=6) is not None, name
        stage, suffix = re.match(r"mtp\.(\d+)\.(.+)$", name).groups()
        if suffix in namespace["_HF_TO_MTP_EXTRA"]:
            extras.add((int(stage), suffix))
        elif not re.fullmatch(r"ffn\.experts\.\d+\.w[123]\.weight", suffix):  # per expert, as in layers
            assert suffix in namespace["_HF_TO_MODEL_SUFFIX"], name
            blocks.add(suffix)
    assert extras == {
        (0, "main_proj.weight"),
        (0, "main_norm.weight"),
        (2, "norm.weight"),
        (2, "markov_head.embed.weight"),
        (2, "markov_head.head.weight"),
        (2, "confidence_head.proj.weight"),
    }
    assert not any(part.startswith(("attn.compressor", "attn.indexer")) for part in blocks)  # window only


def test_a_blocks_rows_read_the_window_deepinfer_gives_them():
    """Main keys up to the last accepted position a and the block's own keys, a - W + 1 .. a + B,
    for every row of the block; none below a sequence's floor or position 0."""
    reference = tilelang_op("get_kv_index").get_fused_dflash_get_input_ref
    window, block, ring = 8, 3, 8 + 3
    accepted = torch.tensor([0, 4, 7, 25, 40])  # a: the last accepted input position
    slots = torch.arange(len(accepted))
    # DeepInfer's metadata: one verify row per request at position a with its slot's ring offset
    slot_mapping = slots * ring + accepted % ring
    _, positions, _, _, _, kv_index = reference(
        slot_mapping.int(),
        accepted.int(),
        torch.arange(len(accepted)).int(),
        torch.zeros(len(accepted)).int(),
        ring,
        block,
        window,
    )
    starts = accepted + 1
    rows = DraftRows(
        slots=slots.repeat_interleave(block),
        positions=positions.long(),
        first=torch.maximum(starts - window, torch.zeros_like(starts)).repeat_interleave(block),
        last=(starts + block - 1).repeat_interleave(block),
    )
    assert positions.tolist() == (starts.unsqueeze(1) + torch.arange(block)).flatten().tolist()
    mask = block_window(rows, ring)
    ours = [
        sorted((slot * ring + torch.nonzero(row).flatten()).tolist())
        for slot, row in zip(rows.slots, mask, strict=True)
    ]
    theirs = [sorted(i for i in row.tolist() if i >= 0) for row in kv_index]
    assert ours == theirs


def test_the_features_and_the_confidence_are_deepinfers(model):
    """The target feature is the streams' mean (`dflash_input_store_ref`); a draft's confidence is
    DeepInfer's sigmoid of [hidden, markov embedding] . w over the temperature, clamped."""
    ops = tilelang_op("dflash")
    streams = torch.randn(7, 4, 128)
    theirs = torch.empty(7, 128)
    ops.dflash_input_store_ref(streams, theirs)
    assert torch.equal(streams.float().mean(dim=1), theirs)

    head = model.mtp[-1].confidence_head
    hidden, markov = torch.randn(6, 128) * 4, torch.randn(6, 16) * 4
    for temperature in (1.0, 0.3):
        expected = ops.confidence_head_fused_ref(hidden, head.proj.weight.t().contiguous(), temperature, markov)
        assert torch.allclose(head(hidden, markov, temperature), expected, atol=1e-6)


@pytest.mark.parametrize("k", [1, 5])
def test_greedy_output_is_the_same_with_dspark(model, prompts, reference, k):
    engine = LLMEngine(model, max_num_batched_tokens=64, speculative="dspark", speculative_tokens=k)
    assert engine.speculative_method == "dspark"
    outputs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == [reference[len(p)] for p in prompts]
    assert all_state_free(engine)


def test_a_confidence_floor_verifies_fewer_drafts_to_the_same_output(model, prompts, reference):
    """With `speculative_min_confidence`, a sequence verifies its drafts while the product of their
    confidences stays above it: random stages are about 0.5 sure of each draft, so a floor of 0.3
    keeps one draft a step of the five a block drafts, and the output stays the reference's."""
    engine = LLMEngine(
        model, max_num_batched_tokens=64, speculative="dspark", speculative_tokens=5, speculative_min_confidence=0.3
    )
    counts = Counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
    tokens = decode_to_end(engine, counting_drafts(counts))
    assert [tokens[str(i)] for i in range(len(prompts))] == [reference[len(p)] for p in prompts]
    assert counts["verified"] > 20 and counts["drafted"] == counts["verified"]  # one draft each


class CheckedDSpark:
    """Runs the engine's DSpark drafter and keeps what it proposed, with the tokens it drafted
    after; then hands the target a scripted drafter's drafts instead (right for 0..k of them), so
    that verify steps accept and reject in every count."""

    def __init__(self, dspark, scripted: ScriptedDrafter):
        self.recording, self.scripted = Recording(dspark), scripted

    @property
    def proposed(self) -> list[tuple[list[int], list[int], list[float]]]:
        return self.recording.proposed

    def advance(self, seqs: list[Sequence], streams: object, starts: list[int], wanted: list[int]) -> None:
        self.recording.advance(seqs, streams, starts, wanted)
        self.scripted.advance(seqs, streams, starts, wanted)

    def keep_up(self, seqs: list[Sequence], starts: list[int]) -> None:
        self.recording.keep_up(seqs, starts)


def test_drafts_after_accepted_and_rejected_rows_are_those_from_one_prefill(model, prompts, reference):
    """V4.1's target verifies drafts right for every count 0..k: its output stays the reference's
    (its window, ratio-2 compressor and YOCO state roll back). DSpark's rings meanwhile hold main
    keys of rejected rows, which its next block overwrites: what it proposes at each step equals
    what it proposes after one prefill of the same tokens in a fresh engine."""
    k = 4
    engine = LLMEngine(model, max_num_batched_tokens=64, speculative="dspark", speculative_tokens=k)
    scripted = ScriptedDrafter(reference, vocab=VOCAB)
    engine.drafter = checked = CheckedDSpark(engine.drafter, scripted)
    counts = Counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
    tokens = decode_to_end(engine, counting_drafts(counts))
    assert [tokens[str(i)] for i in range(len(prompts))] == [reference[len(p)] for p in prompts]
    assert counts["accepted"] == scripted.right > 0 and all_state_free(engine)

    # no resident prefixes: each prompt computed whole, its main keys written from position 0
    fresh = LLMEngine(
        model, max_num_batched_tokens=64, speculative="dspark", speculative_tokens=k, resident_prefix_bytes=0
    )
    recorded = Recording(fresh.drafter)
    fresh.drafter = recorded
    assert len(checked.proposed) > 20
    for sequence, drafts, confidence in checked.proposed[::3]:  # every third block of each request
        recorded.proposed.clear()
        fresh.generate([sequence[:-1]], SamplingParams(max_tokens=k + 2, temperature=0, ignore_eos=True))
        # its block after the same tokens (the target's own next token is the pending one)
        [(proposed, once_confidence)] = [(d, c) for s, d, c in recorded.proposed if s == sequence]
        n = len(drafts)  # fewer near max_tokens: the block's first ones
        assert proposed[:n] == drafts
        # a continuous function of every key the block read (random weights draft the same argmax
        # from many states): the same up to rounding, prompt rows against decode rows
        assert once_confidence[:n] == pytest.approx(confidence, abs=1e-5)


class Recording:
    """The engine's drafter, keeping what it proposed with the tokens it drafted after."""

    def __init__(self, dspark):
        self.dspark, self.proposed = dspark, []

    def advance(self, seqs: list[Sequence], streams: object, starts: list[int], wanted: list[int]) -> None:
        self.dspark.advance(seqs, streams, starts, wanted)
        self.proposed += [
            (seq.tokens_between(0, seq.num_tokens), list(seq.drafts), list(seq.draft_confidence))
            for seq in seqs
            if seq.drafts
        ]

    def keep_up(self, seqs: list[Sequence], starts: list[int]) -> None:
        self.dspark.keep_up(seqs, starts)


def test_a_loaded_state_drafts_from_its_own_rows_only(model, prompts, reference):
    """A request handed over mid-generation has no main keys for what another engine computed: its
    blocks read main keys from its first row computed here on (its floor). Whatever its slot's
    rings hold below that, here random values, it drafts the same, and its greedy output stays the
    reference's."""
    prompt = prompts[1]
    plain = LLMEngine(model, max_num_batched_tokens=64)
    produced = decode_until(plain, "r", prompt, GREEDY, 9)
    snapshot = plain.export_state("r")

    def first_block(garbage: bool) -> tuple[list[int], list[int], list[float]]:
        engine = LLMEngine(model, max_num_batched_tokens=64, speculative="dspark", speculative_tokens=3)
        recording = Recording(engine.drafter)
        rings = engine.kv.cache.window[model.config.num_hidden_layers :]

        class Garbage:  # before the first block: random keys at every position below the first row
            def keep_up(self, seqs, starts):
                recording.keep_up(seqs, starts)

            def advance(self, seqs, streams, starts, wanted):
                if garbage and not recording.proposed:
                    for seq, start in zip(seqs, starts, strict=True):
                        for ring in rings:
                            below = [p % ring.shape[1] for p in range(start - ring.shape[1] + 1, start)]
                            ring[seq.slot, below] = torch.randn(len(below), ring.shape[-1]) * 3
                recording.advance(seqs, streams, starts, wanted)

        engine.drafter = Garbage()
        engine.import_state("r", snapshot, GREEDY)
        assert produced + decode_to_end(engine)["r"] == reference[len(prompt)]
        return recording.proposed[0]

    tokens, drafts, confidence = first_block(garbage=False)
    dirty_tokens, dirty_drafts, dirty_confidence = first_block(garbage=True)
    assert (dirty_tokens, dirty_drafts) == (tokens, drafts)
    assert dirty_confidence == pytest.approx(confidence, abs=1e-6)


def test_self_distillation_trains_the_stages_and_writes_them_back(checkpoint, tmp_path):
    """`make-model --preset tiny-v41-dspark --train-drafter`'s training: the loss falls on the
    continuations it trains on; the trained stages are written into the checkpoint, the target's
    weights are not touched, and the checkpoint serves the same greedy text with DSpark."""
    path = Path(shutil.copytree(checkpoint, tmp_path / "model"))
    model = load_model(path, dtype=torch.float32)
    losses = train_dspark(model, greedy_sequences(model, 2, 16, 24, seed=0), steps=12, batch_size=4)
    assert sum(losses[-3:]) < sum(losses[:3])

    before = load_model(path).state_dict()
    train_checkpoint_dspark(path, steps=3, continuations=2, new_tokens=16, held_out=1, anchors=4)
    after = load_model(path)
    changed = {name for name, value in after.state_dict().items() if not torch.equal(value, before[name])}
    assert changed and all(name.startswith("mtp.") for name in changed)
    prompt = random_prompts([30], 20_000, seed=9)[0]
    plain = LLMEngine(after).generate([prompt], GREEDY)[0].token_ids
    assert LLMEngine(after, speculative="dspark").generate([prompt], GREEDY)[0].token_ids == plain


def test_blocks_after_steps_without_drafts_read_the_keys_those_steps_stored(model, prompts, reference):
    """Steps of more sequences than `speculative_max_batch` run without drafts but still store
    main keys: once a request drafts again, its block reads them all, as after one prefill."""
    engine = LLMEngine(
        model, max_num_batched_tokens=64, speculative="dspark", speculative_tokens=3, speculative_max_batch=1
    )
    recording = engine.drafter = Recording(engine.drafter)
    short = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outputs = engine.generate(prompts[:2], [GREEDY, short])  # two at a time until the short one ends
    assert outputs[0].token_ids == reference[len(prompts[0])]
    # the long request's first block after the steps the two ran together (the prompts' step drafted)
    first = prompts[0]
    sequence, drafts, confidence = next(
        p for p in recording.proposed if p[0][: len(first)] == first and len(p[0]) > len(first) + 1
    )
    assert len(sequence) >= len(first) + 8

    fresh = LLMEngine(model, max_num_batched_tokens=64, speculative="dspark", speculative_tokens=3)
    once = fresh.drafter = Recording(fresh.drafter)
    fresh.generate([sequence[:-1]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    [(drafted_once, confidence_once)] = [(d, c) for s, d, c in once.proposed if s == sequence]
    assert drafted_once == drafts and confidence_once == pytest.approx(confidence, abs=1e-5)


def test_a_stages_image_bias_is_named_unused_and_not_required(checkpoint, tmp_path, caplog):
    """Draft rows are never image tokens: the stages' MoE gates have no `bias_vl`. A checkpoint
    that carries one for them loads all the same, naming it unused; one without it (as
    make-model writes) loads too."""
    path = Path(shutil.copytree(checkpoint, tmp_path / "model"))
    tensors = load_file(path / "model.safetensors")
    assert not any(name.endswith("gate.bias_vl") and name.startswith("mtp.") for name in tensors)
    tensors["mtp.0.ffn.gate.bias_vl"] = torch.zeros(4)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level("WARNING"):
        loaded = load_model(path)
    assert len(loaded.mtp) == 3 and "mtp.0.ffn.gate.bias_vl" in caplog.text
