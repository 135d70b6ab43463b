"""Speculative decoding in the engine: drafts verified in one target step, the rejected ones
leaving no trace in the state, outputs as without them.

A checkpoint in the published layout carries V4's multi-token-prediction module; with random
weights it drafts badly, so besides it a scripted drafter proposes the true continuation with
chosen mistakes: every count of accepted drafts, 0 to k, at positions that close compressor
windows and wrap the window rings, so each kind of state must roll back right.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from engine import LLMEngine, SamplingParams
from engine.checkpoint import load_model
from engine.checkpoint.make_model import preset_config, write_checkpoint
from engine.config import CSA, HCA
from tests.support.drafters import ScriptedDrafter, counting_drafts
from tests.support.models import all_state_free, decode_to_end, decode_until, random_prompts

VOCAB = 512
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
# small windows and rates, so that 40 tokens wrap the window ring and close many entries
SMALL_WINDOWS = dict(sliding_window=16, compress_rates={CSA: 4, HCA: 8}, index_topk=4)
LENGTHS = (3, 15, 37, 70)


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory: pytest.TempPathFactory):
    """A tiny model with small windows, written as the published checkpoints are: with an MTP module."""
    path = tmp_path_factory.mktemp("mtp") / "tiny"
    config = preset_config("tiny", vocab_size=VOCAB, index_n_heads=16, **SMALL_WINDOWS)
    return load_model(write_checkpoint(Path(path), config, seed=5, layout="deepseek"))


@pytest.fixture(scope="module")
def reference(mtp_model) -> dict[int, list[int]]:
    """Greedy outputs without speculation, one request at a time."""
    engine = LLMEngine(mtp_model, max_num_batched_tokens=64)
    return {len(p): engine.generate([p], GREEDY)[0].token_ids for p in random_prompts(LENGTHS, VOCAB, seed=1)}


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_output_is_the_same_with_the_mtp_drafter(mtp_model, reference, k):
    engine = LLMEngine(mtp_model, max_num_batched_tokens=64, speculative="mtp", speculative_tokens=k)
    outputs = engine.generate(random_prompts(LENGTHS, VOCAB, seed=1), GREEDY)
    assert [o.token_ids for o in outputs] == [reference[n] for n in LENGTHS]
    assert all_state_free(engine)


@pytest.mark.parametrize("k", [2, 5])
def test_drafts_accepted_and_rejected_in_every_count_leave_the_output_and_state_exact(mtp_model, reference, k):
    """The target accepts exactly the drafts that are right; the state after a rejection is the
    state of the accepted tokens alone: every later token is still the reference's."""
    engine = LLMEngine(mtp_model, max_num_batched_tokens=64, speculative="mtp", speculative_tokens=k)
    engine.drafter = drafter = ScriptedDrafter(reference)
    prompts = random_prompts(LENGTHS, VOCAB, seed=1)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
    counts = Counter()
    tokens = decode_to_end(engine, counting_drafts(counts))
    assert [tokens[str(i)] for i in range(len(prompts))] == [reference[n] for n in LENGTHS]
    # every right draft was accepted (a wrong one never is, greedy): the steps were fewer
    assert counts["accepted"] == drafter.right and counts["drafted"] > counts["accepted"] > 0
    assert all_state_free(engine)


def test_a_speculating_engines_snapshot_continues_in_one_that_does_not(mtp_model, reference):
    """A hand-over's state leaves without the room for drafts and without rejected rows: an engine
    that does not speculate loads it mid-generation and continues to the same tokens."""
    prompt = random_prompts(LENGTHS, VOCAB, seed=1)[3]
    speculating = LLMEngine(mtp_model, max_num_batched_tokens=64, speculative="mtp", speculative_tokens=3)
    speculating.drafter = ScriptedDrafter(reference)
    plain = LLMEngine(mtp_model, max_num_batched_tokens=64)
    assert speculating.layout == plain.layout
    produced = decode_until(speculating, "r", prompt, GREEDY, 17)
    plain.import_state("r", speculating.export_state("r"), GREEDY)
    assert produced + decode_to_end(plain)["r"] == reference[len(prompt)]


def test_finishing_mid_block_keeps_nothing_past_the_stop(mtp_model, reference):
    """A stop token among the accepted drafts ends the request there, as max_tokens does."""
    prompt = random_prompts(LENGTHS, VOCAB, seed=1)[2]
    expected = reference[len(prompt)]
    stop = expected[9]
    engine = LLMEngine(mtp_model, max_num_batched_tokens=64, speculative="mtp", speculative_tokens=5)
    engine.drafter = ScriptedDrafter({len(prompt): expected})
    engine.drafter.turn = 5  # every draft right: the stop token arrives inside a block
    stopped, short = engine.generate(
        [prompt, prompt],
        [
            SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[stop]),
            SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),
        ],
    )
    assert stopped.token_ids == expected[: expected.index(stop) + 1] and stopped.finish_reason == "stop"
    assert short.token_ids == expected[:7] and short.finish_reason == "length"
    assert all_state_free(engine)


