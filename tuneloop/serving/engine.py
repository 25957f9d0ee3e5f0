"""What every generation engine behind the OpenAI API shares: the request and its stream,
the loaded model, and loading it.

A request becomes a GenerationStream: prompt token ids + SamplingParams in, token ids out.
Engines run the model on their own thread and push tokens into the stream; the asyncio
side (tuneloop/api/generation.py) reads them, turns them into text, applies stop strings and may
cancel the stream (client gone, timeout, stop string hit), which stops its generation.

The engines, each in its own module:
- slots.py, SlotEngine ("slots", the default): iteration-level batching over per-request
  KV-cache slots (its model runner: slot_runner.py, its cache: slot_cache.py);
- adaptive_engine.py, BatchGenerator ("adaptive"): one left-padded batched `generate` over
  whatever requests BentoML's adaptive batcher collected; nobody joins a running batch;
- continuous_engine.py, ContinuousEngine ("continuous"): transformers' ContinuousBatchingManager;
  requests join and leave the running batch at every step;
- vllm_engine.py, VLLMEngine ("vllm"): vLLM's OpenAI server in a process of its own.
Per-request sampling (temperature, top_p, seed, penalties, logprobs) inside a shared batch is
sampling.py's, used by every engine that runs the model here.

torch and transformers are imported inside the functions that use them: the API's process
imports this module, and with the vllm engine (or the slots engine in its own process) it
never runs a model.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Sequence

from tuneloop.serving.constraints import Constraint, GrammarTokenizer
from tuneloop.serving.errors import ServingSetupError
from tuneloop.serving.lora import AdapterRef

log = logging.getLogger(__name__)

BatchObserver = Callable[[int], None]  # called with the batch size of every batch / step


# A temperature below this samples like greedy decoding (as in vLLM): dividing logits by
# it overflows float32 (1e-40 gave inf logits and NaN probabilities).
SAMPLING_EPS = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0  # 0 (or below SAMPLING_EPS) = greedy
    top_p: float = 1.0
    seed: int | None = None
    # OpenAI's penalties, on the tokens this generation produced so far (not the prompt):
    # logit -= frequency_penalty * count + presence_penalty * (count > 0)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    ignore_eos: bool = False  # vLLM's extension: stop tokens do not end the generation
    logprobs: int | None = None  # per token: its log-probability and this many top alternatives
    constraint: Constraint | None = None  # structured output: the text must match it (serving/constraints.py)
    adapter: AdapterRef | None = None  # a LoRA adapter of the served base (serving/lora.py); None: the base

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def shapes_logits(self) -> bool:
        return bool(self.logit_bias) or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


# One generated token's log-probabilities (of the model's own distribution, before
# logit_bias, penalties, temperature and top_p, as vLLM reports them by default):
# (its own, [(token id, log-probability) of the top alternatives, most likely first]).
TokenLogprobs = tuple[float, list[tuple[int, float]]]


class GenerationStream:
    """One generation. Engine threads call emit/finish; the event loop reads events().

    Events are delivered onto the loop with call_soon_threadsafe, so timings (first token,
    finish) are when the asyncio side could first see them.
    """

    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        loop: asyncio.AbstractEventLoop | None = None,
        interval_s: float = 0.0,
    ):
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.loop = loop or asyncio.get_running_loop()
        self._events: deque[tuple] = deque()  # delivered, not yet read
        self._arrived = asyncio.Event()
        self._cancelled = threading.Event()
        self._cancel_hooks: list[Callable[[], None]] = []
        self.claimed = False  # an engine has started running it (so a retried submission is a no-op)
        # Prompt tokens the engine did not prefill: their keys and values were cached (the slots
        # engine's prefix cache; usage.prompt_tokens_details.cached_tokens). 0 for other engines.
        self.cached_tokens = 0
        self.num_generated = 0
        self.finish_reason: str | None = None  # stop | length | cancelled | error
        self.error: BaseException | None = None
        self.created_at = time.perf_counter()
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        # Coalescing (serving.stream_interval_ms): tokens emitted within interval_s of the
        # last hand-over wait here and go to the event loop together, as one SSE chunk.
        self.interval_s = interval_s
        self._held: list[int] = []
        self._held_logprobs: list[TokenLogprobs] = []
        self._handed_at: float | None = None
        self.token_logprobs: list[TokenLogprobs] = []  # event-loop side, one per delivered token (if asked)

    # ---- engine side (the engine's thread: one at a time per stream) ----------------
    def emit(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs] | None = None) -> None:
        if not token_ids:
            return
        self._held.extend(token_ids)
        if logprobs:
            self._held_logprobs.extend(logprobs)
        now = time.perf_counter()
        if self._handed_at is None or now - self._handed_at >= self.interval_s:  # the first token: at once
            self._handed_at = now
            self._hand_over()

    def note_cached(self, count: int) -> None:
        """The engine reused the keys and values of the prompt's first `count` tokens (before its first token)."""
        if count:
            self._post(("cached", count))

    def _hand_over(self) -> None:
        self._post(("tokens", self._held, self._held_logprobs))
        self._held, self._held_logprobs = [], []

    def finish(self, reason: str, error: BaseException | None = None) -> None:
        if self._held:
            self._hand_over()
        self._post(("finish", reason, error))

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def _post(self, event: tuple) -> None:
        if _held_deliveries.pending is not None:  # inside batched_delivery(): sent with the step's others
            _held_deliveries.pending.append((self, event))
            return
        try:
            self.loop.call_soon_threadsafe(self._deliver, event)
        except RuntimeError:  # loop closed: the server is shutting down, nobody is listening
            pass

    # ---- event-loop side ------------------------------------------------------------
    def _deliver(self, event: tuple) -> None:
        if self.finish_reason is not None:
            return  # the stream is over (e.g. cancelled); late tokens are dropped
        if event[0] == "cached":  # a fact for usage, not an event for the reader
            self.cached_tokens = event[1]
            return
        now = time.perf_counter()
        if event[0] == "tokens":
            if self.first_token_at is None:
                self.first_token_at = now
            self.num_generated += len(event[1])
            self.token_logprobs.extend(event[2])
        else:
            self.finish_reason, self.error, self.finished_at = event[1], event[2], now
        self._events.append(event)
        self._arrived.set()

    def add_cancel_hook(self, hook: Callable[[], None]) -> None:
        self._cancel_hooks.append(hook)

    def cancel(self) -> None:
        """Stop generating (idempotent; call on the event loop). Engines notice at their next step."""
        if self._cancelled.is_set() or self.finish_reason is not None:
            return
        self._cancelled.set()
        for hook in self._cancel_hooks:
            try:
                hook()
            except Exception:  # a failing hook must not keep others from running
                log.exception("cancel hook failed for %s", self.request_id)
        self._deliver(("finish", "cancelled", None))

    async def events(self):
        """Yield lists of new token ids until the generation ends; raise if it failed."""
        while True:
            while not self._events:
                self._arrived.clear()
                await self._arrived.wait()
            event = self._events.popleft()
            if event[0] == "tokens":
                tokens = event[1]
                # a reader that fell behind gets everything that has arrived in one piece
                while self._events and self._events[0][0] == "tokens":
                    tokens = tokens + self._events.popleft()[1]
                yield tokens
            else:
                if event[1] == "error":
                    raise event[2] or RuntimeError("generation failed")
                return

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


