"""Engine behaviour: continuous batching, preemption, abort, sampling, stops. (Chunked prefill at
every chunk size: tests/system/test_engine_sweeps.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from engine import InvalidRequestError, LLMEngine, SamplingParams, UnknownRequestError
from tests.support.models import all_state_free, random_prompts

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
LENGTHS = (1, 17, 129, 300, 520)


@pytest.fixture(scope="module")
def expected(tiny_model) -> dict[int, list[int]]:
    """Greedy outputs with the whole prompt in one step, one request at a time."""
    engine = LLMEngine(tiny_model, max_num_batched_tokens=4096)
    return {len(p): engine.generate([p], GREEDY)[0].token_ids for p in random_prompts(LENGTHS, seed=3)}


def test_requests_join_and_leave_between_steps(engine, expected):
    prompts = random_prompts(LENGTHS, seed=3)
    engine.add_request("a", prompts[3], GREEDY)
    engine.add_request("b", prompts[0], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    finished: list[str] = []
    for step in range(200):
        if step == 4:
            engine.add_request("c", prompts[4], GREEDY)
        if step == 9:
            engine.add_request("d", prompts[2], GREEDY)
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finished.append(out.request_id)
        if not engine.has_unfinished_requests():
            break
    assert finished[0] == "b"  # the short request left while the others kept going
    assert tokens["b"] == expected[1][:3]
    assert tokens["a"] == expected[300]
    assert tokens["c"] == expected[520]
    assert tokens["d"] == expected[129]
    assert all_state_free(engine)


def test_preemption_recomputes_and_gives_same_output(tiny_model, expected):
    # 5 blocks of 128 tokens cannot hold these requests at once (they need 1 + 3 + 3 + 5 blocks)
    engine = LLMEngine(tiny_model, num_blocks=5, max_num_batched_tokens=256)
    prompts = random_prompts(LENGTHS, seed=3)
    wanted = [prompts[1], prompts[3], prompts[3], prompts[4]]
    outputs = engine.generate(wanted, GREEDY)
    assert engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outputs] == [expected[17], expected[300], expected[300], expected[520]]
    assert all_state_free(engine)


def test_abort_releases_state_and_others_continue(engine, expected):
    prompts = random_prompts(LENGTHS, seed=3)
    for name, prompt in zip("xyz", prompts[2:5], strict=True):
        engine.add_request(name, prompt, GREEDY)
    for _ in range(3):
        engine.step()
    engine.abort("y")
    with pytest.raises(UnknownRequestError, match="'y'"):
        engine.abort("y")
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str | None] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    assert reasons == {"y": "abort", "x": "length", "z": "length"}
    assert all_state_free(engine)


def test_abort_of_waiting_request(engine):
    engine.add_request("w", [1, 2, 3], GREEDY)
    engine.abort("w")
    outputs = engine.step()
    assert [(o.request_id, o.finished, o.finish_reason) for o in outputs] == [("w", True, "abort")]
    assert not engine.has_unfinished_requests()


def test_seeded_sampling_does_not_depend_on_the_batch(engine):
    prompt = random_prompts([40], seed=5)[0]
    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = engine.generate([prompt], params)[0].token_ids
    crowd = [SamplingParams(max_tokens=30, temperature=0.8, seed=s, ignore_eos=True) for s in range(5)]
    outs = engine.generate([*random_prompts([7, 200, 33, 129, 64], seed=6), prompt], [*crowd, params])
    assert outs[-1].token_ids == alone
    other_seed = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=4321, ignore_eos=True)
    assert engine.generate([prompt], other_seed)[0].token_ids != alone
    greedy = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0].token_ids
    assert alone != greedy  # temperature 1 really samples


def test_stop_token_ids_max_tokens_and_eos(engine, expected):
    prompt = random_prompts(LENGTHS, seed=3)[2]
    full = expected[129]
    stop = full[5]
    first = full.index(stop)
    out = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop]))[0]
    assert out.token_ids == full[: first + 1] and out.finish_reason == "stop"

    out = engine.generate([prompt], SamplingParams(max_tokens=7, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == full[:7] and out.finish_reason == "length"

    eos_before = engine.config.eos_token_id
    engine.config.eos_token_id = stop
    try:
        out = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0))[0]
        assert out.token_ids == full[: first + 1] and out.finish_reason == "stop"
        out = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
        assert out.token_ids == full and out.finish_reason == "length"
    finally:
        engine.config.eos_token_id = eos_before


def test_min_tokens_holds_back_stop_tokens_and_eos(engine, expected):
    """Before min_tokens the stop tokens get no chance (vLLM's min_tokens): the greedy choice is
    the best other token, and logprobs stay the model's own."""
    prompt = random_prompts(LENGTHS, seed=3)[2]
    full = expected[129]
    stop = full[5]
    first = full.index(stop)
    logits = engine.score(prompt + full[:first])[-1]
    runner_up = int(logits.topk(2).indices[1])
    held = SamplingParams(max_tokens=first + 2, temperature=0, stop_token_ids=[stop], min_tokens=first + 1, logprobs=0)
    out = engine.generate([prompt], held)[0]
    assert out.token_ids[: first + 1] == [*full[:first], runner_up]
    assert math.isclose(out.logprobs[first], float(logits.log_softmax(-1)[runner_up]), abs_tol=1e-4)
    free = engine.generate(
        [prompt], SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop], min_tokens=first)
    )
    assert free[0].token_ids == full[: first + 1]  # reached: the stop token stops it again

    eos_before = engine.config.eos_token_id
    engine.config.eos_token_id = stop
    try:
        out = engine.generate([prompt], SamplingParams(max_tokens=first + 1, temperature=0, min_tokens=first + 1))[0]
        assert out.token_ids == [*full[:first], runner_up] and out.finish_reason == "length"
        with pytest.raises(InvalidRequestError, match="min_tokens"):
            SamplingParams(max_tokens=4, min_tokens=5)
    finally:
        engine.config.eos_token_id = eos_before


