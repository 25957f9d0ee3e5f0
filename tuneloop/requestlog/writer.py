"""The buffered request-log writer: nothing on the event loop, nothing lost.

submit() only appends to an in-memory buffer (a lock and a list append, on the event
loop). One thread takes the buffer every `flush_interval_s`, redacts the texts that the
gateway did not redact already, and writes the batch to the sink, which flushes and
fsyncs it (a crash loses at most the last interval's records). Redaction never holds a batch
back: a logged text longer than request_log.max_text_chars keeps its first that many
characters (a marker says how many more there were), a batch goes to the redactor in calls
of at most REDACT_CALL_CHARS characters, and the records of a call that fails or runs out of
time are written on time with their texts withheld (counted: result "texts_withheld").
Before, one 200 KB prompt stalled the writer for ~1.5 minutes. If the sink fails (a SQL
database down), the batch goes to local JSONL segments (the spill folder) instead and
nothing is dropped; `tuneloop logs` reads both. close() (graceful shutdown) writes what is
left before it returns; a record submitted after close() is written at once.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable

from tuneloop.privacy.redactor import PiiRedactor
from tuneloop.requestlog.redactor_process import ProcessRedactor
from tuneloop.requestlog.store import SegmentSink, open_sink

log = logging.getLogger("tuneloop.requestlog")

Redact = Callable[[str], str]
REDACT_CALL_CHARS = 64_000  # characters of text per call to the redactor


def _cut(text: str, limit: int) -> str:
    """At most `limit` characters of a logged text, and a marker of what was left out."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}…[{len(text) - limit} more characters not logged]"


class InProcessRedactor:
    """A PiiRedactor in this process (request_log.redact_in: thread)."""

    def __init__(self, pii):
        self.pii = pii

    def redact_many(self, texts: list[str]) -> list[str]:
        return [self.pii.redact(t)[0] for t in texts]


class _NoMetrics:
    def records(self, stream: str, result: str, n: int) -> None:
        pass

    def pending(self, n: int) -> None:
        pass

    def cpu(self, part: str, seconds: float) -> None:
        pass


class RequestLogMetrics:
    """| tuneloop_request_log_records_total     | stream (requests, feedback), result (written, spilled) |
    | tuneloop_request_log_pending            | records buffered, not yet written                     |
    | tuneloop_request_log_cpu_seconds_total  | part: requests (making and handing over the records, on |
    |                                         | the event loop), writer (the writer thread), redactor   |
    |                                         | (its child process), redactor_start (loading it, once): |
    |                                         | what the log costs the server                           |
    (create inside the server's worker, as ServingMetrics)"""

    def __init__(self, registry=None):
        import prometheus_client as prom

        kw = {} if registry is None else {"registry": registry}
        self._records = prom.Counter(
            "tuneloop_request_log_records", "Request-log records written", ["stream", "result"], **kw
        )
        self._pending = prom.Gauge(
            "tuneloop_request_log_pending", "Request-log records not yet written", multiprocess_mode="livesum", **kw
        )
        self._cpu = prom.Counter("tuneloop_request_log_cpu_seconds", "CPU time the request log used", ["part"], **kw)

    def records(self, stream: str, result: str, n: int) -> None:
        self._records.labels(stream=stream, result=result).inc(n)

    def pending(self, n: int) -> None:
        self._pending.set(n)

    def cpu(self, part: str, seconds: float) -> None:
        if seconds > 0:
            self._cpu.labels(part=part).inc(seconds)


