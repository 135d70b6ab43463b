"""OpenAI's endpoints over the mesh: Chat Completions, Completions, Responses and the model list."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

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


@routes.get("/v1/models")
async def models(state: State) -> dict:
    """As vLLM lists them: benchmark clients read `max_model_len` (and `root`) to size their prompts."""
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "deepmesh",
                "root": name,
                "parent": None,
                "max_model_len": state.max_model_len,
            }
            for name in state.served_models
        ],
    }
