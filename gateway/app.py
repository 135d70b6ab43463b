"""The HTTP front door: OpenAI Chat Completions and Responses, Anthropic Messages.

A call becomes a job: the gateway produces the request to `requests` and waits for the job's
messages on `results`, answering with the complete body or streaming the events as
Server-Sent Events while they arrive (gateway/answers.py). Protocol work (validation of the
body, rendering, parsing the output) happens in the tokenizer service; the gateway only frames it.

This module assembles the application: the shared state (gateway/state.py), the routers of each
surface (gateway/routers/), the error handlers and the start and stop of the threads that read
`results` and run batches.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeout
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.api import server_error_kind
from common.bus import Bus, MemoryBus
from common.replicas import ReplicaTable
from common.topics import Topic, topic_name
from common.tracing import http_telemetry
from gateway import schemas
from gateway.admission import Admission
from gateway.auth import authenticate
from gateway.batch_runner import BatchRunner, BatchRunnerThread
from gateway.batch_store import BatchStore
from gateway.dispatch import Dispatcher
from gateway.files import FileStore
from gateway.http import Refused, endpoint_of, protocol_error
from gateway.jobs import JobStore
from gateway.keys import KeyStore
from gateway.ledger import Ledger
from gateway.quotas import MemoryQuotas, RedisQuotas
from gateway.results import JobRecorder, ResultRouter
from gateway.routers import admin, anthropic, batches, openai, responses, usage
from gateway.routers import jobs as job_endpoints  # `jobs` is create_app's job store
from gateway.state import GatewayState
from gateway.stored_responses import StoredResponses

log = logging.getLogger(__name__)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """The threads that read `results` (and, embedded, run batches) live as long as the app."""
    state: GatewayState = app.state.gateway
    await asyncio.to_thread(state.router.start)
    state.recorder.start()
    if state.batch_rounds is not None:
        # the in-process bus keeps nothing across a restart: the runner sends again what was in it
        runner = BatchRunner(
            state.jobs,
            state.files,
            state.dispatcher.send,
            state.dispatcher.cancel,
            state.batch_in_flight,
            resend_sent=isinstance(state.bus, MemoryBus),
        )
        BatchRunnerThread(runner, state.batch_rounds, state.stop_batches).start()
    yield
    state.stop_batches.set()
    await asyncio.to_thread(state.recorder.stop)
    await asyncio.to_thread(state.router.stop)


async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
    """An unknown path or method, in the protocol's error shape (not FastAPI's `detail`)."""
    kind = {404: "not_found_error", 405: "invalid_request_error"}.get(err.status_code, "invalid_request_error")
    response = protocol_error(endpoint_of(request), err.status_code, str(err.detail), kind)
    response.headers.update(err.headers or {})
    return response


async def bad_parameters(request: Request, err: RequestValidationError) -> JSONResponse:
    """A path or query parameter of the wrong type, in the protocol's shape (not FastAPI's 422)."""
    problem = err.errors()[0] if err.errors() else {"loc": (), "msg": "invalid"}
    where = ".".join(str(part) for part in problem["loc"])
    return protocol_error(endpoint_of(request), 400, f"{where}: {problem['msg']}")


async def refused(request: Request, err: Refused) -> JSONResponse:
    return err.response


# what a store the gateway needs raises while it cannot be reached: a 503 to retry, not a fault
# of ours. The database (stopped, restarting, cut off, its connections all taken) and Redis, which
# counts the API keys' rate limits.
AWAY = {
    OperationalError: "the database",
    InterfaceError: "the database",
    PoolTimeout: "the database",
    RedisConnectionError: "the rate limiter (Redis)",
    RedisTimeout: "the rate limiter (Redis)",
}
AWAY_RETRY_SECONDS = 2


async def store_away(request: Request, err: Exception) -> JSONResponse:
    """A call that needs a store while it is away: 503 in the protocol's shape, with Retry-After.
    Nothing was accepted (a job is accepted once its row is written). The connection stays open:
    unlike `unexpected`, nothing is raised again after this answer."""
    what = next(name for kind, name in AWAY.items() if isinstance(err, kind))
    log.warning("%s %s: %s is unavailable: %s", request.method, request.url.path, what, err.__class__.__name__)
    endpoint = endpoint_of(request)
    response = protocol_error(endpoint, 503, f"{what} is unavailable; retry", server_error_kind(endpoint))
    response.headers["Retry-After"] = str(AWAY_RETRY_SECONDS)
    return response


async def unexpected(request: Request, err: Exception) -> JSONResponse:
    """A fault of ours still answers in the protocol's shape. Starlette raises it again after this
    answer (so that the server logs it), and the server then closes the connection."""
    endpoint = endpoint_of(request)
    return protocol_error(endpoint, 500, "internal error", server_error_kind(endpoint))


def openapi_document(app: FastAPI) -> dict:
    """FastAPI's document, with the protocols' request bodies (gateway/schemas.py)."""
    if app.openapi_schema is None:
        document = get_openapi(title=app.title, version=app.version, routes=app.routes)
        document.setdefault("components", {}).setdefault("schemas", {}).update(schemas.components())
        app.openapi_schema = document
    return app.openapi_schema


def create_app(
    bus: Bus,
    topic_prefix: str,
    served_models: list[str],
    jobs: JobStore,
    max_model_len: int | None = None,
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
    `responses_keep_seconds`: how long a stored response (Responses' `store`) is kept.
    `max_model_len`: the served model's context length, which GET /v1/models reports."""
    results_topic = topic_name(Topic.RESULTS, topic_prefix)
    ledger = Ledger(jobs.session) if jobs is not None else None
    state = GatewayState(
        bus=bus,
        served_models=served_models,
        max_model_len=max_model_len,
        result_timeout=result_timeout,
        require_keys=require_keys,
        batch_rounds=batch_rounds,
        batch_in_flight=batch_in_flight,
        admission=Admission(replicas, admission_wait_seconds) if replicas is not None else None,
        router=ResultRouter(bus, results_topic),
        recorder=JobRecorder(bus, results_topic, group=f"{topic_prefix}gateway-jobs", store=jobs, ledger=ledger),
        dispatcher=Dispatcher(bus, topic_prefix),
        quotas=quotas if quotas is not None else MemoryQuotas(),
        jobs=jobs,
        files=FileStore(jobs.session, files_dir) if jobs is not None else None,
        batches=BatchStore(jobs.session) if jobs is not None else None,
        keys=KeyStore(jobs.session) if jobs is not None else None,
        ledger=ledger,
        stored_responses=StoredResponses(jobs, responses_keep_seconds) if jobs is not None else None,
        cache_stats=cache_stats,
    )
    app = FastAPI(
        title="deepmesh",
        version="0.1.0",
        lifespan=lifespan,
        telemetry=http_telemetry(),
        dependencies=[Depends(authenticate)],
    )
    app.state.gateway = state
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, bad_parameters)
    app.add_exception_handler(Refused, refused)
    for away in AWAY:
        app.add_exception_handler(away, store_away)
    app.add_exception_handler(Exception, unexpected)
    for router in (batches.routes, responses.routes, openai.routes, anthropic.routes, job_endpoints.routes):
        app.include_router(router)
    if cache_stats is not None:
        app.include_router(admin.cache_routes)
    app.include_router(usage.routes)
    app.include_router(admin.routes)
    app.openapi = partial(openapi_document, app)  # type: ignore[method-assign]
    return app
