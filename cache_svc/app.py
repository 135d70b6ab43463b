"""The cache service over HTTP, so that prefill and decode replicas on other hosts share state.

POST   /v1/prefix                    body: the entry (cache_svc/wire.py: its token ids, head and blocks);
                                     headers X-Namespace, X-TTL-Seconds and, for a hand-over,
                                     X-Lease-Holder and X-Lease-Seconds -> Stored
POST   /v1/prefix/lookup             {namespace, token_ids, below} -> PrefixMatch
GET    /v1/prefix/{key}              ?renew_seconds=&release=holder -> the entry's head and blocks
                                     (cache_svc/wire.py; X-Checksum: the body's sha256),
                                     or 404 {error: {type: the miss reason}}
POST   /v1/prefix/{key}/renew        {ttl_seconds} -> {expires_at}
POST   /v1/prefix/{key}/lease        {holder, seconds}: pin it while a hand-over is in flight
DELETE /v1/prefix/{key}/lease/{holder}
DELETE /v1/prefix/{key}
GET    /v1/stats                     tiers, entries and bytes (what `deepmesh cache stats` prints)
POST   /v1/maintenance               run every maintenance task now
POST   /v1/maintenance/{task}        one of them (flush, sweep, rebalance, collect_orphans): Celery's tasks
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict

from fastapi import FastAPI, Header, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field

from cache_svc import wire
from cache_svc.maintenance import TASKS, run_task
from cache_svc.store import InvalidEntry, StateStore
from common.cache_entries import StateBlobs
from common.tracing import http_telemetry

MAX_SECONDS = 366 * 86400


class PrefixLookup(BaseModel):
    namespace: str = Field(min_length=1, max_length=256)
    token_ids: list[int] = Field(min_length=1, max_length=1 << 20)
    below: int = Field(ge=1)


class Renewal(BaseModel):
    ttl_seconds: float = Field(gt=0, le=MAX_SECONDS)


class Lease(BaseModel):
    holder: str = Field(min_length=1, max_length=128)
    seconds: float = Field(gt=0, le=MAX_SECONDS)


def _error(status: int, kind: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)


def create_app(store: StateStore) -> FastAPI:
    # Store calls do file, Redis and SQL I/O: they run in the thread pool, off the event loop.
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        # stopping (SIGTERM): what only this process's memory holds goes down to disk first, so
        # that every entry the catalog lists is still there after a restart
        await run_in_threadpool(store.flush)

    app = FastAPI(title="deepmesh cache", version="0.1.0", lifespan=lifespan, telemetry=http_telemetry())

    @app.post("/v1/prefix")
    async def put_prefix(
        request: Request,
        x_namespace: str = Header(min_length=3, max_length=256),
        x_ttl_seconds: float = Header(gt=0, le=MAX_SECONDS),
        x_lease_holder: str | None = Header(None, max_length=128),
        x_lease_seconds: float = Header(0.0, ge=0, le=MAX_SECONDS),
    ) -> Response:
        try:
            parts, meta = wire.unpack(await request.body())
            if not parts:
                raise InvalidEntry("an entry has a head blob")
            state = StateBlobs(parts[0], parts[1:])
            stored = await run_in_threadpool(
                store.put_prefix,
                x_namespace,
                meta.get("token_ids"),
                state,
                x_ttl_seconds,
                x_lease_holder,
                x_lease_seconds,
            )
        except ValueError as err:  # InvalidEntry too
            return _error(400, "invalid_request", str(err))
        return JSONResponse(asdict(stored))

    @app.post("/v1/image")
    async def put_image(
        request: Request,
        x_namespace: str = Header(min_length=3, max_length=256),
        x_digest: str = Header(min_length=64, max_length=64),
        x_num_tokens: int = Header(ge=1),
        x_ttl_seconds: float = Header(gt=0, le=MAX_SECONDS),
    ) -> Response:
        """An image's encoder rows, stored by its content (StateStore.put_image); loaded by key."""
        try:
            rows = await request.body()
            stored = await run_in_threadpool(store.put_image, x_namespace, x_digest, rows, x_num_tokens, x_ttl_seconds)
        except ValueError as err:
            return _error(400, "invalid_request", str(err))
        return JSONResponse(asdict(stored))

    @app.post("/v1/prefix/lookup")
    async def lookup(body: PrefixLookup) -> Response:
        match = await run_in_threadpool(store.lookup, body.namespace, body.token_ids, body.below)
        return JSONResponse(asdict(match))

    @app.get("/v1/prefix/{key}")
    async def load(key: str, renew_seconds: float = 0.0, release: str | None = None) -> Response:
        state, reason = await run_in_threadpool(store.load, key, renew_seconds, release)
        if state is None:
            return _error(404, reason or "evicted", f"no usable state {key!r}: {reason}")
        data = wire.pack([state.head, *state.blocks])
        return Response(data, media_type="application/octet-stream", headers={"X-Checksum": wire.checksum_of(data)})

    @app.post("/v1/prefix/{key}/renew")
    async def renew(key: str, body: Renewal) -> Response:
        expires = await run_in_threadpool(store.renew, key, body.ttl_seconds)
        return _error(404, "evicted", f"no entry {key!r}") if expires is None else JSONResponse({"expires_at": expires})

    @app.post("/v1/prefix/{key}/lease")
    async def lease(key: str, body: Lease) -> Response:
        if not await run_in_threadpool(store.lease, key, body.holder, body.seconds):
            return _error(404, "evicted", f"no entry {key!r}")
        return Response(status_code=204)

    @app.delete("/v1/prefix/{key}/lease/{holder}")
    async def release(key: str, holder: str) -> Response:
        if not await run_in_threadpool(store.release, key, holder):
            return _error(404, "evicted", f"no entry {key!r}")
        return Response(status_code=204)

    @app.delete("/v1/prefix/{key}")
    async def delete(key: str) -> Response:
        await run_in_threadpool(store.delete, key)
        return Response(status_code=204)

    @app.get("/v1/stats")
    async def stats() -> dict:
        return await run_in_threadpool(store.stats)

    @app.post("/v1/maintenance")
    async def maintain() -> dict:
        return {task: await run_in_threadpool(run_task, store, task) for task in TASKS}

    @app.post("/v1/maintenance/{task}")
    async def maintain_one(task: str) -> Response:
        if task not in TASKS:
            return _error(404, "not_found", f"no maintenance task {task!r}; tasks: {', '.join(TASKS)}")
        return JSONResponse({"task": task, "result": await run_in_threadpool(run_task, store, task)})

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app
