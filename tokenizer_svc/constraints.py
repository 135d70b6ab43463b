"""A request's output constraint as the grammar the engine enforces (engine/grammar.py).

deepseek-recipe reads what the request asks of its output (`response_format` json_schema or
json_object, Responses `text.format`, ...) and reports it as an `OutputConstraint`, leaving its
enforcement to the backend. Here it becomes an llguidance grammar over the whole output, in
DeepSeek-V4's format: in thinking mode, free reasoning up to `</think>`, then the constrained
answer; without thinking (the prompt already ends in `</think>`), the answer alone.

JSON is compact (no whitespace between tokens): a model may not pad an answer with newlines
until it runs out of tokens, which a random-weight model otherwise does for ever.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import llguidance

MAX_SCHEMA_DEPTH = 32  # nesting of a schema's objects and arrays: past it, a 400 (not a slow compile)


class ConstraintError(ValueError):
    """An output constraint that cannot be enforced: its message names why, for a 400."""


@dataclass(frozen=True)
class Markup:
    """The tokens of DeepSeek-V4's output markup that a grammar names by id."""

    think_end: int  # </think> (a special token): reasoning ends
    dsml: int  # ｜DSML｜ (an ordinary one): in every tag of the tool-call markup, <｜DSML｜invoke ...>, ...


def output_grammar(kind: str, schema: str, thinking: bool, markup: Markup, one_call: bool = False) -> str | None:
    """The llguidance grammar of an output constraint (`OutputConstraint.kind` and `.schema`),
    or None when there is nothing to enforce (tools none of which is strict, chosen freely).
    `one_call`: at most one tool call (`parallel_tool_calls: false`). The request's schemas
    reach the recipe with their references written out (`schemas_for_the_recipe`)."""
    if kind == "regex":
        answer = "answer: /" + schema.replace("/", "\\/") + "/\n"
    elif kind == "json":
        answer = f"answer: %json {json.dumps(_compact(schema))}\n"
    elif kind == "tool_call_required":  # the prompt ends inside the markup: <｜DSML｜tool_calls>\n
        answer = "answer: calls\n" + _tool_calls(_tools(schema), markup.dsml, one_call)
    elif kind == "tool_call":
        tools = _tools(schema)
        if not any(tool.get("function", {}).get("strict") for tool in tools):
            return None
        # an answer in text, or text then the calls. ｜DSML｜ is an ordinary token (its text
        # can be spelled in pieces too): the text may not contain it, or a call could hide there
        # (the text before calls ends in "\n\n<": a lexeme stops where it cannot go on, here at
        # the ｜DSML｜ after that "<")
        opening = f'<[{markup.dsml}]> "tool_calls>\\n"'
        answer = f"answer: TEXT | TEXT_BEFORE_CALLS {opening} calls\n"
        no_markup = "~/(?s:.*｜DSML｜.*)/"
        answer += f"TEXT: /(?s:.*)/ & {no_markup}\nTEXT_BEFORE_CALLS: /(?s:.*)\\n\\n</ & {no_markup}\n"
        answer += _tool_calls(tools, markup.dsml, one_call)
    else:
        raise ConstraintError(f"an output constraint of kind {kind!r} is not supported")
    start = f"start: REASONING <[{markup.think_end}]> answer\nREASONING: /(?s:.*)/\n" if thinking else "start: answer\n"
    grammar = llguidance.LLMatcher.grammar_from_lark(start + answer)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:  # llguidance's first line names the problem ("Unimplemented keys: ["if"]"); then the grammar
        reason = messages[0].splitlines()[0].split("failed to compile JSON schema: ")[-1]
        raise ConstraintError(f"the output constraint cannot be enforced: {reason}")
    return grammar


def _tools(schema: str) -> list[dict[str, Any]]:
    """The tools of a tool-call constraint, each one's parameters with their own references resolved."""
    tools = json.loads(schema)
    for tool in tools:
        function = tool.get("function", {})
        if isinstance(function.get("parameters"), dict):
            function["parameters"] = resolve_references(function["parameters"])
    return tools


def _tool_calls(tools: list[dict[str, Any]], dsml: int, one_call: bool) -> str:
    """Lark rules for one or more calls in DSML markup, as deepseek-recipe renders and parses them:

        <｜DSML｜invoke name="f">
        <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
        <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
        </｜DSML｜invoke>
        </｜DSML｜tool_calls>

    A string parameter is its raw text, anything else JSON; a tool's required parameters always
    appear, the others may, in the schema's order."""
    tag = f'"<" <[{dsml}]> '
    end = f'"</" <[{dsml}]> '
    rules, invokes = [], []
    for n, tool in enumerate(tools):
        function = tool.get("function", {})
        parameters = function.get("parameters") or {}
        required = set(parameters.get("required") or [])
        parts = []
        for i, (key, sub) in enumerate((parameters.get("properties") or {}).items()):
            raw = isinstance(sub, dict) and sub.get("type") == "string"
            value = _raw_string(key, sub) if raw else f"%json {json.dumps(_compact(json.dumps(sub)))}"
            opening = _literal(f'parameter name="{key}" string="{"true" if raw else "false"}">')
            rules.append(f'param{n}_{i}: {tag}{opening} {value} {end}"parameter>\\n"')
            parts.append(f"param{n}_{i}" if key in required else f"param{n}_{i}?")
        name = _literal(f'invoke name="{function.get("name", "")}">\n')
        rules.append(f'invoke{n}: {tag}{name} {" ".join(parts)} {end}"invoke>\\n"')
        invokes.append(f"invoke{n}")
    rules.append("invoke: " + " | ".join(invokes))
    rules.append(f'calls: invoke{"" if one_call else "+"} {end}"tool_calls>"')
    return "\n".join(rules) + "\n"


