"""The batch endpoints: OpenAI's Files and Batch API, Anthropic's Message Batches.

Thin: each handler validates what the client sent, answers in the protocol's own shapes
(gateway/batches.py) and leaves the work to the batch runner (gateway/batch_runner.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.datastructures import UploadFile

from common.api import BadRequest, parse_object
from gateway import schemas
from gateway.auth import tenant_of
from gateway.batch_store import COMPLETION_WINDOWS, ENDED, Batch, BatchStore
from gateway.batches import OPENAI_URLS, anthropic_batch, anthropic_line, openai_batch, parse_anthropic_requests
from gateway.files import MAX_FILE_BYTES, FileTooLarge
from gateway.http import Refused, protocol_error, read_body
from gateway.state import State

OPENAI, ANTHROPIC = "jobs", "messages"  # whose error shape: OpenAI's, Anthropic's
routes = APIRouter()


def not_found(shape: str, what: str) -> JSONResponse:
    return protocol_error(shape, 404, f"no {what}", "not_found_error")


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The JSON object of the body, or BadRequest (413 past `limit` bytes)."""
    return await asyncio.to_thread(parse_object, await read_body(request, limit), limit)


def page(shape: str, rows: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    first, last = (rows[0]["id"], rows[-1]["id"]) if rows else (None, None)
    body = {"data": rows, "has_more": has_more, "first_id": first, "last_id": last}
    return {"object": "list", **body} if shape == OPENAI else body


def limit_of(request: Request, shape: str) -> int:
    raw = request.query_params.get("limit", "20")
    if not raw.isdigit() or not 1 <= int(raw) <= 1000:
        raise Refused(protocol_error(shape, 400, "limit must be an integer from 1 to 1000"))
    return int(raw)


async def openai_tenant(request: Request) -> str:
    return tenant_of(request, OPENAI)


async def anthropic_tenant(request: Request) -> str:
    return tenant_of(request, ANTHROPIC)


# -- OpenAI: files ---------------------------------------------------------------------------


@routes.post("/v1/files")
async def upload_file(request: Request, state: State, tenant: str = Depends(openai_tenant)) -> Response:
    if int(request.headers.get("content-length") or 0) > MAX_FILE_BYTES + (1 << 20):
        return protocol_error(OPENAI, 413, f"the file is larger than {MAX_FILE_BYTES >> 20} MB")
    try:
        form = await request.form(max_files=1, max_fields=8)
    except Exception as err:  # Starlette's parser: not multipart, malformed parts
        return protocol_error(OPENAI, 400, f"expected multipart/form-data with file and purpose: {err}")
    try:
        purpose, upload = form.get("purpose"), form.get("file")
        if purpose != "batch":
            return protocol_error(OPENAI, 400, "purpose must be 'batch' (the only purpose this server takes)")
        if not isinstance(upload, UploadFile):
            return protocol_error(OPENAI, 400, "file: the file to upload, as a multipart part with a filename")

        async def chunks() -> AsyncIterator[bytes]:
            while chunk := await upload.read(1 << 20):
                yield chunk

        try:
            record = await state.files.upload(tenant, purpose, upload.filename or "upload.jsonl", chunks())
        except FileTooLarge as err:
            return protocol_error(OPENAI, 413, str(err))
    finally:
        await form.close()
    return JSONResponse(record.to_api())


@routes.get("/v1/files")
async def list_files(request: Request, state: State, tenant: str = Depends(openai_tenant)) -> Response:
    limit = limit_of(request, OPENAI)
    query = request.query_params
    rows, more = await asyncio.to_thread(
        state.files.list, tenant, query.get("purpose"), query.get("after"), limit, query.get("order", "desc")
    )
    return JSONResponse(page(OPENAI, [r.to_api() for r in rows], more))


@routes.get("/v1/files/{file_id}")
async def get_file(file_id: str, request: Request, state: State, tenant: str = Depends(openai_tenant)) -> Response:
    record = await asyncio.to_thread(state.files.get, tenant, file_id)
    return JSONResponse(record.to_api()) if record else not_found(OPENAI, f"file {file_id}")


@routes.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, request: Request, state: State, tenant: str = Depends(openai_tenant)) -> Response:
    record = await asyncio.to_thread(state.files.get, tenant, file_id)
    if record is None or not state.files.path(file_id).is_file():
        return not_found(OPENAI, f"file {file_id}")
    return FileResponse(state.files.path(file_id), media_type="application/jsonl", filename=record.filename)