class RequestLog:
    def __init__(
        self,
        sink,
        flush_interval_s: float = 1.0,
        texts: str = "redacted",
        redactor: Callable[[], Any] | None = None,
        spill=None,
        metrics=None,
        niceness: int = 10,
        max_text_chars: int = 20_000,
    ):
        """sink: store.SegmentSink / SqlSink; redactor: a function returning an object with
        redact_many(texts) -> texts, called once (None: texts the gateway did not redact are
        omitted); spill: a SegmentSink for when sink fails;
        niceness: the writer thread's nice increment (Linux: per thread), so that redaction
        and writes yield the cores to generation when both want them."""
        if texts not in ("redacted", "omit"):
            raise ValueError(f"request_log.texts must be redacted or omit, not {texts!r}")
        self.sink, self.spill = sink, spill
        self.flush_interval_s = float(flush_interval_s)
        self.texts = texts
        self.max_text_chars = int(max_text_chars)
        self.withheld = 0  # records written with their texts withheld because redaction failed
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
        self.niceness = niceness
        self._redactor_cpu_seen = 0.0
        self._thread = threading.Thread(target=self._run, name="tuneloop-request-log", daemon=True)
        self._thread.start()

    # ---- the event loop's side -----------------------------------------------------------
    def account(self, seconds: float) -> None:
        """CPU time the event loop spent on the log's behalf (the middleware measures it)."""
        self.metrics.cpu("requests", seconds)

    def submit(self, record: dict, stream: str = "requests") -> None:
        with self._lock:
            if not self._closed:
                self._buffer.append((stream, record))
                return
        self._write([(stream, record)])  # after close (a request that outlived shutdown)

    @property
    def pending(self) -> int:
        return len(self._buffer)

    def warm_up(self) -> None:
        """Start the redactor now (seconds of Presidio set-up), not while the first records wait.
        Returns once it is up; a call while start_warm_up's thread is at it waits for that."""
        if self.texts == "omit":
            return
        with self._write_lock:
            self._redactor_or_none()

    def start_warm_up(self) -> None:
        """warm_up in a thread of its own: the server calls this before it loads its model, so
        that the redaction process loads Presidio while the model loads and compiles."""
        threading.Thread(target=self.warm_up, name="tuneloop-request-log-warm-up", daemon=True).start()

    # ---- the writer thread ---------------------------------------------------------------
    def _run(self) -> None:
        _lower_priority(self.niceness)
        while True:
            self._wake.wait(self.flush_interval_s)
            self._wake.clear()
            with self._lock:
                closed = self._closed
            self.flush()
            if closed:
                return

    def _account_redactor(self, part: str = "redactor") -> None:
        """The redaction child process's CPU since the last look (ProcessRedactor.cpu_seconds);
        a new child (after one died) starts from zero again."""
        seconds = getattr(self._redactor, "cpu_seconds", None)
        if callable(seconds):
            total = seconds()
            if total is not None:
                if total < self._redactor_cpu_seen:
                    self._redactor_cpu_seen = 0.0
                self.metrics.cpu(part, total - self._redactor_cpu_seen)
                self._redactor_cpu_seen = total

    def flush(self) -> int:
        """Write everything buffered now; returns how many records were written."""
        started = time.thread_time()
        with self._lock:
            batch, self._buffer = self._buffer, []
        if batch:
            self.metrics.pending(len(batch))
            self._write(batch)
            self.metrics.pending(0)
            self.metrics.cpu("writer", time.thread_time() - started)
            self._account_redactor()
        return len(batch)

    def _write(self, batch: list[tuple[str, dict]]) -> None:
        with self._write_lock:
            records = self._prepared([r for _, r in batch])
            by_stream: dict[str, list[dict]] = {}
            for (stream, _), record in zip(batch, records):
                by_stream.setdefault(stream, []).append(record)
            for stream, group in by_stream.items():
                try:
                    self.sink.write(stream, group)
                    self.written += len(group)
                    self.metrics.records(stream, "written", len(group))
                except Exception as exc:
                    self._spill(stream, group, exc)

    def _spill(self, stream: str, records: list[dict], exc: Exception) -> None:
        if self.spill is None:
            log.error(
                "request log: could not write %d %s records to %s (%s: %s); keeping them to retry",
                len(records),
                stream,
                self.sink,
                type(exc).__name__,
                exc,
            )
            with self._lock:
                self._buffer[:0] = [(stream, r) for r in records]
            time.sleep(min(self.flush_interval_s, 1.0))
            return
        log.error(
            "request log: %s failed (%s: %s); %d %s records written to %s instead",
            self.sink,
            type(exc).__name__,
            exc,
            len(records),
            stream,
            self.spill,
        )
        self.spill.write(stream, records)
        self.spilled += len(records)
        self.metrics.records(stream, "spilled", len(records))

    # ---- redaction -------------------------------------------------------------------------
    def _redactor_or_none(self):
        if self._redactor is None and self._redactor_error is None:
            if self._redactor_factory is None:
                self._redactor_error = "no PII redactor"
            else:
                try:
                    self._redactor = self._redactor_factory()
                    warm = getattr(self._redactor, "warm_up", None)
                    if warm is not None:
                        warm()
                    self._account_redactor("redactor_start")  # loading Presidio, once
                except Exception as exc:  # fail closed: texts are omitted, records still written
                    self._redactor = None
                    self._redactor_error = f"the PII redactor did not start: {type(exc).__name__}: {exc}"
                    log.error("request log: %s; logged texts are omitted", self._redactor_error)
        return self._redactor

    def _prepared(self, records: list[dict]) -> list[dict]:
        """Records as they may be written: every text the gateway did not redact goes through
        the redactor, all of a batch in one call; if that fails, those texts are omitted."""
        out = list(records)
        todo: list[tuple[int, list[str]]] = []
        for i, record in enumerate(records):
            fields = [f for f in _TEXT_FIELDS.get(record.get("kind"), ()) if record.get(f) is not None]
            if self.texts == "omit":
                if fields:
                    out[i] = _omit(record, fields, "request_log.texts: omit")
                continue
            fields = [f for f in fields if not record.get(_REDACTED.get(f, ""), False)]
            if fields:
                todo.append((i, fields))
        if not todo:
            return out
        redactor = self._redactor_or_none()
        if redactor is None:
            for i, fields in todo:
                out[i] = _omit(records[i], fields, self._redactor_error or "no PII redactor")
            return out
        for call in self._calls(records, todo):
            texts: list[str] = []
            for i, fields in call:
                for f in fields:
                    _map_texts(records[i][f], lambda t, texts=texts: texts.append(_cut(t, self.max_text_chars)) or t)
            try:
                redacted = iter(redactor.redact_many(texts))
            except Exception as exc:  # never write what could not be redacted: withheld, on time
                log.error(
                    "request log: redaction failed for %d records (%s: %s); their texts are withheld",
                    len(call),
                    type(exc).__name__,
                    exc,
                )
                for i, fields in call:
                    out[i] = _omit(records[i], fields, "redaction failed")
                self.withheld += len(call)
                self.metrics.records(records[call[0][0]].get("kind", "requests"), "texts_withheld", len(call))
                continue
            for i, fields in call:
                record = dict(records[i])
                for f in fields:
                    record[f] = _map_texts(records[i][f], lambda _t, redacted=redacted: next(redacted))
                    if f in _REDACTED:
                        record[_REDACTED[f]] = True
                out[i] = record
        return out

    def _calls(self, records: list[dict], todo: list[tuple[int, list[str]]]) -> list[list[tuple[int, list[str]]]]:
        """The records to redact, grouped into calls of at most REDACT_CALL_CHARS characters
        (a record bigger than that alone in its call), so a failure withholds few."""
        calls: list[list[tuple[int, list[str]]]] = [[]]
        size = 0
        for i, fields in todo:
            n = sum(min(len(t), self.max_text_chars) for f in fields for t in _texts_of(records[i][f]))
            if calls[-1] and size + n > REDACT_CALL_CHARS:
                calls.append([])
                size = 0
            calls[-1].append((i, fields))
            size += n
        return [c for c in calls if c]

    def close(self, timeout: float = 30.0) -> None:
        with self._lock:
            already, self._closed = self._closed, True
        if already:
            return
        self._wake.set()
        self._thread.join(timeout)
        self.flush()
        for s in (self.sink, self.spill, self._redactor):
            if s is not None and hasattr(s, "close"):
                try:
                    s.close()
                except Exception:  # pragma: no cover - closing is best effort
                    pass


