"""The result cache: deterministic answers replayed, never across tenants or model versions.

Only deterministic requests are cached (temperature 0, or a fixed seed; `cacheable`). The
key is a SHA-256 over the tenant (the key's id, or its team where the config shares by
team), the served model's name **and version**, the route, and the request normalised
(sorted JSON of the parameters that change the answer; the alias the client named,
`stream` and `user` do not). So a new champion (a new version) never serves the old one's
answers, and one tenant never sees another's.

Values are JSON (the choices' text and finish reasons, and usage) in Redis with a TTL,
shared by every replica; without a Redis URL an in-process LRU with the same TTL. Redis
trouble bypasses the cache (the breaker in redis_health.py), it never fails a request.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import OrderedDict
from typing import Any, Callable

from tuneloop.gateway.redis_health import RedisHealth, RedisUnavailable

log = logging.getLogger("bentoml.tuneloop.gateway")

# Parameters that do not change the answer (or are rendered per response).
IGNORED = {"model", "stream", "stream_options", "user", "metadata", "store", "service_tier", "parallel_tool_calls"}


def cacheable(body: dict[str, Any]) -> bool:
    """Deterministic requests only; logprobs are not replayed (they are rendered per token)."""
    logprobs = body.get("logprobs")  # completions: 0-5 (0 still asks for them), chat: a bool
    if (logprobs is not None and logprobs is not False) or body.get("top_logprobs") is not None:
        return False
    temperature = body.get("temperature")
    return temperature == 0 or body.get("seed") is not None


def cache_key(tenant: str, model_id: str, route: str, body: dict[str, Any]) -> str:
    normalised = {k: v for k, v in body.items() if k not in IGNORED and v is not None}
    blob = json.dumps([tenant, model_id, route, normalised], sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(blob.encode()).hexdigest()


class _LRU:
    def __init__(self, max_entries: int):
        self.max_entries = max_entries
        self._items: OrderedDict[str, tuple[float, str]] = OrderedDict()

    def get(self, key: str) -> str | None:
        item = self._items.get(key)
        if item is None:
            return None
        if item[0] < time.monotonic():
            del self._items[key]
            return None
        self._items.move_to_end(key)
        return item[1]

    def put(self, key: str, value: str, ttl_s: float) -> None:
        self._items[key] = (time.monotonic() + ttl_s, value)
        self._items.move_to_end(key)
        while len(self._items) > self.max_entries:
            self._items.popitem(last=False)


class ResultCache:
    def __init__(
        self,
        ttl_s: float,
        max_entries: int,
        health: RedisHealth | None = None,
        namespace: str = "tuneloop:cache:",
        on_event: Callable[[str], None] | None = None,
    ):
        self.ttl_s = ttl_s
        self.health = health
        self.namespace = namespace
        self.local = None if health is not None else _LRU(max_entries)
        self.on_event = on_event or (lambda kind: None)

    async def get(self, key: str) -> dict | None:
        if self.local is not None:
            raw = self.local.get(key)
        else:
            assert self.health is not None  # no local store: the entries are in Redis
            try:
                raw = await self.health.call(self.health.client.get(self.namespace + key))
            except RedisUnavailable:
                self.on_event("bypass")
                return None
        return self.found(raw)

    def found(self, raw: str | None) -> dict | None:
        """A lookup's stored value (None: a miss) as the answer, counted as a hit or a miss."""
        self.on_event("hit" if raw is not None else "miss")
        return json.loads(raw) if raw is not None else None

    async def put(self, key: str, value: dict) -> None:
        raw = json.dumps(value, separators=(",", ":"))
        if self.local is not None:
            self.local.put(key, raw, self.ttl_s)
            return
        assert self.health is not None  # no local store: the entries are in Redis
        try:
            await self.health.call(self.health.client.set(self.namespace + key, raw, px=int(self.ttl_s * 1000)))
        except RedisUnavailable:
            self.on_event("bypass")
