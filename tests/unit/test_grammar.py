"""Structured outputs in the engine: requests decoded under their grammar, beside unconstrained
ones, on the random-weight tiny model; and the constraints the tokenizer service compiles."""

from __future__ import annotations

import enum
import json
from typing import Literal

import pydantic
import pytest

from engine import LLMEngine, SamplingParams
from tests.support.models import random_prompts
from tokenizer_svc.constraints import MAX_SCHEMA_DEPTH, ConstraintError, Markup, output_grammar
from tokenizer_svc.protocol import Codec, ProtocolError

THINK_END = 128822  # </think> in the V4 tokenizer
MARKUP = Markup(think_end=THINK_END, dsml=128825)


class Order(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")  # additionalProperties: false, as strict mode sends
    item: str = pydantic.Field(pattern=r"^[a-z]{1,8}$")
    quantity: int = pydantic.Field(ge=1, le=99)
    express: bool
    size: Literal["s", "m", "l"]


class Reading(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    sensor: Literal["a", "b"]
    celsius: int = pydantic.Field(ge=-40, le=60)  # a float's digits are unbounded
    ok: bool


MODELS: list[type[pydantic.BaseModel]] = [Order, Reading]


def grammar_of(model: type[pydantic.BaseModel], thinking: bool = False) -> str:
    grammar = output_grammar("json", json.dumps(model.model_json_schema()), thinking, MARKUP)
    assert grammar is not None
    return grammar


@pytest.fixture(scope="module")
def engine(tiny_preset) -> LLMEngine:
    return LLMEngine.from_pretrained(tiny_preset, max_num_seqs=16, max_num_batched_tokens=1024)


def requests() -> list[tuple[list[int], SamplingParams, type[pydantic.BaseModel] | None]]:
    """16 requests: half under one of two schemas, greedy or seeded sampling; half free."""
    prompts = random_prompts([5 + 7 * i for i in range(16)], vocab=20_000, seed=11)
    made = []
    for i, prompt in enumerate(prompts):
        model = MODELS[i % 2] if i % 2 == 0 or i < 8 else None
        sampled = {"temperature": 0.8, "seed": i} if i % 3 == 0 else {"temperature": 0}
        grammar = grammar_of(model) if model is not None else None
        made.append((prompt, SamplingParams(max_tokens=60, grammar=grammar, **sampled), model))
    return made


def test_a_batch_of_constrained_and_free_requests_decodes_each_as_alone_and_valid(engine, tiny_preset):
    """Each request's tokens are its tokens alone. (A sampled request may part from them where
    its draw falls on the boundary between two tokens of its distribution, which the forward
    pass's rounding, about 1e-6 and different for a batch of 16 and a batch of 1, can move:
    then the two tokens are neighbours in the order the draw walks, adjacent ids.)"""
    batch = requests()
    together = engine.generate([p for p, _, _ in batch], [params for _, params, _ in batch])
    alone = LLMEngine.from_pretrained(tiny_preset, max_num_seqs=1)
    decoder = engine.grammars.tokenizer
    for (prompt, params, model), out in zip(batch, together, strict=True):
        single = alone.generate([prompt], params)[0].token_ids
        if params.greedy or out.token_ids == single:
            assert out.token_ids == single
        else:
            parted = next(i for i, (a, b) in enumerate(zip(out.token_ids, single, strict=False)) if a != b)
            assert abs(out.token_ids[parted] - single[parted]) == 1, (parted, out.token_ids, single)
        if model is not None:  # ends at the end of sequence, right after a valid answer
            assert out.finish_reason == "stop", decoder.decode_str(out.token_ids)
            model.model_validate_json(decoder.decode_str(out.token_ids[:-1]))


def test_a_constrained_request_continued_from_its_tokens_goes_on_where_it_was(engine, tiny_preset):
    """What decode does after a hand-over or a kill: a new engine, the output so far, the rest."""
    prompt = random_prompts([40], vocab=20_000, seed=3)[0]
    params = SamplingParams(max_tokens=60, temperature=0.8, seed=5, grammar=grammar_of(Order))
    whole = engine.generate([prompt], params)[0].token_ids
    other = LLMEngine.from_pretrained(tiny_preset, max_num_seqs=1)
    other.resume("r", prompt, whole[:7], params, seed=5)
    rest: list[int] = []
    while other.has_unfinished_requests():
        rest += [t for out in other.step() for t in out.new_token_ids]
    assert whole[:7] + rest == whole


def test_thinking_mode_reasons_freely_then_answers_under_the_schema(engine):
    grammar = grammar_of(Reading, thinking=True)
    matcher = engine.grammars.matcher(grammar, [])
    tokenizer = engine.grammars.tokenizer
    reasoning = tokenizer.tokenize_str("Let me think: {not json} at all.")
    answer = tokenizer.tokenize_str('{"sensor":"a","celsius":21,"ok":true}')
    assert matcher.consume_tokens([*reasoning, THINK_END, *answer])
    assert matcher.is_accepting()
    refused = engine.grammars.matcher(grammar, [])
    assert not refused.consume_tokens([*reasoning, THINK_END, *tokenizer.tokenize_str("no json")])


@pytest.mark.parametrize(
    ("schema", "named"),
    [
        ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, '"if"'),
        ({"$ref": "https://example.com/remote.json"}, "https://example.com/remote.json"),
        ({"type": "strng"}, "strng"),
        (["not", "an", "object"], "must be an object"),
    ],
)
def test_a_constraint_that_cannot_be_enforced_names_why(schema, named):
    with pytest.raises(ConstraintError) as refused:
        output_grammar("json", json.dumps(schema), False, MARKUP)
    assert named in str(refused.value)


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Part(pydantic.BaseModel):
    code: Literal["a", "b"]


class Tool(pydantic.BaseModel):
    kind: Literal["tool"]


class Kit(pydantic.BaseModel):
    """An enum, a nested model and an anyOf of objects: pydantic writes $defs and $refs."""

    color: Color
    part: Part
    extra: Part | Tool


class Node(pydantic.BaseModel):
    """A recursive model: its reference to itself cannot be written out."""

    label: Literal["x", "y"]
    child: Node | None


def accepts(engine: LLMEngine, grammar: str, text: str) -> bool:
    matcher = engine.grammars.matcher(grammar, [])
    return matcher.consume_tokens(engine.grammars.tokenizer.tokenize_str(text)) and matcher.is_accepting()


def parse_body(model: type[pydantic.BaseModel]) -> dict:
    """What chat.completions.parse sends: openai's strict form of the model's schema."""
    from openai.lib._parsing._completions import type_to_response_format_param

    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Describe it."}],
        "response_format": type_to_response_format_param(model),
    }


