"""The API's ASGI middlewares: the hooks around every /v1 request (HooksMiddleware), the
server's own time, OpenAI-shaped errors for what is answered outside the app, the guard of
internal routes and the served OpenAPI spec. Each acts on the OpenAI API's HTTP requests
under one path prefix (ApiMiddleware) and passes everything else (health, metrics,
websockets, lifespan) through untouched."""

from __future__ import annotations

import hmac
import json
import time

from tuneloop.api.errors import error_response
from tuneloop.api.handlers import CALL_KEY, HOOKS_KEY
from tuneloop.gateway.hook import RequestGate
from tuneloop.hooks import CallHook, Hooks
from tuneloop.requestlog.hook import RequestLogHook
from tuneloop.requestlog.record import RequestRecord
from tuneloop.serving.errors import RouteNotFound, ServingError, error_for_status


class ApiMiddleware:
    """Calls `handle(scope, receive, send)` for HTTP requests under `prefix` (one or a tuple);
    subclasses implement it. Everything else goes straight to the wrapped app."""

    def __init__(self, app, prefix: str | tuple[str, ...] = "/v1/"):
        self.app = app
        self.prefix = prefix

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith(self.prefix):
            return await self.app(scope, receive, send)
        return await self.handle(scope, receive, send)

    async def handle(self, scope, receive, send):
        raise NotImplementedError


def request_hooks(state) -> list[CallHook]:
    """The hooks of one request, outermost first: the request log (it sees refusals too),
    then the gateway. app.state.request_log / app.state.gateway None: that hook is left out."""
    hooks: list[CallHook] = []
    if getattr(state, "request_log", None) is not None:
        hooks.append(RequestLogHook(state.request_log))
    if getattr(state, "gateway", None) is not None:
        hooks.append(RequestGate(state.gateway))
    return hooks


class HooksMiddleware(ApiMiddleware):
    """Every /v1 request: its record (RequestRecord, the facts the routes and hooks write)
    and its hooks (request_hooks) on the scope's state; each hook's on_request before the
    route (a ServingError refuses the request, answered here in OpenAI's shape), its headers
    on the response (a header the response carries already is not added twice), the body
    as it goes, and on_request_end once the response has ended however it ended."""

    async def handle(self, scope, receive, send):
        hooks = Hooks(request_hooks(getattr(scope.get("app"), "state", None)))
        call = RequestRecord(route=scope["path"], method=scope.get("method", ""))
        state = scope.setdefault("state", {})
        state[CALL_KEY], state[HOOKS_KEY] = call, hooks
        if not hooks.hooks:
            return await self.app(scope, receive, send)

        async def hooked_send(message):
            if message["type"] == "http.response.start":
                call.status = int(message["status"])
                headers = list(message.get("headers", []))
                present = {k.lower() for k, _ in headers}
                added = [(k, v) for k, v in await hooks.response_headers(call, call.status) if k not in present]
                message = {**message, "headers": headers + added}
            elif message["type"] == "http.response.body":
                hooks.on_response_body(call, message.get("body", b""))
            await send(message)

        try:
            try:
                await hooks.on_request(call, scope)
            except ServingError as err:
                return await error_response(err)(scope, receive, hooked_send)
            await self.app(scope, receive, hooked_send)
        except BaseException:
            if call.status is None:
                call.status = 500
            raise
        finally:
            hooks.on_request_end(call, scope)


class ProcessingTimeMiddleware(ApiMiddleware):
    """The server's own time on every /v1 response: the milliseconds from the request
    reaching the app to its response starting (the whole answer for a JSON response, the
    time to the stream's start for SSE). Sent as OpenAI sends it, `openai-processing-ms`
    (whole milliseconds), and as the W3C `server-timing: app;dur=<ms>` with microseconds,
    which benchmarks read: a cache hit takes about a millisecond. What a client measures on
    top of it is the HTTP server, the network and the client itself."""

    HEADERS = (b"openai-processing-ms", b"server-timing")

    async def handle(self, scope, receive, send):
        start = time.perf_counter()

        async def send_with_time(message):
            if message["type"] == "http.response.start":
                # Both headers from one reading rounded to microseconds, so the whole
                # milliseconds are that reading rounded (0.5004 ms is "0.500" and "0", not "1").
                ms = round((time.perf_counter() - start) * 1000, 3)
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() not in self.HEADERS]
                headers += [
                    (b"openai-processing-ms", f"{ms:.0f}".encode()),
                    (b"server-timing", f"app;dur={ms:.3f}".encode()),
                ]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_time)


# OpenAI shapes for errors answered outside the FastAPI app