@routes.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, request: Request, state: State, tenant: str = Depends(openai_tenant)) -> Response:
    if not await asyncio.to_thread(state.files.delete, tenant, file_id):
        return not_found(OPENAI, f"file {file_id}")
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})


# -- OpenAI: batches -------------------------------------------------------------------------


@routes.post("/v1/batches", openapi_extra=schemas.request_body("BatchCreateRequest"))
async def create_batch(request: Request, state: State, tenant: str = Depends(openai_tenant)) -> Response:
    try:
        body = await read_json(request, 1 << 20)
    except BadRequest as err:
        return protocol_error(OPENAI, err.status, str(err))
    endpoint, window, metadata = body.get("endpoint"), body.get("completion_window"), body.get("metadata")
    if endpoint not in OPENAI_URLS:
        return protocol_error(OPENAI, 400, f"endpoint must be one of {', '.join(OPENAI_URLS)}, not {endpoint!r}")
    if window not in COMPLETION_WINDOWS:
        return protocol_error(OPENAI, 400, f"completion_window must be one of {', '.join(COMPLETION_WINDOWS)}")
    if metadata is not None and not (
        isinstance(metadata, dict)
        and len(metadata) <= 16
        and all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in metadata.items()
        )
    ):
        return protocol_error(OPENAI, 400, "metadata: at most 16 string keys (64 characters) and values (512)")
    file_id = body.get("input_file_id")
    record = await asyncio.to_thread(state.files.get, tenant, file_id) if isinstance(file_id, str) else None
    if record is None:
        return protocol_error(OPENAI, 400, f"input_file_id: no file {file_id!r}")
    if record.purpose != "batch":
        return protocol_error(OPENAI, 400, f"input_file_id: file {file_id} was not uploaded with purpose 'batch'")
    batch = await asyncio.to_thread(
        state.batches.create, "openai", tenant, OPENAI_URLS[endpoint], window, file_id, metadata
    )
    return JSONResponse(openai_batch(batch, {}))


@routes.get("/v1/batches")
async def list_batches(request: Request, state: State, tenant: str = Depends(openai_tenant)) -> Response:
    limit = limit_of(request, OPENAI)
    rows, more = await asyncio.to_thread(state.batches.list, tenant, "openai", request.query_params.get("after"), limit)
    shown = [openai_batch(b, await asyncio.to_thread(state.batches.counts, b.id)) for b in rows]
    return JSONResponse(page(OPENAI, shown, more))


@routes.get("/v1/batches/{batch_id}")
async def get_batch(batch_id: str, request: Request, state: State, tenant: str = Depends(openai_tenant)) -> Response:
    batch = await asyncio.to_thread(state.batches.get, tenant, batch_id, "openai")
    if batch is None:
        return not_found(OPENAI, f"batch {batch_id}")
    return JSONResponse(openai_batch(batch, await asyncio.to_thread(state.batches.counts, batch_id)))


@routes.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request, state: State, tenant: str = Depends(openai_tenant)) -> Response:
    batch = await asyncio.to_thread(state.batches.cancel, tenant, batch_id, "openai")
    if batch is None:
        return not_found(OPENAI, f"batch {batch_id}")
    return JSONResponse(openai_batch(batch, await asyncio.to_thread(state.batches.counts, batch_id)))


# -- Anthropic: message batches --------------------------------------------------------------