def test_schemas_with_definitions_as_the_openai_sdk_sends_them(engine, tiny_preset):
    """The recipe drops $defs while keeping the $refs to them, refuses a $ref in an anyOf, and
    drops const: the grammar still follows each (references written out, const as an enum)."""
    grammar = Codec.for_model(tiny_preset, "tiny").prompt("chat.completions", parse_body(Kit)).grammar
    assert grammar is not None
    assert accepts(engine, grammar, '{"color":"red","part":{"code":"a"},"extra":{"kind":"tool"}}')
    assert accepts(engine, grammar, '{"color":"blue","part":{"code":"b"},"extra":{"code":"a"}}')
    refused = [
        '{"color":"green","part":{"code":"a"},"extra":{"kind":"tool"}}',  # not in the enum
        '{"color":"red","part":{},"extra":{"kind":"tool"}}',  # the nested model's field
        '{"color":"red","part":{"code":"a"},"extra":{"kind":"spanner"}}',  # not the const
    ]
    assert not any(accepts(engine, grammar, text) for text in refused)


def test_a_recursive_schema_is_refused_by_name(tiny_preset):
    """The recipe cannot read a reference to a schema within itself, so it is refused, not loosened."""
    with pytest.raises(ProtocolError) as refused:
        Codec.for_model(tiny_preset, "tiny").prompt("chat.completions", parse_body(Node))
    assert refused.value.status_code == 400 and "recursive" in refused.value.body and "Node" in refused.value.body


