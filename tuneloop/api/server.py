"""The server object the routes use: the loaded model, its backend (an engine), admission
and the names it answers to. Until it is attached to the app (app.state.server) and warmed
up, every route answers 503."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import Request

from tuneloop.serving.admission import AdmissionController
from tuneloop.serving.engine import GenerationStream, LoadedModel
from tuneloop.serving.errors import Unavailable
from tuneloop.serving.setup import ServedModel


class Backend(Protocol):
    engine: str

    def submit(self, stream: GenerationStream) -> None:
        """Begin generating for stream without waiting for it (tokens arrive in the stream)."""


@dataclass
class OpenAIServer:
    loaded: LoadedModel
    backend: Backend
    admission: AdmissionController
    served: ServedModel
    default_max_tokens: int | None = None  # None: until a stop token or the context window
    max_tokens_limit: int | None = None  # None: the context window
    metrics: Any = None  # tuneloop.serving.metrics.ServingMetrics, or None
    stream_interval_s: float = 0.0  # see GenerationStream: tokens within it share one chunk
    ready: bool = False  # set once warm-up is done
    draining: bool = False  # shutting down: in-flight generations finish, new requests get 503
    # Closed while a new model version is swapped in (tuneloop/serving/hotswap.py): new
    # generations wait here, so each is answered wholly by one version.
    swap_gate: asyncio.Event | None = None

    @property
    def fingerprint(self) -> str:
        return f"tuneloop-{self.backend.engine}"

    @property
    def context_length(self) -> int:
        """The longest request (prompt + completion) served: the engine's where it has one
        (the slots engine's KV cache slots), else the model's context window."""
        return getattr(self.backend, "context_length", None) or self.loaded.context_length

    def count_rejection(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.reject(reason)


def server_of(request: Request) -> OpenAIServer:
    server = getattr(request.app.state, "server", None)
    if server is None or not server.ready:
        raise Unavailable("the model is loading or warming up; retry shortly", retry_after_s=2)
    if server.draining:
        raise Unavailable("the server is shutting down; retry (another replica answers)", retry_after_s=1)
    return server
