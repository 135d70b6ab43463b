"""Answering a protocol call: the call becomes a job on the bus, and the gateway waits for the
job's messages on `results`, answering with the complete body or streaming the events as
Server-Sent Events while they arrive. A client that leaves, or a call that ends early,
cancels the jobs nobody waits for any more.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from common import metrics
from common.api import completion_prompts, merge_completions, protocol_problem, result_frames, server_error_kind
from common.messages import ResultPayload
from common.responses import queued as queued_response
from common.tracing import Span, start_span
from gateway.auth import cache_options
from gateway.http import protocol_error, read_object
from gateway.rate_limits import settle_quota, take_quota
from gateway.state import GatewayState


@dataclass
class _Call:
    """One API call, from request to last byte (streams outlive the HTTP handler): its span, its metrics."""

    endpoint: str
    job_id: str
    span: Span
    started: float = field(default_factory=time.perf_counter)
    first_event_seen: bool = False
    ended: bool = False

    @classmethod
    def begin(cls, endpoint: str) -> _Call:
        job_id = uuid.uuid4().hex
        span = start_span(f"answer {endpoint}", job_id, **{"deepmesh.endpoint": endpoint})
        metrics.IN_FLIGHT.labels(endpoint).inc()
        return cls(endpoint, job_id, span)

    def first_event(self) -> None:
        if not self.first_event_seen:
            self.first_event_seen = True
            metrics.TTFT_SECONDS.labels(self.endpoint).observe(time.perf_counter() - self.started)

    def end(self, status: int) -> None:
        if self.ended:
            return
        self.ended = True
        metrics.IN_FLIGHT.labels(self.endpoint).dec()
        metrics.REQUESTS.labels(self.endpoint, str(status)).inc()
        metrics.REQUEST_SECONDS.labels(self.endpoint).observe(time.perf_counter() - self.started)
        self.span.set_attribute("http.response.status_code", status)
        self.span.end()


class QueueUnavailable(Exception):
    """The request could not be put on the bus (the broker is away): the client may retry."""


class ClientGone(Exception):
    """The client hung up before its answer was complete (a client that times out hangs up too)."""


async def client_gone(request: Request) -> None:
    """Returns when the client disconnects; its request body has been read by then."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def queue_unavailable(endpoint: str) -> JSONResponse:
    """503 with Retry-After: nothing was accepted, so a retry is safe."""
    message = "the request queue is unavailable; retry shortly"
    response = protocol_error(endpoint, 503, message, server_error_kind(endpoint))
    response.headers["Retry-After"] = "1"
    return response


def too_busy(endpoint: str, retry_after: int) -> JSONResponse:
    """429 with Retry-After: no replica could start the request within the admission bound."""
    message = f"every replica is busy beyond the admission bound; retry in {retry_after} s"
    response = protocol_error(endpoint, 429, message, "rate_limit_error")
    response.headers["Retry-After"] = str(retry_after)
    return response


def error_response(endpoint: str, result: ResultPayload) -> JSONResponse:
    body = result.body or {}
    if endpoint == "messages" and "type" not in body:  # the recipe reports errors in OpenAI's shape
        error = body.get("error", {})
        return protocol_error(endpoint, result.status, error.get("message", "error"), error.get("type", "api_error"))
    return JSONResponse(body, status_code=result.status)


async def enqueue(state: GatewayState, job_id: str, endpoint: str, body: dict, parent: Span, options: dict) -> None:
    try:
        request = state.dispatcher.request(job_id, endpoint, body, options)
        if state.bus.produce_waits(len(request)):
            await asyncio.to_thread(state.dispatcher.produce, job_id, request, parent)
        else:  # the in-process bus: on the loop, a thread hop less before the job is on its way
            state.dispatcher.produce(job_id, request, parent)
    except Exception as err:  # kafka-python's errors, a timeout: the broker did not take it
        raise QueueUnavailable(str(err)) from err


def cancel_soon(state: GatewayState, job_id: str, parent: Span) -> None:
    """Cancel the job without waiting: usable where the call itself is being cancelled."""
    asyncio.get_running_loop().run_in_executor(None, state.dispatcher.cancel, job_id, parent)


