"""The HTTP front door: OpenAI Chat Completions and Responses, Anthropic Messages.

A call becomes a job: the gateway produces the request to `requests` and waits for the job's
messages on `results`, answering with the complete body or streaming the events as
Server-Sent Events while they arrive. Protocol work (validation of the body, rendering,
parsing the output) happens in the tokenizer service; the gateway only frames it.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from cache_svc.retention import request_error
from cache_svc.store import StateStore
from common import metrics
from common.bus import Bus
from common.messages import Envelope, RequestPayload, ResultPayload, decode
from common.topics import Topic, topic_name
from common.tracing import Span, SpanKind, headers_of, http_telemetry, job_span, start_span
from gateway.jobs import FINAL, JobStore

MAX_BODY_BYTES = 8 << 20


@dataclass
class _Watch:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    next_seq: int = 0


@dataclass
class ResultRouter:
    """Reads `results` on a thread and hands each job's messages, in order and once, to its waiter."""

    bus: Bus
    topic: str
    group: str  # one per gateway process
    _watches: dict[str, _Watch] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    ready: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="results-router", daemon=True)
        self._thread.start()
        if not self.ready.wait(timeout=60):
            raise RuntimeError("could not subscribe to the results topic")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def watch(self, job_id: str) -> asyncio.Queue:
        """Register interest before the request is produced, so no result can be missed."""
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._watches[job_id] = _Watch(asyncio.get_running_loop(), queue)
        return queue

    def forget(self, job_id: str) -> None:
        with self._lock:
            self._watches.pop(job_id, None)

    def _run(self) -> None:
        # only results produced from now on matter to this gateway
        consumer = self.bus.consumer([self.topic], self.group, from_beginning=False)
        try:
            consumer.wait_assigned(timeout=60)
            self.ready.set()
            while not self._stop.is_set():
                # a poll's results reach each event loop in one wake-up, not one per message
                batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, ResultPayload]]] = {}
                for record in consumer.poll(timeout=0.2):
                    self._route(record.value, batches)
                for loop, deliveries in batches.items():
                    loop.call_soon_threadsafe(_deliver, deliveries)
                consumer.commit()
        finally:
            consumer.close()

    def _route(self, raw: bytes, batches: dict) -> None:
        try:
            envelope = decode(raw, "result")
            result = ResultPayload.model_validate(envelope.payload)
        except ValueError:
            return  # not ours to judge: the topic is public, and producers own their records
        with self._lock:
            watch = self._watches.get(envelope.job_id)
            if watch is None or envelope.seq != watch.next_seq:
                return  # another gateway's job, or a replay of a message already delivered
            watch.next_seq += 1
        batches.setdefault(watch.loop, []).append((watch.queue, result))


def _deliver(deliveries: list[tuple[asyncio.Queue, ResultPayload]]) -> None:
    for queue, result in deliveries:
        queue.put_nowait(result)


@dataclass
class JobRecorder:
    """Stores the results of async jobs (status, events, outcome). One consumer group for all
    gateway replicas, so each results message is stored once; storing is idempotent anyway."""

    bus: Bus
    topic: str
    group: str  # shared by every gateway of the deployment
    store: JobStore
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    # Ids with nothing to record: synchronous calls (most of the traffic) and ended jobs. A job's
    # row is written before its request is produced, so one lookup per id settles it.
    _ignored: OrderedDict[str, None] = field(default_factory=OrderedDict)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="job-recorder", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        consumer = self.bus.consumer([self.topic], self.group)
        try:
            while not self._stop.is_set():
                for record in consumer.poll(timeout=0.2):
                    try:
                        envelope = decode(record.value, "result")
                        result = ResultPayload.model_validate(envelope.payload)
                    except ValueError:
                        continue
                    if envelope.job_id in self._ignored:
                        continue
                    events = [(e.name, e.data) for e in result.events]
                    if not self.store.record(
                        envelope.job_id, envelope.seq, events, result.done, result.status, result.body, result.done_data
                    ):
                        self._ignored[envelope.job_id] = None
                        if len(self._ignored) > 100_000:
                            self._ignored.popitem(last=False)
                consumer.commit()
        finally:
            consumer.close()


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


