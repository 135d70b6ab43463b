"""Batches: OpenAI's Batch API (over an uploaded JSONL file) and Anthropic's Message Batches.

A batch is a row in `batches` and one row per request in `batch_requests` (gateway/batch_store.py);
each request runs as an async job (gateway/jobs.py) whose id the row holds. gateway/batch_runner.py
moves batches through their lifecycle; this module reads a batch's input and shows a batch and
its results in each protocol's shapes.

OpenAI's lifecycle: validating -> in_progress -> finalizing -> completed, or failed (the input
file is not a valid batch: `errors` lists each bad line), expired (the completion window
passed: what finished is in the output file) or cancelling -> cancelled. Anthropic's batches
are the same rows, shown as `processing_status` in_progress / canceling / ended.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from common.api import MAX_BODY_BYTES, BadRequest, error_body, protocol_problem, usage_counts
from common.responses import queued_job_problem
from gateway.batch_store import (
    CANCELED,
    ERRORED,
    EXPIRED,
    PENDING,
    SENDING,
    SENT,
    SUCCEEDED,
    Batch,
    BatchRequest,
)
from gateway.jobs import Job

MAX_REQUESTS = 50_000
# the URL a request line of an OpenAI batch names -> the endpoint that answers it
OPENAI_URLS = {
    "/v1/chat/completions": "chat.completions",
    "/v1/responses": "responses",
    "/v1/completions": "completions",
}
CUSTOM_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # Anthropic's rule for a custom_id
MAX_CUSTOM_ID = 512


class InvalidInput(ValueError):
    """A batch input file that cannot run: OpenAI's `errors.data`, one entry per bad line."""

    def __init__(self, errors: list[dict[str, Any]]):
        super().__init__(errors[0]["message"])
        self.errors = errors


# -- input ---------------------------------------------------------------------------------------


def openai_url(endpoint: str) -> str:
    """The URL an OpenAI batch names for one of our endpoints."""
    return next(url for url, served in OPENAI_URLS.items() if served == endpoint)


def parse_openai_input(path: Path, url: str) -> list[tuple[str, dict[str, Any]]]:
    """The (custom_id, body) of each line of an OpenAI batch input file, or InvalidInput listing
    every bad line (at most 100): not a JSON object, no custom_id, a duplicate custom_id, a
    method other than POST, a url other than the batch's, a body that is not an object or is
    larger than a request may be, or more than MAX_REQUESTS lines."""
    requests: list[tuple[str, dict[str, Any]]] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()

    def bad(line: int, code: str, message: str, param: str | None = None) -> None:
        if len(errors) < 100:
            errors.append({"code": code, "message": message, "param": param, "line": line})

    with path.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            if len(requests) >= MAX_REQUESTS:
                bad(number, "too_many_requests", f"a batch holds at most {MAX_REQUESTS:,} requests")
                break
            if len(raw) > MAX_BODY_BYTES:
                bad(number, "request_too_large", f"the line is larger than {MAX_BODY_BYTES} bytes")
                continue
            try:
                line = json.loads(raw)
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                bad(number, "invalid_json_line", f"the line is not JSON: {err}")
                continue
            if not isinstance(line, dict):
                bad(number, "invalid_json_line", "the line is not a JSON object")
                continue
            custom_id, body = line.get("custom_id"), line.get("body")
            if not isinstance(custom_id, str) or not 1 <= len(custom_id) <= MAX_CUSTOM_ID:
                bad(
                    number,
                    "missing_required_parameter",
                    "custom_id must be a string of 1 to 512 characters",
                    "custom_id",
                )
                continue
            if custom_id in seen:
                bad(number, "duplicate_custom_id", f"the custom_id {custom_id!r} is used more than once", "custom_id")
                continue
            if line.get("method", "POST") != "POST":
                bad(number, "invalid_method", "method must be POST", "method")
                continue
            if line.get("url") != url:
                bad(number, "invalid_url", f"url must be the batch's endpoint, {url}", "url")
                continue
            if not isinstance(body, dict):
                bad(number, "missing_required_parameter", "body must be the JSON object of the request", "body")
                continue
            seen.add(custom_id)
            requests.append((custom_id, body))
    if errors:
        raise InvalidInput(errors)
    if not requests:
        raise InvalidInput([{"code": "empty_file", "message": "the input file holds no requests", "param": None}])
    return requests


