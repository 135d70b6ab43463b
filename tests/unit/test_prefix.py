"""Prefix reuse in the engine: the state after a prompt's first tokens, loaded instead of computed.

A hit must give exactly the tokens of a cold run (greedy), wherever the prefix ends (at every
anchor, on every parity configuration: tests/system/test_engine_sweeps.py).
"""

from __future__ import annotations

import pytest

from engine import InvalidRequestError, LLMEngine, SamplingParams, SnapshotError, StateSnapshot
from tests.support.models import decode_to_end, prefill_and_export, random_prompts

GREEDY = SamplingParams(max_tokens=24, temperature=0)


def test_a_hit_batched_with_cold_requests_and_its_misuse(checkpoints):
    engine = LLMEngine.from_pretrained(checkpoints["tiny-preset"])
    shared, other = random_prompts([200, 90], seed=5)
    first, second = [*shared, 7, 8, 9], [*shared, 10, 11]
    _, data = prefill_and_export(engine, "turn-1", first, GREEDY)
    snapshot = StateSnapshot.from_bytes(data)  # state of all 203 tokens of the first prompt
    with pytest.raises(SnapshotError, match="not a prefix"):
        engine.import_prefix("wrong", snapshot, [*second, 1, 2, 3, 4], GREEDY)
    without_hidden = StateSnapshot.from_bytes(data)
    without_hidden.last_hidden = None  # the whole prompt, but no logits to sample its first token from
    with pytest.raises(SnapshotError, match="nothing to compute"):
        engine.import_prefix("whole", without_hidden, first, GREEDY)
    assert "wrong" not in engine.seqs and "whole" not in engine.seqs

    cold = {i: out.token_ids for i, out in enumerate(engine.generate([[*first, 1, 2], other], GREEDY))}
    assert engine.import_prefix("hit", snapshot, [*first, 1, 2], GREEDY)
    engine.add_request("cold", other, GREEDY)  # prefilled in the same steps as the hit's rest
    tokens = decode_to_end(engine)
    assert tokens["hit"] == cold[0] and tokens["cold"] == cold[1]


def test_the_final_state_of_a_turn_is_where_the_next_turn_resumes(checkpoints):
    engine = LLMEngine.from_pretrained(checkpoints["yarn-hc3"])
    (prompt,) = random_prompts([150], seed=11)
    for reason, params in (
        ("length", SamplingParams(max_tokens=20, temperature=0, keep_final_state=True)),
        ("stop", SamplingParams(max_tokens=40, temperature=0, keep_final_state=True, stop_token_ids=[])),
    ):
        if reason == "stop":  # stop at the 9th token whatever it is
            probe = engine.generate([prompt], SamplingParams(max_tokens=9, temperature=0))[0].token_ids
            params.stop_token_ids = [probe[-1]]
        engine.add_request("turn-1", prompt, params)
        outputs = [o for _ in range(200) if engine.has_unfinished_requests() for o in engine.step()]
        final = outputs[-1]
        assert final.finished and final.finish_reason == reason and final.final_state is not None
        answer = [t for o in outputs for t in o.new_token_ids]
        assert all(o.final_state is None for o in outputs[:-1])
        state = final.final_state
        assert state.num_computed == len(prompt) + len(answer) - 1  # the last token was sampled, never computed
        next_turn = [*prompt, *answer, 5, 6, 7]
        cold = engine.generate([next_turn], GREEDY)[0].token_ids
        assert engine.import_prefix("turn-2", StateSnapshot.from_bytes(state.to_bytes()), next_turn, GREEDY)
        assert decode_to_end(engine)["turn-2"] == cold


def test_snapshots_inside_the_prompt_are_prefixes_of_it(checkpoints):
    """snapshot_at hands back the state after given prompt positions (chunks end there), and each
    such state, loaded, gives the cold tokens: what block-boundary anchors rely on."""
    engine = LLMEngine.from_pretrained(checkpoints["tiny-preset"], max_num_batched_tokens=300)
    (prompt,) = random_prompts([700], seed=21)
    cold = engine.generate([prompt], GREEDY)[0].token_ids
    engine.add_request("long", prompt, GREEDY, snapshot_at=[512, 128, 256])
    outputs = [o for _ in range(200) if engine.has_unfinished_requests() for o in engine.step()]
    states = [o.prefix_state for o in outputs if o.prefix_state is not None]
    assert [s.num_computed for s in states] == [128, 256, 512]
    assert [o.new_token_ids for o in outputs if o.prefix_state is not None] == [[], [], []]
    assert [t for o in outputs for t in o.new_token_ids] == cold  # the same answer, chunked differently
    for state in states:
        assert state.token_ids == prompt[: state.num_computed] and state.prompt_len == state.num_computed
        restored = StateSnapshot.from_bytes(state.to_bytes())
        assert engine.import_prefix(f"from-{state.num_computed}", restored, prompt, GREEDY)
        assert decode_to_end(engine)[f"from-{state.num_computed}"] == cold
    with pytest.raises(InvalidRequestError, match="snapshot positions"):
        engine.add_request("bad", prompt, GREEDY, snapshot_at=[700])


def test_a_repeated_prompt_is_answered_without_computing_it(checkpoints):
    """The state of a whole prompt holds its last token's hidden state: a repeat loads it and
    samples its first token from it in the next step, next to a cold prompt's prefill, and
    computes none of its own tokens: the cold answer, token for token (greedy and seeded)."""
    engine = LLMEngine.from_pretrained(checkpoints["tiny-preset"])
    prompt, other = random_prompts([333, 150], seed=8)
    seeded = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=1234)
    for params in (GREEDY, seeded):
        cold = {i: out.token_ids for i, out in enumerate(engine.generate([prompt, other], params))}
        _, data = prefill_and_export(engine, "first", prompt, params)
        snapshot = StateSnapshot.from_bytes(data)
        assert snapshot.num_computed == len(prompt) and snapshot.last_hidden is not None
        assert engine.import_prefix("repeat", snapshot, prompt, params)
        engine.add_request("cold", other, params)
        outputs = {o.request_id: o for o in engine.step()}
        assert engine.last_step_tokens == len(other)  # the cold prompt's tokens, none of the repeat's
        assert outputs["repeat"].new_token_ids == cold[0][:1]
        tokens = decode_to_end(engine)
        for i, request_id in enumerate(("repeat", "cold")):
            assert [*outputs[request_id].new_token_ids, *tokens[request_id]] == cold[i], request_id
