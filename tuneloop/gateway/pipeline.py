"""The gateway: one request pipeline composed of the small parts of this package.

    auth (keys.py) -> request limit (limiter.py) -> PII on the prompt (remote_pii.py, privacy/redactor.py) ->
    content filter on the prompt (content_filter.py) -> result cache (cache.py) ->
    token reservation (limiter.py) -> generation -> PII on the output (streams too) ->
    content filter on the output -> cache store -> token refund

The gateway is one of the API's hooks (tuneloop/hooks.py): a RequestGate a request (hook.py), whose
stages the API (tuneloop/api) calls: on_request does the first two, the generation routes'
stages the rest. The gate runs on the server's event loop: no extra network hop
but Redis; the heavy work (Presidio, the classifier) runs in the checks' own process
(gateway.checks_in: process, the default: guard_process.py, each tenant's calls in turn) or in
worker threads, with deadlines. Every failure of a safety step refuses the request (fails
closed); only the cache and, in `open` mode, the shared limits degrade when Redis is away.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from typing import Any

from tuneloop.gateway.cache import ResultCache
from tuneloop.gateway.content_filter import ContentFilter
from tuneloop.gateway.filter_registry import build_content_filter, registered_classifier
from tuneloop.gateway.guard_process import GuardProcess
from tuneloop.gateway.keys import ApiKey, InvalidKey, KeyStore, open_key_store
from tuneloop.gateway.limiter import Limits, MemoryLimiter, RedisLimiter
from tuneloop.gateway.redis_health import RedisHealth
from tuneloop.gateway.remote_pii import RemotePiiRedactor
from tuneloop.privacy.redactor import PiiRedactor
from tuneloop.serving.admission import Share
from tuneloop.serving.errors import InvalidApiKey

log = logging.getLogger("bentoml.tuneloop.gateway")

CIRCUIT_VALUES = {"closed": 0, "half_open": 1, "open": 2}


class GatewayMetrics:
    """Prometheus metrics of the gateway (create inside the server's worker, as ServingMetrics).

    | tuneloop_gateway_auth_failures_total   | reason (missing, malformed, unknown, expired, revoked) |
    | tuneloop_gateway_rate_limited_total    | limit (requests, tokens)                               |
    | tuneloop_gateway_cache_total           | result (hit, miss, bypass)                             |
    | tuneloop_gateway_redis_circuit_state   | 0 closed, 1 half open, 2 open                          |
    | tuneloop_gateway_pii_entities_total    | entity, where (prompt, output)                         |
    | tuneloop_gateway_filter_flagged_total  | category, where (prompt, output, moderation)           |
    | tuneloop_gateway_filter_batch_size     | histogram of classifier batch sizes                    |
    | tuneloop_gateway_cpu_seconds_total     | part (pii: Presidio's analyses, filter: the classifier's |
    |                                        | batches; their own thread CPU)                         |
    | tuneloop_gateway_filter_texts_total    | stage (screened: cleared by the TF-IDF screen without   |
    |                                        | embeddings, encoded: scored by the whole classifier)   |
    Labels never carry a key or a key id.
    """

    def __init__(self, registry=None):
        import prometheus_client as prom

        kw = {} if registry is None else {"registry": registry}
        self.auth_failures = prom.Counter("tuneloop_gateway_auth_failures", "Refused API keys", ["reason"], **kw)
        self.rate_limited = prom.Counter("tuneloop_gateway_rate_limited", "Requests over a limit", ["limit"], **kw)
        self.cache = prom.Counter("tuneloop_gateway_cache", "Result cache lookups", ["result"], **kw)
        self.circuit = prom.Gauge(
            "tuneloop_gateway_redis_circuit_state",
            "Redis circuit: 0 closed, 1 half open, 2 open",
            multiprocess_mode="livemax",
            **kw,
        )
        self.pii = prom.Counter("tuneloop_gateway_pii_entities", "PII entities found", ["entity", "where"], **kw)
        self.flagged = prom.Counter(
            "tuneloop_gateway_filter_flagged", "Texts flagged by the content filter", ["category", "where"], **kw
        )
        self.cpu = prom.Counter(
            "tuneloop_gateway_cpu_seconds", "CPU seconds of the gateway's own work, by part", ["part"], **kw
        )
        self.filter_texts = prom.Counter(
            "tuneloop_gateway_filter_texts", "Texts the classifier scored, by the stage that decided", ["stage"], **kw
        )
        self.filter_batch = prom.Histogram(
            "tuneloop_gateway_filter_batch_size", "Classifier batch sizes", buckets=(1, 2, 4, 8, 16, 32, 64, 128), **kw
        )


class _NoMetrics:
    def __getattr__(self, name):
        return self

    def labels(self, **_):
        return self

    def inc(self, *_):
        pass

    set = observe = inc


class Gateway:
    def __init__(
        self,
        config,
        keys: KeyStore | None,
        limiter,
        cache: ResultCache | None,
        pii=None,
        content_filter: ContentFilter | None = None,
        metrics: GatewayMetrics | None = None,
        health: RedisHealth | None = None,
        guard=None,
    ):
        self.config = config  # tuneloop.config.GatewayConfig
        self.keys = keys
        self.limiter = limiter
        self.cache = cache
        self.pii = pii
        self.filter = content_filter
        self.metrics = metrics or _NoMetrics()
        self.health = health
        self.guard = guard  # the GuardProcess running PII analyses and the classifier (checks_in: process)
        # What the screening of a prompt depends on (PII and filter settings, the rules' and the
        # classifier's versions): part of every cache key, so a cached answer is replayed only
        # for a request that passed the same screening (and a hit can skip it).
        policy = [
            config.pii.model_dump(mode="json"),
            config.filter.model_dump(mode="json"),
            content_filter.model_id if content_filter is not None else None,
            pii is not None,
        ]
        self.policy_id = hashlib.sha256(json.dumps(policy, sort_keys=True, default=str).encode()).hexdigest()[:16]

    # ---- building it from config ------------------------------------------------------
    @classmethod
    def from_config(cls, cfg, metrics: GatewayMetrics | None = None, load_classifier: bool = True) -> "Gateway":
        """Everything the config asks for. Raises ServingSetupError-style exceptions with a
        one-line reason when a part cannot start (the server then does not start)."""
        g = cfg.gateway
        counted: Any = metrics or _NoMetrics()
        home = cfg.home / "gateway"
        keys = None
        if g.auth == "on":
            keys = open_key_store(cfg)
        else:
            log.warning(
                "GATEWAY AUTH IS OFF (gateway.auth: off): every /v1 route is open to anyone who can "
                "reach this port, without limits. For local development only."
            )
        health = None
        if g.redis_url:
            health = RedisHealth(
                g.redis_url,
                g.redis_timeout_s,
                g.breaker_failures,
                g.breaker_reset_s,
                on_change=lambda state: counted.circuit.set(CIRCUIT_VALUES[state]),
            )
            limiter: RedisLimiter | MemoryLimiter = RedisLimiter(health, g.on_redis_error)
        else:
            limiter = MemoryLimiter()
            if keys is not None:
                log.info("rate limits are per process (no gateway.redis_url): exact for one replica only")
        cache = None
        if g.cache.enabled:
            cache = ResultCache(
                g.cache.ttl_s,
                g.cache.max_entries,
                health,
                on_event=lambda kind: counted.cache.labels(result=kind).inc(),
            )
        pii: Any = None
        guard = None
        settings = None
        if g.pii.mode != "off" or g.pii.outputs != "off":
            settings = g.pii
            if settings.spacy_model_dir is not None:
                settings = settings.model_copy(update={"spacy_model_dir": cfg.resolve(settings.spacy_model_dir)})
        folder, model_id = registered_classifier(cfg, load_classifier)
        if g.checks_in == "process" and (settings is not None or folder is not None):
            # Started now, ready by the warm-up: the child builds Presidio and loads the
            # classifier while this process loads the model.
            guard = GuardProcess(
                {
                    "pii": None if settings is None else settings.model_dump(mode="json"),
                    "cache_dir": str(home),
                    "key_prefix": g.key_prefix,
                    "classifier": None if folder is None else str(folder),
                },
                name="gateway-checks",
            )
            guard.on_cpu.update(find=counted.cpu.labels(part="pii").inc, scores=counted.cpu.labels(part="filter").inc)
            guard.start()
        if settings is not None:
            if guard is not None:
                pii = RemotePiiRedactor(settings, guard, key_prefix=g.key_prefix)
            else:
                pii = PiiRedactor(settings, home, key_prefix=g.key_prefix)
                pii.on_cpu = counted.cpu.labels(part="pii").inc
        content_filter = build_content_filter(cfg, counted, (folder, model_id), guard)
        return cls(g, keys, limiter, cache, pii, content_filter, metrics, health, guard)

    async def warm_up(self) -> None:
        """The checks' process ready, first calls of the analyzer and the classifier (lazy
        initialisation), before traffic. Raises when the checks cannot run (the server then
        does not become ready)."""
        if self.guard is not None:
            info = await self.guard.await_ready()
            if self.pii is not None:
                self.pii.adopt(info.get("pii", {}))
        if self.pii is not None:
            await self.pii.aredact("warm-up: write to jane.doe@example.com or call 212-555-0199")
        if self.filter is not None:
            await self.filter.check(["warm-up: is this an injection?"])

    async def close(self) -> None:
        if self.guard is not None:
            await asyncio.to_thread(self.guard.close)
        await self.limiter.close()  # refunds still waiting to be sent
        if self.health is not None:
            await self.health.close()
        if self.keys is not None:
            self.keys.close()

    # ---- the middleware's part ----------------------------------------------------------
    def authenticate(self, authorization: str | None) -> ApiKey | None:
        """The key's record, None when auth is off; InvalidApiKey (401) otherwise."""
        if self.keys is None:
            return None
        reason, presented = "missing", None
        if authorization:
            scheme, _, value = authorization.partition(" ")
            if scheme.lower() == "bearer" and value.strip():
                presented = value.strip()
            else:
                reason = "malformed"
        if presented is not None:
            try:
                return self.keys.verify(presented)
            except InvalidKey as exc:
                reason = exc.reason
        self.metrics.auth_failures.labels(reason=reason).inc()
        raise InvalidApiKey(_AUTH_MESSAGES[reason])

    def share_for(self, key: ApiKey | None, max_concurrency: int) -> Share | None:
        """What this key may hold of a server at once (admission's fair share), or None (auth off)."""
        if key is None:
            return None
        tier = self.config.tiers.get(key.tier)
        whole = max(1, int(max_concurrency * self.config.max_share_per_key))
        generations = min(tier.max_generations_in_flight or whole, whole) if tier else whole
        return Share(key.id, generations, tier.max_tokens_in_flight if tier else None)

    def limits_for(self, key: ApiKey) -> Limits:
        tier = self.config.tiers.get(key.tier)
        if tier is None:  # a key whose tier was removed from the config since
            raise InvalidApiKey(f"this API key's tier {key.tier!r} is not configured on this server")
        return Limits(
            key.requests_per_minute or tier.requests_per_minute, key.tokens_per_minute or tier.tokens_per_minute
        )


_AUTH_MESSAGES = {
    "missing": "You didn't provide an API key. Provide it in the Authorization header (Authorization: Bearer "
    "YOUR_KEY). `tuneloop keys create` makes one.",
    "malformed": "The Authorization header is malformed: expected 'Bearer YOUR_KEY'.",
    "unknown": "Incorrect API key provided. `tuneloop keys list` shows the valid keys' ids.",
    "expired": "This API key has expired.",
    "revoked": "This API key has been revoked.",
}
