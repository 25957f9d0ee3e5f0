"""What a client sends, kept from hurting the server or anyone else: request bodies bounded
before they are parsed, client text made safe for logs, paths made safe for metrics.

- BodyLimit (ASGI, in front of every route): a body over serving.max_request_bytes is
  answered 413 in OpenAI's error shape before it is parsed: at once from its Content-Length,
  else as soon as the bytes read pass the limit. Measured before it: a 10 MB prompt took
  11-12 s to be refused while another client's request waited behind it, and a 100 MB one
  grew the worker to 22 GB until the kernel killed it.
- escape(): control characters (newlines included) and Unicode line separators in client
  text written as escapes, so a path like `/x%0A<forged line>` cannot write a log line of its
  own. install_log_escaping() applies it to every log record's arguments in the process
  (BentoML's access log passes the path as an argument, as tuneloop's own lines do).
- metric_path(): a request path as a metrics label: a route the server has, or "/{unknown}".
  BentoML labels its request metrics with the raw path, so 2,000 GETs to unique unknown paths
  grew /metrics from 1.7 to 10.7 MB (NUL bytes included) and its scrape from 0.41 to 2.85 s.
  protect_bentoml_middlewares() gives BentoML's metrics and access-log middlewares the
  collapsed / escaped path while the app behind them sees the path as sent.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Callable, Iterable

from tuneloop.serving.errors import RequestTooLarge

# C0 and C1 controls (newline, carriage return, NUL, escape, ...) and the Unicode line and
# paragraph separators: anything that can end or forge a log line, or reach a terminal.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def escape(text: str) -> str:
    """text with every control character and line separator written as \\xNN / \\uNNNN."""
    if not _UNSAFE.search(text):
        return text
    return _UNSAFE.sub(
        lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100 else f"\\u{ord(m.group()):04x}", text
    )


def _safe_arg(value):
    if isinstance(value, str):
        return escape(value)
    if isinstance(value, bytes):
        return escape(value.decode("utf-8", "backslashreplace"))
    if isinstance(value, BaseException):
        return escape(str(value))
    return value


_installed = False


def install_log_escaping() -> None:
    """Every log record of this process gets its arguments escaped (idempotent). The format
    string is the program's own and stays as written; tracebacks are not touched."""
    global _installed
    if _installed:
        return
    _installed = True
    make = logging.getLogRecordFactory()

    def factory(*args, **kwargs) -> logging.LogRecord:
        record = make(*args, **kwargs)
        if record.args:
            if isinstance(record.args, dict):
                record.args = {k: _safe_arg(v) for k, v in record.args.items()}
            else:
                record.args = tuple(_safe_arg(a) for a in record.args)
        elif isinstance(record.msg, str) and record.msg != escape(record.msg) and "\n" not in record.msg.strip("\n"):
            record.msg = escape(record.msg)  # a one-line message built with client text in it
        return record

    logging.setLogRecordFactory(factory)


UNKNOWN_PATH = "/{unknown}"


class RouteNames:
    """The paths the server answers, as metric labels: a static route by its path, a route
    with parameters by its template (/v1/models/{model}), anything else as UNKNOWN_PATH."""

    def __init__(self, routes: Iterable, extra: Iterable[str] = ()):
        self.static = set(extra)
        self.patterns: list[tuple[re.Pattern, str]] = []
        for route in routes:
            path = getattr(route, "path", None)
            regex = getattr(route, "path_regex", None)
            if path is None:
                continue
            if "{" in path and regex is not None:
                self.patterns.append((regex, path))
            else:
                self.static.add(path)

    def __call__(self, path: str) -> str:
        if path in self.static:
            return path
        for regex, template in self.patterns:
            if regex.match(path):
                return template
        return UNKNOWN_PATH


# Paths BentoML serves itself (probes, metrics, its docs).
BENTOML_PATHS = ("/", "/livez", "/readyz", "/healthz", "/metrics", "/docs", "/docs.json", "/schema.json")


def protect_bentoml_middlewares(metric_path: Callable[[str], str]) -> None:
    """BentoML's request metrics see metric_path(path) and its access log the escaped path;
    the app behind them sees the path as sent. Patches the two middleware classes' __call__
    (idempotent): they sit in front of every middleware a service may add."""
    from bentoml._internal.server.http.access import AccessLogMiddleware
    from bentoml._internal.server.http.instruments import HTTPTrafficMetricsMiddleware, RunnerTrafficMetricsMiddleware

    def shown_as(cls, shown: Callable[[str], str]) -> None:
        original = cls.__call__
        if getattr(original, "_tuneloop_path", False):
            return

        async def call(self, scope, receive, send):
            path = scope.get("path")
            if scope.get("type") not in ("http", "websocket") or path is None or shown(path) == path:
                return await original(self, scope, receive, send)
            inner = self.app

            async def restore(inner_scope, inner_receive, inner_send):
                return await inner({**inner_scope, "path": path}, inner_receive, inner_send)

            self_view = _With(self, app=restore)
            return await original(self_view, {**scope, "path": shown(path)}, receive, send)

        call._tuneloop_path = True
        cls.__call__ = call

    for cls in (HTTPTrafficMetricsMiddleware, RunnerTrafficMetricsMiddleware):
        shown_as(cls, metric_path)
    shown_as(AccessLogMiddleware, escape)


class _With:
    """A view of a middleware object with some attributes replaced (its `app`, per request)."""

    def __init__(self, target, **attrs):
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_attrs", attrs)

    def __getattr__(self, name):
        attrs = object.__getattribute__(self, "_attrs")
        if name in attrs:
            return attrs[name]
        return getattr(object.__getattribute__(self, "_target"), name)

    def __setattr__(self, name, value):
        setattr(object.__getattribute__(self, "_target"), name, value)


DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20  # serving.max_request_bytes' default (tuneloop/config.py)


class BodyLimit:
    """413 for a request body over `limit` bytes, in OpenAI's shape, before anything parses it.
    The paths in `exempt` pass untouched: their routes bound their own bodies as they stream
    them (the Files API's upload, with its own larger limit)."""

    def __init__(self, app, limit: int, exempt: tuple[str, ...] = ()):
        self.app = app
        self.limit = int(limit)
        self.exempt = frozenset(exempt)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        if scope.get("path") in self.exempt:
            return await self.app(scope, receive, send)
        declared = _content_length(scope)
        if declared is not None and declared > self.limit:
            return await self._refuse(send, f"{declared} bytes")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left while sending: nobody to answer
            body = message.get("body", b"")
            size += len(body)
            if size > self.limit:
                return await self._refuse(send, f"more than {self.limit} bytes")
            chunks.append(body)
            if not message.get("more_body"):
                break
        whole, delivered = b"".join(chunks), False

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": whole, "more_body": False}
            return await receive()  # after the body: only a disconnect can come

        return await self.app(scope, replay, send)

    async def _refuse(self, send, what: str) -> None:
        err = RequestTooLarge(
            f"the request body ({what}) is over this server's limit of {self.limit} bytes (serving.max_request_bytes)"
        )
        body = json.dumps(err.body()).encode()
        await send(
            {
                "type": "http.response.start",
                "status": err.status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body, "more_body": False})


def _content_length(scope) -> int | None:
    for key, value in scope.get("headers", []):
        if key.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
