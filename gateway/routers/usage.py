"""What a tenant's API keys have used, from the usage ledger (gateway/ledger.py). Keys themselves
are made and revoked by `deepmesh keys`, not over HTTP; gateway/auth.py checks them on each call."""

from __future__ import annotations

import asyncio
import re
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from gateway.auth import tenant_of
from gateway.http import protocol_error
from gateway.ledger import day_of
from gateway.state import State

routes = APIRouter()


@routes.get("/v1/usage")
async def usage(request: Request, state: State, start: str | None = None, end: str | None = None) -> Response:
    """The caller's tenant's usage per model, day (UTC) and priority, from `start` to `end`
    (YYYY-MM-DD, inclusive; both default to today)."""
    tenant = tenant_of(request, "jobs")
    today = day_of(time.time())
    start, end = start or today, end or today
    if not all(re.fullmatch(r"\d{4}-\d{2}-\d{2}", day) for day in (start, end)):
        return protocol_error("jobs", 400, "start and end are days: YYYY-MM-DD")
    rows = await asyncio.to_thread(state.ledger.report, start, end, tenant)
    return JSONResponse({"object": "list", "tenant": tenant, "start": start, "end": end, "data": rows})