def protocol_error(endpoint: str, status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    """An error in the endpoint's own format: OpenAI's for chat and responses, Anthropic's for messages."""
    if endpoint == "messages":
        body = {"type": "error", "error": {"type": kind, "message": message}}
    else:
        body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
    return JSONResponse(body, status_code=status)


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
    cache: StateStore | None = None,
) -> FastAPI:
    """The API over the bus. `cache`: the embedded mode's KV cache, whose stats the gateway then
    serves at GET /v1/cache/stats (distributed, the cache service serves them itself)."""
    results_topic = topic_name(Topic.RESULTS, topic_prefix)
    router = ResultRouter(bus, results_topic, group=f"{topic_prefix}gateway-{uuid.uuid4().hex[:12]}")
    recorder = JobRecorder(bus, results_topic, group=f"{topic_prefix}gateway-jobs", store=jobs)
    requests_topic = topic_name(Topic.REQUESTS, topic_prefix)
    decode_topic = topic_name(Topic.DECODE, topic_prefix)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await asyncio.to_thread(router.start)
        recorder.start()
        yield
        await asyncio.to_thread(recorder.stop)
        await asyncio.to_thread(router.stop)

    app = FastAPI(title="deepmesh", version="0.1.0", lifespan=lifespan, telemetry=http_telemetry())

    async def read_object(endpoint: str, request: Request) -> dict | Response:
        """The JSON object in the request, or the protocol's error response."""
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            return protocol_error(endpoint, 413, f"request body larger than {MAX_BODY_BYTES} bytes")
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            return protocol_error(endpoint, 400, f"malformed JSON body: {err}")
        if not isinstance(body, dict):
            return protocol_error(endpoint, 400, "the request body must be a JSON object")
        return body

    def cache_options(endpoint: str, request: Request, body: dict) -> dict | Response:
        """The tenant and retention class the request names, or the protocol's error. The class
        comes from the X-DeepMesh-Retention header or the body's `"deepmesh": {"retention": ...}`
        (taken out of the body: it is not part of the protocol)."""
        tenant, retention = request.headers.get("x-deepmesh-tenant"), request.headers.get("x-deepmesh-retention")
        extension = body.pop("deepmesh", None)
        if extension is not None:
            if not isinstance(extension, dict) or set(extension) - {"retention"}:
                return protocol_error(endpoint, 400, 'the "deepmesh" field is an object with one key, "retention"')
            if retention is not None and extension.get("retention") not in (None, retention):
                return protocol_error(endpoint, 400, "the retention header and body field disagree")
            retention = retention or extension.get("retention")
        problem = request_error(tenant, retention)
        if problem is not None:
            return protocol_error(endpoint, 400, problem)
        return {"tenant": tenant or "default", "retention": retention}

    async def enqueue(job_id: str, endpoint: str, body: dict, parent: Span, options: dict) -> None:
        payload = RequestPayload(endpoint=endpoint, body=body, **options).model_dump()
        message = Envelope(type="request", job_id=job_id, payload=payload)
        with job_span("send requests", job_id, parent, SpanKind.PRODUCER) as span:
            headers = headers_of(span)
            await asyncio.to_thread(bus.produce, requests_topic, job_id, message.encode(), headers)

    async def serve(endpoint: str, request: Request) -> Response:
        call = _Call.begin(endpoint)
        try:
            response = await answer(call, request)
        except BaseException:
            call.end(500)
            raise
        if not isinstance(response, StreamingResponse):
            call.end(response.status_code)
        return response

    async def answer(call: _Call, request: Request) -> Response:
        endpoint, job_id = call.endpoint, call.job_id
        body = await read_object(endpoint, request)
        if isinstance(body, Response):
            return body
        options = cache_options(endpoint, request, body)
        if isinstance(options, Response):
            return options
        queue = router.watch(job_id)
        try:
            await enqueue(job_id, endpoint, body, call.span, options)
            first = await asyncio.wait_for(queue.get(), timeout=result_timeout)
        except TimeoutError:
            router.forget(job_id)
            return protocol_error(endpoint, 504, "no result in time", "timeout_error")
        call.first_event()
        if first.done and first.status != 200:
            router.forget(job_id)
            return error_response(endpoint, first)
        if body.get("stream"):
            return StreamingResponse(
                sse(call, first, queue),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        result = first
        try:
            while not result.done:
                result = await asyncio.wait_for(queue.get(), timeout=result_timeout)
        except TimeoutError:
            return protocol_error(endpoint, 504, "no result in time", "timeout_error")
        finally:
            router.forget(job_id)
        return JSONResponse(result.body, status_code=result.status)

    async def sse(call: _Call, result: ResultPayload, queue: asyncio.Queue) -> AsyncIterator[bytes]:
        """Events as they arrive, each `event:` (when the protocol names it) and `data:`; what
        arrived together goes out in one write."""
        try:
            arrived = [result]
            while True:
                frames = []
                for result in arrived:
                    for event in result.events:
                        name = f"event: {event.name}\n" if event.name else ""
                        frames.append(f"{name}data: {event.data}\n\n")
                    if result.done and result.done_data is not None:
                        frames.append(f"data: {result.done_data}\n\n")
                yield "".join(frames).encode()
                if result.done:
                    return
                arrived = [await asyncio.wait_for(queue.get(), timeout=result_timeout)]
                while not arrived[-1].done and not queue.empty():
                    arrived.append(queue.get_nowait())
        finally:
            router.forget(call.job_id)
            call.end(200)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve("chat.completions", request)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await serve("responses", request)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await serve("messages", request)

    @app.post("/v1/jobs", status_code=202)
    async def submit_job(request: Request) -> Response:
        envelope = await read_object("jobs", request)
        if isinstance(envelope, Response):
            return envelope
        endpoint, body = envelope.get("endpoint"), envelope.get("body")
        if endpoint not in ("chat.completions", "responses", "messages"):
            return protocol_error("jobs", 400, "endpoint must be one of chat.completions, responses, messages")
        if not isinstance(body, dict):
            return protocol_error("jobs", 400, "body must be the JSON object of the request")
        options = cache_options("jobs", request, body)
        if isinstance(options, Response):
            return options
        job_id = uuid.uuid4().hex
        with job_span("submit job", job_id, **{"deepmesh.endpoint": endpoint}) as span:
            job = await asyncio.to_thread(jobs.create, job_id, endpoint, {**body, "stream": False})
            await enqueue(job_id, endpoint, {**body, "stream": False}, span, options)
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
        if job.status == "cancelled":  # tell decode to stop and free the state, wherever the job is
            cancel = Envelope(type="cancel", job_id=job_id)
            with job_span("cancel job", job_id) as span:
                headers = headers_of(span)
                await asyncio.to_thread(bus.produce, decode_topic, job_id, cancel.encode(), headers)
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
                    name = f"event: {event.name}\n" if event.name else ""
                    yield f"{name}data: {event.data}\n\n".encode()
                    last = event.seq
                if job.status in FINAL:
                    if job.status == "succeeded" and job.done_data is not None:
                        yield f"data: {job.done_data}\n\n".encode()
                    yield f"event: job.{job.status}\ndata: {json.dumps(job.to_api())}\n\n".encode()
                    return
                await asyncio.sleep(0.1)

        return StreamingResponse(replay(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    if cache is not None:

        @app.get("/v1/cache/stats")
        async def cache_stats() -> dict:
            return await asyncio.to_thread(cache.stats)

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

    return app
