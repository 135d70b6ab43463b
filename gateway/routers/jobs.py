"""Async jobs: submit any protocol's request, poll it, replay its events, cancel it."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from common import metrics
from common.api import ENDPOINTS, frame, protocol_problem
from common.responses import queued_job_problem
from common.tracing import job_span
from gateway import schemas
from gateway.answers import QueueUnavailable, enqueue, queue_unavailable
from gateway.auth import cache_options
from gateway.http import protocol_error, read_object
from gateway.jobs import FINAL
from gateway.rate_limits import take_quota
from gateway.state import State

routes = APIRouter()


@routes.post("/v1/jobs", status_code=202, openapi_extra=schemas.request_body("JobRequest"))
async def submit_job(request: Request, state: State) -> Response:
    envelope = await read_object("jobs", request)
    if isinstance(envelope, Response):
        return envelope
    endpoint, body = envelope.get("endpoint"), envelope.get("body")
    if endpoint not in ENDPOINTS:
        return protocol_error("jobs", 400, f"endpoint must be one of {', '.join(ENDPOINTS)}")
    if not isinstance(body, dict):
        return protocol_error("jobs", 400, "body must be the JSON object of the request")
    options = cache_options("jobs", request, body)
    if isinstance(options, Response):
        return options
    if problem := protocol_problem(endpoint, body) or queued_job_problem(endpoint, body):
        return protocol_error("jobs", 400, problem)
    if isinstance(quota := await take_quota(state.quotas, request, "jobs", body), Response):
        return quota
    job_id = uuid.uuid4().hex
    with job_span("submit job", job_id, **{"deepmesh.endpoint": endpoint}) as span:
        job = await asyncio.to_thread(
            state.jobs.create, job_id, endpoint, {**body, "stream": False}, tenant=options["tenant"]
        )
        try:
            await enqueue(state, job_id, endpoint, {**body, "stream": False}, span, options)
        except QueueUnavailable:  # not accepted after all: no job stays queued that nothing will run
            await asyncio.to_thread(state.jobs.delete, job_id)
            return queue_unavailable("jobs")
    metrics.JOBS_SUBMITTED.labels(endpoint).inc()
    return JSONResponse(job.to_api(), status_code=202)


@routes.get("/v1/jobs/{job_id}")
async def get_job(job_id: str, state: State) -> Response:
    job = await asyncio.to_thread(state.jobs.get, job_id)
    if job is None:
        return protocol_error("jobs", 404, f"no job {job_id}", "not_found_error")
    return JSONResponse(job.to_api())


@routes.delete("/v1/jobs/{job_id}")
async def cancel_job(job_id: str, state: State) -> Response:
    job = await asyncio.to_thread(state.jobs.cancel, job_id)
    if job is None:
        return protocol_error("jobs", 404, f"no job {job_id}", "not_found_error")
    if job.status == "cancelled":
        await asyncio.to_thread(state.dispatcher.cancel, job_id, None)
    return JSONResponse(job.to_api())


@routes.get("/v1/jobs/{job_id}/events")
async def job_events(job_id: str, state: State) -> Response:
    jobs = state.jobs
    if await asyncio.to_thread(jobs.get, job_id) is None:
        return protocol_error("jobs", 404, f"no job {job_id}", "not_found_error")

    async def replay() -> AsyncIterator[bytes]:
        """Every event from the start, then new ones as they are stored, until the job ends."""
        last = -1
        while True:
            job = await asyncio.to_thread(jobs.get, job_id)
            for event in await asyncio.to_thread(jobs.events, job_id, last):
                yield frame(event.name, event.data).encode()
                last = event.seq
            if job.status in FINAL:
                if job.status == "succeeded" and job.done_data is not None:
                    yield frame(None, job.done_data).encode()
                yield frame(f"job.{job.status}", json.dumps(job.to_api())).encode()
                return
            await asyncio.sleep(0.1)

    return StreamingResponse(replay(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
