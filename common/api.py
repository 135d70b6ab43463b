"""The rules of the public API that every service applies the same way.

Endpoints and their response ids, the error body of each protocol, what a request body must
be before any protocol reads it, the tenant and retention rules, and Server-Sent Events
framing. The gateway answers with these; the tokenizer applies them again to requests that
reach `requests` without the gateway (the topic is a public interface); prefill reports its
errors in the same shape.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from common.messages import ResultPayload
from common.retention import RETENTION_CLASSES

ENDPOINTS = ("chat.completions", "responses", "messages", "completions")
RESPONSE_ID_PREFIX = {"chat.completions": "chatcmpl", "responses": "resp", "messages": "msg", "completions": "cmpl"}
# Anthropic Messages, the protocol of coding agents, is `agent`; the OpenAI protocols are `chat`.
DEFAULT_RETENTION = {"messages": "agent", "chat.completions": "chat", "responses": "chat", "completions": "chat"}
TENANT_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,64}")

MAX_BODY_BYTES = 8 << 20
MAX_NESTING = 100  # deeper than any request of the three protocols nests
MAX_PROMPTS = 256  # in one Completions request: each is a job
INT64 = 1 << 63  # JSON integers must fit in 64 bits: seeds, token counts, schema bounds


class BadRequest(ValueError):
    """A request the API refuses before reading it as a protocol request: an HTTP status and why."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def response_id(endpoint: str, job_id: str) -> str:
    return f"{RESPONSE_ID_PREFIX[endpoint]}-{job_id}"


