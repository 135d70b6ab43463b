"""Bad requests get a clear EngineError (a ValueError) and the engine keeps serving."""

from __future__ import annotations

import pytest

from engine import EngineError, InvalidRequestError, SamplingParams, UnknownRequestError

GOOD = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([], "prompt is empty"),
        ([1, 2, 512], "outside the vocabulary"),
        ([-1, 5], "outside the vocabulary"),
        ([1, "2"], "outside the vocabulary"),
        ([1, 2.5], "outside the vocabulary"),
    ],
)
def test_bad_prompts(engine, prompt, message):
    with pytest.raises(InvalidRequestError, match=message):
        engine.add_request("bad", prompt, GOOD)
    with pytest.raises(InvalidRequestError, match=message):
        engine.score(prompt)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"seed": "abc"}, "seed"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**kwargs)


def test_prompt_plus_max_tokens_beyond_context(engine):
    context = engine.max_model_len
    with pytest.raises(InvalidRequestError, match="exceeds the model's context"):
        engine.add_request("long", [1] * 10, SamplingParams(max_tokens=context - 9))
    engine.add_request("fits", [1] * 10, SamplingParams(max_tokens=context - 10))  # exactly the context is fine
    engine.abort("fits")


def test_unknown_and_duplicate_request_ids(engine):
    with pytest.raises(UnknownRequestError, match="never-added"):
        engine.abort("never-added")
    engine.add_request("same", [1, 2, 3], GOOD)
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("same", [4, 5, 6], GOOD)


def test_errors_are_value_errors_and_engine_keeps_serving(engine):
    engine.add_request("ok", [3, 1, 4, 1, 5], GOOD)
    for bad in ([], [10**9]):
        with pytest.raises(ValueError):
            engine.add_request("bad", bad, GOOD)
    assert issubclass(EngineError, ValueError)
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
    assert len(tokens) == 8
