"""One Redis connection for the gateway, behind a circuit breaker.

Every call has a short deadline (`timeout_s` to connect and to answer, no client-side
retries, and an asyncio deadline as a backstop), so a
dead or hung Redis costs a request at most one timeout. After `failures` consecutive
failures the breaker opens: calls fail at once (RedisUnavailable) for `reset_s`, then one
probe call is let through (half-open); its success closes the breaker again. Each state
change is one log line and a metric (`on_change`), not one line per request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from tuneloop.gateway.redis_pipe import RedisPipe

log = logging.getLogger("bentoml.tuneloop.gateway")


class RedisUnavailable(Exception):
    """Redis failed, timed out, or the breaker is open."""


class RedisHealth:
    CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"

    def __init__(
        self,
        url: str,
        timeout_s: float = 0.25,
        failures: int = 3,
        reset_s: float = 5.0,
        on_change: Callable[[str], None] | None = None,
    ):
        self.url = url
        self.timeout_s = timeout_s
        # One pipelined connection (redis_pipe.py): no pool to run dry in a burst, and a
        # burst never looks like a Redis failure to the breaker.
        self.client = RedisPipe(url, timeout_s)
        self.failures_to_open = failures
        self.reset_s = reset_s
        self.on_change = on_change
        self.state = self.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._probing = False

    def _set(self, state: str, why: str) -> None:
        if state == self.state:
            return
        self.state = state
        (log.warning if state == self.OPEN else log.info)(
            "redis %s: circuit %s (%s)", self.url.split("@")[-1], state, why
        )
        if self.on_change:
            self.on_change(state)

    async def call(self, awaitable):
        """Await a Redis command under the breaker; RedisUnavailable if it fails or may not run."""
        probe = False
        if self.state == self.OPEN:
            if time.monotonic() - self._opened_at < self.reset_s or self._probing:
                _discard(awaitable)
                raise RedisUnavailable("circuit open")
            self._probing = probe = True
            self._set(self.HALF_OPEN, "probing")
        try:
            async with asyncio.timeout(self.timeout_s * 2 + 0.05):
                result = await awaitable
        except Exception as exc:
            self._failed(exc)
            raise RedisUnavailable(f"{type(exc).__name__}: {exc}") from None
        finally:
            if probe:
                self._probing = False
        self._failures = 0
        if self.state != self.CLOSED:
            self._set(self.CLOSED, "a call succeeded")
        return result

    def _failed(self, exc: Exception) -> None:
        self._failures += 1
        if self.state == self.HALF_OPEN or self._failures >= self.failures_to_open:
            self._opened_at = time.monotonic()
            if self.state == self.OPEN:
                return
            self._set(self.OPEN, f"{self._failures} consecutive failures, last {type(exc).__name__}")

    async def close(self) -> None:
        try:
            await self.client.aclose()
        except Exception:  # closing a connection to a dead server
            pass


def _discard(awaitable) -> None:
    close = getattr(awaitable, "close", None)  # a coroutine never awaited: no "never awaited" warning
    if close:
        close()
