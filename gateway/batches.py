"""Batches: OpenAI's Batch API (over an uploaded JSONL file) and Anthropic's Message Batches.

A batch is a row in `batches` and one row per request in `batch_requests`; each request runs
as an async job (gateway/jobs.py) whose id the row holds, so its result is recorded the way
every async job's is, whichever gateway replica reads it. gateway/batch_runner.py moves
batches through their lifecycle; this module is the state and how each protocol shows it.

OpenAI's lifecycle: validating -> in_progress -> finalizing -> completed, or failed (the input
file is not a valid batch: `errors` lists each bad line), expired (the completion window
passed: what finished is in the output file) or cancelling -> cancelled. Anthropic's batches
are the same rows, shown as `processing_status` in_progress / canceling / ended.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import JSON, Float, ForeignKey, Integer, String, func, select
from sqlalchemy.orm import Mapped, Session, mapped_column, sessionmaker

from common.api import MAX_BODY_BYTES, BadRequest, error_body, protocol_problem, usage_counts
from common.responses import queued_job_problem
from gateway.jobs import Base, Job

MAX_REQUESTS = 50_000
COMPLETION_WINDOWS = {"24h": 86400.0}
# the URL a request line of an OpenAI batch names -> the endpoint that answers it
OPENAI_URLS = {
    "/v1/chat/completions": "chat.completions",
    "/v1/responses": "responses",
    "/v1/completions": "completions",
}
CUSTOM_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # Anthropic's rule for a custom_id
MAX_CUSTOM_ID = 512

# a request's state: pending (not sent yet), sending (its job exists; being produced), sent (its
# job runs), then one of the final ones
PENDING, SENDING, SENT = "pending", "sending", "sent"
SUCCEEDED, ERRORED, CANCELED, EXPIRED = "succeeded", "errored", "canceled", "expired"
ENDED = ("completed", "failed", "expired", "cancelled")  # batch statuses after which nothing runs


class Batch(Base):
    __tablename__ = "batches"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    protocol: Mapped[str] = mapped_column(String(16))  # openai | anthropic
    tenant: Mapped[str] = mapped_column(String(64))
    endpoint: Mapped[str] = mapped_column(String(32))
    input_file_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    status: Mapped[str] = mapped_column(String(16), index=True)
    completion_window: Mapped[str] = mapped_column(String(8))
    metadata_: Mapped[dict[str, str] | None] = mapped_column("metadata", JSON, nullable=True)
    errors: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, nullable=True)
    usage: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    output_file_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    error_file_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    created_at: Mapped[float] = mapped_column(Float)
    expires_at: Mapped[float] = mapped_column(Float)
    in_progress_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    finalizing_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    completed_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    failed_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    expired_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    cancelling_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    cancelled_at: Mapped[float | None] = mapped_column(Float, nullable=True)

    @property
    def ended_at(self) -> float | None:
        return self.completed_at or self.failed_at or self.expired_at or self.cancelled_at


class BatchRequest(Base):
    __tablename__ = "batch_requests"

    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True)
    index: Mapped[int] = mapped_column(Integer, primary_key=True)
    custom_id: Mapped[str] = mapped_column(String(512))
    body: Mapped[dict[str, Any]] = mapped_column(JSON)
    job_id: Mapped[str] = mapped_column(String(64), unique=True)
    state: Mapped[str] = mapped_column(String(16))
    sent_at: Mapped[float | None] = mapped_column(Float, nullable=True)


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


def job_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request a batch line runs: never streamed."""
    return {**body, "stream": False}


# -- state ---------------------------------------------------------------------------------------


