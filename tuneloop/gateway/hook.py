"""The gateway's hook (tuneloop/hooks.py): RequestGate, one /v1 request's pass through the
gateway, whose stages the API (tuneloop/api) calls in order: auth and the request limit before
the route; for a generation the cache lookup, the prompt's screening (PII, content filter),
the token reservation with the key's fair share; the output side (PII per streamed chunk, the
filter on each whole answer); the cache store and the refund of unused tokens. The gateway's
long-lived parts (keys, limiter, cache, redactor, filter) are pipeline.py's Gateway."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, NoReturn

from tuneloop.gateway.cache import cache_key, cacheable
from tuneloop.gateway.content_filter import Verdict
from tuneloop.gateway.keys import ApiKey
from tuneloop.gateway.limiter import Decision, RedisLimiter, rate_limit_headers
from tuneloop.gateway.pipeline import Gateway
from tuneloop.gateway.redis_health import RedisUnavailable
from tuneloop.hooks import CallHook
from tuneloop.serving.errors import ContentFiltered, GuardUnavailable, PiiDetected, RateLimited, ServingError

log = logging.getLogger("bentoml.tuneloop.gateway")


class RequestGate(CallHook):
    """One /v1 request's pass through the gateway: the API's hook (tuneloop/hooks.py). What it
    finds goes into the request's record (`call`): the key's id and tenant, the cache's
    answer, the prompt's screening (the request log keeps them)."""

    def __init__(self, gateway: Gateway, key: ApiKey | None = None):
        self.gateway = gateway
        self.key = key
        self.decision: Decision | None = None  # the latest limiter decision (for the headers)
        # A generation request's unit of the request limit, taken together with its tokens
        # (one limiter call), with its cache lookup on a hit, or on its own after an early error.
        self.request_pending = False
        self.cache_status: str | None = None
        self.cache_key: str | None = None
        self.reserved = 0
        self.pii_found: list[str] = []  # the entity types removed from the prompt

    @property
    def tenant(self) -> str:
        if self.key is None:
            return "anonymous"
        return self.key.tenant if self.gateway.config.cache.scope == "team" else f"key:{self.key.id}"

    def headers(self) -> list[tuple[bytes, bytes]]:
        out = []
        if self.decision is not None:
            out += [(k.encode(), v.encode()) for k, v in rate_limit_headers(self.decision).items()]
        if self.cache_status is not None:
            out.append((b"x-cache", self.cache_status.encode()))
        return out

    # ---- limits -------------------------------------------------------------------------
    async def take(self, requests: int, tokens: int) -> Decision | None:
        """Take from the key's buckets (both or neither); RateLimited (429) when they do not
        hold it. A request's deferred unit (self.request_pending) goes along with the first
        take; refused by the tokens bucket alone, it is still owed (counted as the response
        starts: a refused request counts against the request limit)."""
        if self.key is None:
            return None
        limits = self.gateway.limits_for(self.key)
        if self.request_pending:
            requests += 1
            self.request_pending = False
        try:
            decision = await self.gateway.limiter.acquire(self.key.id, limits, requests, tokens)
        except RedisUnavailable:  # fail-closed mode
            raise GuardUnavailable(
                "rate limits cannot be checked (Redis is unavailable) and this server fails closed; retry shortly",
                retry_after_s=self.gateway.config.breaker_reset_s,
            ) from None
        return self._decided(decision, requests, tokens)

    def _decided(self, decision: Decision, requests: int, tokens: int) -> Decision:
        self.decision = decision
        if not decision.allowed:
            self.request_pending = requests > 0 and decision.refused_by == "tokens"
            self.gateway.metrics.rate_limited.labels(limit=decision.refused_by).inc()
            raise _rate_limited(decision, tokens)
        return decision

    async def cached(self, key: str) -> dict | None:
        """The cached answer under `key`, or None. A hit takes the request's deferred unit
        (a hit counts against the request limit, not the token limit; 429 when over). With
        Redis behind both, the lookup and the count are one call (one Lua script): a hit
        costs one round trip, a miss takes nothing and its unit goes with the reservation.
        Redis trouble bypasses the cache (the unit is then still owed)."""
        cache = self.gateway.cache
        assert cache is not None, "looked up only when the cache is on (lookup)"
        if self.request_pending and cache.local is None and isinstance(self.gateway.limiter, RedisLimiter):
            assert self.key is not None, "a request unit is pending only for a key"
            try:
                decision, raw = await self.gateway.limiter.acquire_if_cached(
                    self.key.id, self.gateway.limits_for(self.key), cache.namespace + key
                )
            except RedisUnavailable:
                cache.on_event("bypass")
                return None
            hit = cache.found(raw)
            if hit is not None and decision is not None:  # a hit comes with its decision
                self.request_pending = False
                self._decided(decision, 1, 0)
            return hit
        hit = await cache.get(key)
        if hit is not None and self.request_pending:
            await self.take(0, 0)
        return hit

    def refuse_early(self) -> None:
        """RateLimited when the key's next request certainly cannot pass (no call to Redis)."""
        if self.key is None:
            return
        decision = self.gateway.limiter.certain_refusal(self.key.id, self.gateway.limits_for(self.key))
        if decision is not None:
            self.decision = decision
            self.request_pending = False  # refused, not taken: nothing is owed
            self.gateway.metrics.rate_limited.labels(limit="requests").inc()
            raise _rate_limited(decision, 0)

    # ---- every /v1 request --------------------------------------------------------------
    async def on_request(self, call, scope) -> None:
        """Auth and the request limit. A generation route's request unit is taken with its
        token reservation (one limiter call a request; a cache hit takes it with its lookup,
        an error before the reservation as its response starts), after a local check that
        refuses a key certainly over its request limit before any work."""
        gateway = self.gateway
        self.key = gateway.authenticate(_header(scope, b"authorization"))
        if self.key is not None:
            call.key_id, call.tenant = self.key.id, self.key.tenant
        if self.key is not None and scope["method"] == "POST" and scope["path"] in DEFERRED_ROUTES:
            self.request_pending = True
            self.refuse_early()
        else:
            await self.take(1, 0)

    async def response_headers(self, call, status: int) -> list[tuple[bytes, bytes]]:
        if self.request_pending:  # answered before its reservation (an error): it counts all the same
            try:
                await self.take(0, 0)
            except ServingError:  # over the limit or Redis away: this response stands
                self.request_pending = False
        return self.headers()

    # ---- cache --------------------------------------------------------------------------
    async def lookup(self, call, model_id: str, route: str, body: dict[str, Any]) -> dict | None:
        """The cached answer, or None; a hit has taken the request's unit (429 if over). The key
        carries this gateway's policy, so a hit passed the same screening."""
        g = self.gateway
        if g.cache is None or not cacheable(body):
            self.cache_status = call.cache = "miss" if g.cache is not None else None
            return None
        self.cache_key = cache_key(self.tenant, f"{model_id}|policy:{g.policy_id}", route, body)
        hit = await self.cached(self.cache_key)
        self.cache_status = call.cache = "hit" if hit is not None else "miss"
        logged = hit.get("log") if hit is not None else None
        if isinstance(logged, dict) and "prompt" in logged:
            # The prompt as this policy redacted it for the log: no second analysis.
            call.prompt, call.prompt_redacted = logged["prompt"], True
            call.pii_entities = logged.get("pii_entities") or None
        return hit

    async def store(self, call, value: dict) -> None:
        cache = self.gateway.cache
        if self.cache_key is None or cache is None:  # a key is made only when the cache is on
            return
        if call.prompt_redacted:
            # The prompt as this policy redacted it for the log: a hit on this entry (same
            # request, same policy: the key carries both) logs it without analysing it again.
            value = {**value, "log": {"prompt": call.prompt, "pii_entities": sorted(set(self.pii_found))}}
        await cache.put(self.cache_key, value)

    # ---- prompts ------------------------------------------------------------------------
    async def screen_prompts(self, call, texts: list[str], roles: list[str] | None) -> list[str]:
        """PII (redact or block) on every prompt text, then the content filter (block or
        annotate) on the untrusted ones (completions: all; chat: the messages of the roles
        gateway.filter.roles names, every role by default)."""
        g = self.gateway
        if g.pii is not None and g.config.pii.mode != "off" and texts:
            results = await _redact_all(g.pii, texts, self.tenant, g.config.pii.request_budget_s)
            found = [e for _, entities in results for e in entities]
            for entity in found:
                g.metrics.pii.labels(entity=entity, where="prompt").inc()
            texts = [text for text, _ in results]
            self.pii_found = found
            call.prompt, call.prompt_redacted = texts, True  # what a refusal from here on logs
            call.pii_entities = sorted(set(found)) or None
            if found and g.config.pii.mode == "block":
                raise PiiDetected(
                    "The prompt contains personal data or secrets "
                    f"({', '.join(sorted(set(found)))}); remove them and retry."
                )
        else:
            call.prompt = texts
        untrusted = [True] * len(texts) if roles is None else [r in g.config.filter.roles for r in roles]
        checked = [t for t, u in zip(texts, untrusted) if u]
        if g.filter is not None and g.config.filter.prompts != "off" and checked:
            verdicts = await self.check_content(checked, "prompt")
            flagged = [v for v in verdicts if v.flagged]
            call.prompt_filter = (flagged[0] if flagged else verdicts[0]).summary()
            blocking = [v for v in verdicts if v.blocks(g.config.filter.classifier_action)]
            if blocking and g.config.filter.prompts == "block":
                cats = sorted({c for v in blocking for c in v.flagged_categories()})
                raise ContentFiltered(
                    f"The prompt was flagged by the content filter ({', '.join(cats)}) and was not processed."
                )
        return texts

    def prompts_redacted(self) -> bool:
        return self.gateway.pii is not None and self.gateway.config.pii.mode == "redact"

    async def check_content(self, texts: list[str], where: str, classify: bool = True) -> list[Verdict]:
        content_filter = self.gateway.filter
        assert content_filter is not None, "checked only when the filter is on"
        try:
            verdicts = await content_filter.check(texts, classify)
        except Exception as exc:  # the classifier failed or timed out: refuse, never pass unchecked
            log.error("content filter failed: %s: %s", type(exc).__name__, exc)
            raise GuardUnavailable("the content filter could not check this request; retry shortly") from None
        for v in verdicts:
            for c in v.flagged_categories():
                self.gateway.metrics.flagged.labels(category=c, where=where).inc()
        return verdicts

    async def moderate(self, call, texts: list[str]) -> tuple[str, list] | None:
        if self.gateway.filter is None:
            return None
        return self.gateway.filter.model_id, await self.check_content(texts, "moderation")

    # ---- tokens -------------------------------------------------------------------------
    def share(self, max_concurrency: int):
        return self.gateway.share_for(self.key, max_concurrency)

    def tier(self) -> str | None:
        return self.key.tier if self.key is not None else None

    async def reserve(self, call, tokens: int) -> None:
        """Take prompt + max_tokens from the key's tokens/min before generating, with the
        request's deferred unit if it is still owed (429 if over)."""
        if await self.take(0, tokens) is not None:
            self.reserved = tokens

    def release(self, used_tokens: int) -> None:
        """Give back what the response did not use (called once, when it ends however it ends)."""
        unused, self.reserved = self.reserved - used_tokens, 0
        if unused > 0 and self.key is not None:
            self.gateway.limiter.refund_later(self.key.id, self.gateway.limits_for(self.key), unused)

    # ---- outputs ------------------------------------------------------------------------
    def redacts_outputs(self) -> bool:
        return self.gateway.pii is not None and self.gateway.config.pii.outputs != "off"

    def output_stream(self):
        """A per-choice stream redactor (add(delta) -> safe text, flush()), or None."""
        g = self.gateway
        if not self.redacts_outputs():
            return None
        return _CountingRedactor(
            g.pii.stream(g.config.pii.stream_step_chars, self.tenant),
            lambda e: g.metrics.pii.labels(entity=e, where="output").inc(),
        )

    async def screen_outputs(self, call, texts: list[str]) -> list[str]:
        """Whole output texts (e.g. an echoed prompt) through the output redaction."""
        if not self.redacts_outputs():
            return texts
        g = self.gateway
        return [text for text, _ in await _redact_all(g.pii, texts, self.tenant, g.config.pii.request_budget_s)]

    async def check_output(self, call, text: str) -> tuple[Verdict, bool] | None:
        g = self.gateway
        if g.filter is None or g.config.filter.outputs == "off":
            return None
        verdict = (await self.check_content([text], "output", classify=g.config.filter.classify_outputs))[0]
        f = g.config.filter
        return verdict, f.outputs == "block" and verdict.blocks(f.classifier_action)


