"""PII redaction for the request log in its own process.

Presidio's analysis is Python that holds the GIL for milliseconds per text; run in the
server's process it stalls the event loop and the engine (measured: 16 % of output tokens/s
on the demo model with the gateway's PII off, against none with texts omitted). Here it
runs in a child process (tuneloop/gateway/guard_process.py, at a lower priority), which
the writer thread calls once per batch of texts, so the server only serialises strings.

A child that dies or does not answer within the timeout is killed; the batch's texts are
then omitted (never written unredacted) and the next batch starts a new child.
"""

from __future__ import annotations

from tuneloop.gateway.guard_process import GuardFailed, GuardProcess


class RedactionFailed(Exception):
    pass


class ProcessRedactor:
    def __init__(self, pii_config: dict, cache_dir: str, key_prefix: str, timeout_s: float = 60.0):
        self.timeout_s = timeout_s
        self.guard = GuardProcess(
            {"pii": pii_config, "cache_dir": str(cache_dir), "key_prefix": key_prefix, "nice": 10},
            name="request-log-redaction",
        )

    def cpu_seconds(self) -> float | None:
        return self.guard.cpu_seconds()

    def warm_up(self) -> None:
        try:
            self.guard.start(wait=True)
        except GuardFailed as exc:
            raise RedactionFailed(str(exc)) from None

    def redact_many(self, texts: list[str]) -> list[str]:
        if not texts:
            return []
        self.guard.start()
        try:
            out = self.guard.call("redact", texts, self.timeout_s)
        except GuardFailed as exc:
            raise RedactionFailed(str(exc)) from None
        if len(out) != len(texts):
            raise RedactionFailed("the redaction process answered the wrong number of texts")
        return out

    def close(self) -> None:
        self.guard.close()
