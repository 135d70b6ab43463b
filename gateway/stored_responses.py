"""Stored and background Responses: what POST /v1/responses stores, and how a stored one is read
(its endpoints: gateway/routers/responses.py).

A stored response is a job (gateway/jobs.py) of its caller's tenant, kept `keep_seconds`: a
background one keeps its events too, so that its stream can be resumed by `sequence_number`
(which is the event's index in the job's stream); one answered as it ran keeps its outcome.
The rules of the protocol are plain functions in common/responses.py.
"""

from __future__ import annotations

import json
import time
from typing import Any

from fastapi.responses import JSONResponse

from common import responses as rules
from common.messages import ResultPayload
from gateway.http import protocol_error
from gateway.jobs import Job, JobStore

SHAPE = "responses"  # OpenAI's error body


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
