"""Per-key rate limits: requests/min and tokens/min, exact across workers and replicas.

Each key has two token buckets (requests, tokens) that refill continuously at limit/60 per
second up to the limit: a burst of `limit` is allowed at once, and OpenAI's
`x-ratelimit-reset-*` is the time until a bucket is full again. With Redis, check-and-count
is one Lua script (atomic: no two callers can both take the last unit), on Redis's own
clock (replicas' clocks do not matter). Without Redis, MemoryLimiter has the same semantics
for one process.

Tokens are reserved before generation (prompt + max_tokens) and the unused part is refunded
when the response ends; `acquire` takes requests and tokens together, so a call either gets
both or neither (a generation request takes its request and its tokens in one call).
`refund_later` gives tokens back without a call of its own: RedisLimiter sends them with the
key's next call from this process, or within REFUND_DELAY_S when none comes (other
replicas see them that much later, which only ever errs towards the limit).
`certain_refusal` says, without a call, when one more request cannot pass: the requests
bucket as last seen here, refilled since, holds less than one (other replicas can only have
taken more), so a client over its limit is refused before any work is done for it.

A Redis that fails or hangs is noticed within `redis_timeout_s` (socket timeouts, no
retries) and trips a circuit breaker (tuneloop/gateway/redis_health.py); what happens
then is the configured mode: `open` falls back to a per-process MemoryLimiter (limits hold
per replica while Redis is away), `closed` refuses with 503.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tuneloop.gateway.redis_health import RedisHealth, RedisUnavailable

if TYPE_CHECKING:
    from tuneloop.gateway.redis_pipe import Script

WINDOW_S = 60.0
REFUND_DELAY_S = 0.05  # longest a refund waits for the key's next call (RedisLimiter)


@dataclass(frozen=True)
class Limits:
    requests_per_minute: int
    tokens_per_minute: int


@dataclass(frozen=True)
class Decision:
    allowed: bool
    limits: Limits
    remaining_requests: int
    remaining_tokens: int
    reset_requests_s: float  # until the requests bucket is full again
    reset_tokens_s: float
    retry_after_s: float = 0.0  # when refused: until both would fit
    refused_by: str | None = None  # "requests" | "tokens" when refused
    source: str = "redis"  # redis | memory | fallback (Redis away, fail-open)


def _refill(level: float, last: float, now: float, limit: int) -> float:
    return min(float(limit), level + max(0.0, now - last) * limit / WINDOW_S)


def _decide(req: tuple[float, int, int], tok: tuple[float, int, int]) -> tuple[bool, float, str | None]:
    """(level, limit, cost) per bucket -> allowed, retry_after_s, which bucket refused."""
    worst, by = 0.0, None
    for name, (level, limit, cost) in (("requests", req), ("tokens", tok)):
        if cost > level:
            wait = math.inf if cost > limit else (cost - level) * WINDOW_S / limit
            if wait > worst:
                worst, by = wait, name
    return by is None, worst, by


class MemoryLimiter:
    """The same buckets in one process (single replica, or the fail-open fallback).

    Bounded: at most max_keys buckets (least recently used go first: a dropped bucket is
    a full one again, which only ever errs towards the limit, never beyond it for a
    key seen within the last max_keys keys).
    """

    def __init__(self, max_keys: int = 100_000, source: str = "memory"):
        self._buckets: OrderedDict[str, list[float]] = OrderedDict()  # key -> [req, req_t, tok, tok_t]
        self.max_keys = max_keys
        self.source = source

    def _bucket(self, key: str, limits: Limits, now: float) -> list[float]:
        b = self._buckets.get(key)
        if b is None:
            b = [float(limits.requests_per_minute), now, float(limits.tokens_per_minute), now]
        _keep(self._buckets, key, b, self.max_keys)
        b[0] = _refill(b[0], b[1], now, limits.requests_per_minute)
        b[2] = _refill(b[2], b[3], now, limits.tokens_per_minute)
        b[1] = b[3] = now
        return b

    async def acquire(self, key: str, limits: Limits, requests: int = 1, tokens: int = 0) -> Decision:
        now = time.monotonic()
        b = self._bucket(key, limits, now)
        allowed, wait, by = _decide(
            (b[0], limits.requests_per_minute, requests), (b[2], limits.tokens_per_minute, tokens)
        )
        if allowed:
            b[0] -= requests
            b[2] -= tokens
        return self._decision(allowed, limits, b, wait, by)

    async def refund(self, key: str, limits: Limits, tokens: int) -> None:
        self.refund_later(key, limits, tokens)

    def refund_later(self, key: str, limits: Limits, tokens: int) -> None:
        if tokens > 0:
            b = self._bucket(key, limits, time.monotonic())
            b[2] = min(float(limits.tokens_per_minute), b[2] + tokens)

    def certain_refusal(self, key: str, limits: Limits) -> Decision | None:
        """The refusal of one more request when no request unit is left now (nothing taken)."""
        b = self._buckets.get(key)
        if b is None:
            return None
        now = time.monotonic()
        level = _refill(b[0], b[1], now, limits.requests_per_minute)
        if level >= 1:
            return None
        tokens = _refill(b[2], b[3], now, limits.tokens_per_minute)
        return _refusal(limits, level, tokens, self.source)

    async def close(self) -> None:
        pass

    def _decision(self, allowed, limits, b, wait, by) -> Decision:
        return Decision(
            allowed,
            limits,
            int(b[0]),
            int(b[2]),
            (limits.requests_per_minute - b[0]) * WINDOW_S / limits.requests_per_minute,
            (limits.tokens_per_minute - b[2]) * WINDOW_S / limits.tokens_per_minute,
            wait,
            by,
            self.source,
        )


def _keep(store: OrderedDict, key: str, value, max_keys: int) -> None:
    """store[key] = value as its most recently used entry; past max_keys the least recently
    used go."""
    store[key] = value
    store.move_to_end(key)
    while len(store) > max_keys:
        store.popitem(last=False)


def _refusal(limits: Limits, requests_level: float, tokens_level: float, source: str) -> Decision:
    """A refusal by the requests bucket at these levels (requests_level < 1)."""
    rl, tl = limits.requests_per_minute, limits.tokens_per_minute
    return Decision(
        False,
        limits,
        0,
        int(tokens_level),
        (rl - requests_level) * WINDOW_S / rl,
        (tl - tokens_level) * WINDOW_S / tl,
        (1 - requests_level) * WINDOW_S / rl,
        "requests",
        source,
    )


# KEYS[1]: the key's bucket hash; KEYS[2], when given, a result-cache entry: its value is
# returned, and the costs are taken only when there is one (a cache hit's request unit in
# the same call as its lookup; a miss takes nothing). ARGV: requests limit, tokens limit,
# requests cost, tokens cost, mode ("acquire" | "refund"), tokens refunded first (acquire:
# refunds sent along). Levels refill on Redis's clock; the hash expires once both buckets
# would be full again (no memory kept for idle keys). Both keys on one Redis (a cluster
# would need them in one hash slot; the gateway's connection does not speak cluster).
_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local rl, tl = tonumber(ARGV[1]), tonumber(ARGV[2])
local rc, tc = tonumber(ARGV[3]), tonumber(ARGV[4])
local v = false
if #KEYS > 1 then
  v = redis.call('GET', KEYS[2])
  if not v then rc = 0; tc = 0 end
end
local s = redis.call('HMGET', KEYS[1], 'r', 'tok', 'ts')
local r, k, ts = tonumber(s[1]), tonumber(s[2]), tonumber(s[3])
if r == nil then r = rl; k = tl; ts = now end
local dt = math.max(0, now - ts)
r = math.min(rl, r + dt * rl / 60)
k = math.min(tl, k + dt * tl / 60)
local back = tonumber(ARGV[6] or '0')
if back > 0 then k = math.min(tl, k + back) end
local allowed = 1
if ARGV[5] == 'refund' then
  k = math.min(tl, k + tc)
elseif rc > r or tc > k then
  allowed = 0
else
  r = r - rc
  k = k - tc
end
redis.call('HSET', KEYS[1], 'r', tostring(r), 'tok', tostring(k), 'ts', tostring(now))
local full = math.max((rl - r) * 60 / rl, (tl - k) * 60 / tl)
redis.call('PEXPIRE', KEYS[1], math.ceil(full * 1000) + 1000)
return {allowed, tostring(r), tostring(k), v}
"""