class _HeldDeliveries(threading.local):
    pending: list[tuple[GenerationStream, tuple]] | None = None


_held_deliveries = _HeldDeliveries()


@contextmanager
def batched_delivery():
    """Within it, what this thread emits to streams reaches each event loop in one call.

    An engine wraps a decoding step in it: one wake-up of the event loop per step, not one
    per stream (each call_soon_threadsafe writes to the loop's wake-up pipe).
    """
    _held_deliveries.pending = []
    try:
        yield
    finally:
        held, _held_deliveries.pending = _held_deliveries.pending, None
        post_deliveries(held)


def post_deliveries(pairs: list[tuple[GenerationStream, tuple]]) -> None:
    """(stream, event) pairs handed to their streams' event loops: one callback per loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for stream, event in pairs:
        by_loop.setdefault(stream.loop, []).append((stream, event))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver_all, items)
        except RuntimeError:  # loop closed: the server is shutting down
            pass


def _deliver_all(items: list[tuple[GenerationStream, tuple]]) -> None:
    for stream, event in items:
        stream._deliver(event)


# ---------------------------------------------------------------------------------------
# model loading and the facts about the model every engine needs


LONG_TEXT = 16_384  # characters: tokenised without holding the GIL (LoadedModel.encode)


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    stop_ids: frozenset[int]  # token ids that end a generation (eos, <|im_end|>)
    context_length: int
    path: Path

    @cached_property
    def vocab_size(self) -> int:
        """Token ids a request may name (logit_bias, token prompts): the model's output rows."""
        if self.model is None:  # served by another process (the vllm engine): the config says
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(self.path)
            return int(getattr(config.get_text_config(), "vocab_size", None) or len(self.tokenizer))
        return int(self.model.get_output_embeddings().weight.shape[0])

    def encode(self, text: str) -> list[int]:
        """Token ids of text, no special tokens added: what `tokenizer(text, add_special_tokens=False)` gives.

        A fast tokenizer is called through its Rust backend's single `encode`, which holds the
        GIL throughout. `encode_batch` hands the text to the rayon thread pool and gives up the
        GIL: in a busy server getting both back took ~0.5 ms per request, with the event loop
        stalled meanwhile, so only a long text (LONG_TEXT characters) goes that way, where the
        GIL held for the whole text would stall everyone else longer.
        """
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(text) > LONG_TEXT:
            return backend.encode_batch([text], add_special_tokens=False)[0].ids
        return backend.encode(text, add_special_tokens=False).ids

    @cached_property
    def grammar_tokenizer(self) -> GrammarTokenizer:
        """The tokenizer as constrained decoding reads it (built on first use)."""
        return GrammarTokenizer(self.tokenizer, self.vocab_size, self.stop_ids)

    @cached_property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for (its longest vocabulary entry; twice
        that where the tokenizer normalises text, which may fold characters together): a text
        of more than context_length x this many characters cannot fit, whatever it says."""
        vocab = self.tokenizer.get_vocab()
        longest = max((len(t) for t in vocab), default=1)
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        normalises = backend is None or backend.normalizer is not None
        return max(1, longest) * (2 if normalises else 1)


def load_tokenizer(model_dir: Path | str) -> LoadedModel:
    """A LoadedModel without weights, for an engine that runs the model in another process
    (vllm): the tokenizer, stop tokens and context window, all the API needs."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    path = _model_folder(model_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        config = AutoConfig.from_pretrained(path)
    except Exception as exc:
        raise _cannot_load(path, exc) from exc
    try:
        generation = GenerationConfig.from_pretrained(path)
    except OSError:
        generation = GenerationConfig.from_model_config(config)
    return _loaded(None, tokenizer, generation, config, path)