def test_a_reference_to_nothing_is_refused_by_name():
    schema = {"type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}}
    with pytest.raises(ConstraintError, match="#/\\$defs/Missing"):
        output_grammar("json", json.dumps(schema), False, MARKUP)


def test_a_schema_nested_past_the_bound_is_refused_before_compiling():
    schema: dict = {"type": "string"}
    for _ in range(MAX_SCHEMA_DEPTH):
        schema = {"type": "object", "properties": {"x": schema}}
    with pytest.raises(ConstraintError, match="nests deeper"):
        output_grammar("json", json.dumps(schema), False, MARKUP)


FORECAST = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "maximum": 9}},
    "required": ["city", "days"],
    "additionalProperties": False,
}


def markup_tokens(engine: LLMEngine, *pieces: str | int) -> list[int]:
    """Text pieces tokenized, ints as they are: the ｜DSML｜ special token between them."""
    tokenize = engine.grammars.tokenizer.tokenize_str
    return [t for piece in pieces for t in ([piece] if isinstance(piece, int) else tokenize(piece))]


def call(engine: LLMEngine, city: str, days: str) -> list[int]:
    dsml = MARKUP.dsml
    return markup_tokens(
        engine,
        "<", dsml, 'invoke name="forecast">\n',
        "<", dsml, f'parameter name="city" string="true">{city}', "</", dsml, "parameter>\n",
        "<", dsml, f'parameter name="days" string="false">{days}', "</", dsml, "parameter>\n",
        "</", dsml, "invoke>\n", "</", dsml, "tool_calls>",
    )  # fmt: skip


def test_a_strict_tool_the_model_may_call_constrains_only_its_call(engine):
    """tool_choice auto with a strict tool: a text answer, or text and then calls that follow the
    schema, in DeepSeek-V4's markup; a call outside the schema is refused."""
    tools = json.dumps([{"type": "function", "function": {"name": "forecast", "parameters": FORECAST, "strict": True}}])
    grammar = output_grammar("tool_call", tools, False, MARKUP)
    assert grammar is not None
    text_only = engine.grammars.matcher(grammar, [])
    assert text_only.consume_tokens(markup_tokens(engine, "It is sunny <b>today</b>.")) and text_only.is_accepting()
    opening = markup_tokens(engine, "Let me look.\n\n", "<", MARKUP.dsml, "tool_calls>\n")
    with_call = engine.grammars.matcher(grammar, [])
    assert with_call.consume_tokens(opening + call(engine, "Paris", "3")) and with_call.is_accepting()
    for city, days in (("Rome", "3"), ("Paris", "12")):  # not in the enum; past the maximum
        assert not engine.grammars.matcher(grammar, []).consume_tokens(opening + call(engine, city, days))


def test_tools_none_of_which_is_strict_chosen_freely_are_not_constrained():
    tools = json.dumps([{"type": "function", "function": {"name": "forecast", "parameters": FORECAST}}])
    assert output_grammar("tool_call", tools, False, MARKUP) is None
    forced = output_grammar("tool_call_required", tools, False, MARKUP)  # a call it must make: constrained
    assert forced is not None


