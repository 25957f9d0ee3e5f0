"""The gateway: one request pipeline composed of the small parts of this package.

    auth (keys.py) -> request limit (limiter.py) -> PII on the prompt (remote_pii.py, privacy/redactor.py) ->
    content filter on the prompt (content_filter.py) -> result cache (cache.py) ->
    token reservation (limiter.py) -> generation -> PII on the output (streams too) ->
    content filter on the output -> cache store -> token refund

The gateway is one of the API's hooks (tuneloop/hooks.py): a RequestGate a request, whose
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
from pathlib import Path
from typing import Any, Callable, NoReturn

from tuneloop.gateway.cache import ResultCache, cache_key, cacheable
from tuneloop.gateway.content_filter import ContentFilter, RuleSet, Verdict
from tuneloop.gateway.keys import ApiKey, InvalidKey, KeyStore, load_pepper
from tuneloop.gateway.limiter import Decision, Limits, MemoryLimiter, RedisLimiter, rate_limit_headers
from tuneloop.gateway.redis_health import RedisHealth, RedisUnavailable
from tuneloop.hooks import CallHook
from tuneloop.serving.admission import Share
from tuneloop.serving.errors import (
    ContentFiltered,
    GuardUnavailable,
    InvalidApiKey,
    PiiDetected,
    RateLimited,
    ServingError,
)

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
        self.circuit = prom.Gauge("tuneloop_gateway_redis_circuit_state", "Redis circuit: 0 closed, 1 half open, "
                                  "2 open", multiprocess_mode="livemax", **kw)
        self.pii = prom.Counter("tuneloop_gateway_pii_entities", "PII entities found", ["entity", "where"], **kw)
        self.flagged = prom.Counter("tuneloop_gateway_filter_flagged", "Texts flagged by the content filter",
                                    ["category", "where"], **kw)
        self.cpu = prom.Counter("tuneloop_gateway_cpu_seconds", "CPU seconds of the gateway's own work, by part",
                                ["part"], **kw)
        self.filter_texts = prom.Counter("tuneloop_gateway_filter_texts", "Texts the classifier scored, by the "
                                         "stage that decided", ["stage"], **kw)
        self.filter_batch = prom.Histogram("tuneloop_gateway_filter_batch_size", "Classifier batch sizes",
                                           buckets=(1, 2, 4, 8, 16, 32, 64, 128), **kw)


class _NoMetrics:
    def __getattr__(self, name):
        return self

    def labels(self, **_):
        return self

    def inc(self, *_):
        pass

    set = observe = inc


class Gateway:
    def __init__(self, config, keys: KeyStore | None, limiter, cache: ResultCache | None, pii=None,
                 content_filter: ContentFilter | None = None, metrics: GatewayMetrics | None = None,
                 health: RedisHealth | None = None, guard=None):
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
        policy = [config.pii.model_dump(mode="json"), config.filter.model_dump(mode="json"),
                  content_filter.model_id if content_filter is not None else None, pii is not None]
        self.policy_id = hashlib.sha256(json.dumps(policy, sort_keys=True, default=str).encode()).hexdigest()[:16]

    # ---- building it from config ------------------------------------------------------
    @classmethod
    def from_config(cls, cfg, metrics: GatewayMetrics | None = None, load_classifier: bool = True) -> "Gateway":
        """Everything the config asks for. Raises ServingSetupError-style exceptions with a
        one-line reason when a part cannot start (the server then does not start)."""
        g = cfg.gateway
        metrics = metrics or _NoMetrics()
        home = cfg.home / "gateway"
        keys = None
        if g.auth == "on":
            keys = open_key_store(cfg)
        else:
            log.warning("GATEWAY AUTH IS OFF (gateway.auth: off): every /v1 route is open to anyone who can "
                        "reach this port, without limits. For local development only.")
        health = None
        if g.redis_url:
            health = RedisHealth(g.redis_url, g.redis_timeout_s, g.breaker_failures, g.breaker_reset_s,
                                 on_change=lambda state: metrics.circuit.set(CIRCUIT_VALUES[state]))
            limiter = RedisLimiter(health, g.on_redis_error)
        else:
            limiter = MemoryLimiter()
            if keys is not None:
                log.info("rate limits are per process (no gateway.redis_url): exact for one replica only")
        cache = None
        if g.cache.enabled:
            cache = ResultCache(g.cache.ttl_s, g.cache.max_entries, health,
                                on_event=lambda kind: metrics.cache.labels(result=kind).inc())
        pii = guard = None
        settings = None
        if g.pii.mode != "off" or g.pii.outputs != "off":
            settings = g.pii
            if settings.spacy_model_dir is not None:
                settings = settings.model_copy(update={"spacy_model_dir": cfg.resolve(settings.spacy_model_dir)})
        folder, model_id = registered_classifier(cfg, load_classifier)
        if g.checks_in == "process" and (settings is not None or folder is not None):
            from tuneloop.gateway.guard_process import GuardProcess

            # Started now, ready by the warm-up: the child builds Presidio and loads the
            # classifier while this process loads the model.
            guard = GuardProcess({"pii": None if settings is None else settings.model_dump(mode="json"),
                                  "cache_dir": str(home), "key_prefix": g.key_prefix,
                                  "classifier": None if folder is None else str(folder)}, name="gateway-checks")
            guard.on_cpu.update(find=metrics.cpu.labels(part="pii").inc, scores=metrics.cpu.labels(part="filter").inc)
            guard.start()
        if settings is not None:
            from tuneloop.gateway.remote_pii import RemotePiiRedactor
            from tuneloop.privacy.redactor import PiiRedactor

            if guard is not None:
                pii = RemotePiiRedactor(settings, guard, key_prefix=g.key_prefix)
            else:
                pii = PiiRedactor(settings, home, key_prefix=g.key_prefix)
                pii.on_cpu = metrics.cpu.labels(part="pii").inc
        content_filter = build_content_filter(cfg, metrics, (folder, model_id), guard)
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
        return Limits(key.requests_per_minute or tier.requests_per_minute,
                      key.tokens_per_minute or tier.tokens_per_minute)

    async def take(self, gate: "RequestGate", requests: int, tokens: int) -> Decision | None:
        """Take from the key's buckets (both or neither); RateLimited (429) when they do not
        hold it. A request's deferred unit (gate.request_pending) goes along with the first
        take; refused by the tokens bucket alone, it is still owed (counted as the response
        starts: a refused request counts against the request limit)."""
        if gate.key is None:
            return None
        limits = self.limits_for(gate.key)
        if gate.request_pending:
            requests += 1
            gate.request_pending = False
        try:
            decision = await self.limiter.acquire(gate.key.id, limits, requests, tokens)
        except RedisUnavailable:  # fail-closed mode
            raise GuardUnavailable("rate limits cannot be checked (Redis is unavailable) and this server "
                                   "fails closed; retry shortly", retry_after_s=self.config.breaker_reset_s) from None
        return self._decided(gate, decision, requests, tokens)

    def _decided(self, gate: "RequestGate", decision: Decision, requests: int, tokens: int) -> Decision:
        gate.decision = decision
        if not decision.allowed:
            gate.request_pending = requests > 0 and decision.refused_by == "tokens"
            self.metrics.rate_limited.labels(limit=decision.refused_by).inc()
            raise _rate_limited(decision, tokens)
        return decision

    async def cached(self, gate: "RequestGate", key: str) -> dict | None:
        """The cached answer under `key`, or None. A hit takes the request's deferred unit
        (a hit counts against the request limit, not the token limit; 429 when over). With
        Redis behind both, the lookup and the count are one call (one Lua script): a hit
        costs one round trip, a miss takes nothing and its unit goes with the reservation.
        Redis trouble bypasses the cache (the unit is then still owed)."""
        cache = self.cache
        if gate.request_pending and cache.local is None and isinstance(self.limiter, RedisLimiter):
            try:
                decision, raw = await self.limiter.acquire_if_cached(gate.key.id, self.limits_for(gate.key),
                                                                     cache.namespace + key)
            except RedisUnavailable:
                cache.on_event("bypass")
                return None
            hit = cache.found(raw)
            if hit is not None:
                gate.request_pending = False
                self._decided(gate, decision, 1, 0)
            return hit
        hit = await cache.get(key)
        if hit is not None and gate.request_pending:
            await self.take(gate, 0, 0)
        return hit

    def refuse_early(self, gate: "RequestGate") -> None:
        """RateLimited when the key's next request certainly cannot pass (no call to Redis)."""
        if gate.key is None:
            return
        decision = self.limiter.certain_refusal(gate.key.id, self.limits_for(gate.key))
        if decision is not None:
            gate.decision = decision
            gate.request_pending = False  # refused, not taken: nothing is owed
            self.metrics.rate_limited.labels(limit="requests").inc()
            raise _rate_limited(decision, 0)


