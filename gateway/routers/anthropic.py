"""Anthropic's endpoints over the mesh: Messages and its token count."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway import schemas
from gateway.answers import serve
from gateway.state import State

routes = APIRouter()


@routes.post("/v1/messages", openapi_extra=schemas.request_body("MessagesRequest"))
async def messages(request: Request, state: State) -> Response:
    return await serve(state, "messages", request)


@routes.post("/v1/messages/count_tokens", openapi_extra=schemas.request_body("MessageCountTokensRequest"))
async def count_tokens(request: Request, state: State) -> Response:
    """Anthropic's token count: the prompt tokens the same Messages request would report."""
    return await serve(state, "messages", request, count_only=True)