def test_sampled_requests_draw_the_tokens_they_draw_without_speculation(mtp_model):
    """With temperature, every row draws the token a step without drafts would draw at its
    position, so a request's tokens are those it gets without speculation: seeded requests
    (alone, or batched with others whatever the drafts) and unseeded ones from the same seed
    source, with drafts right often and wrong often. (What this replaced, a chi-square test of
    the same requests' distribution, found a top-k filter that mixed the rows of a verify step.)"""
    prompt = random_prompts([9], VOCAB, seed=2)[0]
    unseeded = SamplingParams(max_tokens=6, temperature=1.0, top_k=3, top_p=0.9, ignore_eos=True)
    seeded = [replace(unseeded, seed=seed) for seed in range(40)]

    counts = Counter()

    def run(engine: LLMEngine, params: list[SamplingParams]) -> list[list[int]]:
        engine._seed_source = random.Random(11)
        for i, p in enumerate(params):
            engine.add_request(str(i), prompt, p)
        tokens = decode_to_end(engine, counting_drafts(counts))
        return [tokens[str(i)] for i in range(len(params))]

    plain = LLMEngine(mtp_model, max_num_seqs=64, max_num_batched_tokens=1024)
    expected = run(plain, seeded + [unseeded] * 40)
    common = Counter(tuple(tokens[1:4]) for tokens in expected).most_common(1)[0][0]
    speculating = LLMEngine(
        mtp_model,
        max_num_seqs=64,
        max_num_batched_tokens=1024,
        speculative="mtp",
        speculative_tokens=3,
        speculative_max_batch=64,
    )

    class Guess:  # the commonest continuation: right for many requests, wrong for the rest
        def keep_up(self, seqs, starts):
            pass

        def advance(self, seqs, streams, starts, wanted):
            for seq, k in zip(seqs, wanted, strict=True):
                done = len(seq.output_token_ids)
                seq.drafts = list(common[done - 1 :][:k]) if 1 <= done < 4 else []

    speculating.drafter = Guess()
    counts.clear()
    assert run(speculating, seeded + [unseeded] * 40) == expected
    assert [run(speculating, [params])[0] for params in seeded[:8]] == expected[:8]
    assert 0 < counts["accepted"] < counts["drafted"], counts


def test_speculation_stays_off_where_it_cannot_run(tiny_model):
    with pytest.raises(ValueError, match="multi-token-prediction"):
        LLMEngine(tiny_model, speculative="mtp")
    with pytest.raises(ValueError, match="speculative must be one of"):
        LLMEngine(tiny_model, speculative="eagle")
    assert LLMEngine(tiny_model, speculative="auto").drafter is None  # no MTP module: auto is off


def test_auto_stops_drafting_when_the_drafts_do_not_pay(mtp_model, reference):
    """A random-weight MTP module accepts almost nothing: `auto` measures that over its window of
    drafts and then runs steps as an engine without a drafter does (no streams, no verify)."""
    engine = LLMEngine(mtp_model, max_num_batched_tokens=64, speculative="auto", speculative_tokens=3)
    engine.speculation.window = 24
    prompts = random_prompts(LENGTHS, VOCAB, seed=1)
    drafted_per_step = []
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
    tokens = decode_to_end(engine, lambda e: drafted_per_step.append(e.last_step_drafted))
    assert [tokens[str(i)] for i in range(len(prompts))] == [reference[n] for n in LENGTHS]
    first_off = next(i for i, n in enumerate(drafted_per_step) if i > 2 and n == 0)
    assert 24 <= sum(drafted_per_step) < 24 + 4 * 3  # one window, and the step that completed it
    assert not any(drafted_per_step[first_off:]) and engine.speculation.is_off


def test_preempted_sequences_recompute_and_keep_their_tokens(mtp_model):
    """Prompts that grow past their first block, with three blocks for three of them: the newer
    ones are preempted and recomputed from their tokens (drafts and the drafter's rows started
    again), and still end as without speculation."""
    prompts = random_prompts([100, 110, 120], VOCAB, seed=6)
    plain = LLMEngine(mtp_model, max_num_batched_tokens=64)
    reference = {len(p): plain.generate([p], GREEDY)[0].token_ids for p in prompts}
    engine = LLMEngine(mtp_model, num_blocks=4, max_num_batched_tokens=64, speculative="mtp", speculative_tokens=3)
    engine.drafter = ScriptedDrafter(reference)
    outputs = engine.generate(prompts, GREEDY)
    assert engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outputs] == [reference[len(p)] for p in prompts]
    assert all_state_free(engine)
