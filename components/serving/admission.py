"""Bounded admission: a fixed number of generations queued + running, and a deadline each.

A server that queues without bound answers every request late once it is overloaded;
refusing early (429 + Retry-After) lets clients back off or go elsewhere. The limit counts
generations, not HTTP requests: a completion with a list of 8 prompts takes 8 slots.
Whoever admits a request releases its ticket when the generation ends, whatever the cause
(done, client disconnected, timed out, failed); release is idempotent.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from components.serving.errors import InvalidRequest, Overloaded


@dataclass
class Ticket:
    slots: int
    deadline: float  # time.monotonic() seconds; asyncio's loop.time() uses the same clock
    _controller: "AdmissionController" = field(repr=False)
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._controller.in_flight -= self.slots


class AdmissionController:
    """Counts admitted generations of one worker (one event loop, so no lock is needed)."""

    def __init__(self, max_concurrency: int, request_timeout_s: float, retry_after_s: float = 1.0):
        self.max_concurrency = max_concurrency
        self.request_timeout_s = request_timeout_s
        self.retry_after_s = retry_after_s
        self.in_flight = 0

    def admit(self, slots: int = 1) -> Ticket:
        """A ticket for `slots` generations, or Overloaded (429) at once if they are not free."""
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
        return Ticket(slots, time.monotonic() + self.request_timeout_s, self)
