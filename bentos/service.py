"""The tuneloop model server: an OpenAI-compatible API as a BentoML service.

    bentoml serve bentos.service:TuneloopLLM --port 3000

Configuration (read when this module is imported, so the BentoML decorators get it):
the YAML named by TUNELOOP_CONFIG (else a built bento's bentos/packaged_config.yaml, else
configs/default.yaml), section `serving`
(tuneloop/config.py: ServingConfig), plus environment overrides:

    TUNELOOP_SERVE_MODEL_DIR       Hugging Face model folder to serve
    TUNELOOP_SERVE_MODEL_NAME      registered name      } /v1/models id = "<name>:<version>";
    TUNELOOP_SERVE_MODEL_VERSION   registered version   } requests may also use <name>
    TUNELOOP_SERVE_ENGINE          adaptive | continuous | slots | vllm
    TUNELOOP__SERVING__<KEY>       any other serving key, e.g. TUNELOOP__SERVING__ALIASES='[tuneloop-chat@champion]'

Packaging seam: a bento must carry its model. The packaging step (tuneloop/packaging.py)
imports the MLflow champion into the BentoML model store and sets `serving.bento_model:
<name>:<tag>` (plus model_name/model_version/aliases) in bentos/packaged_config.yaml, which
it puts into the bento next to this file and which is read when TUNELOOP_CONFIG is unset
(BentoML applies a bentofile's envs only inside its container, not to `bentoml serve
<bento>`, so the file is found by location, not by variable). This class then declares
`bentoml.models.BentoModel(tag)` at class level -- which is what makes `bentoml build`
include the model -- and serves its folder. Without bento_model it serves model_dir /
the base model (tuneloop/serving/setup.py: resolve_model_dir).

Engines (serving.engine):
- adaptive: the routes call `self.to_async.generate_batch([request_id])`, which goes
  through BentoML's HTTP path and so through its adaptive batcher (a direct Python call
  is not batched). The batch carries request ids; prompts, per-request parameters and the
  token stream back to the route live in a process-local registry (the self-call never
  leaves this worker process). One left-padded `generate` runs per batch.
- continuous: transformers' continuous batching manager, called directly.
- slots (default): our iteration-level batching over per-request KV-cache slots
  (tuneloop/serving/slots.py), called directly.

BentoML 1.4.40 in-process client bug (field notes; upstream issues 5540/5544): the
client behind `self.to_async` closes its HTTP session every 100 requests / 300 s while
other requests still use it, so concurrent calls fail with ServerDisconnectedError.
Worked around twice: `runner_connection` below makes the session never expire, and a
call that still fails with a connection error is retried (only if its batch has not
started; counted in tuneloop_internal_retries_total).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import time
from pathlib import Path

import bentoml

# None of these imports torch, transformers or prometheus_client when imported (BentoML imports this
# module in the build, the serve parent and the worker): the model is loaded and the metrics are made
# in TuneloopLLM.__init__, in the worker, once BentoML has set prometheus_client's multiprocess mode.
from tuneloop.api.app import create_app
from tuneloop.api.middleware import InternalRoutesGuard, OpenAIErrorMiddleware, PublicOpenAPISpec
from tuneloop.api.server import OpenAIServer
from tuneloop.config import load_config
from tuneloop.cpu_turns import CPU_TURNS
from tuneloop.files import open_file_store
from tuneloop.finetune.adapters import AdapterCatalog
from tuneloop.finetune.jobs import JobStore
from tuneloop.finetune.runner import Dispatcher
from tuneloop.monitoring.exporter import LATEST, MonitoringGauges
from tuneloop.requestlog.writer import RequestLogMetrics, open_request_log
from tuneloop.serving.adaptive_engine import BatchGenerator
from tuneloop.serving.admission import AdmissionController
from tuneloop.serving.continuous_engine import ContinuousEngine
from tuneloop.serving.embedder import Embedder
from tuneloop.serving.engine import load_model, load_tokenizer
from tuneloop.serving.engine_process import EngineProcess
from tuneloop.serving.errors import InternalError, Unavailable
from tuneloop.serving.hotswap import ChampionWatcher
from tuneloop.serving.metrics import ServingMetrics
from tuneloop.serving.setup import resolve_model_dir, served_model, warm_up
from tuneloop.serving.slots import SlotEngine
from tuneloop.serving.untrusted import BENTOML_PATHS, RouteNames, install_log_escaping, protect_bentoml_middlewares
from tuneloop.serving.vllm_engine import VLLMEngine, vllm_dtype

# Under "bentoml" so that `bentoml serve` shows it with its own lines (it configures only that tree).
log = logging.getLogger("bentoml.tuneloop")

# A built bento carries its config next to this file (written by tuneloop/packaging.py);
# an explicit TUNELOOP_CONFIG still wins, then configs/default.yaml.
PACKAGED_CONFIG = Path(__file__).with_name("packaged_config.yaml")
CONFIG = load_config(os.environ.get("TUNELOOP_CONFIG") or (PACKAGED_CONFIG if PACKAGED_CONFIG.exists() else None))
SERVING = CONFIG.serving
BATCH_ROUTE = "/internal/generate_batch"
# The adaptive engine's self-call carries this; a request to /internal/ without it is 404.
INTERNAL_TOKEN = secrets.token_hex(32)

app = create_app(max_request_bytes=SERVING.max_request_bytes)
# What clients send cannot forge log lines or grow /metrics without bound (tuneloop/serving/untrusted.py).
install_log_escaping()
protect_bentoml_middlewares(RouteNames(app.routes, BENTOML_PATHS))


@bentoml.service(
    name="tuneloop_llm",
    workers=1,
    traffic={
        # Our own deadline (request_timeout_s -> 504) fires first; BentoML's is a backstop.
        "timeout": SERVING.request_timeout_s + 30,
    },
    # The API routes and the adaptive engine's batch calls make no spans unless asked
    # (serving.trace_requests): BentoML's OpenTelemetry middleware then passes them through.
    tracing={} if SERVING.trace_requests else {"excluded_urls": ["/v1/", BATCH_ROUTE]},
    # The bug workaround, part 1: never recycle the in-process client's session.
    runner_connection={"max_requests": 2**31 - 1, "max_age": 10.0**9},
    # One access-log line per client request, not a second one for its internal batch call.
    logging={"access": {"skip_paths": ["/metrics", "/healthz", "/livez", "/readyz", BATCH_ROUTE]}},
)
@bentoml.asgi_app(app, path="/")
class TuneloopLLM:
    if SERVING.bento_model:
        # The packaging seam: makes `bentoml build` carry this model (see module docstring).
        bento_model = bentoml.models.BentoModel(SERVING.bento_model)

    def __init__(self) -> None:
        served = served_model(SERVING)
        # Created here, not at import: BentoML switches prometheus_client to multiprocess
        # mode between importing this module and starting the worker.
        self.metrics = ServingMetrics(model=served.id, engine=SERVING.engine)
        # Every finished /v1 request, redacted, written off the event loop (tuneloop/requestlog).
        # Its redaction process (the default) starts first: it loads Presidio while this process
        # builds the gateway and loads the model. Redacting in the writer thread instead shares
        # the gateway's redactor, so that one starts in the warm-up, once the gateway exists.
        self.request_log = open_request_log(CONFIG, lambda: self.gateway.pii, RequestLogMetrics())
        app.state.request_log = self.request_log
        if self.request_log is not None and CONFIG.request_log.redact_in == "process":
            self.request_log.start_warm_up()
        # The interface layer (auth, limits, cache, PII, content filter) in front of every /v1
        # route, in this process; set before the server so no /v1 request ever passes without it.
        from tuneloop.gateway.pipeline import Gateway, GatewayMetrics

        self.gateway = Gateway.from_config(CONFIG, GatewayMetrics())
        app.state.gateway = self.gateway
        # /v1/files: training files of each key's team (the state folder, or an S3 bucket).
        app.state.files = open_file_store(CONFIG)
        # /v1/fine_tuning/jobs: jobs run as training flow runs; their ft: models are adapters of
        # the served base, served beside it (tuneloop/finetune).
        self.dispatcher: Dispatcher | None = None
        if CONFIG.fine_tuning.enabled:
            app.state.jobs = JobStore.from_config(CONFIG)
            app.state.fine_tuning_config = CONFIG
            app.state.adapters = AdapterCatalog(CONFIG, lambda: (self.server.served.name, self.server.served.version))
            self.dispatcher = Dispatcher(
                CONFIG, app.state.jobs, app.state.files, str(CONFIG.source) if CONFIG.source else None
            )
            app.state.dispatcher = self.dispatcher
        # /v1/embeddings: the shipped sentence encoder, loaded by its first request.
        app.state.embedder = Embedder(max_inputs=SERVING.embeddings_max_inputs) if SERVING.embeddings else None
        model_dir = Path(self.bento_model.path) if SERVING.bento_model else resolve_model_dir(CONFIG)
        in_child = SERVING.engine == "vllm" or (SERVING.engine == "slots" and SERVING.engine_process)
        if in_child:  # the weights live in the engine's process; this one needs the tokenizer
            loaded = load_tokenizer(model_dir)
        else:
            loaded = load_model(model_dir, SERVING.num_threads, SERVING.dtype)
        self.server: OpenAIServer | None = None

        def on_batch(size: int) -> None:
            if self.server is not None and self.server.ready:  # warm-up batches are not traffic
                self.metrics.observe_batch(size)

        self.engine = None  # an engine with its own generation thread (slots, continuous)
        if SERVING.engine == "slots" and SERVING.engine_process:
            self.engine = EngineProcess(
                loaded, SERVING, on_batch, self.metrics.observe_turn if SERVING.cpu_turns else None
            )
        elif SERVING.engine == "slots":
            self.engine = SlotEngine.from_config(loaded, SERVING, on_batch)
            if SERVING.cpu_turns and loaded.model.device.type == "cpu":
                CPU_TURNS.enable(self.metrics.observe_turn)
        elif SERVING.engine == "vllm":
            logs = CONFIG.home / "logs"
            logs.mkdir(parents=True, exist_ok=True)
            self.engine = VLLMEngine(
                loaded,
                SERVING.vllm_python,
                dtype=vllm_dtype(SERVING.dtype),
                max_model_len=SERVING.max_model_len,
                kv_cache_gib=SERVING.kv_cache_gib,
                extra_args=SERVING.vllm_args,
                log_path=logs / f"vllm-{os.getpid()}.log",
                lora=SERVING.lora,
            )
        elif SERVING.engine == "continuous":
            self.engine = ContinuousEngine(
                loaded, SERVING.num_blocks, SERVING.page_size, SERVING.max_batch_tokens, on_batch=on_batch
            )
        if self.engine is not None:
            self.engine.launch()
            if hasattr(self.engine, "wait_loaded"):  # the engine's process: fail the start as load_model would
                self.engine.wait_loaded()
            backend = self.engine
        else:  # adaptive: BentoML's batcher calls generate_batch
            self.batcher = BatchGenerator(loaded, on_batch=on_batch)
            backend = _BentoBatchingBackend(self)
        self.pending: dict = {}  # request id -> GenerationStream, for generate_batch
        self.server = OpenAIServer(
            loaded=loaded,
            backend=backend,
            admission=AdmissionController(SERVING.max_concurrency, SERVING.request_timeout_s, SERVING.retry_after_s),
            served=served,
            default_max_tokens=SERVING.default_max_tokens,
            max_tokens_limit=SERVING.max_tokens_limit,
            metrics=self.metrics,
            stream_interval_s=SERVING.stream_interval_ms / 1000,
        )
        app.state.server = self.server
        if self.dispatcher is not None:
            self.dispatcher.start()
        log.info("serving %s from %s with the %s engine", served.id, model_dir, SERVING.engine)

    @bentoml.on_startup
    async def _start_warm_up(self) -> None:
        self._drain_on_signal()  # the web server has its signal handlers by now: this one goes first
        # The self-call client (`self.to_async` through HTTP) is only set up after startup
        # hooks return, so the warm-up runs as a task that waits for it; /readyz stays
        # 503 (__is_ready__) until it is done.
        self._warm_up_task = asyncio.get_running_loop().create_task(self._warm_up())

    async def _warm_up(self) -> None:
        try:
            if SERVING.engine == "adaptive":
                while getattr(self, "__self_proxy__", None) is None:
                    await asyncio.sleep(0.05)
                _pass_internal_routes(self.__self_proxy__.to_async)
            engine_ready = getattr(self.engine, "ready", None)  # slots: compiled; vllm: its server up
            if engine_ready is not None:
                await asyncio.to_thread(engine_ready.wait)
                if not self.engine.is_running:
                    raise RuntimeError(
                        f"the {SERVING.engine} engine did not start: "
                        f"{getattr(self.engine, 'failed', None) or 'see the log'}"
                    )
            if hasattr(self.engine, "compile_mode"):  # slots: say which forward, and whether start-up compiled it
                log.info(
                    "forward: %s; torch.compile: %s",
                    self.engine.forward_name,
                    f"{self.engine.compile_mode} ({self.engine.compile_seconds:.1f} s)"
                    if self.engine.compiled
                    else "off",
                )
            t0 = time.perf_counter()
            await self.gateway.warm_up()
            t1 = time.perf_counter()
            if self.request_log is not None:
                await asyncio.to_thread(self.request_log.warm_up)
            t2 = time.perf_counter()
            seconds = await warm_up(self.server, SERVING.warmup_requests)
            log.info(
                "warm-up done in %.1f s (before it: gateway %.1f s, waiting for the request log's redactor "
                "%.1f s): ready",
                seconds,
                t1 - t0,
                t2 - t1,
            )
            self._monitoring_task = asyncio.get_running_loop().create_task(self._export_monitoring())
            self._follow_champion()
        except Exception:
            log.exception("warm-up failed: the service stays not ready")

    def _follow_champion(self) -> None:
        """A new champion in the registry is swapped in without a restart (tuneloop/serving/hotswap.py)."""
        if not SERVING.follow_champion_s:
            return
        why_not = ChampionWatcher.applies(CONFIG, self.server.served, self.engine)
        if why_not:
            log.info("not following the registry's champion: %s", why_not)
            return
        watcher = ChampionWatcher(CONFIG, self.server, self.engine, SERVING.follow_champion_s, self.metrics)
        self._champion_task = asyncio.get_running_loop().create_task(watcher.run())
        log.info(
            "following the registry's champion (every %g s): a new one is swapped in without a restart",
            SERVING.follow_champion_s,
        )

    async def _export_monitoring(self) -> None:
        """The latest monitoring run's scores on /metrics (tuneloop/monitoring/exporter.py)."""
        gauges = MonitoringGauges(CONFIG.monitoring_dir / LATEST)
        while True:
            await asyncio.to_thread(gauges.refresh)
            await asyncio.sleep(30)

    def __is_ready__(self) -> bool:
        engine_alive = self.engine is None or self.engine.is_running  # continuous/slots: its thread may die
        return self.server is not None and self.server.ready and engine_alive and not self.server.draining

    def __is_alive__(self) -> bool:
        """/livez: false only when this server cannot recover by itself, so that an orchestrator
        restarts it: its engine process crashed faster than restarts mend it (gave_up), or an
        engine without a supervisor (on a thread of this process, vLLM's) died after it served."""
        if getattr(self.engine, "gave_up", False):
            return False
        supervised = hasattr(self.engine, "gave_up")
        served = self.server is not None and self.server.ready
        return supervised or not served or self.engine is None or self.engine.is_running

    def _drain_on_signal(self) -> None:
        """Graceful shutdown: on SIGTERM / SIGINT, before the web server's own handling (it stops
        accepting and waits for open requests), this server stops admitting: /readyz turns red
        and new requests get 503 with Retry-After, while in-flight streams go on to their end,
        for serving.shutdown_grace_s at most; then what is left is ended with a clean error and
        the engine stops (the shutdown hook then writes every logged request out)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous = signal.getsignal(sig)

            def handler(signum, frame, previous=previous):
                if self.server is not None and not self.server.draining:
                    self.server.draining = True
                    log.warning(
                        "signal %d: draining: no new requests; %d generations in flight get up to %.0f s",
                        signum,
                        self.server.admission.in_flight,
                        SERVING.shutdown_grace_s,
                    )
                    loop.call_soon_threadsafe(lambda: loop.create_task(self._drain()))
                if callable(previous):
                    previous(signum, frame)

            signal.signal(sig, handler)

    async def _drain(self) -> None:
        deadline = time.monotonic() + SERVING.shutdown_grace_s
        while self.server.admission.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if self.server.admission.in_flight > 0:
            log.warning(
                "drain: %d generations still running after %.0f s: ending them",
                self.server.admission.in_flight,
                SERVING.shutdown_grace_s,
            )
            if self.engine is not None:
                await asyncio.to_thread(self.engine.stop)
        else:
            log.info("drain: every in-flight generation ended")

    @bentoml.on_shutdown
    async def _stop(self) -> None:
        if self.dispatcher is not None:  # its running jobs fail visibly (server_stopped), no orphans
            await asyncio.to_thread(self.dispatcher.stop)
        if self.engine is not None:
            await asyncio.to_thread(self.engine.stop)
        await self.gateway.close()
        if self.request_log is not None:  # what is buffered is written before the process exits
            await asyncio.to_thread(self.request_log.close)

    if SERVING.engine == "adaptive":  # the other engines have no batch route at all

        @bentoml.api(
            batchable=True,
            max_batch_size=SERVING.max_batch_size,
            max_latency_ms=SERVING.max_latency_ms,
            route=BATCH_ROUTE,
        )
        def generate_batch(self, request_ids: list[str]) -> list[str]:
            """Internal (adaptive engine): run the pending generations named by request_ids as one batch.

            Only the in-process client reaches it (InternalRoutesGuard). Tokens go to each
            request's stream; the answer is each request's finish reason ("skipped" if it
            was unknown, cancelled before its batch, or already run).
            """
            streams = [self.pending.get(rid) for rid in request_ids]
            runnable = [s for s in streams if s is not None and not s.claimed and not s.cancelled]
            self.batcher.run(runnable)
            return ["ran" if s in runnable else "skipped" for s in streams]


# Errors BentoML answers itself (its batch route's validation, unknown paths) get OpenAI's shape.
TuneloopLLM.add_asgi_middleware(OpenAIErrorMiddleware)
# Outsiders never reach the internal routes: not BentoML's validation, not the batcher.
TuneloopLLM.add_asgi_middleware(InternalRoutesGuard, prefix="/internal/", token=INTERNAL_TOKEN)
TuneloopLLM.add_asgi_middleware(PublicOpenAPISpec, hide_prefix="/internal/")


def _pass_internal_routes(client) -> None:
    """Give the in-process client (BentoML 1.4.40: proxy2.AsyncClient over aiohttp) the token
    InternalRoutesGuard asks for: in the headers every session it makes starts from, and in
    the session it may have made already. Without it the adaptive engine's batch calls get
    404 and warm-up fails, so the serving tests notice if BentoML changes these internals."""
    header = InternalRoutesGuard.HEADER.decode()
    client.default_headers[header] = INTERNAL_TOKEN
    manager = client._session_manager
    manager._headers[header] = INTERNAL_TOKEN
    if manager._session is not None:
        manager._session.headers[header] = INTERNAL_TOKEN


class _BentoBatchingBackend:
    """The adaptive engine as an API Backend (tuneloop/api/server.py): each generation is a call through
    BentoML's HTTP path to generate_batch, so BentoML's adaptive batcher groups them."""

    engine = "adaptive"
    ATTEMPTS = 3

    def __init__(self, service: TuneloopLLM):
        self.service = service
        self._calls: set[asyncio.Task] = set()  # strong references while they run

    def submit(self, stream) -> None:
        self.service.pending[stream.request_id] = stream
        task = asyncio.get_running_loop().create_task(self._call(stream))
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    async def _call(self, stream) -> None:
        import aiohttp
        from bentoml.exceptions import BentoMLException

        try:
            for attempt in range(1, self.ATTEMPTS + 1):
                try:
                    await self.service.to_async.generate_batch([stream.request_id])
                    return
                except (aiohttp.ClientError, RuntimeError) as exc:
                    # The bug workaround, part 2. RuntimeError: aiohttp's "Session is closed".
                    if isinstance(exc, RuntimeError) and "closed" not in str(exc).lower():
                        raise
                    self.service.metrics.retry(type(exc).__name__)
                    if stream.claimed or stream.done:
                        return  # its batch is running: the tokens come through the stream
                    log.warning("in-process call for %s failed (%r), attempt %d", stream.request_id, exc, attempt)
                    if attempt == self.ATTEMPTS:
                        raise
        except BentoMLException as exc:
            status = int(getattr(exc, "error_code", 500))
            if status == 503:  # BentoML's batcher shed it: predicted over max_latency_ms
                stream.finish(
                    "error",
                    Unavailable(
                        "the server is overloaded (batch queue over its latency budget); retry shortly",
                        retry_after_s=SERVING.retry_after_s,
                    ),
                )
            else:
                log.error("generate_batch failed for %s: %s", stream.request_id, exc)
                stream.finish("error", InternalError("generation failed; see the server log"))
        except Exception as exc:
            log.exception("generate_batch call failed for %s", stream.request_id)
            stream.finish("error", InternalError(f"generation failed: {type(exc).__name__}"))
        finally:
            self.service.pending.pop(stream.request_id, None)
            if not stream.claimed and not stream.done:
                stream.finish("error", InternalError("generation was never scheduled"))
