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
from typing import Any

import llguidance

MAX_SCHEMA_DEPTH = 32  # nesting of a schema's objects and arrays: past it, a 400 (not a slow compile)


class ConstraintError(ValueError):
    """An output constraint that cannot be enforced: its message names why, for a 400."""


def output_grammar(kind: str, schema: str, thinking: bool, think_end_id: int) -> str | None:
    """The llguidance grammar of an output constraint (`OutputConstraint.kind` and `.schema`);
    None for tool calls, which are not enforced yet."""
    if kind in ("tool_call", "tool_call_required"):
        return None
    if kind == "regex":
        answer = "answer: /" + schema.replace("/", "\\/") + "/\n"
    elif kind == "json":
        answer = f"answer: %json {json.dumps(_compact(schema))}\n"
    else:
        raise ConstraintError(f"an output constraint of kind {kind!r} is not supported")
    start = f"start: REASONING <[{think_end_id}]> answer\nREASONING: /(?s:.*)/\n" if thinking else "start: answer\n"
    grammar = llguidance.LLMatcher.grammar_from_lark(start + answer)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:  # llguidance's first line names the problem ("Unimplemented keys: ["if"]"); then the grammar
        reason = messages[0].splitlines()[0].split("failed to compile JSON schema: ")[-1]
        raise ConstraintError(f"the output constraint cannot be enforced: {reason}")
    return grammar


def _compact(schema: str) -> dict[str, Any]:
    """The schema, checked for depth, with JSON's whitespace fixed. None (json_object) is an
    object, as OpenAI's and DeepSeek's JSON mode give."""
    parsed = json.loads(schema) if schema else {"type": "object"}
    if not isinstance(parsed, dict):
        raise ConstraintError("the JSON schema must be an object")
    if _depth(parsed) > MAX_SCHEMA_DEPTH:
        raise ConstraintError(f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
    options = parsed.get("x-guidance") if isinstance(parsed.get("x-guidance"), dict) else {}
    return {**parsed, "x-guidance": {**options, "whitespace_flexible": False}}


def _depth(node: Any) -> int:
    if isinstance(node, dict):
        return 1 + max((_depth(v) for v in node.values()), default=0)
    if isinstance(node, list):
        return 1 + max((_depth(v) for v in node), default=0)
    return 0
