"""The base of tuneloop's ASGI middlewares (the gateway, the request log, the server's own
time): each acts on the OpenAI API's HTTP requests, under one path prefix, and passes
everything else (health, metrics, websockets, lifespan) through untouched."""

from __future__ import annotations


class ApiMiddleware:
    """Calls `handle(scope, receive, send)` for HTTP requests under `prefix`; subclasses
    implement it. Everything else goes straight to the wrapped app."""

    def __init__(self, app, prefix: str = "/v1/"):
        self.app = app
        self.prefix = prefix

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith(self.prefix):
            return await self.app(scope, receive, send)
        return await self.handle(scope, receive, send)

    async def handle(self, scope, receive, send):
        raise NotImplementedError