async def _redact_all(pii, texts: list[str], tenant=None, budget_s: float | None = None) -> list[tuple[str, list[str]]]:
    """Every text redacted, or GuardUnavailable: any failure (an error, the timeout, the
    request's budget spent) refuses this request only. Texts the pre-screen clears are not
    handed to the analyzer at all; the others go in `tenant`'s turn (a long one in windows)."""
    out: list[tuple[str, list[str]]] = [(t, []) for t in texts]
    todo = [i for i, t in enumerate(texts) if pii.needs_analysis(t)]
    if not todo:
        return out
    try:
        async with asyncio.timeout(budget_s):
            results = await asyncio.gather(*(pii.aredact(texts[i], tenant) for i in todo))
        for i, result in zip(todo, results):
            out[i] = result
    except TimeoutError:
        log.warning(
            "PII analysis of a request's %d characters went over its budget of %g s: refused",
            sum(len(texts[i]) for i in todo),
            budget_s,
        )
        raise GuardUnavailable(
            f"PII analysis of this request took longer than its budget of {budget_s:g} s "
            "(gateway.pii.request_budget_s); shorten the prompt or retry"
        ) from None
    except Exception as exc:
        log.error("PII analysis failed: %s: %s", type(exc).__name__, exc)
        raise GuardUnavailable(
            "PII analysis failed; the request was not processed (the gateway fails closed)"
        ) from None
    return out