class RedisLimiter:
    """The buckets in Redis, shared by every worker and replica."""

    def __init__(self, health: RedisHealth, on_error: str = "open", namespace: str = "tuneloop:rl:"):
        self.health = health
        self.on_error = on_error
        self.namespace = namespace
        self.fallback = MemoryLimiter(source="fallback")
        self._script: Script | None = None  # registered at the first call
        self._refunds: dict[str, list] = {}  # key -> [limits, tokens]: refunds not sent yet
        self._flush: asyncio.TimerHandle | None = None
        self._flushing: set[asyncio.Task] = set()
        # key -> (requests level, tokens level, local time just before the call that saw them,
        # limits): what certain_refusal reads. At most max_keys (least recently used go first).
        self._seen: OrderedDict[str, tuple[float, float, float, Limits]] = OrderedDict()
        self.max_keys = 100_000

    async def _run(
        self, key: str, limits: Limits, requests: int, tokens: int, mode: str, back: int = 0, cached: str | None = None
    ):
        client = self.health.client
        if self._script is None:
            self._script = client.register_script(_SCRIPT)
        keys = [self.namespace + key] if cached is None else [self.namespace + key, cached]
        return await self.health.call(
            self._script(
                keys=keys, args=[limits.requests_per_minute, limits.tokens_per_minute, requests, tokens, mode, back]
            )
        )

    async def acquire(self, key: str, limits: Limits, requests: int = 1, tokens: int = 0) -> Decision:
        try:
            return (await self._acquire(key, limits, requests, tokens))[0]
        except RedisUnavailable:
            if self.on_error == "closed":
                raise
            return await self.fallback.acquire(key, limits, requests, tokens)

    async def acquire_if_cached(
        self, key: str, limits: Limits, cached: str, requests: int = 1
    ) -> tuple[Decision | None, str | None]:
        """One call: the value of the Redis key `cached` (a result-cache entry) and, only when
        there is one, `requests` taken from the key's bucket. (None, None) on a miss: nothing
        taken. RedisUnavailable when Redis fails (nothing taken here; the caller bypasses the
        cache, and its later acquire meets the configured mode)."""
        decision, value = await self._acquire(key, limits, requests, 0, cached)
        return (decision, value) if value is not None else (None, None)

    async def _acquire(
        self, key: str, limits: Limits, requests: int, tokens: int, cached: str | None = None
    ) -> tuple[Decision, str | None]:
        pending = self._refunds.pop(key, None)
        back = pending[1] if pending is not None else 0
        sent_at = time.monotonic()
        try:
            allowed, r, k, *value = await self._run(key, limits, requests, tokens, "acquire", back, cached)
        except RedisUnavailable:
            if back:
                await self.fallback.refund(key, limits, back)
            raise
        r, k = float(r), float(k)
        _keep(self._seen, key, (r, k, sent_at, limits), self.max_keys)
        if allowed:
            wait, by = 0.0, None
        else:  # the script did not take anything: say which bucket refused, and for how long
            _, wait, by = _decide((r, limits.requests_per_minute, requests), (k, limits.tokens_per_minute, tokens))
        return Decision(
            bool(allowed),
            limits,
            int(r),
            int(k),
            (limits.requests_per_minute - r) * WINDOW_S / limits.requests_per_minute,
            (limits.tokens_per_minute - k) * WINDOW_S / limits.tokens_per_minute,
            wait,
            by,
        ), (value[0] if value else None)

    async def refund(self, key: str, limits: Limits, tokens: int) -> None:
        if tokens <= 0:
            return
        try:
            await self._run(key, limits, 0, tokens, "refund")
        except RedisUnavailable:
            await self.fallback.refund(key, limits, tokens)

    def refund_later(self, key: str, limits: Limits, tokens: int) -> None:
        """Give tokens back with the key's next call, or within REFUND_DELAY_S (call on the loop)."""
        if tokens <= 0:
            return
        pending = self._refunds.get(key)
        if pending is None:
            self._refunds[key] = [limits, tokens]
        else:
            pending[0], pending[1] = limits, pending[1] + tokens
        if self._flush is None:
            self._flush = asyncio.get_running_loop().call_later(REFUND_DELAY_S, self._send_refunds)

    def _send_refunds(self) -> None:
        self._flush = None
        if self._refunds:
            task = asyncio.get_running_loop().create_task(self._refund_all())
            self._flushing.add(task)
            task.add_done_callback(self._flushing.discard)

    async def _refund_all(self) -> None:
        pending, self._refunds = self._refunds, {}
        await asyncio.gather(*(self.refund(key, limits, tokens) for key, (limits, tokens) in pending.items()))

    def certain_refusal(self, key: str, limits: Limits) -> Decision | None:
        """The refusal of one more request when, as last seen here and refilled since, the
        key's requests bucket holds less than one (None: ask Redis)."""
        if self.health.state != RedisHealth.CLOSED:
            return self.fallback.certain_refusal(key, limits) if self.on_error == "open" else None
        seen = self._seen.get(key)
        if seen is None or seen[3] != limits:
            return None
        r, k, at, _ = seen
        now = time.monotonic()
        level = _refill(r, at, now, limits.requests_per_minute)
        return _refusal(limits, level, _refill(k, at, now, limits.tokens_per_minute), "redis") if level < 1 else None

    async def close(self) -> None:
        """Send the refunds still waiting."""
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        await self._refund_all()
        if self._flushing:
            await asyncio.gather(*self._flushing, return_exceptions=True)


def format_duration(seconds: float) -> str:
    """OpenAI's reset format: 120ms, 1s, 17.5s, 6m0s, 1h2m3s."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{max(1, round(seconds * 1000))}ms"
    whole_minutes, rest = divmod(seconds, 60)
    hours, minutes = divmod(int(whole_minutes), 60)
    secs = f"{rest:.3f}".rstrip("0").rstrip(".")
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def rate_limit_headers(d: Decision) -> dict[str, str]:
    return {
        "x-ratelimit-limit-requests": str(d.limits.requests_per_minute),
        "x-ratelimit-remaining-requests": str(max(0, d.remaining_requests)),
        "x-ratelimit-reset-requests": format_duration(d.reset_requests_s),
        "x-ratelimit-limit-tokens": str(d.limits.tokens_per_minute),
        "x-ratelimit-remaining-tokens": str(max(0, d.remaining_tokens)),
        "x-ratelimit-reset-tokens": format_duration(d.reset_tokens_s),
    }
