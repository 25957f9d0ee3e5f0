"""/v1/files: OpenAI's Files API for fine-tuning data, over a FileStore (tuneloop/files).

    POST   /v1/files                    multipart `file` + `purpose` ("fine-tune") -> a File
    GET    /v1/files                    `purpose`, `limit` (1-10000), `after`, `order` -> a list page
    GET    /v1/files/{file_id}          -> the File
    DELETE /v1/files/{file_id}          -> {"id", "object": "file", "deleted": true}
    GET    /v1/files/{file_id}/content  -> its bytes

A file is its owner's: the scope of the key that uploaded it, as the gateway's hook wrote it
on the request's record (RequestRecord.tenant: "team:<name>" or "key:<id>"; "anonymous" with
the gateway's auth off). Any other key gets 404 for it, as for a file that does not exist.

An upload is bounded by files.max_upload_bytes, not by serving.max_request_bytes (BodyLimit
leaves this route alone): a declared Content-Length over it is refused before anything is
read, and a body that grows past it as it streams is refused there (413). The form is
parsed as it arrives, the file spooled to disk (Starlette's parser: 1 MiB in memory at most),
then copied to the store's staging folder, checked against the data contract in a child
process (a bad row refuses the whole file, 400, listing the rows), and only then stored.
Nothing of the file is logged: the request log keeps the record (route, key, status, the
file's id), never the content.
"""

from __future__ import annotations

import asyncio
from pathlib import PurePosixPath
from typing import Any, BinaryIO, Callable, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.datastructures import UploadFile
from starlette.requests import ClientDisconnect

from tuneloop.api.handlers import call_of
from tuneloop.api.server import server_of
from tuneloop.files import ANONYMOUS, FileNotFound, FilesError, FileStore
from tuneloop.files.contract import UploadRefused, check_upload_in_child
from tuneloop.files.store import FILE_ID, PURPOSES, FileTooLarge, TooManyFiles
from tuneloop.serving.errors import InternalError, InvalidRequest, RequestTooLarge, RouteNotFound, ServingError

UPLOAD_ROUTE = "/v1/files"
FORM_OVERHEAD = 64 * 1024  # the body's bytes beyond the file itself: boundaries, part headers, `purpose`
MAX_LIST = 10_000
CHUNK = 1 << 20
T = TypeVar("T")


# The routes' OpenAPI documentation of what they read themselves (the form, the list's query).
FILE_UPLOAD_DOC: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "purpose"],
                    "properties": {
                        "file": {"type": "string", "format": "binary", "description": "Fine-tuning data (JSONL)."},
                        "purpose": {"type": "string", "enum": ["fine-tune"]},
                    },
                }
            }
        },
    }
}

FILE_LIST_DOC: dict[str, Any] = {
    "parameters": [
        {"name": "purpose", "in": "query", "required": False, "schema": {"type": "string"}},
        {
            "name": "limit",
            "in": "query",
            "required": False,
            "schema": {"type": "integer", "minimum": 1, "maximum": 10000, "default": 10000},
        },
        {
            "name": "after",
            "in": "query",
            "required": False,
            "schema": {"type": "string", "pattern": "^file-[0-9a-f]{32}$"},
            "description": "A file id: the page starts after it, in the list's order.",
        },
        {"name": "order", "in": "query", "required": False, "schema": {"type": "string", "enum": ["asc", "desc"]}},
    ]
}


class NoSuchFile(ServingError):
    status, type, code, reason = 404, "invalid_request_error", None, "not_found"


def files_of(request: Request) -> FileStore:
    server_of(request)  # ready and not draining, as every route
    store = getattr(request.app.state, "files", None)
    if store is None:
        raise RouteNotFound("the Files API is off on this server (app.state.files: tuneloop.files.open_file_store)")
    return store


def owner_of(request: Request) -> str:
    """Whose files this request sees: its key's scope (team, else the key), set by the gateway."""
    return call_of(request).tenant or ANONYMOUS


def _serving_error(exc: FilesError) -> ServingError:
    if isinstance(exc, FileNotFound):
        return NoSuchFile(str(exc), param="file_id")
    if isinstance(exc, FileTooLarge):
        return RequestTooLarge(str(exc), param="file")
    if isinstance(exc, TooManyFiles):
        return InvalidRequest(str(exc), param="file", code="files_limit_exceeded")
    if isinstance(exc, UploadRefused):
        return InvalidRequest(str(exc), param="file", code="invalid_file")
    return InternalError(str(exc))


async def _run(fn: Callable[..., T], *args) -> T:
    """A store call off the event loop, its refusal as an OpenAI error."""
    try:
        return await asyncio.to_thread(fn, *args)
    except FilesError as exc:
        raise _serving_error(exc) from None


def _too_large(what: str, limit: int) -> RequestTooLarge:
    return RequestTooLarge(
        f"the upload ({what}) is over this server's limit of {limit} bytes a file (files.max_upload_bytes)",
        param="file",
    )


# ---- POST /v1/files ----------------------------------------------------------------------