def abandon(state: GatewayState, call: _Call, stored: bool, background: bool) -> None:
    """Nobody waits for the job's answer any more: cancel it, unless it runs in the background."""
    if background:
        return
    cancel_soon(state, call.job_id, call.span)
    if stored:
        asyncio.get_running_loop().run_in_executor(None, state.jobs.cancel, call.job_id)


async def next_result(state: GatewayState, queue: asyncio.Queue, gone: asyncio.Task) -> ResultPayload:
    """The job's next results message; ClientGone if the client leaves first, TimeoutError
    after result_timeout."""
    get = asyncio.ensure_future(queue.get())
    done, _ = await asyncio.wait({get, gone}, timeout=state.result_timeout, return_when=asyncio.FIRST_COMPLETED)
    if get in done:
        return get.result()
    get.cancel()
    raise ClientGone() if gone in done else TimeoutError()


async def serve(state: GatewayState, endpoint: str, request: Request, count_only: bool = False) -> Response:
    """A protocol endpoint's handler: the call's answer, measured and traced, with the
    rate-limit headers of the key it was counted against."""
    call = _Call.begin(endpoint)
    try:
        response = await answer(state, call, request, count_only)
    except BaseException:
        call.end(500)
        raise
    if not isinstance(response, StreamingResponse):
        call.end(response.status_code)
    taken = getattr(request.state, "quota", None)
    if taken is not None and response.status_code != 429:
        response.headers.update(taken[0].headers(endpoint == "messages"))
    return response


