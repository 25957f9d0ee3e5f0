"""The buffered request-log writer: nothing on the event loop, nothing lost.

submit() only appends to an in-memory buffer (a lock and a list append, on the event
loop). One thread takes the buffer every `flush_interval_s`, redacts the texts that the
gateway did not redact already, and writes the batch to the sink, which flushes and
fsyncs it (a crash loses at most the last interval's records). If the sink fails (a SQL
database down), the batch goes to local JSONL segments (the spill folder) instead and
nothing is dropped; `tuneloop logs` reads both. close() (graceful shutdown) writes what is
left before it returns; a record submitted after close() is written at once.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

log = logging.getLogger("tuneloop.requestlog")

Redact = Callable[[str], str]


class _NoMetrics:
    def records(self, stream: str, result: str, n: int) -> None:
        pass

    def pending(self, n: int) -> None:
        pass


class RequestLogMetrics:
    """| tuneloop_request_log_records_total | stream (requests, feedback), result (written, spilled) |
    | tuneloop_request_log_pending        | records buffered, not yet written                     |
    (create inside the server's worker, as ServingMetrics)"""

    def __init__(self, registry=None):
        import prometheus_client as prom

        kw = {} if registry is None else {"registry": registry}
        self._records = prom.Counter("tuneloop_request_log_records", "Request-log records written",
                                     ["stream", "result"], **kw)
        self._pending = prom.Gauge("tuneloop_request_log_pending", "Request-log records not yet written",
                                   multiprocess_mode="livesum", **kw)

    def records(self, stream: str, result: str, n: int) -> None:
        self._records.labels(stream=stream, result=result).inc(n)

    def pending(self, n: int) -> None:
        self._pending.set(n)


class RequestLog:
    def __init__(self, sink, flush_interval_s: float = 1.0, texts: str = "redacted",
                 redactor: Callable[[], Any] | None = None, spill=None, metrics=None):
        """sink: store.SegmentSink / SqlSink; redactor: a function returning an object with
        redact(text) -> (text, entities), called once in the writer thread (None: texts the
        gateway did not redact are omitted); spill: a SegmentSink for when sink fails."""
        if texts not in ("redacted", "omit"):
            raise ValueError(f"request_log.texts must be redacted or omit, not {texts!r}")
        self.sink, self.spill = sink, spill
        self.flush_interval_s = float(flush_interval_s)
        self.texts = texts
        self._redactor_factory = redactor
        self._redactor = None
        self._redactor_error: str | None = None
        self.metrics = metrics or _NoMetrics()
        self._lock = threading.Lock()
        self._buffer: list[tuple[str, dict]] = []
        self._write_lock = threading.Lock()  # one batch at a time (the thread, flush(), close())
        self._wake = threading.Event()
        self._closed = False
        self.written = 0
        self.spilled = 0
        self._thread = threading.Thread(target=self._run, name="tuneloop-request-log", daemon=True)
        self._thread.start()

    # ---- the event loop's side -----------------------------------------------------------
    def submit(self, record: dict, stream: str = "requests") -> None:
        with self._lock:
            if not self._closed:
                self._buffer.append((stream, record))
                return
        self._write([(stream, record)])  # after close (a request that outlived shutdown)

    @property
    def pending(self) -> int:
        return len(self._buffer)

    # ---- the writer thread ---------------------------------------------------------------
    def _run(self) -> None:
        while True:
            self._wake.wait(self.flush_interval_s)
            self._wake.clear()
            with self._lock:
                closed = self._closed
            self.flush()
            if closed:
                return

    def flush(self) -> int:
        """Write everything buffered now; returns how many records were written."""
        with self._lock:
            batch, self._buffer = self._buffer, []
        if batch:
            self.metrics.pending(len(batch))
            self._write(batch)
            self.metrics.pending(0)
        return len(batch)

    def _write(self, batch: list[tuple[str, dict]]) -> None:
        with self._write_lock:
            by_stream: dict[str, list[dict]] = {}
            for stream, record in batch:
                by_stream.setdefault(stream, []).append(self._prepared(record))
            for stream, records in by_stream.items():
                try:
                    self.sink.write(stream, records)
                    self.written += len(records)
                    self.metrics.records(stream, "written", len(records))
                except Exception as exc:
                    self._spill(stream, records, exc)

    def _spill(self, stream: str, records: list[dict], exc: Exception) -> None:
        if self.spill is None:
            log.error("request log: could not write %d %s records to %s (%s: %s); keeping them to retry",
                      len(records), stream, self.sink, type(exc).__name__, exc)
            with self._lock:
                self._buffer[:0] = [(stream, r) for r in records]
            time.sleep(min(self.flush_interval_s, 1.0))
            return
        log.error("request log: %s failed (%s: %s); %d %s records written to %s instead", self.sink,
                  type(exc).__name__, exc, len(records), stream, self.spill)
        self.spill.write(stream, records)
        self.spilled += len(records)
        self.metrics.records(stream, "spilled", len(records))

    # ---- redaction -------------------------------------------------------------------------
    def _redact_fn(self) -> Redact | None:
        if self._redactor is None and self._redactor_error is None:
            if self._redactor_factory is None:
                self._redactor_error = "no PII redactor"
            else:
                try:
                    self._redactor = self._redactor_factory()
                except Exception as exc:  # fail closed: texts are omitted, records still written
                    self._redactor_error = f"the PII redactor did not start: {type(exc).__name__}"
                    log.error("request log: %s; logged texts are omitted", self._redactor_error)
        if self._redactor is None:
            return None
        return lambda text: self._redactor.redact(text)[0]

    def _prepared(self, record: dict) -> dict:
        fields = _TEXT_FIELDS.get(record.get("kind"), ())
        todo = [f for f in fields if record.get(f) is not None and not record.get(_REDACTED.get(f, ""), False)]
        if self.texts == "omit":
            todo = [f for f in fields if record.get(f) is not None]
            return _omit(record, todo, "request_log.texts: omit") if todo else record
        if not todo:
            return record
        redact = self._redact_fn()
        if redact is None:
            return _omit(record, todo, self._redactor_error or "no PII redactor")
        try:
            out = dict(record)
            for f in todo:
                out[f] = _map_texts(record[f], redact)
                if f in _REDACTED:
                    out[_REDACTED[f]] = True
            return out
        except Exception as exc:  # never write what could not be redacted
            log.error("request log: redaction failed for %s (%s); its texts are omitted",
                      record.get("request_id"), type(exc).__name__)
            return _omit(record, todo, "redaction failed")

    def close(self, timeout: float = 30.0) -> None:
        with self._lock:
            already, self._closed = self._closed, True
        if already:
            return
        self._wake.set()
        self._thread.join(timeout)
        self.flush()
        for s in (self.sink, self.spill):
            if s is not None:
                try:
                    s.close()
                except Exception:  # pragma: no cover - closing is best effort
                    pass


_TEXT_FIELDS = {"request": ("prompt", "completions"), "feedback": ("correction", "comment")}
_REDACTED = {"prompt": "prompt_redacted", "completions": "completion_redacted"}


def _omit(record: dict, fields, why: str) -> dict:
    out = dict(record)
    for f in fields:
        out[f] = None
    out["texts_omitted"] = why
    return out


def _map_texts(value, fn: Redact):
    """Every string in a prompt / completions value through fn (messages: their content)."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, list):
        return [_map_texts(v, fn) for v in value]
    if isinstance(value, dict):
        return {k: (_map_texts(v, fn) if k == "content" else v) for k, v in value.items()}
    return value


def open_request_log(cfg, pii=None, metrics=None) -> RequestLog | None:
    """The RequestLog the config asks for (None when request_log.enabled is false).

    pii: the gateway's PiiRedactor when it has one (shared: one analyzer per process);
    else the writer builds its own from gateway.pii, on first use, in its thread."""
    from components.requestlog.store import SegmentSink, open_sink

    rl = cfg.request_log
    if not rl.enabled:
        return None
    sink = open_sink(rl.url, cfg.home, int(rl.segment_max_mb * (1 << 20)), rl.segment_max_age_s)
    spill = None
    if not isinstance(sink, SegmentSink):
        spill = SegmentSink(cfg.request_log_spill_dir, int(rl.segment_max_mb * (1 << 20)), rl.segment_max_age_s)

    def redactor():
        if pii is not None:
            return pii
        from components.gateway.pii import PiiRedactor

        settings = cfg.gateway.pii
        if settings.spacy_model_dir is not None:
            settings = settings.model_copy(update={"spacy_model_dir": cfg.resolve(settings.spacy_model_dir)})
        return PiiRedactor(settings, cfg.home / "gateway", key_prefix=cfg.gateway.key_prefix)

    log.info("request log: %s (flushed every %g s)", sink, rl.flush_interval_s)
    return RequestLog(sink, rl.flush_interval_s, rl.texts, redactor, spill, metrics)
