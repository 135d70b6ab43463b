"""Who is calling: the API key a call carries, and the tenant and retention class it runs under."""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import Response

from common.api import tenancy_problem
from gateway.http import Refused, endpoint_of, protocol_error
from gateway.state import State


async def authenticate(request: Request, state: State) -> None:
    """Every /v1 call: with keys required, the key in `Authorization: Bearer KEY` (OpenAI)
    or `x-api-key: KEY` (Anthropic) must be one of ours and not revoked; it decides the
    call's tenant and rate limits. Without, keys are not read (clients send placeholders).
    Async, as every dependency here: FastAPI would run a plain function on a thread of its pool,
    a hop there and back before every call; only the key's lookup in the database goes there."""
    request.state.key = None
    if not state.require_keys or not request.url.path.startswith("/v1/"):
        return
    shape = endpoint_of(request)
    scheme, _, token = (request.headers.get("authorization") or "").partition(" ")
    secret = request.headers.get("x-api-key") or (token.strip() if scheme.lower() == "bearer" else "")
    unauthorized = "authentication_error" if shape == "messages" else "invalid_request_error"
    if not secret:
        message = "an API key is required: send Authorization: Bearer KEY or x-api-key: KEY"
        raise Refused(protocol_error(shape, 401, message, unauthorized))
    key = await asyncio.to_thread(state.keys.lookup, secret)
    if key is None:
        raise Refused(protocol_error(shape, 401, "invalid API key", unauthorized))
    if key.revoked_at is not None:
        raise Refused(protocol_error(shape, 403, "this API key has been revoked", "permission_error"))
    request.state.key = key


def tenant_of(request: Request, shape: str) -> str:
    """The caller's tenant (its API key's; else the X-DeepMesh-Tenant header; "default"
    without one), or Refused."""
    if request.state.key is not None:
        return request.state.key.tenant
    tenant = request.headers.get("x-deepmesh-tenant")
    if problem := tenancy_problem(tenant, None):
        raise Refused(protocol_error(shape, 400, problem))
    return tenant or "default"


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
