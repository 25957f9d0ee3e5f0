"""One finished /v1 request as the log keeps it.

Every /v1 request has one (the API's HooksMiddleware makes it): the routes and the hooks
(the gateway: the key, the cache, the screening) fill it while they work, and the request
log's hook (hook.py) hands it over once, when the response has ended however it ended. Texts are held as the
gateway let them through: the prompt after its screening, the completions as the client
got them; `prompt_redacted` / `completion_redacted` say whether the gateway redacted them
already (else the writer does, off the event loop, before anything is written).
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from time import perf_counter
from time import time as wall_clock
from typing import Any

HOST = socket.gethostname()


def utc_iso(ts: float) -> str:
    """An ISO 8601 UTC timestamp with milliseconds (what the log and its readers use)."""
    return datetime.fromtimestamp(ts, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def new_request_id() -> str:
    """OpenAI's x-request-id shape: req_ + 32 hex digits."""
    return f"req_{uuid.uuid4().hex}"


@dataclass
class RequestRecord:
    request_id: str = field(default_factory=new_request_id)
    time: str = ""  # when the request arrived (UTC, ISO 8601)
    route: str = ""
    method: str = ""
    response_id: str | None = None  # the body's `id` (chatcmpl-..., cmpl-...), when there is one
    key_id: str | None = None  # the API key's public id, never the key
    tenant: str | None = None
    model: str | None = None  # the served model's registered name
    model_version: str | None = None
    engine: str | None = None
    stream: bool | None = None
    prompt: Any = None  # completions: the prompt text(s); chat: the messages [{role, content}]
    completions: list[str] | None = None  # per choice, as the client got it
    finish_reasons: list[str | None] | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_s: float | None = None  # arrival -> the first generated token (server side)
    latency_s: float | None = None  # arrival -> the end of the response
    status: int | None = None  # the HTTP status (a stream that failed midway is still 200)
    error_code: str | None = None  # OpenAI's error code/type, or client_disconnected
    error_type: str | None = None
    cache: str | None = None  # hit | miss | None (cache off or not cacheable)
    prompt_filter: dict | None = None  # {flagged, categories, rules, score}
    output_filter: list[dict | None] | None = None
    pii_entities: list[str] | None = None  # entity types found (and removed) in the prompt
    prompt_redacted: bool = False
    completion_redacted: bool = False
    host: str = HOST
    pid: int = field(default_factory=os.getpid)
    started: float = field(default_factory=perf_counter, repr=False)
    _first_token: float | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.time:
            self.time = utc_iso(wall_clock())

    def first_token(self) -> None:
        if self._first_token is None:
            self._first_token = perf_counter()
            self.ttft_s = round(self._first_token - self.started, 6)

    def finish(self) -> None:
        self.latency_s = round(perf_counter() - self.started, 6)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("started")
        out.pop("_first_token")
        out["kind"] = "request"
        return out
