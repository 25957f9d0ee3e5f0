"""The slots engine in a process of its own (serving.engine_process), as vLLM's V1 runs its
engine core apart from its API server.

Why: in one process the engine's thread and the event loop (HTTP, SSE, the gateway's keys,
limits and checks, the request log) share one GIL. On a small model a decoding step is
mostly Python between short tensor calls, so every bit of Python the event loop runs delays
the engine's next call: on the 1.4M demo model the gateway cost 7-15 % of the output
tokens/s with the engine on a thread, and 1-2 % with it in its own process (gateway on/off
0.986 in one run; docs/benchmarks.md). Apart, the engine's process runs its steps while
the server's process runs everything else.

How: the server's process keeps the tokenizer (load_tokenizer) and everything in front of
the engine; EngineProcess is its Backend. The child (`python -m
tuneloop.serving.engine_process`) loads the model and runs a SlotEngine as configured.
They talk over two pipes (plain-pickled messages, _put / _get):
  server -> engine: ("start", model folder, serving settings) once; then ("submit", request
                    id, prompt ids, params (with its LoRA adapter's name and folder: the child
                    loads it on first use), interval), ("cancel", id), ("swap", state dict),
                    ("stop",)
  engine -> server: ("loaded",) then ("ready", facts), or ("failed", why), once; then
                    ("events", [(id, event)], [batch sizes], engine seconds) once per step
                    (the step's tokens and finishes for every stream together, and the
                    prompt tokens its prefix cache reused for each newcomer that reused
                    some: GenerationStream's events as they are), ("swapped", error or None).
The server's worker waits for "loaded" (wait_loaded): a model the child cannot load fails
the server's start, as load_model does in one process.
Each stream on the server's side is the GenerationStream the API made; the child runs a twin
of it whose deliveries go into the pipe instead of onto an event loop.

Supervised: if the child dies after it served (killed, out of memory, a crash in a kernel),
every running request fails at once with 503, is_running (what /readyz reads) turns false,
new requests get 503 with Retry-After, and a new child is started after a backoff (1, 2, 4
... RESTART_MAX_DELAY_S s) with the weights last served (a hot-swapped version's folder
included). More than MAX_RESTARTS crashes within RESTART_WINDOW_S is a fault a restart does
not mend: gave_up turns true, and the server's /livez fails so that an orchestrator restarts
the whole server. Before it, a SIGKILLed engine left the server answering 503 for good with
/livez green. The child runs in a session of its own, so a signal to the server's process
group (Ctrl+C, `bentoml serve` stopping) does not cut its streams: the server stops it, after
they end (graceful shutdown); if the server's process dies, the child reads EOF and exits.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

from tuneloop.config import ServingConfig
from tuneloop.cpu_turns import CPU_TURNS
from tuneloop.serving.engine import GenerationStream, LoadedModel, _deliver_all, load_model, post_deliveries
from tuneloop.serving.errors import ServingError, ServingSetupError, Unavailable
from tuneloop.serving.lora import AdapterChecker, AdaptersNotServed, config_targets
from tuneloop.serving.setup import freeze_heap
from tuneloop.serving.slots import SlotEngine

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
MAX_RESTARTS = 5  # crashes within RESTART_WINDOW_S that a restart may mend; one more: gave_up
RESTART_WINDOW_S = 600.0
RESTART_MAX_DELAY_S = 30.0


def _put(conn: Connection, msg: tuple) -> None:
    """Plain pickle, not Connection.send's: once torch is imported, that one sends a tensor as
    a shared-memory handle which the other process fetches from this one's resource sharer,
    with an authentication key the two unrelated processes do not share (a weight swap failed
    with 'digest received was wrong'). Pickled, a tensor travels as its bytes."""
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def _get(conn: Connection) -> tuple:
    return pickle.loads(conn.recv_bytes())


class EngineProcess:
    """An API Backend (tuneloop/api/server.py) over a SlotEngine in a child process (module docstring)."""

    engine = "slots"

    def __init__(self, loaded: LoadedModel, serving, on_batch=None, on_turn=None, ready_timeout_s: float = 900.0):
        self.loaded = loaded
        self.serving = serving
        self.on_batch = on_batch
        self.on_turn = on_turn  # (holder, seconds): the child's engine steps (tuneloop/cpu_turns.py)
        self.ready_timeout_s = ready_timeout_s
        self.loaded_model = threading.Event()  # the child has the weights (or start-up failed)
        self.ready = threading.Event()  # start-up is over (serving, or failed: see is_running)
        self.failed: str | None = None
        # what the child reports once its engine is up
        self.forward_name, self.compile_mode, self.compiled, self.compile_seconds = "?", "off", False, 0.0
        self.max_len = loaded.context_length
        self.dtype = None  # the weights' torch dtype in the child (a weight swap loads in it)
        # LoRA adapters: whether the child's engine serves them (its fused forward, serving.lora),
        # and why not; adapters are checked here too, so a bad one is refused at submit.
        self.supports_adapters, self.adapter_refusal = False, "the engine has not started"
        self._adapter_checker: AdapterChecker | None = None
        self.swap_error: Exception | None = None
        self._swap_done: threading.Event | None = None
        self._proc: subprocess.Popen | None = None
        self._send_conn: Connection | None = None
        self._send_lock = threading.Lock()
        self._streams: dict[str, GenerationStream] = {}  # running here, by request id
        self._stopping = False
        self.model_dir = Path(loaded.path)  # what a (re)started child loads: the weights last served
        self._swap_folder: Path | None = None
        self.served_once = False  # the first child became ready: a later death is a crash to mend
        self.restarts = 0
        self.gave_up = False  # crashing faster than restarts mend it: the server must be restarted
        self.restart_at: float | None = None  # while restarting: when the next child starts
        self._crashes: list[float] = []
        self._wake = threading.Event()  # stop() interrupts a restart's backoff

    # ---- lifecycle --------------------------------------------------------------------
    def launch(self) -> None:
        self._spawn()
        threading.Thread(target=self._supervise, name="engine-process-supervisor", daemon=True).start()

    def _spawn(self) -> None:
        """A new child (in a session of its own) told to load self.model_dir, and its reader."""
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.Popen(
            [sys.executable, "-m", "tuneloop.serving.engine_process", str(to_child_r), str(from_child_w)],
            pass_fds=(to_child_r, from_child_w),
            env=env,
            cwd=str(REPO_ROOT),
            start_new_session=True,
        )
        os.close(to_child_r)
        os.close(from_child_w)  # the child's end only: EOF here when it exits
        with self._send_lock:
            self._proc, self._send_conn = proc, Connection(to_child_w, readable=False)
        self._send(("start", str(self.model_dir), self.serving.model_dump(mode="json")))
        threading.Thread(
            target=self._read,
            args=(Connection(from_child_r, writable=False), proc),
            name="engine-process-reader",
            daemon=True,
        ).start()

    def _supervise(self) -> None:
        """Watch the child: a start that takes too long fails; a crash after it served is
        restarted with backoff, until crashes come too fast (gave_up)."""
        while not self._stopping:
            proc = self._proc
            if not self.ready.wait(self.ready_timeout_s) and proc is self._proc and not self._stopping:
                self._died(f"the engine process was not ready after {self.ready_timeout_s:.0f} s")
                self._kill(proc)
            code = proc.wait()
            if self._stopping:
                return
            if not self.served_once:  # it never came up: the start fails (wait_loaded says why)
                return
            now = time.monotonic()
            self._crashes = [t for t in self._crashes if now - t < RESTART_WINDOW_S] + [now]
            if len(self._crashes) > MAX_RESTARTS:
                self.gave_up = True
                log.critical(
                    "engine process: %d crashes within %.0f s (last: code %s); not restarting it again: "
                    "the server reports itself dead (/livez) so that it is restarted whole",
                    len(self._crashes),
                    RESTART_WINDOW_S,
                    code,
                )
                return
            delay = min(RESTART_MAX_DELAY_S, 2.0 ** (len(self._crashes) - 1))
            self.restart_at = now + delay
            log.error(
                "engine process exited (code %s): restarting it in %.0f s (%d of %d crashes allowed within %.0f s)",
                code,
                delay,
                len(self._crashes),
                MAX_RESTARTS,
                RESTART_WINDOW_S,
            )
            if self._wake.wait(delay) or self._stopping:
                return
            self.ready.clear()
            self.loaded_model.clear()
            self.failed = None
            self.restarts += 1
            self._spawn()
            self.restart_at = None

    def _kill(self, proc: subprocess.Popen) -> None:
        try:
            proc.kill()
        except OSError:
            pass

    def _read(self, conn: Connection, proc: subprocess.Popen) -> None:
        """The server's side of the pipe from the child: hands each step's events to the streams' loops."""
        try:
            while True:
                msg = _get(conn)
                kind = msg[0]
                if kind == "events":
                    self._deliver(msg[1])
                    if self.on_batch is not None:
                        for size in msg[2]:
                            self.on_batch(size)
                    if self.on_turn is not None and msg[3]:
                        self.on_turn("engine", msg[3])
                elif kind == "loaded":
                    self.loaded_model.set()
                elif kind == "ready":
                    facts = msg[1]
                    self.forward_name, self.compile_mode = facts["forward_name"], facts["compile_mode"]
                    self.compiled, self.compile_seconds = facts["compiled"], facts["compile_seconds"]
                    self.max_len, self.dtype = facts["context_length"], facts["dtype"]
                    self.supports_adapters = facts["supports_adapters"]
                    self.adapter_refusal = facts["adapter_refusal"]
                    log.info(
                        "engine process %d: ready (%s)%s",
                        proc.pid,
                        facts["describe"],
                        f"; restart {self.restarts}" if self.restarts else "",
                    )
                    self.served_once = True
                    self.ready.set()
                elif kind == "failed":
                    self._died(msg[1])
                elif kind == "swapped":
                    self.swap_error = msg[1]
                    if self.swap_error is None and self._swap_folder is not None:
                        self.model_dir = self._swap_folder  # a restart loads what is served now
                    if self._swap_done is not None:
                        self._swap_done.set()
        except (EOFError, OSError):
            pass
        except Exception:  # a message this side cannot read: the pipe's state is unknown
            log.exception("engine process: reading its messages failed")
        code = proc.wait()
        if proc is not self._proc:  # an earlier child's reader, after a restart
            return
        if not self._stopping:
            self._died(f"the engine process exited with code {code}")
        elif self._streams:  # stopped: whatever it did not end is ended here (nobody waits forever)
            ending = Unavailable("the server is shutting down", retry_after_s=1)
            self._deliver([(rid, ("finish", "error", ending)) for rid in list(self._streams)])

    def _deliver(self, items: list) -> None:
        pairs = []
        for request_id, event in items:
            stream = self._streams.get(request_id)
            if stream is None:  # cancelled here already: late tokens are dropped
                continue
            if event[0] == "finish":
                self._streams.pop(request_id, None)
            pairs.append((stream, event))
        post_deliveries(pairs)

    def _died(self, why: str) -> None:
        if self.failed is None:
            self.failed = why
            log.error("engine process: %s", why)
        self.loaded_model.set()
        self.ready.set()  # start-up is over, badly: whoever waits reads is_running / failed
        error = Unavailable(f"the generation engine died: {why}", retry_after_s=1)
        self._deliver([(rid, ("finish", "error", error)) for rid in list(self._streams)])
        if self._swap_done is not None:
            self.swap_error = RuntimeError(why)
            self._swap_done.set()

    def wait_loaded(self) -> None:
        """Block until the child holds the model's weights; ServingSetupError (the child's
        reason, in one line) when it cannot load them, as load_model raises in-process: the
        server then fails its start instead of staying up and never ready."""
        if not self.loaded_model.wait(self.ready_timeout_s):
            self._died(f"the engine process had not loaded the model after {self.ready_timeout_s:.0f} s")
        if self.failed is not None:
            self.stop()
            raise ServingSetupError(self.failed)

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._proc is None or self._proc.poll() is not None:
            return
        try:
            self._send(("stop",))
            self._proc.wait(timeout)
        except (OSError, subprocess.TimeoutExpired):
            self._proc.kill()
            self._proc.wait(5)

    @property
    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None and self.failed is None and self.ready.is_set()

    @property
    def context_length(self) -> int:
        return self.max_len

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _send(self, msg: tuple) -> None:
        with self._send_lock:
            _put(self._send_conn, msg)

    # ---- requests ---------------------------------------------------------------------
    def submit(self, stream: GenerationStream) -> None:
        """Start stream's generation in the child (call on its event loop)."""
        if not self.is_running:
            if self.restart_at is not None or (self.served_once and not self.gave_up and not self._stopping):
                wait = max(1.0, (self.restart_at or time.monotonic()) - time.monotonic() + 5.0)
                raise Unavailable(
                    "the generation engine is restarting after a crash; retry shortly", retry_after_s=wait
                )
            raise Unavailable(
                f"the generation engine is not running{': ' + self.failed if self.failed else ''}; "
                "the server is not ready",
                retry_after_s=1,
            )
        if stream.params.adapter is not None:
            self.check_adapter(stream.params.adapter)
        stream.claimed = True
        rid = stream.request_id
        self._streams[rid] = stream
        try:
            self._send(("submit", rid, stream.prompt_ids, stream.params, stream.interval_s))
        except OSError as exc:
            self._streams.pop(rid, None)
            raise Unavailable(f"the generation engine is not reachable ({exc})", retry_after_s=1) from exc
        stream.add_cancel_hook(lambda: self._cancel(rid))

    def check_adapter(self, ref) -> None:
        """SlotEngine.check_adapter on this side of the pipe: raises AdaptersNotServed or
        AdapterError (400s) for a request naming `ref` that the child would refuse."""
        if not self.supports_adapters:
            raise AdaptersNotServed(
                f"model {ref.name!r} is a LoRA adapter and this server serves none: {self.adapter_refusal}"
            )
        if self._adapter_checker is None:
            from transformers import AutoConfig

            self._adapter_checker = AdapterChecker(
                config_targets(AutoConfig.from_pretrained(self.model_dir)), self.serving.lora.max_rank
            )
        self._adapter_checker.check(ref)

    def _cancel(self, rid: str) -> None:
        self._streams.pop(rid, None)
        try:
            self._send(("cancel", rid))
        except OSError:  # the child is gone: nothing to stop
            pass

    def swap_weights(self, state: dict, folder: Path | None = None) -> threading.Event:
        """SlotEngine.swap_weights in the child; the event is set when it is done (swap_error says
        if it failed). folder: where these weights are, what a restarted child loads from then on."""
        if self._swap_done is not None and not self._swap_done.is_set():
            raise RuntimeError("a weight swap is already in progress")
        self.swap_error = None
        self._swap_folder = folder
        self._swap_done = threading.Event()
        self._send(("swap", {k: v.detach().cpu() for k, v in state.items()}))
        return self._swap_done