def results_url(request: Request, batch_id: str) -> str:
    return str(request.url_for("message_batch_results", batch_id=batch_id))


async def show_message_batch(batches: BatchStore, request: Request, batch: Batch | None, batch_id: str) -> Response:
    if batch is None:
        return not_found(ANTHROPIC, f"message batch {batch_id}")
    shown = anthropic_batch(batch, await asyncio.to_thread(batches.counts, batch_id), results_url(request, batch_id))
    return JSONResponse(shown)


@routes.post("/v1/messages/batches", openapi_extra=schemas.request_body("MessageBatchCreateRequest"))
async def create_message_batch(request: Request, state: State, tenant: str = Depends(anthropic_tenant)) -> Response:
    try:
        body = await read_json(request, MAX_FILE_BYTES)
        requests = parse_anthropic_requests(body)
    except BadRequest as err:
        return protocol_error(ANTHROPIC, err.status, str(err))
    batch = await asyncio.to_thread(state.batches.create, "anthropic", tenant, "messages", "24h", None, None, requests)
    return await show_message_batch(state.batches, request, batch, batch.id)


@routes.get("/v1/messages/batches")
async def list_message_batches(request: Request, state: State, tenant: str = Depends(anthropic_tenant)) -> Response:
    limit = limit_of(request, ANTHROPIC)
    after = request.query_params.get("after_id")
    rows, more = await asyncio.to_thread(state.batches.list, tenant, "anthropic", after, limit)
    shown = [
        anthropic_batch(b, await asyncio.to_thread(state.batches.counts, b.id), results_url(request, b.id))
        for b in rows
    ]
    return JSONResponse(page(ANTHROPIC, shown, more))


@routes.get("/v1/messages/batches/{batch_id}")
async def get_message_batch(
    batch_id: str, request: Request, state: State, tenant: str = Depends(anthropic_tenant)
) -> Response:
    batch = await asyncio.to_thread(state.batches.get, tenant, batch_id, "anthropic")
    return await show_message_batch(state.batches, request, batch, batch_id)


@routes.post("/v1/messages/batches/{batch_id}/cancel")
async def cancel_message_batch(
    batch_id: str, request: Request, state: State, tenant: str = Depends(anthropic_tenant)
) -> Response:
    batch = await asyncio.to_thread(state.batches.cancel, tenant, batch_id, "anthropic")
    return await show_message_batch(state.batches, request, batch, batch_id)


@routes.get("/v1/messages/batches/{batch_id}/results", name="message_batch_results")
async def message_batch_results(
    batch_id: str, request: Request, state: State, tenant: str = Depends(anthropic_tenant)
) -> Response:
    batch = await asyncio.to_thread(state.batches.get, tenant, batch_id, "anthropic")
    if batch is None:
        return not_found(ANTHROPIC, f"message batch {batch_id}")
    if batch.status not in ENDED:
        return protocol_error(
            ANTHROPIC, 400, f"message batch {batch_id} is still processing; its results come when it ends"
        )

    async def lines() -> AsyncIterator[bytes]:
        rows = await asyncio.to_thread(lambda: list(state.batches.results(batch_id)))
        for request_row, job in rows:
            yield anthropic_line(request_row, job)

    return StreamingResponse(lines(), media_type="application/x-jsonl")


@routes.delete("/v1/messages/batches/{batch_id}")
async def delete_message_batch(
    batch_id: str, request: Request, state: State, tenant: str = Depends(anthropic_tenant)
) -> Response:
    batch = await asyncio.to_thread(state.batches.delete, tenant, batch_id, "anthropic")
    if batch is None:
        return not_found(ANTHROPIC, f"message batch {batch_id}")
    if batch.status not in ENDED:
        return protocol_error(ANTHROPIC, 400, f"message batch {batch_id} is still processing; cancel it first")
    return JSONResponse({"id": batch_id, "type": "message_batch_deleted"})