def _cannot_load(path: Path, exc: Exception) -> ServingSetupError:
    """One line that says what and where; the traceback stays in the log."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return ServingSetupError(f"cannot load the model at {path}: {type(exc).__name__}: {first}")


def _model_folder(model_dir: Path | str) -> Path:
    path = Path(model_dir)
    if not (path / "config.json").exists():
        raise ServingSetupError(f"{path}: not a Hugging Face model folder (no config.json)")
    return path


def _loaded(model, tokenizer, generation_config, config, path: Path) -> LoadedModel:
    """Stop tokens and context window, the same for a loaded model and a tokenizer alone."""
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    stop_ids = set()
    eos = getattr(generation_config, "eos_token_id", None)
    stop_ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        stop_ids.add(tokenizer.eos_token_id)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        stop_ids.add(im_end)
    context = getattr(config, "max_position_embeddings", None) or tokenizer.model_max_length
    return LoadedModel(model, tokenizer, frozenset(stop_ids), int(context), path)


# What the lossy bfloat16 path costs, measured with the agreement check (tuneloop/serving/
# agreement.py, against transformers' float32 forward) on SmolLM2-135M-Instruct (2026-12-06):
# the fused forward in bfloat16 13 of 24 greedy answers equal, top-1 agreement 0.974 (float32:
# 24/24, 1.0000). Other numerics, measured in transformers' forward: bfloat16 weights with
# bfloat16 products and float32 elsewhere (what llama.cpp's bf16 does) 14/24 and 0.973;
# bfloat16-rounded weights with float32 arithmetic 22/24 and 0.995, and no faster here; int8
# weights 12/24 and 0.96. Only float32 passes the bar (23/24 and 0.99): it is what auto serves.
BF16_COST = "SmolLM2-135M: 13 of 24 greedy answers equal to float32's, top-1 agreement 0.974"
DTYPES = {"float32": "float32", "bfloat16-lossy": "bfloat16"}


def choose_cpu_dtype(model, requested: str = "auto"):
    """The serving dtype and why: float32 for auto (the only dtype that gives the reference's
    answers, see BF16_COST) and for float32; bfloat16 for bfloat16-lossy, said with its cost."""
    import torch

    if requested in ("auto", "float32"):
        return torch.float32, "float32" + (
            " (auto: the dtype whose answers are the reference's)" if requested == "auto" else ""
        )
    if requested == "bfloat16-lossy":
        return torch.bfloat16, (
            f"bfloat16-lossy (configured): weights, activations and cache in bfloat16, faster "
            f"and NOT the reference's answers ({BF16_COST}; `tuneloop agreement --dtype "
            f"bfloat16-lossy` measures it on this model)"
        )
    raise ValueError(f"serving.dtype must be auto, float32 or bfloat16-lossy, not {requested!r}")


def load_model(model_dir: Path | str, num_threads: int | None = None, dtype: str = "float32") -> LoadedModel:
    """Load a Hugging Face causal LM folder for serving (sdpa attention, left padding).

    dtype: auto or float32 (float32), or bfloat16-lossy (see choose_cpu_dtype), on a CPU and a GPU alike.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if num_threads:
        torch.set_num_threads(num_threads)
    path = _model_folder(model_dir)
    try:
        # transformers 5 does not persist padding_side: batched generate needs left padding.
        tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    except Exception as exc:
        raise _cannot_load(path, exc) from exc
    chosen, why = choose_cpu_dtype(model, dtype)
    (log.warning if chosen != torch.float32 else log.info)("serving dtype: %s", why)
    if torch.cuda.is_available():  # GPU hosts (the CUDA bento)
        model = model.to(device="cuda")
    if chosen != model.dtype:
        model = model.to(chosen)
    return _loaded(model, tokenizer, model.generation_config, model.config, path)
