"""The gateway's CPU-heavy checks in a child process: Presidio's analyses and the classifier.

Both are Python that holds the GIL for a millisecond or more a call; in the server's
process every such millisecond is taken from the engine's thread and the event loop (on the
demo model the classifier and Presidio took 7 % of the server's CPU and, through the GIL,
more of its throughput). Here they run in a child process, on another core, while the
server only serialises strings:

    GuardProcess(spec).start()   spawns `python -m tuneloop.gateway.guard_child <spec>`
    .submit(op, payload)         -> concurrent.futures.Future (thread-safe, never blocks)
    await .acall(op, payload, timeout_s)
    .call(op, payload, timeout_s)

One JSON line per request each way, with an id; the child answers in order. A writer
thread feeds the child's stdin (so a stalled child never blocks the event loop) and starts
a new child when the last one is gone; a reader thread resolves the futures. When the child
exits every pending call fails at once (GuardFailed), and a call that times out while the
child has answered nothing for as long kills it: the caller refuses the request (fails
closed) and the next call gets a new child.

Fair between tenants: calls wait in a queue per tenant (submit's `tenant`: the API key),
and the writer hands the child MAX_IN_FLIGHT calls at a time, taking the tenants' queues in
turn. A tenant with a long prompt (PII analysis in chunks: tuneloop/gateway/remote_pii.py) waits
behind its own chunks, not the others behind them: before, one 200 KB prompt analysed whole
made the child time out, be restarted, and 11 of 16 other tenants' streams fail.

This module is the parent's side and imports nothing of tuneloop; what runs in the child
(loading the checks, answering the calls) is tuneloop/gateway/guard_child.py. Ops (the spec
says what the child loads): ``find`` (a text -> its PII entities), ``redact`` (texts ->
redacted texts: the request log's writer), ``scores`` (texts -> the classifier's scores and
how many the screen cleared).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, InvalidStateError
from typing import Any, Callable

log = logging.getLogger("bentoml.tuneloop.gateway")

START_TIMEOUT_S = 120.0  # building Presidio's analyzer takes seconds, more on a busy host
MAX_IN_FLIGHT = 2  # calls written to the child at a time: one running, the next ready in the pipe


class GuardFailed(Exception):
    """The child failed this call: it errored, exited, did not start or did not answer."""


class GuardProcess:
    def __init__(self, spec: dict, name: str = "guard", start_timeout_s: float = START_TIMEOUT_S):
        self.spec = dict(spec)
        self.name = name
        self.start_timeout_s = start_timeout_s
        self.info: dict[str, Any] = {}  # what the child said when it was ready
        self.on_cpu: dict[str, Callable[[float], None]] = {}  # op -> the child's CPU seconds per call
        self.ready = threading.Event()
        self.starts = 0
        # calls waiting to be written, per tenant, and the tenants with calls in their turn order
        self._queues: dict[Any, collections.deque] = {}
        self._turns: collections.deque = collections.deque()
        self._wanted = threading.Condition()  # a call queued, an answer in, a (re)start asked for
        self._spawn_asked = False
        self._pending: dict[int, tuple[str, Future, subprocess.Popen]] = {}  # id -> (op, future, child)
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._proc: subprocess.Popen | None = None
        self._last_answer = time.monotonic()
        self._start_error: str | None = None
        self._retry_at = 0.0  # after a failed start: calls fail at once until then
        self._failed_starts = 0
        self._closed = False
        self._writer: threading.Thread | None = None

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self, wait: bool = False) -> "GuardProcess":
        """Start the writer thread, which spawns the child at once; wait: until it is ready
        (GuardFailed if it cannot start)."""
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, daemon=True, name=f"tuneloop-{self.name}-writer")
            self._writer.start()
            self._wake(spawn=True)  # spawn now, not at the first call
        if wait:
            self.wait_ready(self.start_timeout_s)
        return self

    def wait_ready(self, timeout_s: float) -> dict:
        """What the child said when it was ready; GuardFailed as soon as a start fails, or at the timeout."""
        failed, deadline = self._failed_starts, time.monotonic() + timeout_s
        while not self.ready.wait(0.05):
            if self._failed_starts != failed or time.monotonic() > deadline:
                raise GuardFailed(self._start_error or f"the {self.name} process did not start within {timeout_s:g} s")
        return self.info

    async def await_ready(self, timeout_s: float | None = None) -> dict:
        return await asyncio.to_thread(self.wait_ready, timeout_s or self.start_timeout_s)

    def close(self) -> None:
        self._closed = True
        self._wake()
        proc = self._proc
        if proc is not None:
            assert proc.stdin is not None  # _spawn opens every child with stdin=PIPE
            try:
                proc.stdin.close()
                proc.wait(5)
            except Exception:  # noqa: BLE001 - gone already, or does not stop: killed below
                pass
        self._kill("closed")

    def cpu_seconds(self) -> float | None:
        """CPU (user + system) the current child has used, where /proc tells (Linux)."""
        proc = self._proc
        if proc is None:
            return None
        try:
            fields = open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return None

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None else None

    # ---- calls --------------------------------------------------------------------------
    def submit(self, op: str, payload, tenant=None) -> Future:
        """Queue a call in `tenant`'s queue (any hashable; None: one shared queue)."""
        fut: Future = Future()
        if self._closed:
            fut.set_exception(GuardFailed(f"the {self.name} process is closed"))
            return fut
        with self._wanted:
            waiting = self._queues.get(tenant)
            if waiting is None:
                waiting = self._queues[tenant] = collections.deque()
            if not waiting:
                self._turns.append(tenant)
            waiting.append((op, payload, fut))
            self._wanted.notify()
        return fut

    def _wake(self, spawn: bool = False) -> None:
        with self._wanted:
            self._spawn_asked = self._spawn_asked or spawn
            self._wanted.notify()

    def _next_call(self):
        """Block until a call may be written (fewer than MAX_IN_FLIGHT pending) or a start
        is asked for; (op, payload, future) in the tenants' turn, or None."""
        with self._wanted:
            while True:
                if self._closed or self._spawn_asked:
                    self._spawn_asked = False
                    return None
                if self._turns and len(self._pending) < MAX_IN_FLIGHT:
                    tenant = self._turns.popleft()
                    waiting = self._queues[tenant]
                    item = waiting.popleft()
                    if waiting:
                        self._turns.append(tenant)  # its next call after the other tenants' next
                    else:
                        del self._queues[tenant]
                    return item
                self._wanted.wait(1.0)

    def call(self, op: str, payload, timeout_s: float, tenant=None):
        fut = self.submit(op, payload, tenant)
        try:
            return fut.result(timeout_s)
        except TimeoutError:
            fut.cancel()
            self._timed_out(timeout_s)
            raise GuardFailed(f"the {self.name} process did not answer within {timeout_s:g} s") from None

    async def acall(self, op: str, payload, timeout_s: float, tenant=None):
        # One loop future, resolved from the reader thread, and one timer: lighter than
        # wait_for(wrap_future(...)) (a waiter future and two hops more a call).
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        fut = self.submit(op, payload, tenant)
        fut.add_done_callback(lambda f: loop.is_closed() or loop.call_soon_threadsafe(_hand_over, f, waiter))
        timer = loop.call_later(timeout_s, _expire, waiter)
        try:
            return await waiter
        except TimeoutError:
            fut.cancel()
            self._timed_out(timeout_s)
            raise GuardFailed(f"the {self.name} process did not answer within {timeout_s:g} s") from None
        except asyncio.CancelledError:
            fut.cancel()  # its caller gave up: the writer skips it if it is still queued
            raise
        finally:
            timer.cancel()

    def _timed_out(self, timeout_s: float) -> None:
        """A call ran out of time: if the child has answered nothing for as long, it is stuck
        (not merely busy): kill it, so that the next call gets a new one."""
        with self._lock:
            stuck = self._pending and time.monotonic() - self._last_answer >= timeout_s
        if stuck:
            log.error("%s process: no answer for %.1f s with calls pending; restarting it", self.name, timeout_s)
            self._kill("it stopped answering")

    # ---- the threads --------------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            item = self._next_call()
            if self._closed:
                if item is not None:
                    _settle(item[2], error=GuardFailed(f"the {self.name} process is closed"))
                self._fail_queued()
                return
            proc = self._proc
            if (proc is None or proc.poll() is not None) and time.monotonic() >= self._retry_at:
                proc = self._spawn()
            if item is None:
                continue
            op, payload, fut = item
            if fut.done():  # cancelled: its caller gave up
                continue
            if proc is None or proc.poll() is not None:
                _settle(fut, error=GuardFailed(f"the {self.name} process could not start: {self._start_error}"))
                continue
            rid = next(self._ids)
            with self._lock:
                self._pending[rid] = (op, fut, proc)
                if len(self._pending) == 1:
                    self._last_answer = time.monotonic()  # the wait for an answer starts now
            assert proc.stdin is not None  # _spawn opens every child with stdin=PIPE
            try:
                proc.stdin.write(
                    json.dumps({"id": rid, "op": op, "payload": payload}, ensure_ascii=False).encode() + b"\n"
                )
                proc.stdin.flush()
            except (OSError, ValueError) as exc:
                self._kill(f"writing to it failed ({exc})", proc)

    def _fail_queued(self) -> None:
        with self._wanted:
            items = [item for waiting in self._queues.values() for item in waiting]
            self._queues.clear()
            self._turns.clear()
        for item in items:
            _settle(item[2], error=GuardFailed(f"the {self.name} process is closed"))

    def _spawn(self) -> subprocess.Popen | None:
        """A new child, ready (None, with _start_error set, if it could not start)."""
        self.ready.clear()
        self.starts += 1
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tuneloop.gateway.guard_child", json.dumps(self.spec)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        except OSError as exc:
            self._start_failed(f"{type(exc).__name__}: {exc}")
            return None
        line = _read_line(proc, self.start_timeout_s)
        try:
            hello = json.loads(line) if line else {}
        except ValueError:
            hello = {}
        if not hello.get("ready"):
            why = hello.get("error") or (
                f"it did not say it was ready within {self.start_timeout_s:g} s" if proc.poll() is None else "it exited"
            )
            proc.kill()
            proc.wait()
            self._start_failed(why)
            return None
        self._proc, self.info, self._start_error = proc, hello, None
        threading.Thread(target=self._read_loop, args=(proc,), daemon=True, name=f"tuneloop-{self.name}-reader").start()
        self.ready.set()
        if self.starts > 1:
            log.warning("%s process: restarted (start %d)", self.name, self.starts)
        return proc

    def _start_failed(self, why: str) -> None:
        self._start_error = why
        self._retry_at = time.monotonic() + 2.0  # not a start per queued call
        self._failed_starts += 1
        log.error("%s process: could not start: %s", self.name, why)

    def _read_loop(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None  # _spawn opens every child with stdout=PIPE
        for line in proc.stdout:
            try:
                reply = json.loads(line)
            except ValueError:
                continue
            with self._lock:
                owed = self._pending.pop(reply.get("id"), None)
                self._last_answer = time.monotonic()
            self._wake()  # room for the next call
            if owed is None:
                continue
            op, fut, _ = owed
            on_cpu = self.on_cpu.get(op)
            if on_cpu is not None and "cpu" in reply:
                on_cpu(float(reply["cpu"]))
            if "error" in reply:
                _settle(fut, error=GuardFailed(reply["error"]))
            else:
                _settle(fut, result=reply.get("result"))
        # EOF: the child is gone (killed, crashed, closed). Everything it had is lost.
        proc.wait()
        if self._proc is proc:
            self._proc = None
            self.ready.clear()
        self._fail_pending(f"the {self.name} process exited (code {proc.returncode})", proc)

    def _kill(self, why: str, proc: subprocess.Popen | None = None) -> None:
        """Stop `proc` (default: the current child) and fail what it still owed."""
        proc = proc or self._proc
        if proc is None:
            return
        if self._proc is proc:
            self._proc = None
            self.ready.clear()
        try:
            proc.kill()
            proc.wait(5)
        except Exception:  # noqa: BLE001 - gone already
            pass
        self._fail_pending(f"the {self.name} process was stopped: {why}", proc)

    def _fail_pending(self, why: str, proc: subprocess.Popen) -> None:
        """Fail the calls written to `proc` (those of a later child are its own business)."""
        with self._lock:
            owed = [rid for rid, (_, _, p) in self._pending.items() if p is proc]
            futures = [self._pending.pop(rid)[1] for rid in owed]
        self._wake(spawn=True)  # the next child now, not when the next call comes
        for fut in futures:
            _settle(fut, error=GuardFailed(why))


def _hand_over(fut: Future, waiter: asyncio.Future) -> None:
    """On the loop: the call's outcome into the caller's waiter (unless it gave up)."""
    if waiter.done() or fut.cancelled():
        return
    error = fut.exception()
    if error is not None:
        waiter.set_exception(error)
    else:
        waiter.set_result(fut.result())


def _expire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


def _settle(fut: Future, result=None, error: Exception | None = None) -> None:
    """Resolve a future that its caller may have cancelled meanwhile (then nothing happens)."""
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
    except InvalidStateError:
        pass


def _read_line(proc: subprocess.Popen, timeout_s: float) -> bytes:
    """The child's first line, or b"" if it says nothing within timeout_s (or exits)."""
    assert proc.stdout is not None  # _spawn opens every child with stdout=PIPE
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout_s
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return b""
        chunk = os.read(fd, 1)  # byte by byte: what follows the first line is the reader thread's
        if not chunk:
            return b""
        buf += chunk
    return buf