def test_logprobs_are_those_of_the_model(engine):
    prompt = random_prompts([50], seed=8)[0]
    out = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=0.7, seed=3, ignore_eos=True))[0]
    logits = engine.score(prompt + out.token_ids[:-1])[len(prompt) - 1 :]
    expected = logits.log_softmax(-1).gather(1, torch.tensor(out.token_ids).unsqueeze(1)).squeeze(1)
    assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-4)


def test_score_returns_logits_of_every_position(engine):
    prompt = random_prompts([300], seed=9)[0]
    logits = engine.score(prompt)
    assert logits.shape == (300, engine.config.vocab_size)
    # the last row is what greedy decoding picks from
    first = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0))[0].token_ids[0]
    assert first == logits[-1].argmax().item()
    assert torch.allclose(engine.score(prompt[:100]), logits[:100], atol=1e-5)


def test_interactive_requests_go_before_batch_work(tiny_model, expected):
    """Batch work (priority 1) queued first still waits for interactive work (0) that comes
    later. All answer as they would alone."""
    engine = LLMEngine(
        tiny_model, num_blocks=6, max_num_batched_tokens=1024, max_num_seqs=2, max_low_priority_tokens=1024
    )
    prompts = random_prompts(LENGTHS, seed=3)
    batch = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, priority=1)
    for name in ("batch-0", "batch-1", "batch-2"):
        engine.add_request(name, prompts[3], batch)
    tokens: dict[str, list[int]] = {}
    finished: list[str] = []
    for out in engine.step():  # two batch requests run (3 blocks each): the batch has the engine to itself
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert {s.request_id for s in engine.scheduler.running} == {"batch-0", "batch-1"}
    engine.add_request("interactive-0", prompts[4], GREEDY)  # 520 + 24 tokens: 5 of the 6 blocks
    engine.add_request("interactive-1", prompts[2], GREEDY)  # 129 + 24: 2 blocks
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finished.append(out.request_id)
    # the first free slots go to the interactive requests, not to batch-2 which waited longer
    assert finished.index("interactive-0") < finished.index("batch-2")
    assert finished.index("interactive-1") < finished.index("batch-2")
    assert tokens["interactive-0"] == expected[520] and tokens["interactive-1"] == expected[129]
    assert [tokens[f"batch-{i}"] for i in range(3)] == [expected[300]] * 3
    assert all_state_free(engine)