# ---------------------------------------------------------------------------------------
# the child


class _Pipe:
    """What the child's streams take for their event loop: a step's deliveries (batched_delivery
    hands them over together) go to the server in one message, with the step's batch sizes."""

    def __init__(self, conn: Connection, streams: dict):
        self.conn, self.streams = conn, streams
        self.lock = threading.Lock()
        self.batches: list[int] = []
        self.turn_seconds = 0.0  # the engine's steps since the last message

    def call_soon_threadsafe(self, fn, arg) -> None:
        if fn is _deliver_all:
            items = [(stream.request_id, event) for stream, event in arg]
        else:  # one stream's _deliver, outside a step
            items = [(fn.__self__.request_id, arg)]
        sent = []
        for rid, event in items:
            if event[0] == "finish":
                self.streams.pop(rid, None)
                if event[2] is not None:
                    event = ("finish", event[1], _portable(event[2]))
            sent.append((rid, event))
        with self.lock:
            batches, self.batches = self.batches, []
            seconds, self.turn_seconds = self.turn_seconds, 0.0
            _put(self.conn, ("events", sent, batches, seconds))

    def on_batch(self, size: int) -> None:
        self.batches.append(size)

    def on_turn(self, holder: str, seconds: float) -> None:
        self.turn_seconds += seconds


