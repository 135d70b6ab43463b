"""Stored and background Responses: what POST /v1/responses stores, and the endpoints that read it.

A stored response is a job (gateway/jobs.py) of its caller's tenant, kept `keep_seconds`: a
background one keeps its events too, so that its stream can be resumed by `sequence_number`
(which is the event's index in the job's stream); one answered as it ran keeps its outcome.
The rules of the protocol are plain functions in common/responses.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from common import responses as rules
from common.api import frame
from common.messages import ResultPayload
from gateway.http import Refused, protocol_error
from gateway.jobs import FINAL, Job, JobStore

SHAPE = "responses"  # OpenAI's error body
TenantOf = Callable[[Request, str], str]


def not_found(response_id: str, what: str = "Response") -> JSONResponse:
    return protocol_error(SHAPE, 404, f"{what} with id '{response_id}' not found.", "invalid_request_error")


class StoredResponses:
    def __init__(self, jobs: JobStore, keep_seconds: float):
        self.jobs = jobs
        self.keep_seconds = keep_seconds

    def find(self, response_id: str, tenant: str) -> Job | None:
        """The job of a stored response of this tenant's, unless it has expired."""
        job_id = rules.job_id_of(response_id)
        job = self.jobs.get(job_id) if job_id is not None else None
        if job is None or job.endpoint != "responses" or job.tenant != tenant:
            return None
        if job.expires_at is not None and job.expires_at < time.time():
            return None
        return job

    def prepare(self, job_id: str, body: dict[str, Any], tenant: str) -> tuple[dict[str, Any], bool] | JSONResponse:
        """A Responses request about to run: the body to run (with `previous_response_id`, the
        previous conversation before its input) and whether it is stored (its job row is
        written now, before the request goes out), or the error."""
        if problem := rules.request_problem(body):
            return protocol_error(SHAPE, 400, problem)
        if (previous_id := body.get("previous_response_id")) is not None:
            previous = self.find(previous_id, tenant)
            if previous is None:
                return not_found(previous_id, "Previous response")
            if previous.status != "succeeded" or previous.result is None:
                status = rules.JOB_STATUS.get(previous.status, previous.status)
                return protocol_error(SHAPE, 400, f"Previous response '{previous_id}' is {status}, not completed")
            body = rules.continued(body, previous.body, previous.result)
        stored = body.get("store") is not False
        if stored:
            keep_events = bool(body.get("background"))
            self.jobs.create(
                job_id, "responses", body, tenant=tenant, keep_events=keep_events, keep_seconds=self.keep_seconds
            )
        return body, stored

    def finish(self, job_id: str, result: ResultPayload) -> None:
        """Store the outcome of a response answered as it ran (the job recorder may have already)."""
        self.jobs.record(job_id, 0, [], True, result.status, result.body, result.done_data)

    def answer(self, job: Job) -> dict[str, Any]:
        latest = self.jobs.last_event(job.id, rules.RESPONSE_EVENTS) if job.keep_events else None
        return rules.stored_response(
            job.id, job.status, job.body, job.result, json.loads(latest.data)["response"] if latest else None
        )


def response_routes(
    stored: StoredResponses | None, tenant_of: TenantOf, cancel_job: Callable[[str], None]
) -> APIRouter:
    """`cancel_job`: stop a job wherever it runs (a cancel on the bus)."""
    routes = APIRouter()

    async def find(request: Request, response_id: str) -> Job:
        if stored is None:
            raise Refused(not_found(response_id))
        job = await asyncio.to_thread(stored.find, response_id, tenant_of(request, SHAPE))
        if job is None:
            raise Refused(not_found(response_id))
        return job

    @routes.get("/v1/responses/{response_id}")
    async def retrieve(
        request: Request, response_id: str, stream: bool = False, starting_after: int | None = None
    ) -> Response:
        job = await find(request, response_id)
        if not stream:
            return JSONResponse(await asyncio.to_thread(stored.answer, job))
        if not job.keep_events:
            return protocol_error(SHAPE, 400, "only a background response's events are kept to stream again")
        return StreamingResponse(
            replay(job.id, -1 if starting_after is None else starting_after),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def replay(job_id: str, after: int) -> AsyncIterator[bytes]:
        """The events after `after` (a sequence_number), then new ones as they are stored,
        until the response ends."""
        while True:
            job = await asyncio.to_thread(stored.jobs.get, job_id)
            if job is None:  # deleted meanwhile
                return
            for event in await asyncio.to_thread(stored.jobs.events, job_id, after):
                yield frame(event.name, event.data).encode()
                after = event.seq
            if job.status in FINAL:
                if job.status == "failed":  # its error ended it before any event said so
                    error = rules.stored_response(job.id, job.status, job.body, job.result, None)["error"]
                    data = {"type": "error", **error, "param": None, "sequence_number": after + 1}
                    yield frame("error", json.dumps(data)).encode()
                return
            await asyncio.sleep(0.1)

    @routes.post("/v1/responses/{response_id}/cancel")
    async def cancel(request: Request, response_id: str) -> Response:
        job = await find(request, response_id)
        if not job.body.get("background"):
            return protocol_error(SHAPE, 400, "Only responses created with background=true can be cancelled.")
        job = await asyncio.to_thread(stored.jobs.cancel, job.id)
        if job is not None and job.status == "cancelled":
            await asyncio.to_thread(cancel_job, job.id)
        return JSONResponse(await asyncio.to_thread(stored.answer, job))

    @routes.delete("/v1/responses/{response_id}")
    async def delete(request: Request, response_id: str) -> Response:
        job = await find(request, response_id)
        if job.status not in FINAL:
            await asyncio.to_thread(cancel_job, job.id)
        await asyncio.to_thread(stored.jobs.delete, job.id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @routes.get("/v1/responses/{response_id}/input_items")
    async def input_items(
        request: Request, response_id: str, after: str | None = None, limit: int = 20, order: str = "desc"
    ) -> Response:
        job = await find(request, response_id)
        if not 1 <= limit <= 100 or order not in ("asc", "desc"):
            return protocol_error(SHAPE, 400, "limit is 1 to 100 and order asc or desc")
        items = rules.input_items(job.id, job.body)
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                return protocol_error(SHAPE, 400, f"no input item {after!r} in this response")
            items = items[ids.index(after) + 1 :]
        shown = items[:limit]
        first, last = (shown[0]["id"], shown[-1]["id"]) if shown else (None, None)
        page = {"object": "list", "data": shown, "first_id": first, "last_id": last, "has_more": len(items) > limit}
        return JSONResponse(page)

    return routes
