"""The PII redactor with its analyses in the gateway's checks' process (guard_process.py):
the project's redactor (tuneloop/privacy/redactor.py) with its Presidio calls made remotely."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tuneloop.gateway.guard_process import GuardFailed
from tuneloop.privacy.redactor import Entity, PiiError, PiiRedactor, merge_entities, prescreen_for, windows
from tuneloop.privacy.secrets import secrets_for

if TYPE_CHECKING:
    from tuneloop.config import PiiConfig


class RemotePiiRedactor(PiiRedactor):
    """A PiiRedactor whose analyses run in a GuardProcess (tuneloop/gateway/guard_process.py),
    off this process's GIL; the pre-screen, the replacement and streams' bookkeeping stay
    here (microseconds). Until the child is ready, every text counts as possibly holding an
    entity and streams emit nothing early (the safe side); the child then says what the
    analyzer it built allows. Failures are PiiError, as in-process."""

    def __init__(self, config: PiiConfig, guard, key_prefix: str = "tl-"):
        self.config = config
        self.guard = guard
        self.on_cpu = None  # the child's CPU is reported through guard.on_cpu["find"]
        self._screen = prescreen_for(secrets_for(key_prefix))
        self.entities = config.entities
        self.prescreen = self.early_emit = False

    def adopt(self, info: dict) -> None:
        """What the child's analyzer allows (GuardProcess.info["pii"])."""
        self.prescreen = bool(info.get("prescreen"))
        self.early_emit = bool(info.get("early_emit"))

    def _analyze(self, text: str) -> list[Entity]:
        try:
            return [Entity(*e) for e in self.guard.call("find", text, self.config.timeout_s)]
        except GuardFailed as exc:
            raise PiiError(f"PII analysis failed: {exc}") from None

    async def afind(self, text: str, tenant=None) -> list[Entity]:
        """The child's analysis, a window at a time in `tenant`'s turn (GuardProcess: tenants'
        calls interleave, so a long prompt delays its own request, not the others')."""
        if not self.needs_analysis(text):
            return []
        found = []
        try:
            for start, end in windows(text, overlap=self.config.holdback_chars):
                part = await self.guard.acall("find", text[start:end], self.config.timeout_s, tenant)
                found += [Entity(kind, a + start, b + start, score) for kind, a, b, score in part]
        except GuardFailed as exc:
            raise PiiError(f"PII analysis failed: {exc}") from None
        return merge_entities(found)