class _CountingRedactor:
    """A stream redactor (analysis in the checks' process or a worker thread, within
    pii.timeout_s) whose failures refuse (GuardUnavailable) and whose finds are counted. A
    delta that needs no analysis passes without awaiting anything."""

    def __init__(self, inner, count: Callable[[str], None]):
        self.inner = inner
        self.count = count
        self._counted = 0

    @property
    def resolved(self) -> int:
        return self.inner.resolved

    @property
    def spans(self):
        return self.inner.spans

    async def add(self, delta: str) -> str:
        try:
            early, window = self.inner.begin(delta)
            if window is None:
                return early
            out = early + await self.inner.finish(window)
        except Exception as exc:
            self._failed(exc)
        self._count_new()
        return out

    async def flush(self) -> str:
        try:
            out = await self.inner.aflush()
        except Exception as exc:
            self._failed(exc)
        self._count_new()
        return out

    def _failed(self, exc: Exception) -> NoReturn:
        log.error("PII analysis of an output failed: %s: %s", type(exc).__name__, exc)
        raise GuardUnavailable("PII analysis of the answer failed; the rest of it was withheld") from None

    def _count_new(self) -> None:
        for entity in self.inner.found[self._counted :]:
            self.count(entity)
        self._counted = len(self.inner.found)


