"""The HTTP front door: OpenAI Chat Completions and Responses, Anthropic Messages.

A call becomes a job: the gateway produces the request to `requests` and waits for the job's
messages on `results`, answering with the complete body or streaming the events as
Server-Sent Events while they arrive. Protocol work (validation of the body, rendering,
parsing the output) happens in the tokenizer service; the gateway only frames it.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from common import metrics
from common.api import (
    ENDPOINTS,
    BadRequest,
    completion_prompts,
    frame,
    merge_completions,
    parse_object,
    protocol_problem,
    result_frames,
    server_error_kind,
    tenancy_problem,
)
from common.bus import Bus, MemoryBus
from common.messages import ResultPayload
from common.replicas import ReplicaTable
from common.responses import queued as queued_response
from common.responses import queued_job_problem
from common.topics import Topic, topic_name
from common.tracing import Span, http_telemetry, job_span, start_span
from gateway import schemas
from gateway.admission import Admission
from gateway.batch_api import batch_routes
from gateway.batch_runner import BatchRunner, BatchRunnerThread
from gateway.batch_store import BatchStore
from gateway.dispatch import Dispatcher
from gateway.files import FileStore
from gateway.http import Refused, protocol_error, read_body
from gateway.jobs import FINAL, JobStore
from gateway.keys import KeyStore
from gateway.ledger import Ledger, day_of
from gateway.quotas import Decision, MemoryQuotas, RedisQuotas, estimate_tokens
from gateway.responses_api import StoredResponses, response_routes
from gateway.results import JobRecorder, ResultRouter

JSON_MEDIA_TYPE = re.compile(r"application/(.+\+)?json", re.IGNORECASE)


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


def endpoint_of(request: Request) -> str:
    """Whose error shape a call gets: Anthropic's under /v1/messages, OpenAI's elsewhere."""
    return "messages" if request.url.path.startswith("/v1/messages") else "chat.completions"


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


def create_app(
    bus: Bus,
    topic_prefix: str,
    served_models: list[str],
    jobs: JobStore,
    result_timeout: float = 600.0,
    cache_stats: Callable[[], dict] | None = None,
    replicas: ReplicaTable | None = None,
    admission_wait_seconds: float = 30.0,
    files_dir: str = ".cache/files",
    batch_rounds: float | None = None,
    batch_in_flight: int = 64,
    require_keys: bool = False,
    quotas: MemoryQuotas | RedisQuotas | None = None,
    responses_keep_seconds: float = 30 * 86400,
) -> FastAPI:
    """The API over the bus. `cache_stats`: the embedded mode's KV cache statistics, which the
    gateway then serves at GET /v1/cache/stats (distributed, the cache service serves them).
    `replicas`: the replicas' load reports, by which a call that no replica could start within
    `admission_wait_seconds` is refused with a 429 (gateway/admission.py); None: every call is
    queued. `files_dir`: uploaded and batch output files. `batch_rounds`: run the batch runner
    in this process, a round every so many seconds (embedded; distributed, Celery runs it).
    `require_keys`: every /v1 call needs an API key (gateway/keys.py), which decides its tenant
    and its rate limits, counted in `quotas` (Redis across replicas; in memory by default).
    `responses_keep_seconds`: how long a stored response (Responses' `store`) is kept."""
    admission = Admission(replicas, admission_wait_seconds) if replicas is not None else None
    results_topic = topic_name(Topic.RESULTS, topic_prefix)
    router = ResultRouter(bus, results_topic, group=f"{topic_prefix}gateway-{uuid.uuid4().hex[:12]}")
    dispatcher = Dispatcher(bus, topic_prefix)
    files = FileStore(jobs.session, files_dir) if jobs is not None else None
    batches = BatchStore(jobs.session) if jobs is not None else None
    keys = KeyStore(jobs.session) if jobs is not None else None
    ledger = Ledger(jobs.session) if jobs is not None else None
    stored_responses = StoredResponses(jobs, responses_keep_seconds) if jobs is not None else None
    recorder = JobRecorder(bus, results_topic, group=f"{topic_prefix}gateway-jobs", store=jobs, ledger=ledger)
    quotas = quotas if quotas is not None else MemoryQuotas()
    stop_batches = threading.Event()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await asyncio.to_thread(router.start)
        recorder.start()
        if batch_rounds is not None:
            # the in-process bus keeps nothing across a restart: the runner sends again what was in it
            runner = BatchRunner(
                jobs, files, dispatcher.send, dispatcher.cancel, batch_in_flight, resend_sent=isinstance(bus, MemoryBus)
            )
            BatchRunnerThread(runner, batch_rounds, stop_batches).start()
        yield
        stop_batches.set()
        await asyncio.to_thread(recorder.stop)
        await asyncio.to_thread(router.stop)

    def authenticate(request: Request) -> None:
        """Every /v1 call: with keys required, the key in `Authorization: Bearer KEY` (OpenAI)
        or `x-api-key: KEY` (Anthropic) must be one of ours and not revoked; it decides the
        call's tenant and rate limits. Without, keys are not read (clients send placeholders)."""
        request.state.key = None
        if not require_keys or not request.url.path.startswith("/v1/"):
            return
        shape = endpoint_of(request)
        scheme, _, token = (request.headers.get("authorization") or "").partition(" ")
        secret = request.headers.get("x-api-key") or (token.strip() if scheme.lower() == "bearer" else "")
        unauthorized = "authentication_error" if shape == "messages" else "invalid_request_error"
        if not secret:
            message = "an API key is required: send Authorization: Bearer KEY or x-api-key: KEY"
            raise Refused(protocol_error(shape, 401, message, unauthorized))
        key = keys.lookup(secret)
        if key is None:
            raise Refused(protocol_error(shape, 401, "invalid API key", unauthorized))
        if key.revoked_at is not None:
            raise Refused(protocol_error(shape, 403, "this API key has been revoked", "permission_error"))
        request.state.key = key

    app = FastAPI(
        title="deepmesh",
        version="0.1.0",
        lifespan=lifespan,
        telemetry=http_telemetry(),
        dependencies=[Depends(authenticate)],
    )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        """An unknown path or method, in the protocol's error shape (not FastAPI's `detail`)."""
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(err.status_code, "invalid_request_error")
        response = protocol_error(endpoint_of(request), err.status_code, str(err.detail), kind)
        response.headers.update(err.headers or {})
        return response

    @app.exception_handler(RequestValidationError)
    async def bad_parameters(request: Request, err: RequestValidationError) -> JSONResponse:
        """A path or query parameter of the wrong type, in the protocol's shape (not FastAPI's 422)."""
        problem = err.errors()[0] if err.errors() else {"loc": (), "msg": "invalid"}
        where = ".".join(str(part) for part in problem["loc"])
        return protocol_error(endpoint_of(request), 400, f"{where}: {problem['msg']}")

    @app.exception_handler(Refused)
    async def refused(request: Request, err: Refused) -> JSONResponse:
        return err.response

    @app.exception_handler(Exception)
    async def unexpected(request: Request, err: Exception) -> JSONResponse:
        """A fault of ours still answers in the protocol's shape, and the connection stays usable."""
        endpoint = endpoint_of(request)
        return protocol_error(endpoint, 500, "internal error", server_error_kind(endpoint))

    async def read_object(endpoint: str, request: Request) -> dict | Response:
        """The JSON object in the request, or the protocol's error response (common/api.py)."""
        media_type = request.headers.get("content-type", "").split(";")[0].strip()
        if not JSON_MEDIA_TYPE.fullmatch(media_type):
            return protocol_error(endpoint, 415, f"Content-Type must be application/json, not {media_type!r}")
        try:
            return parse_object(await read_body(request))
        except BadRequest as err:
            return protocol_error(endpoint, err.status, str(err))

    def cache_options(endpoint: str, request: Request, body: dict) -> dict | Response:
        """The tenant and retention class the request names, or the protocol's error. The class
        comes from the X-DeepMesh-Retention header or the body's `"deepmesh": {"retention": ...}`
        (taken out of the body: it is not part of the protocol). A call with an API key is its tenant's."""
        tenant, retention = request.headers.get("x-deepmesh-tenant"), request.headers.get("x-deepmesh-retention")
        if request.state.key is not None:
            tenant = request.state.key.tenant
        extension = body.pop("deepmesh", None)
        if extension is not None:
            if not isinstance(extension, dict) or set(extension) - {"retention"}:
                return protocol_error(endpoint, 400, 'the "deepmesh" field is an object with one key, "retention"')
            if retention is not None and extension.get("retention") not in (None, retention):
                return protocol_error(endpoint, 400, "the retention header and body field disagree")
            retention = retention or extension.get("retention")
        problem = tenancy_problem(tenant, retention)
        if problem is not None:
            return protocol_error(endpoint, 400, problem)
        return {"tenant": tenant or "default", "retention": retention}

    def tenant_of(request: Request, shape: str) -> str:
        """The caller's tenant (its API key's; else the X-DeepMesh-Tenant header; "default"
        without one), or Refused."""
        if request.state.key is not None:
            return request.state.key.tenant
        tenant = request.headers.get("x-deepmesh-tenant")
        if problem := tenancy_problem(tenant, None):
            raise Refused(protocol_error(shape, 400, problem))
        return tenant or "default"

    app.include_router(batch_routes(files, batches, tenant_of))
    app.include_router(response_routes(stored_responses, tenant_of, lambda job_id: dispatcher.cancel(job_id, None)))

    async def take_quota(request: Request, endpoint: str, body: dict) -> Decision | Response | None:
        """Count the call against its API key's limits: the decision, a 429 in the protocol's
        shape with the rate-limit headers, or None (no key, or a key without limits)."""
        key = request.state.key
        if key is None or (key.rpm is None and key.tpm is None):
            return None
        tokens = estimate_tokens(int(request.headers.get("content-length") or 0), body)
        decision = await asyncio.to_thread(quotas.admit, key.id, key.rpm, key.tpm, tokens)
        request.state.quota = (decision, tokens)
        if decision.admitted:
            return decision
        message = f"this API key's rate limit is reached; retry in {decision.headers(False)['retry-after']} s"
        response = protocol_error(endpoint, 429, message, "rate_limit_error")
        response.headers.update(decision.headers(endpoint == "messages"))
        return response

    def settle_quota(request: Request, *results: ResultPayload) -> None:
        """Correct the minute a call was counted in to the tokens its jobs used (estimated until now)."""
        taken = getattr(request.state, "quota", None)
        if taken is None or any(result.usage is None for result in results):
            return
        decision, estimate = taken
        used = sum(
            u.cached_input_tokens + u.uncached_input_tokens + u.output_tokens for u in (r.usage for r in results)
        )
        asyncio.get_running_loop().run_in_executor(
            None, quotas.settle, request.state.key.id, decision.window, used - estimate
        )

    async def enqueue(job_id: str, endpoint: str, body: dict, parent: Span, options: dict) -> None:
        try:
            await asyncio.to_thread(dispatcher.send, job_id, endpoint, body, options, parent)
        except Exception as err:  # kafka-python's errors, a timeout: the broker did not take it
            raise QueueUnavailable(str(err)) from err

    async def serve(endpoint: str, request: Request, count_only: bool = False) -> Response:
        call = _Call.begin(endpoint)
        try:
            response = await answer(call, request, count_only)
        except BaseException:
            call.end(500)
            raise
        if not isinstance(response, StreamingResponse):
            call.end(response.status_code)
        taken = getattr(request.state, "quota", None)
        if taken is not None and response.status_code != 429:
            response.headers.update(taken[0].headers(endpoint == "messages"))
        return response

    def cancel_soon(job_id: str, parent: Span) -> None:
        """Cancel the job without waiting: usable where the call itself is being cancelled."""
        asyncio.get_running_loop().run_in_executor(None, dispatcher.cancel, job_id, parent)

    async def next_result(queue: asyncio.Queue, gone: asyncio.Task) -> ResultPayload:
        """The job's next results message; ClientGone if the client leaves first, TimeoutError
        after result_timeout."""
        get = asyncio.ensure_future(queue.get())
        done, _ = await asyncio.wait({get, gone}, timeout=result_timeout, return_when=asyncio.FIRST_COMPLETED)
        if get in done:
            return get.result()
        get.cancel()
        raise ClientGone() if gone in done else TimeoutError()

    async def answer(call: _Call, request: Request, count_only: bool = False) -> Response:
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
            if admission is not None and (retry_after := admission.retry_after(size)) is not None:
                return too_busy(endpoint, retry_after)
            if isinstance(quota := await take_quota(request, endpoint, body), Response):
                return quota
        if endpoint == "completions" and len(each := completion_prompts(body)) > 1:
            return await answer_each(call, request, each, options)
        # Responses' state: the previous response's conversation first, this one stored (common/responses.py)
        stored, background = False, endpoint == "responses" and bool(body.get("background"))
        if endpoint == "responses" and not count_only and stored_responses is not None:
            prepared = await asyncio.to_thread(stored_responses.prepare, job_id, body, options["tenant"])
            if isinstance(prepared, Response):
                return prepared
            body, stored = prepared
        # an answer stored as it runs: its outcome stored by the time the client has it
        keep = stored_responses.finish if stored and not background else None
        queue = router.watch(job_id)
        gone = asyncio.create_task(client_gone(request))
        streaming = False
        try:
            await enqueue(job_id, endpoint, body, call.span, options)
            if background and not body.get("stream"):  # the client polls, cancels or streams it later
                return JSONResponse(queued_response(job_id, body))
            result = await next_result(queue, gone)
            call.first_event()
            if result.done and result.status != 200:
                if keep is not None:
                    await asyncio.to_thread(keep, job_id, result)
                return error_response(endpoint, result)
            if body.get("stream"):
                streaming = True  # from here the stream watches the client (Starlette) and owns the job
                return StreamingResponse(
                    sse(call, result, queue, request, keep, detached=background),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                )
            while not result.done:
                result = queue.get_nowait() if not queue.empty() else await next_result(queue, gone)
            settle_quota(request, result)
            if keep is not None:
                await asyncio.to_thread(keep, job_id, result)
            return JSONResponse(result.body, status_code=result.status)
        except QueueUnavailable:
            if stored:  # not accepted after all: nothing stays stored that nothing will answer
                await asyncio.to_thread(jobs.delete, job_id)
            return queue_unavailable(endpoint)
        except TimeoutError:
            abandon(call, stored, background)
            return protocol_error(endpoint, 504, "no result in time", "timeout_error")
        except ClientGone:
            abandon(call, stored, background)  # nobody is waiting for the rest: stop computing it
            return Response(status_code=499)  # never sent; counted as nginx's "client closed request"
        finally:
            gone.cancel()
            if not streaming:
                router.forget(job_id)

    def abandon(call: _Call, stored: bool, background: bool) -> None:
        """Nobody waits for the job's answer any more: cancel it, unless it runs in the background."""
        if background:
            return
        cancel_soon(call.job_id, call.span)
        if stored:
            asyncio.get_running_loop().run_in_executor(None, jobs.cancel, call.job_id)

    async def answer_each(call: _Call, request: Request, bodies: list[dict], options: dict) -> Response:
        """A Completions request with a list of prompts: a job per prompt, run together, answered
        together once every one has ended (the first error, if one fails, and the rest cancelled)."""
        endpoint = call.endpoint
        job_ids = [call.job_id, *(uuid.uuid4().hex for _ in bodies[1:])]
        queues = [router.watch(job_id) for job_id in job_ids]
        gone = asyncio.create_task(client_gone(request))

        async def last_result(queue: asyncio.Queue) -> ResultPayload:
            result = await next_result(queue, gone)
            while not result.done:
                result = await next_result(queue, gone)
            return result

        finished: list[ResultPayload] = []
        waiting: list[asyncio.Future[ResultPayload]] = []
        try:
            for job_id, body in zip(job_ids, bodies, strict=True):
                await enqueue(job_id, endpoint, body, call.span, options)
            waiting = [asyncio.ensure_future(last_result(queue)) for queue in queues]
            for arrived in asyncio.as_completed(waiting):
                result = await arrived
                finished.append(result)
                if result.status != 200:
                    return error_response(endpoint, result)
            call.first_event()
            results = [task.result() for task in waiting]
            settle_quota(request, *results)
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
                    cancel_soon(job_id, call.span)
            for job_id in job_ids:
                router.forget(job_id)

    async def sse(
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
        try:
            while True:
                if arrived[-1].done and keep is not None:
                    await asyncio.to_thread(keep, call.job_id, arrived[-1])
                yield result_frames(arrived)
                if arrived[-1].done:
                    settle_quota(request, arrived[-1])
                    return
                arrived = [await asyncio.wait_for(queue.get(), timeout=result_timeout)]
                while not arrived[-1].done and not queue.empty():
                    arrived.append(queue.get_nowait())
        finally:
            if not arrived[-1].done:  # the client left, or no result came in time
                abandon(call, keep is not None, detached)
            router.forget(call.job_id)
            call.end(200)

    @app.post("/v1/chat/completions", openapi_extra=schemas.request_body("ChatCompletionRequest"))
    async def chat_completions(request: Request) -> Response:
        return await serve("chat.completions", request)

    @app.post("/v1/responses", openapi_extra=schemas.request_body("ResponsesRequest"))
    async def responses(request: Request) -> Response:
        return await serve("responses", request)

    @app.post("/v1/completions", openapi_extra=schemas.request_body("CompletionRequest"))
    async def completions(request: Request) -> Response:
        """OpenAI's legacy Completions: a raw prompt, no chat template (tokenizer_svc/completions.py)."""
        return await serve("completions", request)

    @app.post("/v1/messages", openapi_extra=schemas.request_body("MessagesRequest"))
    async def messages(request: Request) -> Response:
        return await serve("messages", request)

    @app.post("/v1/messages/count_tokens", openapi_extra=schemas.request_body("MessageCountTokensRequest"))
    async def count_tokens(request: Request) -> Response:
        """Anthropic's token count: the prompt tokens the same Messages request would report."""
        return await serve("messages", request, count_only=True)

    @app.post("/v1/jobs", status_code=202, openapi_extra=schemas.request_body("JobRequest"))
    async def submit_job(request: Request) -> Response:
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
        if isinstance(quota := await take_quota(request, "jobs", body), Response):
            return quota
        job_id = uuid.uuid4().hex
        with job_span("submit job", job_id, **{"deepmesh.endpoint": endpoint}) as span:
            job = await asyncio.to_thread(
                jobs.create, job_id, endpoint, {**body, "stream": False}, tenant=options["tenant"]
            )
            try:
                await enqueue(job_id, endpoint, {**body, "stream": False}, span, options)
            except QueueUnavailable:  # not accepted after all: no job stays queued that nothing will run
                await asyncio.to_thread(jobs.delete, job_id)
                return queue_unavailable("jobs")
        metrics.JOBS_SUBMITTED.labels(endpoint).inc()
        return JSONResponse(job.to_api(), status_code=202)

    @app.get("/v1/jobs/{job_id}")
    async def get_job(job_id: str) -> Response:
        job = await asyncio.to_thread(jobs.get, job_id)
        if job is None:
            return protocol_error("jobs", 404, f"no job {job_id}", "not_found_error")
        return JSONResponse(job.to_api())

    @app.delete("/v1/jobs/{job_id}")
    async def cancel_job(job_id: str) -> Response:
        job = await asyncio.to_thread(jobs.cancel, job_id)
        if job is None:
            return protocol_error("jobs", 404, f"no job {job_id}", "not_found_error")
        if job.status == "cancelled":
            await asyncio.to_thread(dispatcher.cancel, job_id, None)
        return JSONResponse(job.to_api())

    @app.get("/v1/jobs/{job_id}/events")
    async def job_events(job_id: str) -> Response:
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

    if cache_stats is not None:

        @app.get("/v1/cache/stats")
        async def stats_of_the_cache() -> dict:
            return await asyncio.to_thread(cache_stats)

    @app.get("/v1/usage")
    async def usage(request: Request, start: str | None = None, end: str | None = None) -> Response:
        """The caller's tenant's usage per model, day (UTC) and priority, from `start` to `end`
        (YYYY-MM-DD, inclusive; both default to today)."""
        tenant = tenant_of(request, "jobs")
        today = day_of(time.time())
        start, end = start or today, end or today
        if not all(re.fullmatch(r"\d{4}-\d{2}-\d{2}", day) for day in (start, end)):
            return protocol_error("jobs", 400, "start and end are days: YYYY-MM-DD")
        rows = await asyncio.to_thread(ledger.report, start, end, tenant)
        return JSONResponse({"object": "list", "tenant": tenant, "start": start, "end": end, "data": rows})

    @app.get("/v1/models")
    async def models() -> dict:
        return {
            "object": "list",
            "data": [{"id": name, "object": "model", "created": 0, "owned_by": "deepmesh"} for name in served_models],
        }

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/readyz")
    async def readyz() -> Response:
        ready = router.ready.is_set()
        return JSONResponse({"ready": ready}, status_code=200 if ready else 503)

    def openapi() -> dict:
        """FastAPI's document, with the protocols' request bodies (gateway/schemas.py)."""
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, routes=app.routes)
            document.setdefault("components", {}).setdefault("schemas", {}).update(schemas.components())
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