_AUTH_MESSAGES = {
    "missing": "You didn't provide an API key. Provide it in the Authorization header (Authorization: Bearer "
               "YOUR_KEY). `tuneloop keys create` makes one.",
    "malformed": "The Authorization header is malformed: expected 'Bearer YOUR_KEY'.",
    "unknown": "Incorrect API key provided. `tuneloop keys list` shows the valid keys' ids.",
    "expired": "This API key has expired.",
    "revoked": "This API key has been revoked.",
}


def _rate_limited(d: Decision, tokens: int) -> RateLimited:
    limits = d.limits
    if d.refused_by == "tokens":
        if tokens > limits.tokens_per_minute:
            message = (f"Request too large: it may use {tokens} tokens (prompt + max_tokens), more than this key's "
                       f"limit of {limits.tokens_per_minute} tokens per minute. Lower max_tokens or the prompt.")
            err = RateLimited(message, headers=rate_limit_headers(d))
        else:
            err = RateLimited(f"Rate limit reached for tokens per minute: limit {limits.tokens_per_minute}, "
                              f"remaining {max(0, d.remaining_tokens)}, requested {tokens}. Try again in "
                              f"{d.retry_after_s:.1f}s.", retry_after_s=d.retry_after_s, headers=rate_limit_headers(d))
        err.type = "tokens"
        return err
    return RateLimited(f"Rate limit reached for requests per minute: limit {limits.requests_per_minute}. Try again "
                       f"in {d.retry_after_s:.1f}s.", retry_after_s=d.retry_after_s, headers=rate_limit_headers(d))