# ---------------------------------------------------------------------------------------
# the request's scope


# Routes whose request unit is taken with their token reservation (one limiter call a request).
DEFERRED_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})


def _header(scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", []):
        if k.lower() == name:
            return v.decode("latin-1")
    return None


def _rate_limited(d: Decision, tokens: int) -> RateLimited:
    limits = d.limits
    if d.refused_by == "tokens":
        if tokens > limits.tokens_per_minute:
            message = (
                f"Request too large: it may use {tokens} tokens (prompt + max_tokens), more than this key's "
                f"limit of {limits.tokens_per_minute} tokens per minute. Lower max_tokens or the prompt."
            )
            err = RateLimited(message, headers=rate_limit_headers(d))
        else:
            err = RateLimited(
                f"Rate limit reached for tokens per minute: limit {limits.tokens_per_minute}, "
                f"remaining {max(0, d.remaining_tokens)}, requested {tokens}. Try again in "
                f"{d.retry_after_s:.1f}s.",
                retry_after_s=d.retry_after_s,
                headers=rate_limit_headers(d),
            )
        err.type = "tokens"
        return err
    return RateLimited(
        f"Rate limit reached for requests per minute: limit {limits.requests_per_minute}. Try again "
        f"in {d.retry_after_s:.1f}s.",
        retry_after_s=d.retry_after_s,
        headers=rate_limit_headers(d),
    )
