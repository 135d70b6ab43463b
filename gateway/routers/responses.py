"""OpenAI's stored Responses: retrieve one (or stream its events again), cancel a background
one, delete one, list its input items. POST /v1/responses itself is in gateway/routers/openai.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from common import responses as rules
from common.api import frame
from gateway.auth import tenant_of
from gateway.http import Refused, protocol_error
from gateway.jobs import FINAL, Job, JobStore
from gateway.state import GatewayState, State
from gateway.stored_responses import SHAPE, not_found

routes = APIRouter()


async def find(state: GatewayState, request: Request, response_id: str) -> Job:
    """The caller's stored response, or Refused with the protocol's 404."""
    if state.stored_responses is None:
        raise Refused(not_found(response_id))
    job = await asyncio.to_thread(state.stored_responses.find, response_id, tenant_of(request, SHAPE))
    if job is None:
        raise Refused(not_found(response_id))
    return job


@routes.get("/v1/responses/{response_id}")
async def retrieve(
    request: Request, state: State, response_id: str, stream: bool = False, starting_after: int | None = None
) -> Response:
    job = await find(state, request, response_id)
    if not stream:
        return JSONResponse(await asyncio.to_thread(state.stored_responses.answer, job))
    if not job.keep_events:
        return protocol_error(SHAPE, 400, "only a background response's events are kept to stream again")
    return StreamingResponse(
        replay(state.stored_responses.jobs, job.id, -1 if starting_after is None else starting_after),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def replay(jobs: JobStore, job_id: str, after: int) -> AsyncIterator[bytes]:
    """The events after `after` (a sequence_number), then new ones as they are stored,
    until the response ends."""
    while True:
        job = await asyncio.to_thread(jobs.get, job_id)
        if job is None:  # deleted meanwhile
            return
        for event in await asyncio.to_thread(jobs.events, job_id, after):
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
async def cancel(request: Request, state: State, response_id: str) -> Response:
    job = await find(state, request, response_id)
    if not job.body.get("background"):
        return protocol_error(SHAPE, 400, "Only responses created with background=true can be cancelled.")
    job = await asyncio.to_thread(state.stored_responses.jobs.cancel, job.id)
    if job is not None and job.status == "cancelled":
        await asyncio.to_thread(state.dispatcher.cancel, job.id, None)  # stop it wherever it runs
    return JSONResponse(await asyncio.to_thread(state.stored_responses.answer, job))


@routes.delete("/v1/responses/{response_id}")
async def delete(request: Request, state: State, response_id: str) -> Response:
    job = await find(state, request, response_id)
    if job.status not in FINAL:
        await asyncio.to_thread(state.dispatcher.cancel, job.id, None)
    await asyncio.to_thread(state.stored_responses.jobs.delete, job.id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


@routes.get("/v1/responses/{response_id}/input_items")
async def input_items(
    request: Request, state: State, response_id: str, after: str | None = None, limit: int = 20, order: str = "desc"
) -> Response:
    job = await find(state, request, response_id)
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