def key_store_url(cfg) -> str:
    return cfg.gateway.key_store_url or f"sqlite:///{cfg.home / 'gateway' / 'keys.db'}"


def open_key_store(cfg) -> KeyStore:
    """The deployment's key store, as `tuneloop keys` and every server replica open it."""
    g = cfg.gateway
    pepper = load_pepper(cfg.resolve(g.pepper_file) if g.pepper_file else cfg.home / "gateway" / "pepper")
    return KeyStore(key_store_url(cfg), pepper, g.key_prefix, tiers=list(g.tiers))


def registered_classifier(cfg, load: bool = True) -> tuple[Path | None, str | None]:
    """(its folder, "name:version") of the classifier gateway.filter.classifier names, when the
    filter is on and it is registered; (None, None) otherwise (rules only, with a warning, or
    ServingSetupError with on_missing_classifier: fail)."""
    f = cfg.gateway.filter
    if (f.prompts == "off" and f.outputs == "off") or not f.classifier or not load:
        return None, None
    folder, model_id = registered_classifier_folder(cfg, f.classifier)
    if folder is None:
        if f.on_missing_classifier == "fail":
            from tuneloop.serving.errors import ServingSetupError

            raise ServingSetupError(f"gateway.filter.classifier {f.classifier!r} is not registered; train it "
                                    "with `tuneloop filter train`")
        log.warning("content filter: %s is not registered (train it with `tuneloop filter train`); "
                    "rules only", f.classifier)
    return folder, model_id


def build_content_filter(cfg, metrics=None, classifier: tuple | None = None, guard=None) -> ContentFilter | None:
    """Rules, plus the registered classifier (registered_classifier's (folder, model id); None:
    looked up here): loaded in this process, or scored in `guard`'s process."""
    f = cfg.gateway.filter
    if f.prompts == "off" and f.outputs == "off":
        return None
    rules = RuleSet(f.rules, f.rules_version)
    folder, model_id = classifier if classifier is not None else registered_classifier(cfg)
    clf = None
    if folder is not None:
        from tuneloop.gateway.filter_model import InjectionClassifier, RemoteClassifier

        clf = RemoteClassifier(folder, guard, f.timeout_s) if guard is not None else InjectionClassifier.load(folder)
    on_batch = on_texts = on_cpu = None
    if metrics is not None and guard is None:  # in a process, the child's CPU comes through guard.on_cpu
        on_cpu = metrics.cpu.labels(part="filter").inc
    if metrics is not None:

        def on_batch(n: int) -> None:
            metrics.filter_batch.observe(n)

        def on_texts(screened: int, encoded: int) -> None:
            metrics.filter_texts.labels(stage="screened").inc(screened)
            metrics.filter_texts.labels(stage="encoded").inc(encoded)
    return ContentFilter(rules, clf, f.threshold, model_id, f.max_batch_size, f.max_latency_ms, f.timeout_s,
                         on_batch=on_batch, on_texts=on_texts, on_cpu=on_cpu)


def load_registered_classifier(cfg, ref: str):
    """(InjectionClassifier, "name:version") for "name@alias" (or "name:version"); (None, None) if absent."""
    folder, model_id = registered_classifier_folder(cfg, ref)
    if folder is None:
        return None, None
    from tuneloop.gateway.filter_model import InjectionClassifier

    return InjectionClassifier.load(folder), model_id


