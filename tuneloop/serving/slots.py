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
- Active requests always occupy slots 0..n-1, so every step's cache is a view
  (keys[:n, :, :kv_len]). A request that ends frees its slot; the last active request
  moves into the hole (one copy of its cache rows).

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
"""

from __future__ import annotations

import logging
import math
import mmap
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from tuneloop.cpu_turns import CPU_TURNS
from tuneloop.serving.engine import BatchObserver, GenerationStream, LoadedModel, SamplingParams, batched_delivery
from tuneloop.serving.sampling import RowSampler, row_sampler, sample_rows
from tuneloop.serving.errors import ServingSetupError, Unavailable

log = logging.getLogger(__name__)


class SlotEngineError(ServingSetupError):
    """The model cannot be served by the slots engine (the message says why and what to use)."""


# ---------------------------------------------------------------------------------------
# the cache the model writes into


HUGE_PAGE = 2 << 20
KEY_BLOCK = 16  # fused_forward.KEY_BLOCK (not imported here: that module needs torch at import)
MADV_HUGEPAGE = 14


def _zeros_on_huge_pages(shape: tuple[int, ...], dtype, device):
    """torch.zeros(shape), on CPU placed on transparent huge pages where the kernel allows it.

    Each decoding step reads every active row's keys and values (tens of MB with 32 rows)
    at scattered offsets; with 4 KiB pages that costs a TLB miss per page. 2 MiB pages cut
    the slot attention kernel's time by ~15% here. Linux only grants them to 2 MiB-aligned
    memory marked with madvise(MADV_HUGEPAGE) (when transparent_hugepage is `madvise`, the
    common default) before it is first touched. So the memory is a fresh anonymous mapping
    of our own: torch's allocator may hand out heap memory that was touched before (glibc
    raises its mmap threshold after large frees), and touched pages stay small. Anywhere
    else this is plain torch.zeros.
    """
    import torch

    if torch.device(device).type != "cpu" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    # Private (a shared anonymous mapping is shmem, which huge pages rarely cover), untouched, zero-filled.
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer = torch.frombuffer(region, dtype=torch.uint8)  # shares the memory and keeps `region` alive
    offset = -buffer.data_ptr() % HUGE_PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, offset, nbytes // mmap.PAGESIZE * mmap.PAGESIZE)
    except OSError:  # EINVAL: transparent huge pages are off; small pages then
        pass
    # Zeroing is the first touch: the pages fault in huge.
    return buffer[offset:offset + nbytes].view(dtype).view(shape).zero_()


def _slot_cache(num_layers: int, num_slots: int, max_len: int):
    """A transformers Cache whose layers keep one row per slot (see the module docstring).

    All layers share one tensor (layers x 2 x slots x kv heads x max_len x head dim), so
    moving a request to another slot is one copy. Before each forward the engine sets
    where this step writes:
      prefill: slot indices `slots` of the newcomers (their padded prompts start at index 0);
      decode:  rows 0..n-1, each at write index positions[i], attending to [:kv_len].
    """
    import torch
    from transformers.cache_utils import Cache, CacheLayerMixin

    class SlotLayer(CacheLayerMixin):
        def __init__(self, owner, index: int):
            super().__init__()
            self.owner, self.index = owner, index

        def lazy_initialization(self, key_states, value_states) -> None:
            self.owner.allocate(key_states)

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            o = self.owner
            if o.prefill:  # empty slots: attention needs only the new keys
                width = key_states.shape[2]
                self.keys[:, :, :width].index_copy_(0, o.slots, key_states)
                self.values[:, :, :width].index_copy_(0, o.slots, value_states)
                return key_states, value_states
            n = key_states.shape[0]
            self.keys[o.rows[:n], :, o.positions] = key_states[:, :, 0]
            self.values[o.rows[:n], :, o.positions] = value_states[:, :, 0]
            if o.whole_slots:  # the slot attention kernel reads each row's own range itself
                return self.keys[:n], self.values[:n]
            return self.keys[:n, :, :o.kv_len], self.values[:n, :, :o.kv_len]

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.owner.kv_len, 0  # unused: the engine always passes a 4D mask

        def get_seq_length(self) -> int:
            return 0  # unused: the engine always passes position ids

        def get_max_length(self) -> int:
            return self.owner.max_len

    class SlotCache(Cache):
        def __init__(self):
            self.num_slots, self.max_len = num_slots, max_len
            super().__init__(layers=[SlotLayer(self, i) for i in range(num_layers)])
            self.kv = None
            self.rows = torch.arange(num_slots)
            self.prefill = False
            self.slots = torch.zeros(0, dtype=torch.long)
            self.positions = torch.zeros(num_slots, dtype=torch.long)
            self.kv_len = 1
            self.whole_slots = False  # decode returns whole slots (for the slot attention kernel)

        def allocate(self, key_states) -> None:
            _, heads, _, dim = key_states.shape
            self.allocate_shape(heads, dim, key_states.dtype, key_states.device)

        def allocate_shape(self, heads: int, dim: int, dtype, device) -> None:
            # positions rounded up to whole key blocks of the fused forward's cache layout
            positions = -(-self.max_len // KEY_BLOCK) * KEY_BLOCK
            shape = (len(self.layers), 2, self.num_slots, heads, positions, dim)
            self.kv = _zeros_on_huge_pages(shape, dtype, device)
            for layer in self.layers:
                layer.keys, layer.values = self.kv[layer.index, 0], self.kv[layer.index, 1]
                layer.is_initialized = True

        def move(self, src: int, dst: int, length: int) -> None:
            if self.kv is not None:  # whole key blocks (the fused forward's keys are stored by block)
                length = -(-length // KEY_BLOCK) * KEY_BLOCK
                self.kv[:, :, dst, :, :length] = self.kv[:, :, src, :, :length]

    return SlotCache()


# ---------------------------------------------------------------------------------------
# how much cache, in how many slots


@dataclass(frozen=True)
class KVCachePlan:
    """The slots engine's cache: num_slots slots of slot_len token positions each."""

    num_slots: int
    slot_len: int  # the longest request (prompt + max_tokens) the engine serves
    bytes_per_token: int

    @property
    def tokens(self) -> int:
        return self.num_slots * self.slot_len

    @property
    def gib(self) -> float:
        return self.tokens * self.bytes_per_token / 2**30

    def describe(self) -> str:
        return (f"KV cache: {self.tokens} tokens ({self.gib:.2f} GiB) = {self.num_slots} slots x {self.slot_len} "
                f"tokens; a request may use up to {self.slot_len} tokens (prompt + max_tokens)")


