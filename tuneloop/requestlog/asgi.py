"""The ASGI middleware that makes one RequestRecord per /v1 request and hands it to the
RequestLog exactly once, when the response has ended (sent, failed, or the client left).

It sits outside the gateway's middleware, so refused requests (401, 429) are logged too;
the routes fill in what they know through record_of(request). Every /v1 response gets an
`x-request-id` header (OpenAI's), the id the log and POST /v1/feedback use.
"""

from __future__ import annotations

import json
import logging
import time

from tuneloop.asgi import ApiMiddleware
from tuneloop.gateway.pipeline import STATE_KEY as GATE_KEY
from tuneloop.requestlog.record import RequestRecord, verdict_summary

log = logging.getLogger("tuneloop.requestlog")
STATE_KEY = "tuneloop_record"
_MAX_ERROR_BODY = 16384


def record_of(request) -> RequestRecord | None:
    return request.scope.get("state", {}).get(STATE_KEY)


class RequestLogMiddleware(ApiMiddleware):
    """Without app.state.request_log it lets everything through untouched."""

    async def handle(self, scope, receive, send):
        state = getattr(scope.get("app"), "state", None)
        request_log = getattr(state, "request_log", None)
        if request_log is None:
            return await self.app(scope, receive, send)
        spent = time.thread_time()  # the log's own work on the event loop, reported as its cost
        record = RequestRecord(route=scope["path"], method=scope.get("method", ""))
        scope.setdefault("state", {})[STATE_KEY] = record
        error_body: list[bytes] = []
        spent = time.thread_time() - spent

        async def logged_send(message):
            if message["type"] == "http.response.start":
                record.status = int(message["status"])
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-request-id", record.request_id.encode())]}
            elif message["type"] == "http.response.body" and record.status and record.status >= 400:
                if sum(map(len, error_body)) < _MAX_ERROR_BODY:
                    error_body.append(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, logged_send)
        except BaseException:
            if record.status is None:
                record.status = 500
            raise
        finally:
            started = time.thread_time()
            try:
                _complete(record, scope, error_body)
                request_log.submit(record.to_dict())
            except Exception:  # the log never breaks a response
                log.exception("request log: could not record %s", record.request_id)
            request_log.account(spent + time.thread_time() - started)


def _complete(record: RequestRecord, scope, error_body: list[bytes]) -> None:
    record.finish()
    state = getattr(scope.get("app"), "state", None)
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
    server = getattr(state, "server", None)
    if server is not None:
        if record.model is None:
            record.model, record.model_version = server.served.name, server.served.version
        record.engine = getattr(server.backend, "engine", None)

    # What the gateway knew: the key (its id only), the cache, the prompt's screening.
    gate = scope.get("state", {}).get(GATE_KEY)
    if gate is not None:
        if gate.key is not None:
            record.key_id, record.tenant = gate.key.id, gate.key.tenant
        if record.cache is None and gate.cache_status is not None:
            record.cache = gate.cache_status
        if gate.pii_found:
            record.pii_entities = sorted(set(gate.pii_found))
        if record.prompt_filter is None and gate.prompt_verdicts:
            flagged = [v for v in gate.prompt_verdicts if v.flagged]
            record.prompt_filter = verdict_summary(flagged[0] if flagged else gate.prompt_verdicts[0])
        if record.prompt is None and gate.screened is not None:
            # refused after the screening (PII block, content filter): the screened texts
            record.prompt = gate.screened
            record.prompt_redacted = gate.screened_redacted