def registered_classifier_folder(cfg, ref: str) -> tuple[Path | None, str | None]:
    """(the local folder of "name@alias" or "name:version", downloaded once, "name:version");
    (None, None) if it is not registered."""
    from tuneloop.registry import ModelRegistry

    name, sep, alias = ref.partition("@")
    version = None
    if not sep:
        name, _, version = ref.partition(":")
    registry = ModelRegistry(cfg.mlflow_tracking_uri, name)
    info = registry.version(version) if version else registry.by_alias(alias)
    if info is None:
        return None, None
    folder = cfg.home / "gateway" / "filter" / f"{name}-{info.version}"
    if not (folder / "classifier.json").exists():
        tmp = folder.with_name(f".{folder.name}.{id(folder)}")
        registry.download(info.version, tmp)
        found = next(tmp.rglob("classifier.json"), None)
        if found is None:
            raise ValueError(f"{name} version {info.version} has no classifier.json")
        if not folder.exists():
            found.parent.rename(folder)
    log.info("content filter: classifier %s:%s (%s)", name, info.version, ref)
    return folder, f"{name}:{info.version}"


# ---------------------------------------------------------------------------------------
# per request


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
            gateway.refuse_early(self)
        else:
            await gateway.take(self, 1, 0)

    async def response_headers(self, call, status: int) -> list[tuple[bytes, bytes]]:
        if self.request_pending:  # answered before its reservation (an error): it counts all the same
            try:
                await self.gateway.take(self, 0, 0)
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
        hit = await g.cached(self, self.cache_key)
        self.cache_status = call.cache = "hit" if hit is not None else "miss"
        logged = hit.get("log") if hit is not None else None
        if isinstance(logged, dict) and "prompt" in logged:
            # The prompt as this policy redacted it for the log: no second analysis.
            call.prompt, call.prompt_redacted = logged["prompt"], True
            call.pii_entities = logged.get("pii_entities") or None
        return hit

    async def store(self, call, value: dict) -> None:
        if self.cache_key is None:
            return
        if call.prompt_redacted:
            # The prompt as this policy redacted it for the log: a hit on this entry (same
            # request, same policy: the key carries both) logs it without analysing it again.
            value = {**value, "log": {"prompt": call.prompt, "pii_entities": sorted(set(self.pii_found))}}
        await self.gateway.cache.put(self.cache_key, value)

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
                raise PiiDetected("The prompt contains personal data or secrets "
                                  f"({', '.join(sorted(set(found)))}); remove them and retry.")
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
                raise ContentFiltered(f"The prompt was flagged by the content filter ({', '.join(cats)}) and was "
                                      "not processed.")
        return texts

    def prompts_redacted(self) -> bool:
        return self.gateway.pii is not None and self.gateway.config.pii.mode == "redact"

    async def check_content(self, texts: list[str], where: str, classify: bool = True) -> list[Verdict]:
        try:
            verdicts = await self.gateway.filter.check(texts, classify)
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

    async def reserve(self, call, tokens: int) -> None:
        """Take prompt + max_tokens from the key's tokens/min before generating, with the
        request's deferred unit if it is still owed (429 if over)."""
        if await self.gateway.take(self, 0, tokens) is not None:
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
        return _CountingRedactor(g.pii.stream(g.config.pii.stream_step_chars, self.tenant),
                                 lambda e: g.metrics.pii.labels(entity=e, where="output").inc())

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


async def _redact_all(pii, texts: list[str], tenant=None, budget_s: float | None = None
                      ) -> list[tuple[str, list[str]]]:
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
        log.warning("PII analysis of a request's %d characters went over its budget of %g s: refused",
                    sum(len(texts[i]) for i in todo), budget_s)
        raise GuardUnavailable(f"PII analysis of this request took longer than its budget of {budget_s:g} s "
                               "(gateway.pii.request_budget_s); shorten the prompt or retry") from None
    except Exception as exc:
        log.error("PII analysis failed: %s: %s", type(exc).__name__, exc)
        raise GuardUnavailable("PII analysis failed; the request was not processed (the gateway fails closed)") \
            from None
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
        for entity in self.inner.found[self._counted:]:
            self.count(entity)
        self._counted = len(self.inner.found)


# ---------------------------------------------------------------------------------------
# the request's scope


# Routes whose request unit is taken with their token reservation (one limiter call a request).
DEFERRED_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions"})


def _header(scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", []):
        if k.lower() == name:
            return v.decode("latin-1")
    return None