class BatchStore:
    def __init__(self, session: sessionmaker[Session]):
        self.session = session

    def create(
        self,
        protocol: str,
        tenant: str,
        endpoint: str,
        completion_window: str = "24h",
        input_file_id: str | None = None,
        metadata: dict[str, str] | None = None,
        requests: list[tuple[str, dict[str, Any]]] | None = None,
    ) -> Batch:
        """A new batch: validating (its input file is read by the runner), or in progress with
        `requests` given."""
        now = time.time()
        prefix = "msgbatch_" if protocol == "anthropic" else "batch_"
        batch = Batch(
            id=f"{prefix}{uuid.uuid4().hex}",
            protocol=protocol,
            tenant=tenant,
            endpoint=endpoint,
            input_file_id=input_file_id,
            status="validating",
            completion_window=completion_window,
            metadata_=metadata,
            created_at=now,
            expires_at=now + COMPLETION_WINDOWS[completion_window],
        )
        with self.session.begin() as s:
            s.add(batch)
            if requests is not None:
                s.flush()
                self._add_requests(s, batch, requests)
        return batch

    def start(self, batch_id: str, requests: list[tuple[str, dict[str, Any]]]) -> None:
        """A validated batch's requests, pending: the batch is in progress."""
        with self.session.begin() as s:
            batch = s.get(Batch, batch_id, with_for_update=True)
            if batch is not None and batch.status == "validating":
                self._add_requests(s, batch, requests)

    @staticmethod
    def _add_requests(s: Session, batch: Batch, requests: list[tuple[str, dict[str, Any]]]) -> None:
        rows = [
            {"batch_id": batch.id, "index": i, "custom_id": c, "body": job_body(b), "job_id": uuid.uuid4().hex}
            | {"state": PENDING}
            for i, (c, b) in enumerate(requests)
        ]
        s.execute(BatchRequest.__table__.insert(), rows)
        batch.status, batch.in_progress_at = "in_progress", time.time()

    def fail(self, batch_id: str, errors: list[dict[str, Any]]) -> None:
        with self.session.begin() as s:
            batch = s.get(Batch, batch_id, with_for_update=True)
            if batch is not None and batch.status == "validating":
                batch.status, batch.failed_at, batch.errors = "failed", time.time(), errors

    def get(self, tenant: str, batch_id: str, protocol: str) -> Batch | None:
        with self.session() as s:
            return _owned(s.get(Batch, batch_id), tenant, protocol)

    def list(self, tenant: str, protocol: str, after: str | None, limit: int) -> tuple[list[Batch], bool]:
        """A page of the tenant's batches, newest first, after the batch `after`; and whether more follow."""
        with self.session() as s:
            query = select(Batch).where(Batch.tenant == tenant, Batch.protocol == protocol)
            if after and (cursor := s.get(Batch, after)) is not None:
                query = query.where(Batch.created_at < cursor.created_at)
            rows = list(s.scalars(query.order_by(Batch.created_at.desc()).limit(limit + 1)))
        return rows[:limit], len(rows) > limit

    def cancel(self, tenant: str, batch_id: str, protocol: str) -> Batch | None:
        """Ask a batch to stop: cancelling (the runner cancels what runs and ends it). One that
        has ended stays as it is."""
        with self.session.begin() as s:
            batch = _owned(s.get(Batch, batch_id, with_for_update=True), tenant, protocol)
            if batch is None:
                return None
            if batch.status in ("validating", "in_progress"):
                batch.status, batch.cancelling_at = "cancelling", time.time()
            return batch

    def delete(self, tenant: str, batch_id: str, protocol: str) -> Batch | None:
        with self.session.begin() as s:
            batch = _owned(s.get(Batch, batch_id), tenant, protocol)
            if batch is not None and batch.status in ENDED:
                s.delete(batch)  # its requests go with it (ON DELETE CASCADE)
            return batch

    def counts(self, batch_id: str) -> dict[str, int]:
        """How many of the batch's requests are in each state."""
        with self.session() as s:
            query = (
                select(BatchRequest.state, func.count())
                .where(BatchRequest.batch_id == batch_id)
                .group_by(BatchRequest.state)
            )
            return {state: count for state, count in s.execute(query)}

    def results(self, batch_id: str, chunk: int = 500) -> Iterator[tuple[BatchRequest, Job | None]]:
        """Every request that has ended, with its job, in the order of the batch."""
        last = -1
        while True:
            with self.session() as s:
                query = (
                    select(BatchRequest, Job)
                    .outerjoin(Job, Job.id == BatchRequest.job_id)
                    .where(
                        BatchRequest.batch_id == batch_id,
                        BatchRequest.index > last,
                        BatchRequest.state.in_((SUCCEEDED, ERRORED, CANCELED, EXPIRED)),
                    )
                    .order_by(BatchRequest.index)
                    .limit(chunk)
                )
                rows = s.execute(query).all()
            yield from rows
            if len(rows) < chunk:
                return
            last = rows[-1][0].index


def _owned(batch: Batch | None, tenant: str, protocol: str) -> Batch | None:
    """The batch, if it is this tenant's and of this protocol (another's is as good as none)."""
    return batch if batch is not None and batch.tenant == tenant and batch.protocol == protocol else None


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