async def create_file(request: Request) -> dict | Response:
    store, owner = files_of(request), owner_of(request)
    limit = store.max_upload_bytes
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit + FORM_OVERHEAD:
        raise _too_large(f"{declared} bytes", limit)
    if not request.headers.get("content-type", "").lower().startswith("multipart/form-data"):
        raise InvalidRequest("send the file as multipart/form-data: a `file` part and a `purpose` field", param="file")
    await _run(store.check_room, owner)  # before taking the upload in
    try:
        form = await Request(request.scope, _bounded(request.receive, limit + FORM_OVERHEAD, limit)).form(
            max_files=1, max_fields=8, max_part_size=FORM_OVERHEAD
        )
    except ClientDisconnect:
        return Response(status_code=499)  # the client left while sending (nginx's code); nobody reads it
    try:
        upload, purpose = _upload_fields(form)
        filename = PurePosixPath((upload.filename or "").replace("\\", "/")).name[:255] or "upload"
        with store.staged() as staged:
            await _run(_copy, upload.file, staged, limit)
            checked = await _run(check_upload_in_child, staged, filename)
            stored = await _run(store.create, owner, staged, filename, purpose, checked.format, checked.rows)
    finally:
        await form.close()
    call_of(request).response_id = stored.id
    return stored.openai()


def _bounded(receive, limit: int, file_limit: int):
    """receive, refusing (413) once the body passes `limit` bytes."""
    seen = 0

    async def bounded():
        nonlocal seen
        message = await receive()
        seen += len(message.get("body", b""))
        if seen > limit:
            raise _too_large(f"more than {file_limit} bytes", file_limit)
        return message

    return bounded


def _upload_fields(form) -> tuple[UploadFile, str]:
    for name in form.keys():
        if name.startswith("expires_after"):
            raise InvalidRequest("expires_after: files here do not expire; leave it out", param="expires_after")
        if name not in ("file", "purpose"):
            raise InvalidRequest(f"Unrecognized request argument supplied: {name}", param=name)
    purpose = form.get("purpose")
    if not isinstance(purpose, str):
        raise InvalidRequest("you must provide 'purpose' (a form field): fine-tune", param="purpose")
    if purpose not in PURPOSES:
        raise InvalidRequest(
            f"purpose {purpose!r} is not supported here: files are kept for {', '.join(PURPOSES)} only",
            param="purpose",
        )
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise InvalidRequest("you must provide 'file': the data as a multipart file part", param="file")
    return upload, purpose


def _copy(source: BinaryIO, target, limit: int) -> None:
    size = 0
    with open(target, "wb") as out:
        while chunk := source.read(CHUNK):
            size += len(chunk)
            if size > limit:
                raise FileTooLarge(
                    f"the file (more than {limit} bytes) is over this server's limit of {limit} bytes a file "
                    "(files.max_upload_bytes)"
                )
            out.write(chunk)


# ---- the other routes ----------------------------------------------------------------------


async def list_files(request: Request) -> dict:
    store, owner = files_of(request), owner_of(request)
    q = request.query_params
    limit_text = q.get("limit", str(MAX_LIST))
    if not limit_text.isdigit() or not 1 <= int(limit_text) <= MAX_LIST:
        raise InvalidRequest(f"limit: an integer from 1 to {MAX_LIST}, got {limit_text!r}", param="limit")
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest(f"order: asc or desc, got {order!r}", param="order")
    after = q.get("after")
    if after is not None and not FILE_ID.match(after):
        raise InvalidRequest(f"after: a file id (file-...), got {after!r}", param="after")
    files = await _run(store.list, owner, q.get("purpose"))
    if order == "desc":
        files.reverse()
    if after is not None:  # ids sort as the files were created: a deleted `after` still places the page
        files = [f for f in files if (f.id > after if order == "asc" else f.id < after)]
    page = files[: int(limit_text)]
    return {
        "object": "list",
        "data": [f.openai() for f in page],
        "first_id": page[0].id if page else None,
        "last_id": page[-1].id if page else None,
        "has_more": len(files) > len(page),
    }


async def retrieve_file(request: Request, file_id: str) -> dict:
    store, owner = files_of(request), owner_of(request)
    stored = await _run(store.get, file_id, owner)
    call_of(request).response_id = stored.id
    return stored.openai()


async def delete_file(request: Request, file_id: str) -> dict:
    store, owner = files_of(request), owner_of(request)
    stored = await _run(store.delete, file_id, owner)
    call_of(request).response_id = stored.id
    return {"id": stored.id, "object": "file", "deleted": True}


async def file_content(request: Request, file_id: str) -> StreamingResponse:
    store, owner = files_of(request), owner_of(request)
    stored = await _run(store.get, file_id, owner)
    stream = await _run(store.open, file_id, owner)

    def chunks():
        try:
            while chunk := stream.read(CHUNK):
                yield chunk
        finally:
            stream.close()

    call_of(request).response_id = stored.id
    return StreamingResponse(
        chunks(), media_type="application/octet-stream", headers={"content-length": str(stored.bytes)}
    )
