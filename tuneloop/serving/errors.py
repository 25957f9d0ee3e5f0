"""The one family of serving errors, and the one place that maps them to HTTP + OpenAI shapes.

Everything the server refuses or fails at is a ServingError; `openai_error_body` and
`ServingError.headers` are what every handler (FastAPI's, the BentoML middleware's) sends.
OpenAI's shape: {"error": {"message", "type", "param", "code"}} with the matching status,
so the official SDK raises its typed exceptions (BadRequestError, NotFoundError,
RateLimitError, InternalServerError, ...).
"""

from __future__ import annotations

import math
from typing import Any


class ServingSetupError(Exception):
    """The server cannot start (no model, a model that does not load); the message says what to fix."""


class ServingError(Exception):
    status: int = 500
    type: str = "server_error"
    code: str | None = "internal_error"
    # Counted in tuneloop_requests_rejected_total{reason=...}
    reason: str = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.retry_after_s = retry_after_s
        self.extra_headers = headers or {}

    def body(self) -> dict[str, Any]:
        return openai_error_body(self.message, self.type, self.param, self.code)

    @property
    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return dict(self.extra_headers)
        return {**self.extra_headers, "Retry-After": str(max(1, math.ceil(self.retry_after_s)))}


class InvalidRequest(ServingError):
    status, type, code, reason = 400, "invalid_request_error", None, "invalid_request"


class RequestTooLarge(InvalidRequest):
    """The request body is over serving.max_request_bytes (refused before it is parsed)."""

    status, code, reason = 413, "request_too_large", "request_too_large"


class ContextLengthExceeded(InvalidRequest):
    code, reason = "context_length_exceeded", "context_length_exceeded"


class ModelNotFound(ServingError):
    status, type, code, reason = 404, "invalid_request_error", "model_not_found", "model_not_found"


class RouteNotFound(ServingError):
    status, type, code, reason = 404, "invalid_request_error", "not_found", "not_found"


class MethodNotAllowed(ServingError):
    status, type, code, reason = 405, "invalid_request_error", "method_not_allowed", "invalid_request"


class Overloaded(ServingError):
    """Admission refused: too many requests queued + running. The client should retry."""

    status, type, code, reason = 429, "rate_limit_error", "rate_limit_exceeded", "overloaded"


class Unavailable(ServingError):
    """Not ready yet (loading, warming up) or shutting down, or BentoML's batcher shed the request."""

    status, type, code, reason = 503, "server_error", "service_unavailable", "unavailable"


class RequestTimeout(ServingError):
    status, type, code, reason = 504, "timeout_error", "timeout", "timeout"


class InvalidApiKey(ServingError):
    """Missing, malformed, unknown, expired or revoked API key (the message never quotes it)."""

    status, type, code, reason = 401, "invalid_request_error", "invalid_api_key", "invalid_api_key"


class RateLimited(ServingError):
    """The key's requests/min or tokens/min is spent (headers say how long until it is not)."""

    status, type, code, reason = 429, "requests", "rate_limit_exceeded", "rate_limited"


class PiiDetected(InvalidRequest):
    code, reason = "pii_detected", "pii_detected"


class ContentFiltered(InvalidRequest):
    code, reason = "content_filter", "content_filter"


class GuardUnavailable(ServingError):
    """A safety check (PII analysis, the content filter, Redis in fail-closed mode) could not
    run: the request is refused rather than passed through unchecked."""

    status, type, code, reason = 503, "server_error", "guard_unavailable", "guard_unavailable"


class InternalError(ServingError):
    """Anything unexpected; the traceback goes to the server log, never to the client."""


def openai_error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_for_status(status: int, message: str) -> ServingError:
    """The ServingError for a bare HTTP status (e.g. from BentoML's own handlers)."""
    by_status: dict[int, type[ServingError]] = {
        400: InvalidRequest,
        404: RouteNotFound,
        405: MethodNotAllowed,
        413: RequestTooLarge,
        422: InvalidRequest,
        429: Overloaded,
        503: Unavailable,
        504: RequestTimeout,
    }
    cls = by_status.get(status, InvalidRequest if 400 <= status < 500 else InternalError)
    err = cls(message)
    if status == 422:
        err.status = 400
    elif cls is InvalidRequest or cls is InternalError:
        err.status = status
    return err
