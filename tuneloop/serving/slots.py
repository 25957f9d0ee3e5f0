"""The "slots" engine: iteration-level batching over a fixed set of KV-cache slots.

Like the continuous engine, requests join and leave the running batch at every step.
Unlike it, the model runs on a cache laid out for one machine's CPU as much as for a GPU:

- Every running request owns a *slot*: one row of a key/value tensor preallocated per
  layer (slots x kv heads x max_len x head dim). A token is written into its slot in place;
  nothing is concatenated or copied per step (DynamicCache's torch.cat per layer per step
  was ~45% of a 32-row decoding step of the demo model).
- A decoding step attends each row to its own slot only, through a (rows x 1 x 1 x kv_len)
  boolean mask, where kv_len is the longest active slot. transformers' continuous
  batching manager instead runs, on a CPU (no flash/paged kernels), one dense mask of
  (new tokens x every cached token of the whole batch): its attention grows with
  batch size squared.
- transformers' forward: active requests always occupy slots 0..n-1, so every step's cache
  is a view (keys[:n, :, :kv_len]). A request that ends frees its slot; the last active
  request moves into the hole (one copy of its cache rows). The fused forward names each
  token's slot, so a request stays in its slot, and a slot it leaves keeps what it wrote.
- The prefix cache (serving.prefix_cache, the fused forward): a newcomer takes the free slot
  that holds the longest prefix of its prompt (a chat's system prompt, an earlier turn of the
  conversation), as llama.cpp's server does, or copies a longer one from a running request's
  slot, and prefills only the rest; its stream reports the reused tokens (cached_tokens).
  Which slot: slot_cache.py's SlotPool. A weight swap drops every held prefix.

It drives any Hugging Face decoder with full attention through the model's own forward:
SlotCache is a transformers Cache whose layers write into the slots, and the model gets
explicit position ids and 4D masks. The forward is torch.compile'd when serving.compile
is on (the default): ~1/3 faster per step on 2 CPU cores, for 10-70 s of compilation at
start-up (the warm-up compiles every shape class before the server is ready).

One loop on one thread:
  1. admit: queued requests take free slots; their prompts run as one left-padded prefill
     (so each row's last prompt token is the last column and only its logits are
     computed), which also gives each its first token;
  2. decode: one forward over all active slots; every row gets its next token;
  3. rows that ended (stop token, max_tokens, context full, cancelled) free their slot.

This module is the scheduler: the queue, which request gets which slot, admission into the
batch, how much prompt a step prefills, each step's tokens handed to their streams, rows
freed, weight swaps at a step boundary, LoRA adapters (serving.lora, lora.py): a request
whose adapter is not loaded waits while it is read, the others go on; rows of different
adapters share each step, each with its own. The model runs in slot_runner.py (SlotRunner: the
forward passes over the slots, token picking); the cache and its size are slot_cache.py's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from tuneloop.config import ServingLoraConfig
from tuneloop.cpu_turns import CPU_TURNS
from tuneloop.serving.engine import BatchObserver, GenerationStream, LoadedModel, batched_delivery
from tuneloop.serving.errors import Unavailable
from tuneloop.serving.lora import AdapterChecker, AdapterRef, AdaptersNotServed, AdapterSpec
from tuneloop.serving.sampling import row_sampler
from tuneloop.serving.slot_cache import RunningPrefix, SlotPool
from tuneloop.serving.slot_runner import SlotRow, SlotRunner, WarmUpSink

log = logging.getLogger(__name__)


def _prefix_key(adapter: AdapterRef | None) -> tuple[str, str] | None:
    """Whose keys and values a prefix is: the base's (None) or one adapter's (a LoRA changes them)."""
    return None if adapter is None else (adapter.name, adapter.path)


class SlotEngine:
    """The "slots" engine as an API Backend: submit(stream) from the event loop."""

    engine = "slots"

    def __init__(
        self,
        loaded: LoadedModel,
        num_slots: int,
        max_prefill_tokens: int = 2048,
        compile: bool = False,
        on_batch: BatchObserver | None = None,
        decode_attention: str = "kernel",
        kv_cache_tokens: int | None = None,
        kv_cache_gib: float | None = None,
        max_model_len: int | None = None,
        compile_mode: str = "auto",
        forward: str = "fused",
        lora: ServingLoraConfig | None = None,
        prefix_cache: bool = True,
    ):
        self.loaded = loaded
        self.lora = lora if lora is not None else ServingLoraConfig()
        self.runner = SlotRunner(
            loaded,
            num_slots,
            compile=compile,
            decode_attention=decode_attention,
            kv_cache_tokens=kv_cache_tokens,
            kv_cache_gib=kv_cache_gib,
            max_model_len=max_model_len,
            compile_mode=compile_mode,
            forward=forward,
            lora=self.lora,
        )
        self.runner.on_adapter_read = self._notify
        self._checker: AdapterChecker | None = None
        self.plan = self.runner.plan
        self.num_slots = self.runner.num_slots  # num_slots is the most; the cache budget may give fewer
        self.max_len = self.runner.max_len
        self.max_prefill_tokens = max_prefill_tokens  # the first newcomer of a step is admitted whatever its length
        self.on_batch = on_batch
        self.rows: list[SlotRow] = []  # transformers' forward: row i is in slot i; the fused forward: row.slot
        # The fused forward's free slots and the prompt prefixes they hold (the prefix cache).
        self.pool = SlotPool(self.num_slots, enabled=prefix_cache)
        self._inbox: deque[GenerationStream] = deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._closed = False  # the thread has ended: nothing more is taken
        self._thread: threading.Thread | None = None
        self.ready = threading.Event()  # set once compiled (at once without serving.compile)
        self._swap: dict | None = None  # a pending weight swap (swap_weights)
        self.swap_error: Exception | None = None
        self._admissions = 0
        self.compile_seconds = 0.0

    @classmethod
    def from_config(cls, loaded: LoadedModel, serving, on_batch: BatchObserver | None = None) -> "SlotEngine":
        """The engine as configured (a ServingConfig: tuneloop/config.py)."""
        return cls(
            loaded,
            serving.max_batch_size,
            serving.max_prefill_tokens,
            compile=serving.compile,
            on_batch=on_batch,
            decode_attention=serving.decode_attention,
            kv_cache_tokens=serving.kv_cache_tokens,
            kv_cache_gib=serving.kv_cache_gib,
            max_model_len=serving.max_model_len,
            compile_mode=serving.compile_mode,
            forward=serving.forward,
            lora=serving.lora,
            prefix_cache=serving.prefix_cache,
        )

    # ---- what the runner chose (read once ready) ----------------------------------------
    @property
    def forward_name(self) -> str:
        return self.runner.forward_name

    @property
    def kernel(self) -> bool:
        """Whether decoding uses the slot attention kernel."""
        return self.runner.kernel

    @property
    def compiled(self) -> bool:
        return self.runner.compiled

    @property
    def compile_mode(self) -> str:
        return self.runner.compile_mode

    @property
    def cache(self):
        return self.runner.cache

    @property
    def prefix_cache(self) -> bool:
        """Whether requests reuse the cached keys and values of a prompt prefix (the fused forward only)."""
        return self.pool.enabled and self.runner.ragged

    @property
    def supports_adapters(self) -> bool:
        """Whether requests may name a LoRA adapter (SamplingParams.adapter): the fused forward
        serves the model and serving.lora is on. Known once ready; adapter_refusal says why not."""
        return self.runner.adapters is not None

    @property
    def adapter_refusal(self) -> str | None:
        return self.runner.adapter_refusal

    @property
    def adapters(self):
        """The runner's lora.AdapterTable (None without adapters): what is loaded, its stats."""
        return self.runner.adapters

    def check_adapter(self, ref: AdapterRef) -> AdapterSpec:
        """Raise what a request naming `ref` would get now: AdaptersNotServed (this engine
        serves none, and why) or AdapterError (this adapter cannot be served: what is wrong),
        both 400s; else the adapter's spec (checked from its config and safetensors header)."""
        if self.runner.adapters is None:
            raise AdaptersNotServed(
                f"model {ref.name!r} is a LoRA adapter and this server serves none: {self.runner.adapter_refusal}"
            )
        if self._checker is None:
            targets = self.runner.fused.lora_targets()
            self._checker = AdapterChecker(
                {m: (t.out_features, t.in_features) for m, t in targets.items()}, self.lora.max_rank
            )
        return self._checker.check(ref)

    # ---- lifecycle --------------------------------------------------------------------
    def launch(self) -> None:
        """Start the generation thread (which first compiles, when serving.compile is on)."""
        self._thread = threading.Thread(target=self._main, name="slots-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        if not self.is_running:  # the model is shared: give it back
            self.runner.release()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def context_length(self) -> int:
        """The longest request served: prompt + max_tokens within one slot."""
        return self.max_len

    def submit(self, stream: GenerationStream) -> None:
        """Queue stream for a slot (any thread; called on the event loop by the API). A stream
        naming an adapter this engine cannot serve raises check_adapter's 400 instead."""
        if stream.params.adapter is not None and self.ready.is_set():
            self.check_adapter(stream.params.adapter)
        with self._wake:
            if self._closed or not self.is_running:
                raise Unavailable("the generation engine is not running; the server is not ready", retry_after_s=1)
            stream.claimed = True
            self._inbox.append(stream)
            self._wake.notify()

    # ---- the loop ---------------------------------------------------------------------
    def _main(self) -> None:
        """The engine's thread. However it ends -- stopped, or killed by an error nothing
        else caught -- every running and queued request is failed at once (none waits for
        its timeout), and submit() refuses new ones; /readyz turns red with is_running."""
        ending: BaseException = Unavailable("the server is shutting down", retry_after_s=1)
        try:
            self._prepare()
            self._loop()
        except BaseException as exc:
            log.critical("slots engine: the generation thread died; failing every request", exc_info=True)
            ending = Unavailable(
                f"the generation engine died ({type(exc).__name__}: {exc}); the server is not ready", retry_after_s=1
            )
        finally:
            self.ready.set()  # start-up is over either way: whoever waits reads is_running
            with self._wake:
                self._closed = True
                streams = [row.stream for row in self.rows] + list(self._inbox)
                if self.runner.adapters is not None:
                    streams += self.runner.adapters.waiting()
                self.rows, self._inbox = [], deque()
            with batched_delivery():
                for stream in streams:
                    stream.finish("error", ending)

    def _prepare(self) -> None:
        """Pick the forward, the decoding attention and compile, on this thread, before taking requests."""
        self.runner.choose_forward()
        if self.runner.ragged:
            log.info(
                "slots engine: fused forward (%s, %s, ragged steps: prompts prefilled in chunks of up to %d "
                "tokens beside the decodes; prefix cache %s)",
                type(self.runner.fused).__name__,
                self.runner.fused.dtype,
                self.max_prefill_tokens,
                "on" if self.pool.enabled else "off",
            )
        if self.runner.compiled:
            started = time.perf_counter()
            try:
                self._compile_warm_up()
                self.compile_seconds = time.perf_counter() - started
                log.info("slots engine: compiled the model (%s) in %.1f s", self.compile_mode, self.compile_seconds)
            except Exception:  # a model torch.compile cannot handle is still served, uncompiled
                log.exception("slots engine: torch.compile failed; serving the model uncompiled")
                self.runner.uncompile()
                self.rows = []
        self.ready.set()

    def _loop(self) -> None:
        import torch  # the engine's thread runs the model; importing this module does not

        with torch.inference_mode():
            while True:
                with self._wake:
                    while (
                        not self._stopping
                        and not self.rows
                        and not self._inbox
                        and self._swap is None
                        and not self._adapter_read()
                    ):
                        self._wake.wait(0.5)
                    if self._stopping:
                        return
                try:
                    with CPU_TURNS.turn("engine"):  # one step, then the filter's encoder if it waits
                        self._step()
                except Exception as exc:  # the engine survives; the requests of this step do not
                    log.exception("slots engine step failed (%d running)", len(self.rows))
                    with batched_delivery():
                        for row in self.rows:
                            row.stream.finish("error", exc)
                    self.rows = []
                    self.pool.reset()  # what the failed step wrote is unknown

    def _step(self) -> None:
        self._drop_cancelled()
        if self._swap is not None:  # draining for a weight swap: finish the running rows, admit none
            if self.rows:
                self._fused_step() if self.runner.ragged else self._decode(len(self.rows))
            else:
                self._apply_swap()
            return
        if self.runner.ragged:
            self._take_read_adapters()
            self._admit_ragged()
            if self.rows:
                self._fused_step()
            return
        running = len(self.rows)  # rows 0..running-1 decode this step; newcomers come after them
        newcomers = self._admit()
        if newcomers:
            self._prefill(newcomers)  # gives each newcomer its first token; they decode from the next step
        if running:
            self._decode(running)

    # ---- a new model's weights, with no request dropped ---------------------------------
    def swap_weights(self, state: dict, folder=None) -> threading.Event:
        """Load `state` (a state dict of the same architecture) into the served model at a
        step boundary: the running generations finish on the old weights while new ones
        queue, then the weights are copied in place (compiled code and the KV cache stay
        valid) and the queue is served by the new ones. No request is dropped and none mixes
        two models. Returns an event set when done; `swap_error` then says if it failed
        (the old weights stay)."""
        self.runner.check_weights(state)
        done = threading.Event()
        with self._wake:
            if self._swap is not None:
                raise RuntimeError("a weight swap is already in progress")
            self.swap_error = None
            self._swap = {"state": state, "done": done}
            self._wake.notify()
        return done

    def _apply_swap(self) -> None:
        swap, started = self._swap, time.perf_counter()
        try:
            self.pool.forget()  # computed with the old weights
            self.runner.load_weights(swap["state"])
            log.info("slots engine: new weights loaded in %.2f s", time.perf_counter() - started)
        except Exception as exc:  # pragma: no cover - shapes were checked in swap_weights
            log.exception("slots engine: the weight swap failed")
            self.swap_error = exc
        finally:
            with self._wake:
                self._swap = None
            swap["done"].set()

    # ---- LoRA adapters --------------------------------------------------------------------
    def _notify(self) -> None:
        with self._wake:
            self._wake.notify()

    def _adapter_read(self) -> bool:
        return self.runner.adapters is not None and self.runner.adapters.has_news

    def _take_read_adapters(self) -> None:
        """Adapters read since the last step are installed (evicting unused ones as needed); the
        requests that waited for them go to the front of the queue."""
        table = self.runner.adapters
        if table is None:
            return
        ready = table.poll({row.adapter for row in self.rows if row.adapter is not None})
        if ready:
            with self._wake:
                self._inbox.extendleft(reversed(ready))

    # ---- admission ----------------------------------------------------------------------
    def _drop_cancelled(self) -> None:
        i = 0
        while i < len(self.rows):
            if self.rows[i].stream.cancelled:
                self._free(i)  # cancel() already told the stream
            else:
                i += 1

    def _admit(self) -> list[SlotRow]:
        """Take queued requests into free slots; at most max_prefill_tokens of prompt per step."""
        newcomers: list[SlotRow] = []
        budget = self.max_prefill_tokens
        width = 0
        with self._wake:
            while self._inbox and len(self.rows) < self.num_slots:
                stream = self._inbox[0]
                if stream.cancelled:
                    self._inbox.popleft()
                    continue
                if stream.params.adapter is not None:  # refused at submit; queued before the engine was ready
                    self._inbox.popleft()
                    stream.finish("error", AdaptersNotServed(f"LoRA adapters are not served: {self.adapter_refusal}"))
                    continue
                n = len(stream.prompt_ids)
                new_width = max(width, n)
                # left padding: every newcomer's slot must still hold its whole generation
                longest = max([stream.params.max_new_tokens, *(r.stream.params.max_new_tokens for r in newcomers)])
                fits = new_width + longest <= self.max_len
                if newcomers and (new_width * (len(newcomers) + 1) > budget or not fits):
                    break
                self._inbox.popleft()
                width = new_width
                params = stream.params
                row = SlotRow(stream, offset=0, length=n, last=-1, sampler=row_sampler(params, self.loaded))
                newcomers.append(row)
                self.rows.append(row)
        for row in newcomers:
            row.offset = width - row.length
        return newcomers

    def _place(self, row: SlotRow, copies: list[tuple[int, int, int]]) -> None:
        """Give a newcomer its slot (the fused forward): the free one holding the longest prefix
        of its prompt (SlotPool.choose), whose tokens it then need not prefill. A prefix to copy
        from a running request's slot goes into `copies` (source, slot, tokens), made in order
        once the queue's lock is let go."""
        key = _prefix_key(row.stream.params.adapter)
        running = [  # prompts in running rows' slots: a newcomer may copy a longer prefix from one
            RunningPrefix(r.slot, r.stream.prompt_ids, r.prefilled, key)
            for r in self.rows
            if self.pool.enabled and _prefix_key(r.stream.params.adapter) == key
        ]
        choice = self.pool.choose(row.stream.prompt_ids, key, running)
        self.pool.take(choice)
        row.slot = choice.slot
        if choice.source is not None:
            copies.append((choice.source, choice.slot, choice.reused))
        row.prefilled = choice.reused
        row.stream.note_cached(choice.reused)

    def _admit_ragged(self) -> None:
        """The fused forward's admission: queued requests take free slots while the prompt
        tokens still waiting to be prefilled are under max_prefill_tokens (a step prefills at
        most that many, in chunks: a long prompt takes several steps, beside the decodes)."""
        waiting = sum(len(r.stream.prompt_ids) - r.prefilled for r in self.rows if r.prefilling)
        table = self.runner.adapters
        copies: list[tuple[int, int, int]] = []
        with batched_delivery(), self._wake:  # what newcomers are told goes out once the queue is let go
            while self._inbox and len(self.rows) < self.num_slots and waiting < self.max_prefill_tokens:
                stream = self._inbox.popleft()
                if stream.cancelled:
                    continue
                adapter = stream.params.adapter
                if adapter is not None:
                    if table is None:  # refused at submit; queued before the engine was ready
                        stream.finish(
                            "error", AdaptersNotServed(f"LoRA adapters are not served: {self.adapter_refusal}")
                        )
                        continue
                    if table.position(adapter.name) is None:  # read meanwhile; the queue goes on
                        table.wait_for(stream)
                        continue
                    table.touch(adapter.name)
                self._admissions += 1
                n = len(stream.prompt_ids)
                row = SlotRow(
                    stream,
                    offset=0,
                    length=n,
                    last=-1,
                    sampler=row_sampler(stream.params, self.loaded),
                    admitted=self._admissions,
                    adapter=adapter.name if adapter is not None else None,
                )
                self._place(row, copies)
                self.rows.append(row)
                waiting += n - row.prefilled
        for source, slot, count in copies:  # a few MB each: not while submit() waits for the lock
            self.runner.move(source, slot, count)

    # ---- the steps ----------------------------------------------------------------------
    def _prefill(self, newcomers: list[SlotRow]) -> None:
        first = len(self.rows) - len(newcomers)
        try:
            logits = self.runner.prefill(newcomers, first)
        except Exception as exc:
            log.exception("prefill of %d requests failed", len(newcomers))
            for row in newcomers:
                self.rows.remove(row)
                row.stream.finish("error", exc)
            return
        self._advance(newcomers, logits, first)

    def _fused_step(self) -> None:
        """One ragged forward over every row: a token for each decoding row, and the next
        chunk of each prefilling row's prompt (up to max_prefill_tokens in all, the earliest
        admitted first). Rows that decoded, and rows whose prompt is now whole, get their
        next token."""
        budget = self.max_prefill_tokens
        chunks: dict[int, int] = {}  # row index -> prompt tokens it prefills this step
        for i in sorted((i for i, r in enumerate(self.rows) if r.prefilling), key=lambda i: self.rows[i].admitted):
            if budget <= 0:
                break
            row = self.rows[i]
            chunks[i] = min(budget, len(row.stream.prompt_ids) - row.prefilled)
            budget -= chunks[i]
        step = self.runner.fused_step(self.rows, chunks)
        if step is None:
            return
        logits, picked = step
        if self.on_batch:
            self.on_batch(len(picked))
        self._advance([self.rows[slot] for slot in picked], logits, picked)

    def _decode(self, n: int) -> None:
        """One token for each of the rows in slots 0..n-1."""
        rows = self.rows[:n]
        logits = self.runner.decode(rows)
        if self.on_batch:
            self.on_batch(n)
        self._advance(rows, logits, 0)

    def _advance(self, rows: list[SlotRow], logits, slots: int | list[int]) -> None:
        """Pick each row's next token, hand it to its stream, and free the rows that ended.
        slots: each row's index in self.rows, or the first of consecutive ones."""
        if isinstance(slots, int):
            slots = list(range(slots, slots + len(rows)))
        with batched_delivery():
            self._hand_out(rows, logits, slots)

    def _hand_out(self, rows: list[SlotRow], logits, slots: list[int]) -> None:
        tokens, failed = self.runner.pick(rows, logits)
        ended: list[int] = []
        stop_ids = self.loaded.stop_ids
        for i, (row, token) in enumerate(zip(rows, tokens)):
            stream = row.stream
            if stream.cancelled:
                ended.append(slots[i])
            elif i in failed:  # only this request fails; the rest of the step goes on
                stream.finish("error", failed[i])
                ended.append(slots[i])
            elif token in stop_ids and not stream.params.ignore_eos:
                stream.finish("stop")
                ended.append(slots[i])
            else:
                if row.sampler is not None:
                    row.sampler.observe(token)
                stream.emit([token], row.sampler.take_logprobs() if row.sampler is not None else None)
                row.output.append(token)
                row.generated += 1
                row.last = token
                if row.generated >= stream.params.max_new_tokens or row.write_at >= self.max_len:
                    stream.finish("length")
                    ended.append(slots[i])
        for slot in sorted(ended, reverse=True):
            self._free(slot)

    def _free(self, slot: int) -> None:
        """Free the slot of row `slot` (an index in self.rows). The fused forward: the slot keeps
        what the row wrote, for a later prompt that starts the same (the prefix cache).
        transformers' forward: the last active row moves into it so that slots 0..n-1 stay active."""
        if self.runner.ragged:
            row = self.rows.pop(slot)
            self.pool.give_back(row.slot, row.cached_ids(), _prefix_key(row.stream.params.adapter))
            return
        last = len(self.rows) - 1
        if slot != last:
            moved = self.rows[last]
            self.runner.move(last, slot, moved.write_at)
            self.rows[slot] = moved
        self.rows.pop()

    # ---- compilation ------------------------------------------------------------------
    def _compile_warm_up(self) -> None:
        """Run every shape class once so that torch.compile compiles before the server is ready.

        Dynamic shapes still specialise sizes 0 and 1: one row and several, a one-token
        prompt and a longer one, for both prefill and decode.
        """
        import torch  # as in _loop

        with torch.inference_mode():
            for prompts in ([[1]], [[1, 2, 3]], [[1], [2]], [[1, 2, 3], [4, 5]]):
                # Rows made here, not through the queue: requests that arrive while this
                # compiles (the server's own warm-up) wait, so each batch has the shape it should.
                newcomers = [
                    SlotRow(WarmUpSink(ids, 3), offset=len(max(prompts, key=len)) - len(ids), length=len(ids), last=-1)
                    for ids in prompts
                ]  # type: ignore[arg-type]
                self.rows.extend(newcomers)
                self._prefill(newcomers)
                while self.rows:
                    self._decode(len(self.rows))
