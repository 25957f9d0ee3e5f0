"""The stages a /v1 request passes, for the parts that act around the model call.

The API (tuneloop/api) runs every request through an ordered list of hooks, the way
LiteLLM's proxy composes its guardrails and loggers: the request log first (outermost: it
sees refusals too), then the gateway (auth, limits, cache, PII, content filter). A server
without a gateway or a log has fewer hooks; the routes never ask which are there.

Each hook is one object per request (made by a factory on the app's state) and overrides
the stages it needs; every stage here does nothing. All of them get the request's
RequestRecord-like `call` (tuneloop/requestlog/record.py): the facts of this request that
the API and every hook write, and the request log keeps.

    every /v1 request:   on_request -> [route] -> response_headers / on_response_body -> on_request_end
    a generation route:  lookup (a cached answer ends it) -> screen_prompts -> share, reserve ->
                         [generation: output_stream per choice, per streamed chunk] ->
                         check_output per choice -> store -> release
    /v1/moderations:     moderate

This module imports nothing of the project: every layer may implement a hook.
"""

from __future__ import annotations

from typing import Any


class CallHook:
    """One request's pass through one hook; a subclass overrides the stages it acts in."""

    # ---- every /v1 request ---------------------------------------------------------------
    async def on_request(self, call, scope) -> None:
        """Before the route: may refuse the request by raising a ServingError."""

    async def response_headers(self, call, status: int) -> list[tuple[bytes, bytes]]:
        """Headers this hook adds to the response (errors and streams included)."""
        return []

    def on_response_body(self, call, body: bytes) -> None:
        """Each chunk of the response body as it is sent."""

    def on_request_end(self, call, scope) -> None:
        """Once, when the response has ended however it ended (sent, failed, client gone)."""

    # ---- generation routes (before the call) ----------------------------------------------
    async def lookup(self, call, model_id: str, route: str, body: dict[str, Any]) -> dict | None:
        """A stored answer to this very request, which ends it; None: generate."""
        return None

    async def screen_prompts(self, call, texts: list[str], roles: list[str] | None) -> list[str]:
        """The prompt's texts as the model may see them (chat: each message's role in
        `roles`); may refuse by raising a ServingError."""
        return texts

    def prompts_redacted(self) -> bool:
        """Whether the texts screen_prompts returned are redacted already (the log keeps them as they are)."""
        return False

    def share(self, max_concurrency: int) -> Any:
        """This request's share of the engine (tuneloop.serving.admission.Share), or None."""
        return None

    def tier(self) -> str | None:
        """The caller's tier (its key's), where this hook knows one."""
        return None

    async def reserve(self, call, tokens: int) -> None:
        """Before generating: take the request's most tokens from its budget (may refuse)."""

    # ---- during and after the call ------------------------------------------------------
    def redacts_outputs(self) -> bool:
        return False

    async def screen_outputs(self, call, texts: list[str]) -> list[str]:
        """Whole output texts (an echoed prompt) as the client may see them."""
        return texts

    def output_stream(self) -> Any:
        """Per choice, a filter of the streamed text, or None: `await add(delta) -> text`,
        `await flush() -> text`, and `resolved` (input characters settled) and `spans`
        ((start, end, replacement) of what it replaced) for the logprobs that wait on it."""
        return None

    async def check_output(self, call, text: str) -> tuple[Any, bool] | None:
        """A choice's whole text: (verdict, whether it is withheld), or None when not checked."""
        return None

    async def store(self, call, value: dict) -> None:
        """The finished answer (choices and usage), for lookup to find again."""

    def release(self, used_tokens: int) -> None:
        """Once, when the generation ended however it ended: the tokens it used."""

    # ---- /v1/moderations --------------------------------------------------------------
    async def moderate(self, call, texts: list[str]) -> tuple[str, list] | None:
        """(the classifier's model id, a verdict per text), or None when this hook has no filter."""
        return None


class Hooks:
    """A request's hooks in order; each stage runs them all (a lookup or a moderation:
    the first that answers). With no hooks every stage is the identity."""

    def __init__(self, hooks: list[CallHook]):
        self.hooks = hooks

    async def on_request(self, call, scope) -> None:
        for h in self.hooks:
            await h.on_request(call, scope)

    async def response_headers(self, call, status: int) -> list[tuple[bytes, bytes]]:
        out: list[tuple[bytes, bytes]] = []
        for h in self.hooks:
            out += await h.response_headers(call, status)
        return out

    def on_response_body(self, call, body: bytes) -> None:
        for h in self.hooks:
            h.on_response_body(call, body)

    def on_request_end(self, call, scope) -> None:
        for h in reversed(self.hooks):
            h.on_request_end(call, scope)

    async def lookup(self, call, model_id: str, route: str, body: dict[str, Any]) -> dict | None:
        for h in self.hooks:
            hit = await h.lookup(call, model_id, route, body)
            if hit is not None:
                return hit
        return None

    async def screen_prompts(self, call, texts: list[str], roles: list[str] | None = None) -> list[str]:
        for h in self.hooks:
            texts = await h.screen_prompts(call, texts, roles)
        return texts

    def prompts_redacted(self) -> bool:
        return any(h.prompts_redacted() for h in self.hooks)

    def share(self, max_concurrency: int) -> Any:
        for h in self.hooks:
            share = h.share(max_concurrency)
            if share is not None:
                return share
        return None

    def tier(self) -> str | None:
        return next((t for t in (h.tier() for h in self.hooks) if t is not None), None)

    async def reserve(self, call, tokens: int) -> None:
        for h in self.hooks:
            await h.reserve(call, tokens)

    def redacts_outputs(self) -> bool:
        return any(h.redacts_outputs() for h in self.hooks)

    async def screen_outputs(self, call, texts: list[str]) -> list[str]:
        for h in self.hooks:
            texts = await h.screen_outputs(call, texts)
        return texts

    def output_stream(self) -> Any:
        """One hook's stream filter per choice (the first that has one)."""
        for h in self.hooks:
            stream = h.output_stream()
            if stream is not None:
                return stream
        return None

    async def check_output(self, call, text: str) -> tuple[Any, bool] | None:
        for h in self.hooks:
            checked = await h.check_output(call, text)
            if checked is not None:
                return checked
        return None

    async def store(self, call, value: dict) -> None:
        for h in self.hooks:
            await h.store(call, value)

    def release(self, used_tokens: int) -> None:
        for h in self.hooks:
            h.release(used_tokens)

    async def moderate(self, call, texts: list[str]) -> tuple[str, list] | None:
        for h in self.hooks:
            out = await h.moderate(call, texts)
            if out is not None:
                return out
        return None