async def answer(state: GatewayState, call: _Call, request: Request, count_only: bool = False) -> Response:
    """A protocol call's answer; `count_only`: the prompt's token count (the tokenizer answers)."""
    endpoint, job_id = call.endpoint, call.job_id
    body = await read_object(endpoint, request)
    if isinstance(body, Response):
        return body
    options = cache_options(endpoint, request, body)
    if isinstance(options, Response):
        return options
    if count_only:  # no engine time, no tokens used: neither admission nor quotas apply
        options["count_only"] = True
        body.pop("stream", None)
        body.setdefault("max_tokens", 1)  # a count's body has none; the Messages request it counts does
    else:
        if problem := protocol_problem(endpoint, body):
            return protocol_error(endpoint, 400, problem)
        size = int(request.headers.get("content-length") or 0)
        if state.admission is not None and (retry_after := state.admission.retry_after(size)) is not None:
            return too_busy(endpoint, retry_after)
        if isinstance(quota := await take_quota(state.quotas, request, endpoint, body), Response):
            return quota
    if endpoint == "completions" and len(each := completion_prompts(body)) > 1:
        return await answer_each(state, call, request, each, options)
    # Responses' state: the previous response's conversation first, this one stored (common/responses.py)
    stored, background = False, endpoint == "responses" and bool(body.get("background"))
    if endpoint == "responses" and not count_only and state.stored_responses is not None:
        prepared = await asyncio.to_thread(state.stored_responses.prepare, job_id, body, options["tenant"])
        if isinstance(prepared, Response):
            return prepared
        body, stored = prepared
    # an answer stored as it runs: its outcome stored by the time the client has it
    keep = state.stored_responses.finish if stored and not background else None
    queue = state.router.watch(job_id)
    if not stored and not background:  # no job row: nothing of its results to record
        state.recorder.ignore(job_id)
    gone = asyncio.create_task(client_gone(request))
    streaming = False
    try:
        await enqueue(state, job_id, endpoint, body, call.span, options)
        if background and not body.get("stream"):  # the client polls, cancels or streams it later
            return JSONResponse(queued_response(job_id, body))
        result = await next_result(state, queue, gone)
        call.first_event()
        if result.done and result.status != 200:
            if keep is not None:
                await asyncio.to_thread(keep, job_id, result)
            return error_response(endpoint, result)
        if body.get("stream"):
            streaming = True  # from here the stream watches the client (Starlette) and owns the job
            return StreamingResponse(
                sse(state, call, result, queue, request, keep, detached=background),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        while not result.done:
            result = queue.get_nowait() if not queue.empty() else await next_result(state, queue, gone)
        settle_quota(state.quotas, request, result)
        if keep is not None:
            await asyncio.to_thread(keep, job_id, result)
        return JSONResponse(result.body, status_code=result.status)
    except QueueUnavailable:
        if stored:  # not accepted after all: nothing stays stored that nothing will answer
            await asyncio.to_thread(state.jobs.delete, job_id)
        return queue_unavailable(endpoint)
    except TimeoutError:
        abandon(state, call, stored, background)
        return protocol_error(endpoint, 504, "no result in time", "timeout_error")
    except ClientGone:
        abandon(state, call, stored, background)  # nobody is waiting for the rest: stop computing it
        return Response(status_code=499)  # never sent; counted as nginx's "client closed request"
    finally:
        gone.cancel()
        if not streaming:
            state.router.forget(job_id)


async def answer_each(
    state: GatewayState, call: _Call, request: Request, bodies: list[dict], options: dict
) -> Response:
    """A Completions request with a list of prompts: a job per prompt, run together, answered
    together once every one has ended (the first error, if one fails, and the rest cancelled)."""
    endpoint = call.endpoint
    job_ids = [call.job_id, *(uuid.uuid4().hex for _ in bodies[1:])]
    queues = [state.router.watch(job_id) for job_id in job_ids]
    for job_id in job_ids:  # no job rows: nothing of their results to record
        state.recorder.ignore(job_id)
    gone = asyncio.create_task(client_gone(request))

    async def last_result(queue: asyncio.Queue) -> ResultPayload:
        result = await next_result(state, queue, gone)
        while not result.done:
            result = await next_result(state, queue, gone)
        return result

    finished: list[ResultPayload] = []
    waiting: list[asyncio.Future[ResultPayload]] = []
    try:
        for job_id, body in zip(job_ids, bodies, strict=True):
            await enqueue(state, job_id, endpoint, body, call.span, options)
        waiting = [asyncio.ensure_future(last_result(queue)) for queue in queues]
        for arrived in asyncio.as_completed(waiting):
            result = await arrived
            finished.append(result)
            if result.status != 200:
                return error_response(endpoint, result)
        call.first_event()
        results = [task.result() for task in waiting]
        settle_quota(state.quotas, request, *results)
        return JSONResponse(merge_completions([result.body or {} for result in results]))
    except QueueUnavailable:
        return queue_unavailable(endpoint)
    except TimeoutError:
        return protocol_error(endpoint, 504, "no result in time", "timeout_error")
    except ClientGone:
        return Response(status_code=499)
    finally:
        gone.cancel()
        for task in waiting:  # those still waiting (an error, a client gone): nobody will read them
            task.cancel()
        if len(finished) < len(job_ids) or any(result.status != 200 for result in finished):
            for job_id in job_ids:
                cancel_soon(state, job_id, call.span)
        for job_id in job_ids:
            state.router.forget(job_id)


async def sse(
    state: GatewayState,
    call: _Call,
    result: ResultPayload,
    queue: asyncio.Queue,
    request: Request,
    keep: Callable[[str, ResultPayload], None] | None = None,
    detached: bool = False,
) -> AsyncIterator[bytes]:
    """Events as they arrive, each `event:` (when the protocol names it) and `data:`; what
    arrived together goes out in one write. A client that leaves mid-stream cancels the job,
    unless it is `detached` (a background response). `keep`: stores the outcome first."""
    arrived = [result]
    unfinished = 499  # how a stream that ends before its answer is counted: the client left
    try:
        while True:
            if arrived[-1].done and keep is not None:
                await asyncio.to_thread(keep, call.job_id, arrived[-1])
            yield result_frames(arrived)
            if arrived[-1].done:
                settle_quota(state.quotas, request, arrived[-1])
                return
            try:
                arrived = [await asyncio.wait_for(queue.get(), timeout=state.result_timeout)]
            except TimeoutError:
                unfinished = 504  # no result in time
                raise
            while not arrived[-1].done and not queue.empty():
                arrived.append(queue.get_nowait())
    finally:
        if not arrived[-1].done:  # the client left, or no result came in time
            abandon(state, call, keep is not None, detached)
        state.router.forget(call.job_id)
        call.end(200 if arrived[-1].done else unfinished)
