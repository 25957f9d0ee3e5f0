"""The request log as one of the API's hooks (tuneloop/hooks.py): every /v1 request's
record (RequestRecord, filled by the routes and the other hooks while they work) goes to the
RequestLog exactly once, when the response has ended (sent, failed, or the client left).

It is the outermost hook, so refused requests (401, 429) are logged too. Every /v1
response gets an `x-request-id` header (OpenAI's), the id the log and POST /v1/feedback use.
"""

from __future__ import annotations

import json
import logging
import time

from tuneloop.hooks import CallHook
from tuneloop.requestlog.record import RequestRecord

log = logging.getLogger("tuneloop.requestlog")
_MAX_ERROR_BODY = 16384


class RequestLogHook(CallHook):
    def __init__(self, request_log):
        self.request_log = request_log
        self.error_body: list[bytes] = []
        self.spent = 0.0  # the log's own work on the event loop, reported as its cost

    async def response_headers(self, call: RequestRecord, status: int) -> list[tuple[bytes, bytes]]:
        return [(b"x-request-id", call.request_id.encode())]

    def on_response_body(self, call: RequestRecord, body: bytes) -> None:
        if call.status is not None and call.status >= 400 and sum(map(len, self.error_body)) < _MAX_ERROR_BODY:
            self.error_body.append(body)

    def on_request_end(self, call: RequestRecord, scope) -> None:
        started = time.thread_time()
        try:
            _complete(call, scope, self.error_body)
            self.request_log.submit(call.to_dict())
        except Exception:  # the log never breaks a response
            log.exception("request log: could not record %s", call.request_id)
        self.request_log.account(self.spent + time.thread_time() - started)


def _complete(record: RequestRecord, scope, error_body: list[bytes]) -> None:
    record.finish()
    if record.status is None:  # the client left before any response started
        record.status = 499
        record.error_code = record.error_code or "client_disconnected"
    if record.status >= 400 and record.error_code is None:
        try:
            err = json.loads(b"".join(error_body) or b"null")
            err = err.get("error") if isinstance(err, dict) else None
        except ValueError:
            err = None
        if isinstance(err, dict):
            record.error_code = err.get("code") or err.get("type")
            record.error_type = err.get("type")
        elif record.status == 499:
            record.error_code = "client_disconnected"
    server = getattr(getattr(scope.get("app"), "state", None), "server", None)
    if server is not None:
        if record.model is None:
            record.model, record.model_version = server.served.name, server.served.version
        record.engine = getattr(server.backend, "engine", None)
