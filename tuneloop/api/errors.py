"""Errors in OpenAI's shape: a ServingError as a response, a validation error as a 400
naming the parameter."""

from __future__ import annotations

import json

from fastapi.responses import Response

from tuneloop.api.protocol import ChatMessage, StreamOptions, TextContentPart
from tuneloop.serving.errors import InvalidRequest, ServingError


def error_response(err: ServingError) -> Response:
    # ASCII-escaped: a message may quote the client's input, which is not always encodable text.
    return Response(json.dumps(err.body()), status_code=err.status, headers=err.headers, media_type="application/json")


def _param_from_loc(loc: tuple) -> str | None:
    parts = [p for p in loc if p != "body"]
    if not parts or not isinstance(parts[0], str):
        return None
    out = parts[0]
    for p in parts[1:]:
        if isinstance(p, int):
            out += f"[{p}]"
        elif p in ChatMessage.model_fields or p in StreamOptions.model_fields or p in TextContentPart.model_fields:
            out += f".{p}"
        else:
            break  # a union member tag such as 'str' or 'list[str]'
    return out


def validation_error(errors: list[dict]) -> InvalidRequest:
    """The first pydantic/FastAPI validation error as an OpenAI 400 naming the parameter."""
    if not errors:
        return InvalidRequest("invalid request")
    e = errors[0]
    if e.get("type") == "json_invalid":
        return InvalidRequest(f"the request body is not valid JSON: {e.get('msg')}")
    param = _param_from_loc(tuple(e.get("loc", ())))
    if e.get("type") == "extra_forbidden":
        return InvalidRequest(f"Unrecognized request argument supplied: {param}", param=param)
    if e.get("type") == "missing" and param:
        return InvalidRequest(f"you must provide '{param}'", param=param)
    return InvalidRequest(f"{param}: {e.get('msg')}" if param else str(e.get("msg")), param=param)