def _raw_string(key: str, schema: dict[str, Any]) -> str:
    """A string parameter's value as raw text: its enum, its pattern, or any text without "<"
    (which would open the markup's closing tag)."""
    if "enum" in schema:
        return "(" + " | ".join(_literal(str(v)) for v in schema["enum"]) + ")"
    if "pattern" in schema:
        return "/" + schema["pattern"].removeprefix("^").removesuffix("$").replace("/", "\\/") + "/"
    if "format" in schema:
        raise ConstraintError(f'the "format" of string parameter {key!r} cannot be enforced in a tool call')
    return "/[^<]*/"


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _compact(schema: str) -> dict[str, Any]:
    """The schema, its references resolved, checked for depth, with JSON's whitespace fixed. None
    (json_object) is an object, as OpenAI's and DeepSeek's JSON mode give."""
    parsed = json.loads(schema) if schema else {"type": "object"}
    if not isinstance(parsed, dict):
        raise ConstraintError("the JSON schema must be an object")
    parsed = resolve_references(parsed)
    if _depth(parsed) > MAX_SCHEMA_DEPTH:
        raise ConstraintError(f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
    options = parsed.get("x-guidance") if isinstance(parsed.get("x-guidance"), dict) else {}
    return {**parsed, "x-guidance": {**options, "whitespace_flexible": False}}


DEFINITIONS = ("$defs", "definitions")  # JSON Schema's name for them, and draft 7's (older pydantic)


def schemas_for_the_recipe(body: dict[str, Any]) -> dict[str, Any]:
    """The request with each of its schemas (response format, tools' parameters) in the form the
    recipe keeps whole: references written out (it drops `$defs`, and refuses a `$ref` in an
    `anyOf`) and `const` as a one-value `enum` (its strict form drops `const`)."""
    body = dict(body)

    def rewritten(holder: Any, key: str) -> None:
        if isinstance(holder, dict) and isinstance(holder.get(key), dict):
            resolved = resolve_references(holder[key])
            if "$defs" in resolved:  # what is left is recursive, which the recipe cannot read
                names = ", ".join(sorted(resolved["$defs"]))
                raise ConstraintError(f"recursive JSON schemas are not supported (a $ref within {names})")
            holder[key] = _with_enums(resolved)

    for outer, inner in (("response_format", "json_schema"), ("text", "format"), ("output_config", "format")):
        if isinstance(body.get(outer), dict) and isinstance(body[outer].get(inner), dict):
            body[outer] = {**body[outer], inner: dict(body[outer][inner])}
            rewritten(body[outer][inner], "schema")
    if isinstance(body.get("tools"), list):
        body["tools"] = [dict(tool) if isinstance(tool, dict) else tool for tool in body["tools"]]
        for tool in body["tools"]:
            if isinstance(tool, dict) and isinstance(tool.get("function"), dict):
                tool["function"] = dict(tool["function"])
                rewritten(tool["function"], "parameters")
            rewritten(tool, "parameters")  # Responses
            rewritten(tool, "input_schema")  # Messages
    return body


JSON_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (type(None), "null"))


def _with_enums(node: Any) -> Any:
    """`const: x` as `enum: [x]`, with the `type` the recipe requires where a schema gives none."""
    if isinstance(node, list):
        return [_with_enums(item) for item in node]
    if not isinstance(node, dict):
        return node
    rewritten: dict[str, Any] = {}
    for key, value in node.items():
        if key in ("enum", "const", "default", "examples"):  # values, not schemas
            rewritten[key] = value
        elif key in ("properties", "patternProperties", *DEFINITIONS) and isinstance(value, dict):
            rewritten[key] = {name: _with_enums(schema) for name, schema in value.items()}  # names, then schemas
        else:
            rewritten[key] = _with_enums(value)
    node = rewritten
    if "const" in node:
        node["enum"] = [node.pop("const")]
    if "enum" in node and "type" not in node:
        kinds = {next((name for kind, name in JSON_TYPES if type(v) is kind), None) for v in node["enum"]}
        if len(kinds) == 1 and None not in kinds:
            node["type"] = kinds.pop()
    return node


def resolve_references(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with each local reference (`#/$defs/Name`, `#/definitions/Name`) replaced by
    what it names in the schema's own definitions. A recursive one (a tree, a linked list) stays
    a reference, with the definitions at the root for llguidance to follow."""
    known = {k: v for key in DEFINITIONS for k, v in (schema.get(key) or {}).items()}
    recursive: list[str] = []

    def resolve(node: Any, within: tuple[str, ...]) -> Any:
        if isinstance(node, list):
            return [resolve(item, within) for item in node]
        if not isinstance(node, dict):
            return node
        reference = node.get("$ref")
        if isinstance(reference, str) and reference.startswith(("#/$defs/", "#/definitions/")):
            name = reference.split("/", 2)[2]
            if name not in known:
                raise ConstraintError(f"the JSON schema refers to {reference}, which it does not define")
            if name in within:  # recursive: left as a reference to the root's $defs
                recursive.append(name)
                return {**node, "$ref": f"#/$defs/{name}"}
            rest = {k: resolve(v, within) for k, v in node.items() if k != "$ref"}
            return {**resolve(known[name], (*within, name)), **rest}
        return {k: resolve(v, within) for k, v in node.items() if k not in DEFINITIONS}

    resolved = resolve(schema, ())
    if recursive:
        resolved["$defs"] = {name: resolve(definition, (name,)) for name, definition in known.items()}
    return resolved


def _depth(node: Any) -> int:
    if isinstance(node, dict):
        return 1 + max((_depth(v) for v in node.values()), default=0)
    if isinstance(node, list):
        return 1 + max((_depth(v) for v in node), default=0)
    return 0
