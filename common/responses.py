"""Stored and background Responses: the protocol rules the gateway applies around a job.

OpenAI's Responses API keeps a response (`store`, true unless the request says false) so that
a later request can continue it (`previous_response_id`), a client can fetch it again
(`GET /v1/responses/{id}`), list what it was given (`input_items`), delete it, or run it in the
background and poll, cancel or resume its event stream. deepseek-recipe converts one request
to one prompt and knows none of this; these plain functions say what the gateway stores and
answers, and the job machinery (gateway/jobs.py) keeps it.
"""

from __future__ import annotations

import time
from typing import Any

from common.api import response_id

# a response's status as its job's: a job that ended well holds the response body, whose own
# status says completed or incomplete
JOB_STATUS = {"queued": "queued", "running": "in_progress", "failed": "failed", "cancelled": "cancelled"}
# the events whose data carries the whole response object (`response`)
RESPONSE_EVENTS = frozenset(
    {"response.created", "response.in_progress", "response.completed", "response.incomplete", "response.failed"}
)


def request_problem(body: dict[str, Any]) -> str | None:
    """What this gateway cannot do with a Responses request's state options, or None."""
    if body.get("background") and body.get("store") is False:
        return "background: a background response must be stored (store: true)"
    if body.get("conversation") is not None:
        return "conversation is not supported: continue a response with previous_response_id"
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        return "previous_response_id must be a string"
    return None


def queued_job_problem(endpoint: str, body: dict[str, Any]) -> str | None:
    """Why a request queued as an async job or a batch line cannot run as asked: the state
    options need POST /v1/responses (a stored response to continue, a background run)."""
    if endpoint == "responses":
        for option in ("previous_response_id", "background", "conversation"):
            if body.get(option):
                return f"{option} is served by POST /v1/responses, not in a job or a batch"
    return None


def job_id_of(response: str) -> str | None:
    """The job behind a response id (`resp-<job id>`), or None for an id that is not one of ours."""
    prefix = response_id("responses", "")
    return response.removeprefix(prefix) if response.startswith(prefix) and len(response) > len(prefix) else None


def as_items(given: Any) -> list[Any]:
    """A request's `input` as a list of items (a string is one user message)."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    return list(given) if isinstance(given, list) else []


def continued(body: dict[str, Any], previous_body: dict[str, Any], previous_answer: dict[str, Any]) -> dict[str, Any]:
    """The request with the previous response's conversation before its own input: what that
    response was given, then what it answered. (As OpenAI does, `instructions` and tools are
    not carried over: each request states its own.) The prompt then starts with the previous
    one's tokens, which the KV cache holds."""
    history = as_items(previous_body.get("input")) + list(previous_answer.get("output") or [])
    return {**body, "input": history + as_items(body.get("input"))}


def queued(job_id: str, body: dict[str, Any]) -> dict[str, Any]:
    """The response object of a background response before its first event: what the request
    asked, no output yet."""
    return {
        "id": response_id("responses", job_id),
        "object": "response",
        "created_at": int(time.time()),
        "status": "queued",
        "background": bool(body.get("background")),
        "error": None,
        "incomplete_details": None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "model": body.get("model"),
        "output": [],
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "store": body.get("store", True),
        "temperature": body.get("temperature"),
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p"),
        "usage": None,
        "metadata": body.get("metadata") or {},
    }


def stored_response(
    job_id: str, status: str, body: dict[str, Any], result: dict[str, Any] | None, latest: dict[str, Any] | None
) -> dict[str, Any]:
    """A stored response as GET answers it, from its job: the response body once it has ended
    well; otherwise the latest response object its events carried (`latest`), or the queued
    one, with the job's status, and for a failed job the error its result holds."""
    if status == "succeeded" and result is not None:
        return result
    answer = {**(latest or queued(job_id, body)), "status": JOB_STATUS[status]}
    if status == "failed":
        error = (result or {}).get("error") or {}
        answer["error"] = {"code": error.get("type", "server_error"), "message": error.get("message", "failed")}
    return answer


def input_items(job_id: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The items a response was given (with `previous_response_id`, the whole conversation
    before it), as `input_items` lists them: each with an id, a message's text as content parts."""
    items = []
    for index, item in enumerate(as_items(body.get("input"))):
        if not isinstance(item, dict):
            continue
        entry = dict(item)
        if "role" in entry and entry.get("type", "message") == "message":
            entry["type"] = "message"
            content = entry.get("content")
            if isinstance(content, str):
                part = "output_text" if entry["role"] == "assistant" else "input_text"
                entry["content"] = [{"type": part, "text": content}]
            entry.setdefault("status", "completed")
        entry.setdefault("id", f"msg_{job_id}_{index}")
        items.append(entry)
    return items
