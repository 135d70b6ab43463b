"""What every handler of the gateway needs: bodies read within a limit, errors in the protocol's shape."""

from __future__ import annotations

import re

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from common.api import MAX_BODY_BYTES, BadRequest, error_body, parse_object

JSON_MEDIA_TYPE = re.compile(r"application/(.+\+)?json", re.IGNORECASE)


class Refused(Exception):
    """Raised by a dependency to answer the call with `response` (an error in the protocol's shape)."""

    def __init__(self, response: JSONResponse):
        super().__init__(response.status_code)
        self.response = response


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The body, or BadRequest (413) past `limit` bytes: the rest is then read and dropped, so
    the connection stays usable for the client's next request."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size <= limit:
            chunks.append(chunk)
    if size > limit:
        raise BadRequest(f"request body larger than {limit} bytes", 413)
    return b"".join(chunks)


def protocol_error(endpoint: str, status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    """An error in the endpoint's own format: OpenAI's for chat and responses, Anthropic's for messages."""
    return JSONResponse(error_body(endpoint, message, kind), status_code=status)


def endpoint_of(request: Request) -> str:
    """Whose error shape a call gets: Anthropic's under /v1/messages, OpenAI's elsewhere."""
    return "messages" if request.url.path.startswith("/v1/messages") else "chat.completions"


async def read_object(endpoint: str, request: Request) -> dict | Response:
    """The JSON object in the request, or the protocol's error response (common/api.py)."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip()
    # none at all reads as JSON, as FastAPI reads a body (and so vLLM and SGLang): a script's
    # `requests.post(url, data=json.dumps(body))` sends none
    if media_type and not JSON_MEDIA_TYPE.fullmatch(media_type):
        return protocol_error(endpoint, 415, f"Content-Type must be application/json, not {media_type!r}")
    try:
        return parse_object(await read_body(request))
    except BadRequest as err:
        return protocol_error(endpoint, err.status, str(err))