def _lower_priority(niceness: int) -> None:
    if niceness <= 0 or not hasattr(os, "setpriority"):
        return
    try:  # on Linux a thread is a task with its own nice value
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + niceness))
    except OSError:  # pragma: no cover - not permitted here: the thread keeps its priority
        pass


_TEXT_FIELDS = {"request": ("prompt", "completions"), "feedback": ("correction", "comment", "chosen", "rejected")}
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


def _texts_of(value) -> list[str]:
    found: list[str] = []
    _map_texts(value, lambda t: found.append(t) or t)
    return found


def open_request_log(cfg, pii=None, metrics=None) -> RequestLog | None:
    """The RequestLog the config asks for (None when request_log.enabled is false).

    Texts the gateway did not redact are redacted with gateway.pii's settings: in a child
    process (request_log.redact_in: process, the default) or in the writer thread (thread:
    with the gateway's PiiRedactor `pii` when there is one; `pii` may be a function returning
    it, called when the redactor starts)."""
    rl = cfg.request_log
    if not rl.enabled:
        return None
    sink = open_sink(rl.url, cfg.home, int(rl.segment_max_mb * (1 << 20)), rl.segment_max_age_s)
    spill = None
    if not isinstance(sink, SegmentSink):
        spill = SegmentSink(cfg.request_log_spill_dir, int(rl.segment_max_mb * (1 << 20)), rl.segment_max_age_s)

    def redactor():
        settings = cfg.gateway.pii
        if settings.spacy_model_dir is not None:
            settings = settings.model_copy(update={"spacy_model_dir": cfg.resolve(settings.spacy_model_dir)})
        if rl.redact_in == "process":
            return ProcessRedactor(
                settings.model_dump(mode="json"),
                str(cfg.home / "gateway"),
                cfg.gateway.key_prefix,
                timeout_s=rl.redaction_timeout_s,
            )
        shared = pii() if callable(pii) else pii
        if shared is not None:
            return InProcessRedactor(shared)
        return InProcessRedactor(PiiRedactor(settings, cfg.home / "gateway", key_prefix=cfg.gateway.key_prefix))

    log.info("request log: %s (flushed every %g s)", sink, rl.flush_interval_s)
    return RequestLog(sink, rl.flush_interval_s, rl.texts, redactor, spill, metrics, max_text_chars=rl.max_text_chars)
