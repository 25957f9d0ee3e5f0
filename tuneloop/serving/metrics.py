"""Prometheus metrics of the model server (names follow vLLM's, prefixed tuneloop_).

| name                                       | type      | labels          | meaning                                   |
|--------------------------------------------|-----------|-----------------|-------------------------------------------|
| tuneloop_time_to_first_token_seconds       | histogram | model, engine   | admission to first generated token        |
| tuneloop_time_per_output_token_seconds     | histogram | model, engine   | (last - first token time) / (tokens - 1)  |
| tuneloop_e2e_request_latency_seconds       | histogram | model, engine   | admission to last token                   |
| tuneloop_prompt_tokens_total               | counter   | model, engine   | prompt tokens of finished generations     |
| tuneloop_generation_tokens_total           | counter   | model, engine   | tokens generated (also for cut-off ones)  |
| tuneloop_num_requests_running              | gauge     | model, engine   | generations that produced a token         |
| tuneloop_num_requests_waiting              | gauge     | model, engine   | admitted, no token yet                    |
| tuneloop_batch_size                        | histogram | engine          | rows per batch / per step (continuous, slots)|
| tuneloop_requests_rejected_total           | counter   | reason          | error answers + aborted generations       |
| tuneloop_request_success_total             | counter   | finish_reason   | generations finished with stop / length   |
| tuneloop_internal_retries_total            | counter   | error           | in-process calls retried (BentoML bug)    |

Reasons: invalid_request, context_length_exceeded, model_not_found, not_found, overloaded,
unavailable, timeout, client_disconnected, internal_error.

prometheus_client is imported inside ServingMetrics: BentoML workers switch it to
multiprocess mode (PROMETHEUS_MULTIPROC_DIR) after importing the service module, and
metrics created before that would never reach BentoML's /metrics. Create ServingMetrics
in the service's __init__, never at import time.
"""

from __future__ import annotations

TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
REQUEST_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class ServingMetrics:
    def __init__(self, model: str, engine: str, registry=None):
        import prometheus_client as prom

        kw = {} if registry is None else {"registry": registry}
        self.model, self.engine = model, engine
        labels = ["model", "engine"]
        self.ttft = prom.Histogram(
            "tuneloop_time_to_first_token_seconds", "Time to first token", labels, buckets=TOKEN_LATENCY_BUCKETS, **kw
        )
        self.tpot = prom.Histogram(
            "tuneloop_time_per_output_token_seconds",
            "Time per output token after the first",
            labels,
            buckets=TOKEN_LATENCY_BUCKETS,
            **kw,
        )
        self.e2e = prom.Histogram(
            "tuneloop_e2e_request_latency_seconds",
            "End-to-end generation latency",
            labels,
            buckets=REQUEST_LATENCY_BUCKETS,
            **kw,
        )
        self.prompt_tokens = prom.Counter("tuneloop_prompt_tokens", "Prompt tokens processed", labels, **kw)
        self.generation_tokens = prom.Counter("tuneloop_generation_tokens", "Tokens generated", labels, **kw)
        # livesum: in BentoML's multiprocess mode, the sum over live worker processes.
        self.running = prom.Gauge(
            "tuneloop_num_requests_running", "Generations producing tokens", labels, multiprocess_mode="livesum", **kw
        )
        self.waiting = prom.Gauge(
            "tuneloop_num_requests_waiting",
            "Admitted generations without a token yet",
            labels,
            multiprocess_mode="livesum",
            **kw,
        )
        self.batch_size = prom.Histogram(
            "tuneloop_batch_size",
            "Rows per generation batch (adaptive) or step (continuous, slots)",
            ["engine"],
            buckets=BATCH_SIZE_BUCKETS,
            **kw,
        )
        self.rejected = prom.Counter(
            "tuneloop_requests_rejected", "Requests refused or aborted, by reason", ["reason"], **kw
        )
        self.success = prom.Counter("tuneloop_request_success", "Generations finished", ["finish_reason"], **kw)
        self.retries = prom.Counter("tuneloop_internal_retries", "In-process calls retried", ["error"], **kw)
        # Wall time the engine's steps and the filter's encoder batches held the CPU, in turns
        # (tuneloop/cpu_turns.py): the filter's share of it is what it costs the engine.
        self.cpu_turns = prom.Counter(
            "tuneloop_cpu_turn_seconds", "Seconds the CPU's turns were held, by holder", ["holder"], **kw
        )
        self._labels = {"model": model, "engine": engine}
        # Which version serves now (1) and which served before (0): the other series keep the
        # label this process started with, also after a hot swap (tuneloop/serving/hotswap.py).
        self.model_info = prom.Gauge(
            "tuneloop_model_info",
            "1 for the model version this replica serves now",
            ["model"],
            multiprocess_mode="livemax",
            **kw,
        )
        self.model_info.labels(model=model).set(1)

    def serving(self, old: str, new: str) -> None:
        self.model_info.labels(model=old).set(0)
        self.model_info.labels(model=new).set(1)

    def observe_turn(self, holder: str, seconds: float) -> None:
        self.cpu_turns.labels(holder=holder).inc(seconds)

    def observe_batch(self, size: int) -> None:
        self.batch_size.labels(engine=self.engine).observe(size)

    def reject(self, reason: str) -> None:
        self.rejected.labels(reason=reason).inc()

    def retry(self, error: str) -> None:
        self.retries.labels(error=error).inc()

    # ---- one generation's life: admitted -> first token -> finished --------------------
    def generation_admitted(self) -> None:
        self.waiting.labels(**self._labels).inc()

    def first_token(self) -> None:
        self.waiting.labels(**self._labels).dec()
        self.running.labels(**self._labels).inc()

    def generation_ended(self, stream, started_at: float, got_token: bool, finish_reason: str | None) -> None:
        """Record one ended generation (stream: tuneloop.serving.engine.GenerationStream).

        finish_reason: what the client was told (stop / length), None if it never finished.
        """
        (self.running if got_token else self.waiting).labels(**self._labels).dec()
        lab = self._labels
        self.prompt_tokens.labels(**lab).inc(len(stream.prompt_ids))
        self.generation_tokens.labels(**lab).inc(stream.num_generated)
        if stream.first_token_at is not None:
            self.ttft.labels(**lab).observe(stream.first_token_at - started_at)
            end = stream.finished_at or stream.first_token_at
            self.e2e.labels(**lab).observe(end - started_at)
            if stream.num_generated > 1:
                self.tpot.labels(**lab).observe((end - stream.first_token_at) / (stream.num_generated - 1))
        if finish_reason in ("stop", "length"):
            self.success.labels(finish_reason=finish_reason).inc()
