"""Bounded admission: a fixed number of generations queued + running, a deadline each, and
a fair share per tenant.

A server that queues without bound answers every request late once it is overloaded;
refusing early (429 + Retry-After) lets clients back off or go elsewhere. The limit counts
generations, not HTTP requests: a completion with a list of 8 prompts takes 8 slots.
Whoever admits a request releases its ticket when the generation ends, whatever the cause
(done, client disconnected, timed out, failed); release is idempotent.

Fair share: one tenant (an API key) may hold at most its share of the server: `Share`
caps its generations and its tokens in flight (each generation's prompt + max_tokens),
from its tier (gateway.tiers) and a fraction of the whole (gateway.max_share_per_key).
Before it, one paid request (4 prompts x n=128 x 400 tokens) took all 512 places and
another tenant got 226 of 234 requests refused as "server at capacity" for a minute.
A request that needs more than the tenant's whole share can never pass: 400, not 429.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tuneloop.serving.errors import InvalidRequest, Overloaded


@dataclass(frozen=True)
class Share:
    """What one tenant may hold at once (None: no cap of its own)."""

    tenant: str
    generations: int | None = None
    tokens: int | None = None


@dataclass
class Ticket:
    slots: int
    deadline: float  # time.monotonic() seconds; asyncio's loop.time() uses the same clock
    _controller: "AdmissionController" = field(repr=False)
    released: bool = False
    tenant: str | None = None
    tokens: int = 0

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._controller._release(self)


class AdmissionController:
    """Counts admitted generations of one worker (one event loop, so no lock is needed)."""

    def __init__(self, max_concurrency: int, request_timeout_s: float, retry_after_s: float = 1.0):
        self.max_concurrency = max_concurrency
        self.request_timeout_s = request_timeout_s
        self.retry_after_s = retry_after_s
        self.in_flight = 0
        # tenant -> [generations, tokens] it holds now
        self.held: dict[str, list[int]] = {}

    def admit(self, slots: int = 1, tokens: int = 0, share: Share | None = None) -> Ticket:
        """A ticket for `slots` generations (`tokens` in all), or Overloaded (429) at once if
        the server or the tenant's share has no room for them now."""
        if share is not None:
            self._check_share(slots, tokens, share)
        if slots > self.max_concurrency:
            raise InvalidRequest(
                f"this request needs {slots} generations but the server admits at most "
                f"{self.max_concurrency} at a time; send fewer prompts per request",
                param="prompt",
            )
        if self.in_flight + slots > self.max_concurrency:
            raise Overloaded(
                f"server is at capacity ({self.in_flight} of {self.max_concurrency} generations queued or "
                f"running); retry after {self.retry_after_s:g} s",
                retry_after_s=self.retry_after_s,
            )
        self.in_flight += slots
        tenant = share.tenant if share is not None else None
        if tenant is not None:
            held = self.held.setdefault(tenant, [0, 0])
            held[0] += slots
            held[1] += tokens
        return Ticket(slots, time.monotonic() + self.request_timeout_s, self, tenant=tenant, tokens=tokens)

    def _check_share(self, slots: int, tokens: int, share: Share) -> None:
        gens, toks = self.held.get(share.tenant, (0, 0))
        for what, need, have, cap, param in (
            ("generations", slots, gens, share.generations, "n"),
            ("tokens (prompt + max_tokens per generation)", tokens, toks, share.tokens, "max_tokens"),
        ):
            if cap is None:
                continue
            if need > cap:
                raise InvalidRequest(
                    f"this request needs {need} {what} at once, more than this API key may hold "
                    f"({cap}); send fewer prompts, a smaller n or max_tokens",
                    param=param,
                )
            if have + need > cap:
                raise Overloaded(
                    f"this API key holds {have} of its {cap} {what} in flight; retry after "
                    f"{self.retry_after_s:g} s (other keys are not affected)",
                    retry_after_s=self.retry_after_s,
                )

    def _release(self, ticket: Ticket) -> None:
        self.in_flight -= ticket.slots
        if ticket.tenant is not None:
            held = self.held.get(ticket.tenant)
            if held is not None:
                held[0] -= ticket.slots
                held[1] -= ticket.tokens
                if held[0] <= 0:
                    del self.held[ticket.tenant]