def _portable(error: BaseException) -> BaseException:
    """An error the server's side can unpickle: ServingErrors as they are, others as their text."""
    if isinstance(error, ServingError):
        try:
            pickle.loads(pickle.dumps(error))
            return error
        except Exception:  # noqa: BLE001
            pass
    return RuntimeError(f"{type(error).__name__}: {error}")


def _child(read_fd: int, write_fd: int) -> None:
    # Stopping is the server's to decide: it drains on SIGTERM and then says "stop" (or its
    # end of the pipe closes: EOF below). A SIGTERM that reaches this process too (BentoML's
    # arbiter signals the worker's children) must not end the streams in flight; seen in CI as
    # "the engine process exited with code -15" cutting test_hostile's draining stream. The
    # gateway's guard child does the same (guard_child.py).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(asctime)s engine-process[{os.getpid()}] %(levelname)s %(name)s: %(message)s",
    )
    inbox, outbox = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    _, model_dir, serving_dict = _get(inbox)
    try:
        serving = ServingConfig.model_validate(serving_dict)
        loaded = load_model(model_dir, serving.num_threads, serving.dtype)
        _put(outbox, ("loaded",))
        streams: dict[str, GenerationStream] = {}
        pipe = _Pipe(outbox, streams)
        engine = SlotEngine.from_config(loaded, serving, pipe.on_batch)
        if serving.cpu_turns and loaded.model.device.type == "cpu":
            # The engine is the only holder here (the filter's encoder is in the server's
            # process): turns cost nothing but count its steps' seconds for the server's metric.
            CPU_TURNS.enable(pipe.on_turn)
        started = time.perf_counter()
        engine.launch()
        engine.ready.wait()
        if not engine.is_running:
            raise RuntimeError("the slots engine did not start; see this process's log")
    except BaseException as exc:  # noqa: BLE001 - said to the server, which stays not ready
        log.exception("the engine process could not start")
        # load_model's ServingSetupError is already one line that says what and where
        _put(outbox, ("failed", str(exc) if isinstance(exc, ServingSetupError) else f"{type(exc).__name__}: {exc}"))
        return
    import torch  # loaded by now (load_model); this module, imported by the server's process, needs none

    freeze_heap()  # as the server's process does after its warm-up: no full GC pass stalls a step
    _put(
        outbox,
        (
            "ready",
            {
                "forward_name": engine.forward_name,
                "compile_mode": engine.compile_mode,
                "compiled": engine.compiled,
                "compile_seconds": engine.compile_seconds,
                "context_length": engine.context_length,
                "dtype": loaded.model.dtype,
                "supports_adapters": engine.supports_adapters,
                "adapter_refusal": engine.adapter_refusal,
                "describe": f"{engine.plan.describe()}; forward {engine.forward_name}; "
                f"prefix cache {'on' if engine.prefix_cache else 'off'}; {torch.get_num_threads()} threads; "
                f"up in {time.perf_counter() - started:.1f} s",
            },
        ),
    )
    try:
        while True:
            msg = _get(inbox)
            kind = msg[0]
            if kind == "submit":
                _, rid, prompt_ids, params, interval_s = msg
                stream = GenerationStream(rid, prompt_ids, params, loop=pipe, interval_s=interval_s)
                streams[rid] = stream
                try:
                    engine.submit(stream)
                except Exception as exc:  # noqa: BLE001 - this request fails, the others go on
                    stream.finish("error", exc)
            elif kind == "cancel":
                stream = streams.pop(msg[1], None)
                if stream is not None:
                    stream._cancelled.set()  # the engine frees its slot at its next step
            elif kind == "swap":
                threading.Thread(target=_swap, args=(engine, msg[1], pipe), daemon=True).start()
            elif kind == "stop":
                break
    except (EOFError, OSError):  # the server's process is gone
        pass
    engine.stop()


def _swap(engine, state: dict, pipe: _Pipe) -> None:
    try:
        engine.swap_weights(state).wait()
        error = engine.swap_error
    except Exception as exc:  # noqa: BLE001 - the old weights stay; the server is told
        error = exc
    with pipe.lock:
        _put(pipe.conn, ("swapped", None if error is None else _portable(error)))


if __name__ == "__main__":
    _child(int(sys.argv[1]), int(sys.argv[2]))