def test_a_string_format_in_a_tool_call_is_refused_not_ignored():
    schema = {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"}}, "required": ["id"]}
    tools = json.dumps([{"type": "function", "function": {"name": "f", "parameters": schema, "strict": True}}])
    with pytest.raises(ConstraintError, match="format"):
        output_grammar("tool_call_required", tools, False, MARKUP)


def test_parallel_tool_calls_false_allows_one_call(engine):
    """A model sampling freely may open call after call; `parallel_tool_calls: false` ends at one."""
    tools = json.dumps([{"type": "function", "function": {"name": "forecast", "parameters": FORECAST, "strict": True}}])
    one = call(engine, "Oslo", "2")
    closing = markup_tokens(engine, "</", MARKUP.dsml, "tool_calls>")
    twice = one[: -len(closing)] + one  # two invokes, then the closing tag
    assert engine.grammars.matcher(output_grammar("tool_call_required", tools, False, MARKUP), []).consume_tokens(twice)
    single = output_grammar("tool_call_required", tools, False, MARKUP, one_call=True)
    assert not engine.grammars.matcher(single, []).consume_tokens(twice)
    assert engine.grammars.matcher(single, []).consume_tokens(one)


def test_asking_the_grammar_first_chooses_what_masking_every_step_would(engine, tiny_preset):
    """Greedy under a grammar, as the sampler does it (the free choice, then the next most likely,
    checked one by one; the full mask only when none is allowed) against the plain definition:
    every step, the best of all the tokens the grammar's mask allows, over the engine's own
    scores of the text so far. Forced text (a tool's name in the call markup) is spelled as the
    mask spells it, though the grammar would take another spelling of the same bytes."""
    tool = {"type": "function", "function": {"name": "forecast", "parameters": FORECAST, "strict": True}}
    request = {"model": "tiny", "messages": [{"role": "user", "content": "What is a Kafka partition?"}]}
    request |= {"tools": [tool], "tool_choice": "required", "thinking": {"type": "disabled"}}
    call = Codec.for_model(tiny_preset, "tiny").prompt("chat.completions", request)
    cases = [
        (grammar_of(Order), random_prompts([30], vocab=20_000, seed=7)[0]),
        (grammar_of(Reading, thinking=True), random_prompts([30], vocab=20_000, seed=7)[0]),
        (call.grammar, call.token_ids),  # let, the tiny model spells "forecast" "fore" "cas" "t" here
    ]
    for grammar, prompt in cases:
        out = engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0, grammar=grammar))[0]
        matcher = engine.grammars.matcher(grammar, [])
        # the scores of every next token at once: position i of a causal model's prompt sees
        # the text up to i (tests/system/test_parity.py holds these to transformers')
        every = engine.score(prompt + out.token_ids)[len(prompt) - 1 :]
        for step, token in enumerate(out.token_ids):
            scores = every[step]
            allowed = engine.grammars.allowed([matcher])[0]
            assert token == int(allowed[scores[allowed].argmax()]), (grammar[:60], step)
            assert matcher.consume_token(token)


def test_the_end_of_sequence_is_allowed_where_the_answer_may_end(engine):
    """llguidance's validate_tokens refuses the end of sequence even where its mask allows it."""
    matcher = engine.grammars.matcher(grammar_of(Reading), [])
    answer = engine.grammars.tokenizer.tokenize_str('{"sensor":"a","celsius":21,"ok":true')
    eos = engine.grammars.eos_token_id
    assert matcher.consume_tokens(answer[:-1])  # '{"sensor":"a","celsius":21,"ok":' ...
    step = engine.grammars.step([matcher])
    assert step.first_allowed(0, [eos]) is None  # the object is still open
    assert matcher.consume_tokens(answer[-1:] + engine.grammars.tokenizer.tokenize_str("}"))
    assert matcher.validate_tokens([eos]) == 0 and step.first_allowed(0, [eos]) == eos


def test_properties_named_like_keywords_stay_properties(engine, tiny_preset):
    """A property called `const` or `enum` is a name, not the keyword: only schemas are rewritten."""
    schema = {
        "type": "object",
        "properties": {"const": {"type": "string", "const": "a"}, "enum": {"type": "integer", "enum": [1, 2]}},
        "required": ["const", "enum"],
        "additionalProperties": False,
    }
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Describe it."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "k", "schema": schema, "strict": True}},
    }
    grammar = Codec.for_model(tiny_preset, "tiny").prompt("chat.completions", body).grammar
    assert accepts(engine, grammar, '{"const":"a","enum":2}')
    assert not accepts(engine, grammar, '{"const":"b","enum":2}')