MIN_SLOT_LEN = 2048  # without max_model_len, slots shrink to fit max_batch_size in the budget, not below this
DEFAULT_KV_FRACTION = 0.2  # of the memory available at start-up, without kv_cache_tokens / kv_cache_gib


def kv_bytes_per_token(model) -> int:
    """Keys + values of one token over every layer, in the model's dtype."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers * 2 * kv_heads * head_dim * model.dtype.itemsize


def available_memory_bytes() -> int | None:
    """MemAvailable (Linux), or None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def plan_kv_cache(model, context_length: int, max_slots: int, kv_cache_tokens: int | None = None,
                  kv_cache_gib: float | None = None, max_model_len: int | None = None) -> KVCachePlan:
    """Size the cache by a budget, not by max_slots x the model's whole context window.

    The budget: kv_cache_tokens, else kv_cache_gib, else DEFAULT_KV_FRACTION of the memory
    available now. Each slot holds max_model_len tokens when given (at most the context
    window); otherwise the window, shrunk where the budget cannot give every one of
    max_slots that much (never below MIN_SLOT_LEN); then as many slots as the budget holds.
    """
    per_token = kv_bytes_per_token(model)
    if kv_cache_tokens is not None:
        budget, source = kv_cache_tokens, "serving.kv_cache_tokens"
    elif kv_cache_gib is not None:
        budget, source = int(kv_cache_gib * 2**30 // per_token), "serving.kv_cache_gib"
    else:
        free = available_memory_bytes()
        budget = int(free * DEFAULT_KV_FRACTION // per_token) if free else max_slots * context_length
        source = f"{DEFAULT_KV_FRACTION:.0%} of available memory"
    if max_model_len is not None:
        if max_model_len > context_length:
            raise SlotEngineError(f"serving.max_model_len={max_model_len} is above the model's context window "
                                  f"of {context_length} tokens")
        slot_len = max_model_len
    else:
        slot_len = min(context_length, max(budget // max_slots, min(context_length, MIN_SLOT_LEN)))
    slots = min(max_slots, budget // slot_len)
    if slots < 1:
        if max_model_len is not None or budget < 64:
            raise SlotEngineError(
                f"the KV cache budget ({source}: {budget} tokens, {per_token} bytes each) holds no slot of "
                f"{slot_len} tokens; raise serving.kv_cache_tokens / kv_cache_gib or lower serving.max_model_len")
        slots, slot_len = 1, budget
    return KVCachePlan(slots, slot_len, per_token)


# ---------------------------------------------------------------------------------------
# how much to compile

FULL_COMPILE_MAX_LAYERS = 8


def resolve_compile_mode(compile: bool, mode: str, num_layers: int) -> str:
    """off, full or regional. auto: the whole forward for small stacks (the demo model: ~1/3
    faster per step, 10-70 s of compiling), nothing for deeper ones: their whole-graph
    compile does not end in reasonable time (SmolLM2-135M's 30 layers: 17+ min in inductor
    before it was stopped), and regional compilation, bounded (60-95 s there), made its
    steps slower, not faster (float32 158 vs 199 output tok/s eager, bfloat16 271 vs 281)."""
    if not compile:
        return "off"
    if mode == "auto":
        return "full" if num_layers <= FULL_COMPILE_MAX_LAYERS else "off"
    return mode


def decoder_layers(model) -> list:
    """The model's repeated decoder blocks: its longest nn.ModuleList (Llama's model.layers,
    GPT-2's transformer.h, ...)."""
    import torch

    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        raise SlotEngineError(f"{type(model).__name__}: no repeated decoder layers to compile regionally; "
                              "use serving.compile_mode: full, or serving.compile: false")
    return list(max(lists, key=len))


# ---------------------------------------------------------------------------------------
# the engine


class _WarmUpSink:
    """A stream stand-in with nobody listening (start-up checks and compilation)."""

    def __init__(self, ids: list[int], steps: int):
        self.prompt_ids, self.params = ids, SamplingParams(max_new_tokens=steps, temperature=0.0)
        self.cancelled = False

    def emit(self, ids, logprobs=None) -> None:
        pass

    def finish(self, reason, error=None) -> None:
        pass


@dataclass(eq=False)
class _Row:
    """A running request in its slot."""

    stream: GenerationStream
    offset: int  # left padding of its prefill: its tokens start at this slot index
    length: int  # tokens in the slot after the padding (prompt + generated so far)
    last: int  # the token to feed next
    generated: int = 0
    sampler: RowSampler | None = None  # sampling / shaped rows; None for plain greedy
    prefilled: int = 0  # the fused forward: prompt tokens in the cache so far (it prefills in chunks)
    admitted: int = 0  # admission order: the earliest prefilling row gets the step's budget first

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.stream.prompt_ids)

    @property
    def write_at(self) -> int:
        return self.offset + self.length


class SlotEngine:
    """The "slots" engine as an openai_api Backend: submit(stream) from the event loop."""

    engine = "slots"

    def __init__(self, loaded: LoadedModel, num_slots: int, max_prefill_tokens: int = 2048,
                 compile: bool = False, on_batch: BatchObserver | None = None, decode_attention: str = "kernel",
                 kv_cache_tokens: int | None = None, kv_cache_gib: float | None = None,
                 max_model_len: int | None = None, compile_mode: str = "auto", forward: str = "fused"):
        import torch

        config = loaded.model.config
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        if getattr(text_config, "sliding_window", None) or getattr(text_config, "is_encoder_decoder", False):
            raise SlotEngineError(
                f"{loaded.path}: the slots engine needs a decoder with full attention on every layer "
                f"(this one is {text_config.model_type} with a sliding window or an encoder); "
                "use serving.engine: continuous")
        self.loaded = loaded
        self.model = loaded.model
        self.device = self.model.device
        # num_slots is the most slots; the budget may give fewer, each of plan.slot_len tokens
        self.plan = plan_kv_cache(self.model, loaded.context_length, num_slots, kv_cache_tokens, kv_cache_gib,
                                  max_model_len)
        log.info("slots engine: %s", self.plan.describe())
        self.num_slots = self.plan.num_slots
        self.max_len = self.plan.slot_len
        self.max_prefill_tokens = max_prefill_tokens  # the first newcomer of a step is admitted whatever its length
        self.on_batch = on_batch
        self.pad_id = loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else 0
        self.cache = _slot_cache(text_config.num_hidden_layers, self.num_slots, self.max_len)
        self.cache.rows = self.cache.rows.to(self.device)
        self._arange = torch.arange(self.max_len, device=self.device)
        self.rows: list[_Row] = []
        self._inbox: deque[GenerationStream] = deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._closed = False  # the thread has ended: nothing more is taken
        self._thread: threading.Thread | None = None
        self.ready = threading.Event()  # set once compiled (at once without serving.compile)
        self._swap: dict | None = None  # a pending weight swap (swap_weights)
        self.swap_error: Exception | None = None
        # Decoding attention: our kernel over each row's own tokens where it builds and
        # agrees with sdpa on this model (slot_attention.py), else sdpa up to the longest row.
        # Chosen on the engine's thread at start (_main), not here: all model work stays on one
        # thread. Running the model once on the constructing thread too left OpenMP with a
        # second thread team whose spinning cost the engine ~20% (in-process 5.0k vs 8.0k tok/s).
        self.decode_attention = decode_attention
        self.kernel = False
        # The forward: tuneloop's fused one (fused_forward.py: Llama and GPT-2 architectures on a CPU,
        # ragged steps that prefill newcomers beside the running decodes) where it serves the
        # model and matches transformers' forward on it at start-up; else transformers' own.
        # Also chosen on the engine's thread (_prepare).
        if forward not in ("fused", "transformers"):
            raise ValueError(f"serving.forward must be fused or transformers, not {forward!r}")
        self.forward_wanted = forward
        self.fused = None  # a fused_forward.FusedDecoder once chosen
        self._replaced_attention: str | None = None  # the model's attention before the kernel's
        self._forward, self._decode_forward = self._run_model, self._decode_model
        self._admissions = 0
        self._compiled_layers: list = []
        self.compile_mode = resolve_compile_mode(compile, compile_mode, text_config.num_hidden_layers)
        if self.compile_mode == "full":
            # Compiled apart: the prefill (every prompt width) and the decoding step (mask included).
            self._forward = torch.compile(self._run_model, dynamic=True)
            self._decode_forward = torch.compile(self._decode_model, dynamic=True)
        elif self.compile_mode == "regional":
            # One decoder layer's code, compiled once and shared by every layer (parameters
            # are graph inputs): compile time of one layer, not of the whole stack.
            self._compiled_layers = decoder_layers(self.model)
            for layer in self._compiled_layers:
                layer.compile(dynamic=True)
        self.compiled = self.compile_mode != "off"
        self.compile_seconds = 0.0

    @classmethod
    def from_config(cls, loaded: LoadedModel, serving, on_batch: BatchObserver | None = None) -> "SlotEngine":
        """The engine as configured (a ServingConfig: tuneloop/config.py)."""
        return cls(loaded, serving.max_batch_size, serving.max_prefill_tokens, compile=serving.compile,
                   on_batch=on_batch, decode_attention=serving.decode_attention,
                   kv_cache_tokens=serving.kv_cache_tokens, kv_cache_gib=serving.kv_cache_gib,
                   max_model_len=serving.max_model_len, compile_mode=serving.compile_mode, forward=serving.forward)

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
        if self._replaced_attention is not None and not self.is_running:  # the model is shared: give it back
            self.model.config._attn_implementation = self._replaced_attention
            self._replaced_attention = None
        if not self.is_running:
            self._uncompile_layers()

    def _uncompile_layers(self) -> None:
        for layer in self._compiled_layers:  # nn.Module.compile keeps its compiled call here
            layer._compiled_call_impl = None
        self._compiled_layers = []

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def context_length(self) -> int:
        """The longest request served: prompt + max_tokens within one slot."""
        return self.max_len

    def submit(self, stream: GenerationStream) -> None:
        """Queue stream for a slot (any thread; called on the event loop by the API)."""
        with self._wake:
            if self._closed or not self.is_running:
                raise Unavailable("the generation engine is not running; the server is not ready",
                                  retry_after_s=1)
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
            ending = Unavailable(f"the generation engine died ({type(exc).__name__}: {exc}); the server is "
                                 "not ready", retry_after_s=1)
        finally:
            self.ready.set()  # start-up is over either way: whoever waits reads is_running
            with self._wake:
                self._closed = True
                streams = [row.stream for row in self.rows] + list(self._inbox)
                self.rows, self._inbox = [], deque()
            with batched_delivery():
                for stream in streams:
                    stream.finish("error", ending)

    @property
    def forward_name(self) -> str:
        return "fused" if self.fused is not None else "transformers"

    def _prepare(self) -> None:
        """Pick the forward, the decoding attention and compile, on this thread, before taking requests."""
        if self.forward_wanted == "fused":
            try:
                self.fused = self._use_fused()
            except Exception:  # the engine still serves, with transformers' forward
                log.exception("slots engine: checking the fused forward failed; serving with transformers' forward")
                self.fused = None
        if self.fused is not None:  # eager: nothing of transformers' forward to compile or re-route
            self.compiled, self.compile_mode = False, "off"
            self.ready.set()
            return
        if self.decode_attention == "kernel":
            try:
                self.kernel = self._use_kernel()
            except Exception:  # the engine still serves, with sdpa
                log.exception("slots engine: checking the slot attention kernel failed; decoding uses sdpa")
                self.kernel, self.rows = False, []
        if self.compiled:
            started = time.perf_counter()
            try:
                self._compile_warm_up()
                self.compile_seconds = time.perf_counter() - started
                log.info("slots engine: compiled the model (%s) in %.1f s", self.compile_mode, self.compile_seconds)
            except Exception:  # a model torch.compile cannot handle is still served, uncompiled
                log.exception("slots engine: torch.compile failed; serving the model uncompiled")
                self._forward, self._decode_forward = self._run_model, self._decode_model
                self._uncompile_layers()
                self.compiled, self.compile_mode, self.rows = False, "off", []
        self.ready.set()

    def _loop(self) -> None:
        import torch

        with torch.inference_mode():
            while True:
                with self._wake:
                    while not self._stopping and not self.rows and not self._inbox and self._swap is None:
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

    def _step(self) -> None:
        self._drop_cancelled()
        if self._swap is not None:  # draining for a weight swap: finish the running rows, admit none
            if self.rows:
                self._fused_step() if self.fused is not None else self._decode(len(self.rows))
            else:
                self._apply_swap()
            return
        if self.fused is not None:
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
        own = self.model.state_dict()
        missing = sorted(set(own) - set(state))
        wrong = [k for k in own if k in state and tuple(state[k].shape) != tuple(own[k].shape)]
        if missing or wrong:
            raise ValueError(f"not the served model's architecture: missing {missing[:3]}, other shapes {wrong[:3]}")
        done = threading.Event()
        with self._wake:
            if self._swap is not None:
                raise RuntimeError("a weight swap is already in progress")
            self.swap_error = None
            self._swap = {"state": state, "done": done}
            self._wake.notify()
        return done

    def _apply_swap(self) -> None:
        import torch

        swap, started = self._swap, time.perf_counter()
        try:
            with torch.no_grad():
                for name, tensor in self.model.state_dict().items():  # views of the parameters: copied in place
                    tensor.copy_(swap["state"][name].to(device=tensor.device, dtype=tensor.dtype))
            if self.fused is not None:  # its fused weights are views of these; packed copies are not
                self.fused.refresh()
            log.info("slots engine: new weights loaded in %.2f s", time.perf_counter() - started)
        except Exception as exc:  # pragma: no cover - shapes were checked in swap_weights
            log.exception("slots engine: the weight swap failed")
            self.swap_error = exc
        finally:
            with self._wake:
                self._swap = None
            swap["done"].set()

    def _drop_cancelled(self) -> None:
        i = 0
        while i < len(self.rows):
            if self.rows[i].stream.cancelled:
                self._free(i)  # cancel() already told the stream
            else:
                i += 1

    def _admit(self) -> list[_Row]:
        """Take queued requests into free slots; at most max_prefill_tokens of prompt per step."""
        newcomers: list[_Row] = []
        budget = self.max_prefill_tokens
        width = 0
        with self._wake:
            while self._inbox and len(self.rows) < self.num_slots:
                stream = self._inbox[0]
                if stream.cancelled:
                    self._inbox.popleft()
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
                row = _Row(stream, offset=0, length=n, last=-1,
                           sampler=row_sampler(params))
                newcomers.append(row)
                self.rows.append(row)
        for row in newcomers:
            row.offset = width - row.length
        return newcomers

    def _admit_ragged(self) -> None:
        """The fused forward's admission: queued requests take free slots while the prompt
        tokens still waiting to be prefilled are under max_prefill_tokens (a step prefills at
        most that many, in chunks: a long prompt takes several steps, beside the decodes)."""
        waiting = sum(len(r.stream.prompt_ids) - r.prefilled for r in self.rows if r.prefilling)
        with self._wake:
            while self._inbox and len(self.rows) < self.num_slots and waiting < self.max_prefill_tokens:
                stream = self._inbox.popleft()
                if stream.cancelled:
                    continue
                self._admissions += 1
                n = len(stream.prompt_ids)
                self.rows.append(_Row(stream, offset=0, length=n, last=-1, sampler=row_sampler(stream.params),
                                      admitted=self._admissions))
                waiting += n

    def _prefill(self, newcomers: list[_Row], forward=None) -> None:
        import torch

        first = len(self.rows) - len(newcomers)
        width = max(r.offset + r.length for r in newcomers)
        ids = torch.tensor([[self.pad_id] * r.offset + r.stream.prompt_ids for r in newcomers], device=self.device)
        offsets = torch.tensor([r.offset for r in newcomers], device=self.device)
        cols = self._arange[:width]
        # query i attends to key j when j <= i (causal) and j is not padding; a padding
        # query attends to itself only (a row with nothing to attend to would be NaN)
        mask = (cols[None, :, None] >= cols[None, None, :]) & (cols[None, None, :] >= offsets[:, None, None])
        mask |= torch.eye(width, dtype=torch.bool, device=self.device)[None]
        positions = (cols[None, :] - offsets[:, None]).clamp(min=0)
        self.cache.prefill = True
        self.cache.slots = torch.arange(first, first + len(newcomers), device=self.device)
        try:
            logits = (forward or self._forward)(ids, mask[:, None], positions)
        except Exception as exc:
            log.exception("prefill of %d requests failed", len(newcomers))
            for row in newcomers:
                self.rows.remove(row)
                row.stream.finish("error", exc)
            return
        finally:
            self.cache.prefill = False
        self._advance(newcomers, logits, first)

    def _fused_step(self) -> None:
        """One ragged forward over every row: a token for each decoding row, and the next
        chunk of each prefilling row's prompt (up to max_prefill_tokens in all, the earliest
        admitted first). Rows that decoded, and rows whose prompt is now whole, get their
        next token."""
        import torch

        budget = self.max_prefill_tokens
        chunks: dict[int, int] = {}  # slot -> prompt tokens it prefills this step
        for slot in sorted((i for i, r in enumerate(self.rows) if r.prefilling), key=lambda i: self.rows[i].admitted):
            if budget <= 0:
                break
            row = self.rows[slot]
            chunks[slot] = min(budget, len(row.stream.prompt_ids) - row.prefilled)
            budget -= chunks[slot]
        ids: list[int] = []
        slots: list[int] = []
        positions: list[int] = []
        starts: list[int] = []
        picks: list[int] = []  # the tokens whose logits pick a next token
        picked: list[int] = []  # ... and their rows' slots
        decoding: list[_Row] = []
        for slot, row in enumerate(self.rows):
            if slot in chunks:
                first, count = row.prefilled, chunks[slot]
                ids.extend(row.stream.prompt_ids[first:first + count])
                positions.extend(range(first, first + count))
                if first + count == len(row.stream.prompt_ids):
                    picks.append(len(ids) - 1)
                    picked.append(slot)
            elif not row.prefilling:
                ids.append(row.last)
                positions.append(row.write_at)
                count = 1
                picks.append(len(ids) - 1)
                picked.append(slot)
                decoding.append(row)
            else:
                continue  # waits for budget in a later step
            slots.extend([slot] * count)
            starts.extend([row.offset] * count)
        if not ids:
            return
        def longs(values: list[int]):
            return torch.tensor(values, dtype=torch.long, device=self.device)

        logits = self.fused.forward(longs(ids), longs(slots), longs(positions), longs(starts), longs(picks),
                                    self.cache.kv)
        if self.on_batch:
            self.on_batch(len(picks))
        for row in decoding:
            row.length += 1  # its `last` token is in the cache now
        for slot, count in chunks.items():
            self.rows[slot].prefilled += count
        self._advance([self.rows[slot] for slot in picked], logits, picked)

    def _use_fused(self):
        """The fused forward for the served model if there is one and it matches transformers' forward on it."""
        import torch

        from tuneloop.serving import fused_forward

        reason = fused_forward.unsupported_reason(self.model)
        if reason is not None:
            log.info("slots engine: transformers' forward (the fused forward does not serve %s)", reason)
            return None
        fused = fused_forward.fused_forward_for(self.model, self.max_len)
        if self.cache.kv is None:
            self.cache.allocate_shape(fused.kv_heads, fused.head_dim, self.model.dtype, self.device)
        with torch.inference_mode():
            mismatch = fused_forward.check_against_transformers(fused, self.model, self.cache.kv)
        if mismatch is not None:
            log.warning("slots engine: the fused forward disagrees with transformers' on %s (%s); "
                        "serving with transformers' forward", self.loaded.path, mismatch)
            return None
        log.info("slots engine: fused forward (%s, %s, ragged steps: prompts prefilled in chunks of up to %d "
                 "tokens beside the decodes)", type(fused).__name__, fused.dtype, self.max_prefill_tokens)
        return fused

    def _decode(self, n: int) -> None:
        """One token for each of the rows in slots 0..n-1."""
        import torch

        rows = self.rows[:n]
        # one (n, 3) tensor: the token fed, its position id, and where its slot starts
        state = torch.tensor([(r.last, r.length, r.offset) for r in rows], device=self.device)
        self.cache.kv_len = max(r.write_at for r in rows) + 1
        logits = self._decode_forward(state)
        if self.on_batch:
            self.on_batch(n)
        for r in rows:
            r.length += 1  # its `last` token is in the cache now
        self._advance(rows, logits, 0)

    def _decode_model(self, state):
        """A decoding step from (token, position id, slot offset) per row; builds the mask itself."""
        ids, positions, offsets = state[:, 0:1], state[:, 1:2], state[:, 2:3]
        writes = offsets + positions  # each row's new token goes here in its slot
        self.cache.positions = writes[:, 0]
        if self.kernel:  # row i attends to offsets[i]..writes[i] of its slot; the mask is a placeholder
            self.cache.whole_slots = True
            try:
                return self._run_model(ids, self._no_mask[:ids.shape[0]], positions,
                                       slot_bounds=(offsets[:, 0], writes[:, 0]))
            finally:
                self.cache.whole_slots = False
        cols = self._arange[:self.cache.kv_len][None, :]
        mask = (cols <= writes) & (cols >= offsets)
        return self._run_model(ids, mask[:, None, None, :], positions)

    def _run_model(self, input_ids, mask, position_ids, **attention_kwargs):
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                         past_key_values=self.cache, use_cache=True, logits_to_keep=1, **attention_kwargs)
        return out.logits[:, -1, :]

    def _use_kernel(self) -> bool:
        """Install the slot attention kernel if it builds, fits the model, and matches sdpa on it."""
        import torch

        from tuneloop.serving import slot_attention

        if not slot_attention.usable_for(self.model) or slot_attention.load_kernel() is None:
            return False
        self._replaced_attention = slot_attention.install(self.model)
        self._no_mask = torch.ones((self.num_slots, 1, 1, 1), dtype=torch.bool, device=self.device)
        # The model must hand our keyword to its attention layers and read the cache as a
        # transformers model should: check on two rows (one left-padded) against sdpa.
        with torch.inference_mode():
            rows = [_Row(_WarmUpSink([1, 2, 3, 4], 2), offset=0, length=4, last=-1),  # type: ignore[arg-type]
                    _Row(_WarmUpSink([5, 6], 2), offset=2, length=2, last=-1)][:self.num_slots]  # type: ignore[arg-type]
            self.rows.extend(rows)
            self._prefill(rows, self._run_model)  # uncompiled: compiling comes after this choice
            state = torch.tensor([(r.last, r.length, r.offset) for r in rows], device=self.device)
            self.cache.kv_len = max(r.write_at for r in rows) + 1
            self.kernel = True
            try:
                ours = self._decode_model(state)
            except Exception:
                log.exception("slot attention kernel failed on %s; decoding uses sdpa", self.loaded.path)
                ours = None
            self.kernel = False
            reference = self._decode_model(state)  # rewrites the same cache entries
            self.rows = []
        if ours is None or not torch.allclose(ours, reference, rtol=1e-4, atol=1e-4):
            if ours is not None:
                log.warning("slot attention kernel disagrees with sdpa on %s (max |diff| %.2e); decoding uses sdpa",
                            self.loaded.path, float((ours - reference).abs().max()))
            return False
        return True

    def _advance(self, rows: list[_Row], logits, slots: int | list[int]) -> None:
        """Pick each row's next token, hand it to its stream, and free the rows that ended.
        slots: each row's slot, or the first of consecutive ones."""
        if isinstance(slots, int):
            slots = list(range(slots, slots + len(rows)))
        with batched_delivery():
            self._hand_out(rows, logits, slots)

    def _hand_out(self, rows: list[_Row], logits, slots: list[int]) -> None:
        failed = {}
        if any(r.sampler is not None for r in rows):
            failed = sample_rows(logits, [r.sampler for r in rows])
        tokens = logits.argmax(dim=-1).tolist()
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
                row.generated += 1
                row.last = token
                if row.generated >= stream.params.max_new_tokens or row.write_at >= self.max_len:
                    stream.finish("length")
                    ended.append(slots[i])
        for slot in sorted(ended, reverse=True):
            self._free(slot)

    def _free(self, slot: int) -> None:
        """Free a slot; the last active row moves into it so that slots 0..n-1 stay active."""
        last = len(self.rows) - 1
        if slot != last:
            moved = self.rows[last]
            self.cache.move(last, slot, moved.write_at)
            self.rows[slot] = moved
        self.rows.pop()

    # ---- compilation ------------------------------------------------------------------
    def _compile_warm_up(self) -> None:
        """Run every shape class once so that torch.compile compiles before the server is ready.

        Dynamic shapes still specialise sizes 0 and 1: one row and several, a one-token
        prompt and a longer one, for both prefill and decode.
        """
        import torch

        with torch.inference_mode():
            for prompts in ([[1]], [[1, 2, 3]], [[1], [2]], [[1, 2, 3], [4, 5]]):
                # Rows made here, not through the queue: requests that arrive while this
                # compiles (the server's own warm-up) wait, so each batch has the shape it should.
                newcomers = [_Row(_WarmUpSink(ids, 3), offset=len(max(prompts, key=len)) - len(ids), length=len(ids),
                                  last=-1) for ids in prompts]  # type: ignore[arg-type]
                self.rows.extend(newcomers)
                self._prefill(newcomers)
                while self.rows:
                    self._decode(len(self.rows))