def error_body(endpoint: str, message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    """An error in the endpoint's own format: Anthropic's for messages, OpenAI's for the rest."""
    if endpoint == "messages":
        return {"type": "error", "error": {"type": kind, "message": message}}
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def unknown_model_body(endpoint: str, model: str) -> dict[str, Any]:
    """A request for a model this server does not serve, answered with a 404 as OpenAI
    (`model_not_found`) and Anthropic (`not_found_error`) answer it, on every endpoint alike."""
    message = f"The model {model!r} does not exist: this server serves the models GET /v1/models lists"
    if endpoint == "messages":
        return error_body(endpoint, message, "not_found_error")
    body = error_body(endpoint, message)
    body["error"]["code"] = "model_not_found"
    return body


def server_error_kind(endpoint: str) -> str:
    return "api_error" if endpoint == "messages" else "server_error"


# -- request bodies ------------------------------------------------------------------------------


def _no_constants(name: str) -> float:
    raise BadRequest(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BadRequest(f"the number {text[:40]} is out of range")
    return value


def _int64(text: str) -> int:
    if len(text) > 20:
        raise BadRequest(f"the integer {text[:40]}... does not fit in 64 bits")
    value = int(text)
    if not -INT64 <= value < INT64:
        raise BadRequest(f"the integer {text} does not fit in 64 bits")
    return value


# An escaped UTF-16 surrogate: the only way a lone one can get into a JSON text.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def parse_object(raw: bytes, limit: int = MAX_BODY_BYTES) -> dict[str, Any]:
    """A request body as a JSON object, or BadRequest: not UTF-8 JSON, not an object, NaN or
    Infinity, a number out of range, nesting deeper than MAX_NESTING, or a string holding a
    lone surrogate (which no encoder downstream can write)."""
    if len(raw) > limit:
        raise BadRequest(f"request body larger than {limit} bytes", 413)
    try:
        body = json.loads(raw, parse_constant=_no_constants, parse_float=_finite, parse_int=_int64)
    except RecursionError:
        raise BadRequest(f"the JSON body is nested more than {MAX_NESTING} levels deep") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise BadRequest(f"malformed JSON body: {err}") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    _check_shape(body, strings=bool(_SURROGATE_ESCAPE.search(raw)))
    return body


def _check_shape(value: Any, strings: bool) -> None:
    """Nesting depth, and (when the text escapes a surrogate) that every string encodes."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_NESTING:
            raise BadRequest(f"the JSON body is nested more than {MAX_NESTING} levels deep")
        if isinstance(item, dict):
            if strings:
                for key in item:
                    _check_string(key)
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
        elif strings and isinstance(item, str):
            _check_string(item)


def _check_string(text: str) -> None:
    try:
        text.encode()
    except UnicodeEncodeError:
        raise BadRequest("a string in the body holds a lone UTF-16 surrogate (not a character)") from None


def protocol_problem(endpoint: str, body: dict[str, Any]) -> str | None:
    """A rule of the endpoint's protocol the recipe does not enforce, or None."""
    if endpoint == "messages" and "max_tokens" not in body:
        return "max_tokens: Field required"  # Anthropic's API requires it; without it a request runs to the context
    if endpoint == "completions" and len(prompts := completion_prompts(body)) > 1:
        if body.get("stream"):
            return "stream one prompt per request (a list of prompts is answered whole, without stream)"
        if len(prompts) > MAX_PROMPTS:
            return f"prompt: at most {MAX_PROMPTS} prompts per request, not {len(prompts)}"
    return None


def completion_prompts(body: dict[str, Any]) -> list[dict[str, Any]]:
    """A Completions request as one request per prompt: its `prompt` may be a list of prompts
    (texts or token id lists), which lm-evaluation-harness sends a batch as. Each one is a job;
    the answer lists their choices (`merge_completions`)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        return [{**body, "prompt": one} for one in prompt]
    return [body]


def merge_completions(answers: list[dict[str, Any]]) -> dict[str, Any]:
    """The answer to a Completions request with a list of prompts: the first prompt's answer,
    holding every prompt's choice (index = its place in the list) and their usage summed."""
    merged = {**answers[0], "choices": []}
    usage = {
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "total_tokens": 0,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    for index, answer in enumerate(answers):
        merged["choices"].append({**answer["choices"][0], "index": index})
        for name in ("prompt_tokens", "completion_tokens", "total_tokens"):
            usage[name] += answer["usage"][name]
        usage["prompt_tokens_details"]["cached_tokens"] += answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    merged["usage"] = usage
    return merged


def usage_counts(endpoint: str, body: dict[str, Any]) -> tuple[int, int, int]:
    """(cached input, uncached input, output) tokens from a response's `usage`, in any of the
    three protocols' shapes (Anthropic counts cached input apart from `input_tokens`)."""
    usage = body.get("usage") or {}
    if endpoint == "messages":
        cached = usage.get("cache_read_input_tokens") or 0
        return cached, usage.get("input_tokens") or 0, usage.get("output_tokens") or 0
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    cached = details.get("cached_tokens") or 0
    prompt = usage.get("prompt_tokens", usage.get("input_tokens")) or 0
    output = usage.get("completion_tokens", usage.get("output_tokens")) or 0
    return cached, max(0, prompt - cached), output


def tenancy_problem(tenant: str | None, retention_class: str | None) -> str | None:
    """Why the tenant or retention class a request names is not acceptable, or None."""
    if tenant is not None and not TENANT_PATTERN.fullmatch(tenant):
        return "X-DeepMesh-Tenant must be 1 to 64 letters, digits, '.', '_' or '-'"
    if retention_class is not None and retention_class not in RETENTION_CLASSES:
        return f"the retention class must be one of {', '.join(RETENTION_CLASSES)}, not {retention_class!r}"
    return None


# -- Server-Sent Events --------------------------------------------------------------------------


def frame(name: str | None, data: str) -> str:
    """One event: `event:` when the protocol names it, then `data:`."""
    return f"event: {name}\ndata: {data}\n\n" if name else f"data: {data}\n\n"


def result_frames(results: list[ResultPayload]) -> bytes:
    """The events of results messages that arrived together, as one write; the last message's
    final data (Chat Completions' [DONE]) after its events."""
    frames = []
    for result in results:
        frames += [frame(event.name, event.data) for event in result.events]
        if result.done and result.done_data is not None:
            frames.append(frame(None, result.done_data))
    return "".join(frames).encode()