def parse_anthropic_requests(body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The (custom_id, params) of a Message Batches create body, or BadRequest. A request whose
    params break the Messages protocol is not refused here: it ends `errored`, as Anthropic's do."""
    requests = body.get("requests")
    if not isinstance(requests, list) or not requests:
        raise BadRequest("requests: a non-empty list of {custom_id, params}")
    if len(requests) > MAX_REQUESTS:
        raise BadRequest(f"requests: at most {MAX_REQUESTS:,} in one batch, not {len(requests):,}")
    parsed, seen = [], set()
    for index, request in enumerate(requests):
        if not isinstance(request, dict) or not isinstance(request.get("params"), dict):
            raise BadRequest(f"requests.{index}: an object with custom_id and params")
        custom_id = request.get("custom_id")
        if not isinstance(custom_id, str) or not CUSTOM_ID.fullmatch(custom_id):
            raise BadRequest(f"requests.{index}.custom_id: 1 to 64 letters, digits, '_' or '-'")
        if custom_id in seen:
            raise BadRequest(f"requests.{index}.custom_id: {custom_id!r} is used more than once")
        seen.add(custom_id)
        parsed.append((custom_id, request["params"]))
    return parsed


# -- how each protocol shows a batch and its results ---------------------------------------------------


def _seconds(value: float | None) -> int | None:
    return int(value) if value is not None else None


def _rfc3339(value: float | None) -> str | None:
    return datetime.fromtimestamp(value, UTC).isoformat().replace("+00:00", "Z") if value is not None else None


def openai_batch(batch: Batch, counts: dict[str, int]) -> dict[str, Any]:
    errors = {"object": "list", "data": batch.errors} if batch.errors else None
    return {
        "id": batch.id,
        "object": "batch",
        "endpoint": openai_url(batch.endpoint),
        "errors": errors,
        "input_file_id": batch.input_file_id,
        "completion_window": batch.completion_window,
        "status": batch.status,
        "output_file_id": batch.output_file_id,
        "error_file_id": batch.error_file_id,
        "created_at": int(batch.created_at),
        "in_progress_at": _seconds(batch.in_progress_at),
        "expires_at": int(batch.expires_at),
        "finalizing_at": _seconds(batch.finalizing_at),
        "completed_at": _seconds(batch.completed_at),
        "failed_at": _seconds(batch.failed_at),
        "expired_at": _seconds(batch.expired_at),
        "cancelling_at": _seconds(batch.cancelling_at),
        "cancelled_at": _seconds(batch.cancelled_at),
        "request_counts": {
            "total": sum(counts.values()),
            "completed": counts.get(SUCCEEDED, 0),
            "failed": counts.get(ERRORED, 0),
        },
        "metadata": batch.metadata_,
        "usage": batch.usage,
    }


def anthropic_batch(batch: Batch, counts: dict[str, int], results_url: str) -> dict[str, Any]:
    ended = batch.ended_at
    status = "ended" if ended else "canceling" if batch.status == "cancelling" else "in_progress"
    return {
        "id": batch.id,
        "type": "message_batch",
        "processing_status": status,
        "request_counts": {
            "processing": counts.get(PENDING, 0) + counts.get(SENDING, 0) + counts.get(SENT, 0),
            "succeeded": counts.get(SUCCEEDED, 0),
            "errored": counts.get(ERRORED, 0),
            "canceled": counts.get(CANCELED, 0),
            "expired": counts.get(EXPIRED, 0),
        },
        "created_at": _rfc3339(batch.created_at),
        "expires_at": _rfc3339(batch.expires_at),
        "ended_at": _rfc3339(ended),
        "cancel_initiated_at": _rfc3339(batch.cancelling_at),
        "archived_at": None,
        "results_url": results_url if ended else None,
    }


def _error_of(job: Job | None, endpoint: str) -> dict[str, Any]:
    """A failed job's error in the endpoint's protocol (the recipe reports errors in OpenAI's shape)."""
    body = (job.result if job is not None else None) or {}
    if endpoint == "messages" and body.get("type") == "error":
        return body
    error = body.get("error") or {}
    kind = error.get("type") or ("invalid_request_error" if ((job and job.status_code) or 500) < 500 else "api_error")
    return error_body(endpoint, error.get("message") or "the request failed", kind)


def openai_line(request: BatchRequest, job: Job | None, endpoint: str) -> tuple[bool, bytes]:
    """A request's line of the output file (True) or of the error file (False), as OpenAI writes them."""
    line: dict[str, Any] = {"id": f"batch_req_{request.job_id}", "custom_id": request.custom_id}
    if request.state == SUCCEEDED and job is not None:
        line["response"] = {"status_code": 200, "request_id": request.job_id, "body": job.result}
        line["error"] = None
        ok = True
    elif request.state == ERRORED:
        status = job.status_code if job is not None and job.status_code else 500
        line["response"] = {"status_code": status, "request_id": request.job_id, "body": _error_of(job, endpoint)}
        line["error"] = None
        ok = False
    else:
        code = "batch_expired" if request.state == EXPIRED else "batch_cancelled"
        message = "the batch expired before this request ran" if request.state == EXPIRED else "the batch was cancelled"
        line["response"], line["error"] = None, {"code": code, "message": message}
        ok = False
    return ok, (json.dumps(line) + "\n").encode()


def anthropic_line(request: BatchRequest, job: Job | None) -> bytes:
    """A request's line of a Message Batch's results, as Anthropic writes them."""
    if request.state == SUCCEEDED and job is not None:
        result: dict[str, Any] = {"type": "succeeded", "message": job.result}
    elif request.state == ERRORED:
        result = {"type": "errored", "error": _error_of(job, "messages")}
    else:
        result = {"type": request.state}  # canceled | expired
    return (json.dumps({"custom_id": request.custom_id, "result": result}) + "\n").encode()


def problem_of(endpoint: str, body: dict[str, Any]) -> str | None:
    """Why a batch request's body cannot run at all, before it is sent (the rest the tokenizer checks)."""
    return protocol_problem(endpoint, body) or queued_job_problem(endpoint, body)


def usage_of(endpoint: str, results: list[dict[str, Any] | None]) -> dict[str, Any]:
    """OpenAI's batch `usage`: the sum over the answered requests."""
    cached = uncached = output = 0
    for body in results:
        c, u, o = usage_counts(endpoint, body or {})
        cached, uncached, output = cached + c, uncached + u, output + o
    return {
        "input_tokens": cached + uncached,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": cached + uncached + output,
    }
