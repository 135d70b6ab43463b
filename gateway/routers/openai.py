"""OpenAI's endpoints over the mesh: Chat Completions, Completions, Responses and the model list."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from common.api import unknown_model_body
from gateway import schemas
from gateway.answers import serve
from gateway.state import State

routes = APIRouter()


@routes.post("/v1/chat/completions", openapi_extra=schemas.request_body("ChatCompletionRequest"))
async def chat_completions(request: Request, state: State) -> Response:
    return await serve(state, "chat.completions", request)


@routes.post("/v1/responses", openapi_extra=schemas.request_body("ResponsesRequest"))
async def responses(request: Request, state: State) -> Response:
    return await serve(state, "responses", request)


@routes.post("/v1/completions", openapi_extra=schemas.request_body("CompletionRequest"))
async def completions(request: Request, state: State) -> Response:
    """OpenAI's legacy Completions: a raw prompt, no chat template (tokenizer_svc/completions.py)."""
    return await serve(state, "completions", request)


# when this gateway started: a model's `created` (vLLM's cards stamp the time of the call)
STARTED = int(time.time())


def model_card(name: str, max_model_len: int) -> dict:
    """As vLLM describes a model: benchmark clients read `max_model_len` (and `root`) to size their prompts."""
    return {
        "id": name,
        "object": "model",
        "created": STARTED,
        "owned_by": "deepmesh",
        "root": name,
        "parent": None,
        "max_model_len": max_model_len,
    }


@routes.get("/v1/models")
async def models(state: State) -> dict:
    return {"object": "list", "data": [model_card(name, state.max_model_len) for name in state.served_models]}


@routes.get("/v1/models/{model:path}")
async def model(model: str, state: State) -> Response:
    """One model, as OpenAI's `models.retrieve` asks for it (a name may hold slashes: org/model)."""
    if model not in state.served_models:
        return JSONResponse(unknown_model_body("chat.completions", model), status_code=404)
    return JSONResponse(model_card(model, state.max_model_len))
