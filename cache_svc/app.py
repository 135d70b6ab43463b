"""The cache service over HTTP, so that prefill and decode replicas on other hosts share state.

PUT    /v1/state/{key}         body: the blob; header X-Lease-Seconds -> {checksum, lease_expires_at}
GET    /v1/state/{key}         -> the blob (its checksum in X-Checksum), or 404
DELETE /v1/state/{key}
POST   /v1/state/{key}/lease   header X-Lease-Seconds -> {lease_expires_at}, or 404
"""

from __future__ import annotations

from fastapi import FastAPI, Header, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, Gauge, generate_latest

from cache_svc.store import StateStore, checksum_of
from common.tracing import http_telemetry

ENTRIES = Gauge("deepmesh_cache_entries", "State entries held by the cache service")


def create_app(store: StateStore) -> FastAPI:
    app = FastAPI(title="deepmesh cache", version="0.1.0", telemetry=http_telemetry())
    ENTRIES.set_function(lambda: len(store))

    def missing(key: str) -> JSONResponse:
        return JSONResponse({"error": {"message": f"no state {key!r}", "type": "not_found"}}, status_code=404)

    @app.put("/v1/state/{key:path}")
    async def put(key: str, request: Request, x_lease_seconds: float = Header(600.0)) -> Response:
        if not 0 < x_lease_seconds <= 7 * 86400:
            return JSONResponse({"error": {"message": "X-Lease-Seconds must be in (0, 604800]"}}, status_code=400)
        checksum, expires = store.put(key, await request.body(), x_lease_seconds)
        return JSONResponse({"checksum": checksum, "lease_expires_at": expires})

    @app.get("/v1/state/{key:path}")
    async def get(key: str) -> Response:
        data = store.get(key)
        if data is None:
            return missing(key)
        return Response(data, media_type="application/octet-stream", headers={"X-Checksum": checksum_of(data)})

    @app.delete("/v1/state/{key:path}")
    async def delete(key: str) -> Response:
        store.delete(key)
        return Response(status_code=204)

    @app.post("/v1/state/{key:path}/lease")
    async def renew(key: str, x_lease_seconds: float = Header(600.0)) -> Response:
        expires = store.renew(key, x_lease_seconds)
        return missing(key) if expires is None else JSONResponse({"lease_expires_at": expires})

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok", "entries": len(store), **store.stats}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app
