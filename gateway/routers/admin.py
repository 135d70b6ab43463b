"""For operators and orchestrators: liveness, readiness, Prometheus metrics and, embedded, the
KV cache's statistics (distributed, the cache service serves those)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.state import State

routes = APIRouter()
cache_routes = APIRouter()  # included only where the gateway has the cache's statistics


@cache_routes.get("/v1/cache/stats")
async def stats_of_the_cache(state: State) -> dict:
    return await asyncio.to_thread(state.cache_stats)


@routes.get("/healthz")
@routes.get("/health")  # vLLM's and SGLang's probe, which benchmark clients wait on before starting
async def healthz() -> dict:
    return {"status": "ok"}


@routes.get("/metrics")
async def prometheus_metrics() -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


@routes.get("/readyz")
async def readyz(state: State) -> Response:
    ready = state.router.ready.is_set()
    return JSONResponse({"ready": ready}, status_code=200 if ready else 503)
