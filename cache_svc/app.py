"""The cache service over HTTP, so that prefill and decode replicas on other hosts share state.

PUT    /v1/state/{key}         body: the blob; header X-Lease-Seconds -> {checksum, lease_expires_at}
GET    /v1/state/{key}         -> the blob (its checksum in X-Checksum), or 404
DELETE /v1/state/{key}
POST   /v1/state/{key}/lease   header X-Lease-Seconds -> {lease_expires_at}, or 404
POST   /v1/prefix              {namespace, token_ids, key}: index stored state as a prefix anchor
POST   /v1/prefix/lookup       {namespace, token_ids, below} -> {key, num_tokens} of the longest, or 404
"""

from __future__ import annotations

from fastapi import FastAPI, Header, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, Gauge, generate_latest
from pydantic import BaseModel, Field

from cache_svc.store import StateStore, checksum_of
from common.tracing import http_telemetry

ENTRIES = Gauge("deepmesh_cache_entries", "State entries held by the cache service")


class PrefixAnchor(BaseModel):
    namespace: str = Field(min_length=1, max_length=256)
    token_ids: list[int] = Field(min_length=1, max_length=1 << 20)
    key: str


class PrefixLookup(BaseModel):
    namespace: str = Field(min_length=1, max_length=256)
    token_ids: list[int] = Field(min_length=1, max_length=1 << 20)
    below: int = Field(ge=1)


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

    @app.post("/v1/prefix")
    async def index_prefix(anchor: PrefixAnchor) -> Response:
        try:
            store.index_prefix(anchor.namespace, anchor.token_ids, anchor.key)
        except ValueError as err:
            return JSONResponse({"error": {"message": str(err), "type": "invalid_request"}}, status_code=400)
        except KeyError:
            return missing(anchor.key)
        return Response(status_code=204)

    @app.post("/v1/prefix/lookup")
    async def lookup_prefix(lookup: PrefixLookup) -> Response:
        found = store.longest_prefix(lookup.namespace, lookup.token_ids, lookup.below)
        if found is None:
            return JSONResponse({"error": {"message": "no stored prefix", "type": "not_found"}}, status_code=404)
        return JSONResponse({"key": found[0], "num_tokens": found[1]})

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok", "entries": len(store), **store.stats}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app