def test_batch_work_gives_its_blocks_back_first(tiny_model):
    """When a running request needs a block and none is free, the victim is batch work, even
    when an interactive request is newer (without priorities the newest goes)."""
    growing, short, bulk = random_prompts((120, 17, 200), seed=5)
    reference = LLMEngine(tiny_model)
    prompts = {"a": growing, "c": short, "b": bulk}
    alone = {name: reference.generate([p], GREEDY)[0].token_ids for name, p in prompts.items()}
    engine = LLMEngine(tiny_model, num_blocks=4, max_num_batched_tokens=1024)  # 1 + 1 + 2 blocks: full
    engine.add_request("b", bulk, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, priority=1))
    engine.add_request("c", short, GREEDY)
    engine.add_request("a", growing, GREEDY)  # needs a second block at its 129th token
    tokens: dict[str, list[int]] = {}
    preempted: dict[str, int] = {}
    while engine.has_unfinished_requests():
        for name, seq in engine.seqs.items():
            preempted[name] = seq.num_preemptions
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert preempted["b"] >= 1 and preempted["c"] == 0 and preempted["a"] == 0
    assert tokens == alone
    assert all_state_free(engine)


def test_a_prefill_step_with_interactive_work_takes_no_batch_work(tiny_model, expected):
    """Batch prompts are prefilled in short steps (max_low_priority_tokens), and not at all in a
    step that has an interactive prompt: one arriving waits for a short step only."""
    engine = LLMEngine(tiny_model, max_num_batched_tokens=1024, max_low_priority_tokens=128)
    prompts = random_prompts(LENGTHS, seed=3)
    engine.add_request("batch", prompts[4], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, priority=1))
    tokens: dict[str, list[int]] = {}

    def step() -> None:
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)

    step()
    assert engine.seqs["batch"].num_computed == 128
    engine.add_request("interactive", prompts[3], GREEDY)
    step()  # the interactive prompt alone, all 300 tokens of it
    assert engine.seqs["batch"].num_computed == 128 and engine.seqs["interactive"].num_computed == 300
    step()
    assert engine.seqs["batch"].num_computed == 256  # back to the batch
    decoded = len(tokens["interactive"])
    step()  # the interactive request decodes between two batch prefill steps
    assert engine.seqs["batch"].num_computed == 256 and len(tokens["interactive"]) == decoded + 1
    step()
    assert engine.seqs["batch"].num_computed == 384
    while engine.has_unfinished_requests():
        step()
    assert tokens == {"batch": expected[520], "interactive": expected[300]}


def test_held_batch_work_waits_while_interactive_work_steps(tiny_model, expected):
    """hold_low_priority (set while an interactive job is on its way to its first token in an
    engine on the same thread): steps take interactive work only; released, batch work goes on,
    and both answer as they would alone."""
    engine = LLMEngine(tiny_model, max_num_batched_tokens=1024)
    prompts = random_prompts(LENGTHS, seed=3)
    engine.add_request("batch", prompts[2], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, priority=1))
    tokens: dict[str, list[int]] = {}

    def step() -> None:
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)

    step()
    step()
    assert len(tokens["batch"]) == 2
    engine.scheduler.hold_low_priority = True
    step()  # nothing but batch work: no step at all
    assert len(tokens["batch"]) == 2
    engine.add_request("interactive", prompts[1], GREEDY)
    step()
    step()
    assert len(tokens["batch"]) == 2 and len(tokens["interactive"]) == 2
    engine.scheduler.hold_low_priority = False
    while engine.has_unfinished_requests():
        step()
    assert tokens == {"batch": expected[129], "interactive": expected[17]}


def test_indexer_selection_is_a_stable_sorts_choice():
    """The indexer keeps its top-k entries, ties to the earlier one: exactly what a stable descending
    sort keeps, on scores full of exact ties, signed zeros and masked (-inf) entries."""
    from engine.model import Indexer

    torch.manual_seed(0)
    scores = torch.randn(64, 300).relu().round(decimals=1) * torch.randn(64, 1).sign()  # ties, -0.0 among them
    scores[:, ::7] = float("-inf")
    scores[0] = 0.0
    scores[1, ::2], scores[1, 1::2] = -0.0, 0.0  # equal, whatever their sign bits
    scores[2, 150:] = float("-inf")
    for rows in (scores, scores[5:9, :37]):
        for count in (1, 8, 37, rows.shape[1]):
            stable = rows.sort(dim=-1, descending=True, stable=True).indices[..., :count]
            assert torch.equal(Indexer.select(None, rows, count), stable)