class OpenAIErrorMiddleware:
    """Rewrites error responses that are not OpenAI-shaped (BentoML's own 400/404/429/503/504,
    Starlette's plain-text 404/405) into {"error": {...}}, keeping the status (422 -> 400).

    Health and metrics endpoints keep their own bodies (probes read only the status).
    """

    SKIP = ("/livez", "/readyz", "/healthz", "/metrics")

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path", "") in self.SKIP:
            return await self.app(scope, receive, send)
        start: dict | None = None
        chunks: list[bytes] = []

        async def capture(message):
            nonlocal start
            if message["type"] == "http.response.start":
                if message["status"] < 400:
                    start = None
                    return await send(message)
                start = message
                return None
            if message["type"] == "http.response.body" and start is not None:
                chunks.append(message.get("body", b""))
                if message.get("more_body"):
                    return None
                return await self._send_rewritten(scope, start, b"".join(chunks), send)
            return await send(message)

        await self.app(scope, receive, capture)

    @staticmethod
    async def _send_rewritten(scope, start: dict, body: bytes, send) -> None:
        status = start["status"]
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() not in (b"content-length", b"content-type")]
        try:
            data = json.loads(body or b"null")
        except ValueError:
            data = body.decode("utf-8", "replace").strip()
        if isinstance(data, dict) and isinstance(data.get("error"), dict) and "message" in data["error"]:
            new_body, new_status = body, status  # already OpenAI-shaped
        else:
            message = f"{scope.get('method')} {scope.get('path')}: {_message_of(data) or f'HTTP {status}'}"
            err = error_for_status(status, message)
            new_body, new_status = json.dumps(err.body()).encode(), err.status
            if err.headers and not any(k.lower() == b"retry-after" for k, _ in headers):
                headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
        headers += [(b"content-type", b"application/json"), (b"content-length", str(len(new_body)).encode())]
        await send({"type": "http.response.start", "status": new_status, "headers": headers})
        await send({"type": "http.response.body", "body": new_body, "more_body": False})


def _message_of(data) -> str:
    if isinstance(data, str):
        return data
    if isinstance(data, dict):
        msg = data.get("error") or data.get("detail") or data.get("message") or ""
        detail = data.get("detail")
        if isinstance(detail, list) and detail and isinstance(detail[0], dict):
            d = detail[0]
            loc = ".".join(str(p) for p in d.get("loc", ()))
            msg = f"{msg}: {loc}: {d.get('msg')}" if msg else f"{loc}: {d.get('msg')}"
        return str(msg)
    if isinstance(data, (list, tuple)) and data:
        return _message_of(data[0])
    return ""


class InternalRoutesGuard:
    """Makes routes under `prefix` unreachable from outside the process: a request there
    without the process's own token (header `x-tuneloop-internal`, a random secret made at
    start-up and given only to the in-process client) is answered 404, as if the route did
    not exist, before anything parses its body."""

    HEADER = b"x-tuneloop-internal"

    def __init__(self, app, prefix: str, token: str):
        self.app, self.prefix, self.token = app, prefix, token.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("path", "").startswith(self.prefix):
            given = dict(scope.get("headers") or []).get(self.HEADER, b"")
            if not hmac.compare_digest(given, self.token):
                err = RouteNotFound(f"{scope.get('method')} {scope.get('path')}: not found")
                body = json.dumps(err.body()).encode()
                await send(
                    {
                        "type": "http.response.start",
                        "status": err.status,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": body, "more_body": False})
                return
        await self.app(scope, receive, send)


class PublicOpenAPISpec:
    """The served OpenAPI spec (BentoML's `/docs.json`) as clients should read it: without
    the routes under `hide_prefix` (nobody outside can call them), and declared as OpenAPI
    3.1, which is what its schemas are (pydantic's JSON Schema: numeric exclusiveMinimum,
    `type: null`); BentoML labels them 3.0.2, and 3.0 tools then reject them."""

    def __init__(self, app, hide_prefix: str, path: str = "/docs.json"):
        self.app, self.hide_prefix, self.path = app, hide_prefix, path

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") != self.path:
            return await self.app(scope, receive, send)
        start: dict = {}
        chunks: list[bytes] = []

        async def capture(message):
            if message["type"] == "http.response.start":
                start.update(message)
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
                if not message.get("more_body"):
                    body = b"".join(chunks)
                    if start.get("status") == 200:
                        body = json.dumps(self.rewrite(json.loads(body))).encode()
                    headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
                    await send({**start, "headers": headers + [(b"content-length", str(len(body)).encode())]})
                    await send({"type": "http.response.body", "body": body, "more_body": False})
            else:
                await send(message)

        await self.app(scope, receive, capture)

    def rewrite(self, spec: dict) -> dict:
        spec["openapi"] = "3.1.0"
        spec["paths"] = {k: v for k, v in spec.get("paths", {}).items() if not k.startswith(self.hide_prefix)}
        return spec
