"""Two of the generation engines behind the OpenAI API, and what all three share
(the third, the default "slots" engine, is in slots.py).

A request becomes a GenerationStream: prompt token ids + SamplingParams in, token ids out.
Engines run the model on their own thread and push tokens into the stream; the asyncio
side (openai_api.py) reads them, turns them into text, applies stop strings and may
cancel the stream (client gone, timeout, stop string hit), which stops its generation.

- BatchGenerator ("adaptive" engine): one left-padded batched `generate` over whatever
  requests BentoML's adaptive batcher collected. Requests leave the batch early (eos,
  their own max_tokens, cancelled) through a per-row stopping criterion, but nobody joins
  a running batch: newcomers wait for the next one.
- ContinuousEngine ("continuous" engine): transformers' ContinuousBatchingManager;
  requests join and leave the running batch at every step.

Per-request sampling (temperature, top_p, seed) inside a shared batch is done by one
function, sample_rows, used by every engine: each row that samples draws its token with
its own torch.Generator (so a seed gives the same text whoever shares the batch) and
its logits are replaced by a one-hot; greedy rows keep their logits. The model then runs
with do_sample=False, so greedy rows are exactly `generate`'s argmax.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from tuneloop.serving.errors import ServingSetupError, Unavailable

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

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 loop: asyncio.AbstractEventLoop | None = None, interval_s: float = 0.0):
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.loop = loop or asyncio.get_running_loop()
        self._events: deque[tuple] = deque()  # delivered, not yet read
        self._arrived = asyncio.Event()
        self._cancelled = threading.Event()
        self._cancel_hooks: list[Callable[[], None]] = []
        self.claimed = False  # an engine has started running it (so a retried submission is a no-op)
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
# model loading and facts both engines need


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
        return torch.float32, "float32" + (" (auto: the dtype whose answers are the reference's)"
                                           if requested == "auto" else "")
    if requested == "bfloat16-lossy":
        return torch.bfloat16, (f"bfloat16-lossy (configured): weights, activations and cache in bfloat16, faster "
                                f"and NOT the reference's answers ({BF16_COST}; `tuneloop agreement --dtype "
                                f"bfloat16-lossy` measures it on this model)")
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


# ---------------------------------------------------------------------------------------
# per-request sampling inside a shared batch


def make_generator(seed: int | None):
    import torch

    # torch takes seeds in [-2**63, 2**64); the API allows OpenAI's int64 range. Reduced
    # here too, so no seed can make an engine step raise.
    return torch.Generator().manual_seed(seed % 2**64 if seed is not None else secrets.randbits(63))


RowFailures = dict  # row index -> the exception that row's sampling raised


class RowSampler:
    """One generation's sampling state: its parameters, its own torch.Generator (sampled
    rows), and how often it generated each token (for the penalties)."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = None if params.greedy else make_generator(params.seed)
        self.counts: dict[int, int] = {}
        # logprobs of the tokens sample_rows picked, not yet handed to the stream (the engine
        # thread appends; whoever emits the token takes them, on any thread: deque is safe)
        self._logprobs: deque[TokenLogprobs] = deque()

    @property
    def active(self) -> bool:
        """Whether sample_rows has anything to do for this row (else its logits stay as they are)."""
        return not self.params.greedy or self.params.shapes_logits or self.params.logprobs is not None

    @property
    def counts_tokens(self) -> bool:
        """Whether its penalties need the counts of the tokens it generates."""
        return bool(self.params.presence_penalty or self.params.frequency_penalty)

    def observe(self, token: int) -> None:
        """Record a token this generation produced (what the penalties count)."""
        if self.counts_tokens:
            self.counts[token] = self.counts.get(token, 0) + 1

    def take_logprobs(self, n: int = 1) -> list[TokenLogprobs]:
        """The logprobs of the next n picked tokens ([] without logprobs)."""
        out = []
        while self._logprobs and len(out) < n:
            out.append(self._logprobs.popleft())
        return out


def row_sampler(params: SamplingParams) -> RowSampler | None:
    """A RowSampler where the row needs one, None for plain greedy rows (left to the argmax)."""
    sampler = RowSampler(params)
    return sampler if sampler.active else None


LOGPROB_FLOOR = -9999.0  # what JSON can carry for log(0), as vLLM reports it


def token_logprobs(lp, token: int, top: int) -> TokenLogprobs:
    """One token's entry from its row's log-probabilities."""
    import torch

    own = max(float(lp[token]), LOGPROB_FLOOR)
    if top <= 0:
        return own, []
    values, ids = torch.topk(lp, min(top, lp.shape[-1]))
    return own, [(int(i), max(float(v), LOGPROB_FLOOR)) for i, v in zip(ids.tolist(), values.tolist())]


def sample_rows(scores, rows: Sequence[RowSampler | None]) -> RowFailures:
    """Shape and sample one token for every row that has a RowSampler; in place.

    Shaping (logit_bias, presence/frequency penalties) changes a row's logits; a sampling
    row's logits then become a one-hot (0 / -inf) on its drawn token. Greedy rows keep their
    (shaped) logits, so an argmax over the result is every row's next token. Rows that
    report logprobs get that token's entry queued on their RowSampler (take_logprobs).

    One row's failure is that row's alone: it is returned ({row index: exception}) for its
    engine to end that request with an error, and every other row of the batch goes on.
    """
    import torch

    failures: RowFailures = {}
    reporting = [i for i, r in enumerate(rows) if r is not None and r.params.logprobs is not None]
    # the model's own distribution, before anything below changes the logits
    raw = dict(zip(reporting, torch.log_softmax(scores[reporting].float(), dim=-1).cpu())) if reporting else {}
    for i, row in enumerate(rows):
        if row is None or not row.active:
            continue
        try:
            if row.params.shapes_logits:
                _shape_row(scores, i, row)
            if not row.params.greedy:
                _sample_row(scores, i, row.params, row.generator)
            if i in raw:  # the token the engine's argmax will pick from these scores
                row._logprobs.append(token_logprobs(raw[i], int(scores[i].argmax()), row.params.logprobs))
        except Exception as exc:  # noqa: BLE001 - isolated to its row, reported to its stream
            log.exception("sampling failed for one row of a batch; only its request fails")
            failures[i] = exc
    return failures


def _shape_row(scores, i: int, row: RowSampler) -> None:
    import torch

    p = row.params
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias], device=scores.device)
        scores[i, ids] += torch.tensor([b for _, b in p.logit_bias], dtype=scores.dtype, device=scores.device)
    if row.counts:
        ids = torch.tensor(list(row.counts), device=scores.device)
        counts = torch.tensor(list(row.counts.values()), dtype=scores.dtype, device=scores.device)
        scores[i, ids] -= p.frequency_penalty * counts + p.presence_penalty


def _sample_row(scores, i: int, params: SamplingParams, generator) -> None:
    import torch

    # Sampled on the CPU: the seeded torch.Generator lives there, and one vocab-sized
    # row is cheap to move; the one-hot result goes back to the scores' device.
    logits = scores[i].float().cpu()
    # Shifted so the largest logit is 0 before scaling: a small temperature then sends the
    # others towards -inf, never the largest to +inf.
    logits = (logits - logits.max()) / params.temperature
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p. The top token always stays:
        # a top_p below float32's resolution (1e-300 is 0.0 there) must not remove it.
        outside = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= params.top_p
        outside[0] = False
        probs = probs.clone()
        probs[order[outside]] = 0.0
    token = torch.multinomial(probs, 1, generator=generator)
    scores[i].fill_(float("-inf"))
    scores[i, token.to(scores.device)] = 0.0


# ---------------------------------------------------------------------------------------
# adaptive engine: left-padded batched generate


class BatchGenerator:
    """Runs a batch of streams with one left-padded `generate` call (the "adaptive" engine).

    Used from BentoML's batchable API, which collects the batch; run() blocks until every
    stream of the batch has finished.
    """

    def __init__(self, loaded: LoadedModel, on_batch: BatchObserver | None = None):
        self.loaded = loaded
        self.on_batch = on_batch
        self._lock = threading.Lock()  # one generate at a time per model

    def run(self, streams: Iterable[GenerationStream]) -> None:
        live = []
        for s in streams:
            if s.cancelled or s.claimed:
                continue  # gone before its batch started, or already run by an earlier attempt
            s.claimed = True
            live.append(s)
        for group in self._fit_context(live):
            with self._lock:
                self._run_group(group)

    def _fit_context(self, streams: list[GenerationStream]) -> list[list[GenerationStream]]:
        """Split so that every group's longest prompt + largest max_new_tokens fits the context.

        In a padded batch every row runs as many steps as the longest request; a long prompt
        next to a long generation would run past the position embeddings.
        """
        groups: list[list[GenerationStream]] = []
        for s in sorted(streams, key=lambda s: len(s.prompt_ids)):
            for g in groups:
                width = max(len(s.prompt_ids), *(len(x.prompt_ids) for x in g))
                steps = max(s.params.max_new_tokens, *(x.params.max_new_tokens for x in g))
                if width + steps <= self.loaded.context_length:
                    g.append(s)
                    break
            else:
                groups.append([s])
        return groups

    def _run_group(self, group: list[GenerationStream]) -> None:
        import torch
        from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

        tok = self.loaded.tokenizer
        if self.on_batch:
            self.on_batch(len(group))
        try:
            width = max(len(s.prompt_ids) for s in group)
            pad = tok.pad_token_id
            input_ids = torch.tensor([[pad] * (width - len(s.prompt_ids)) + s.prompt_ids for s in group])
            attention_mask = torch.tensor([[0] * (width - len(s.prompt_ids)) + [1] * len(s.prompt_ids)
                                           for s in group])
            input_ids = input_ids.to(self.loaded.model.device)
            attention_mask = attention_mask.to(self.loaded.model.device)
            rows = [row_sampler(s.params) for s in group]
            tracker = _RowTracker(group, self.loaded.stop_ids, rows)
            sampling = _RowSampling(rows, on_failure=tracker.fail)
            config = GenerationConfig(
                do_sample=False,
                max_new_tokens=max(s.params.max_new_tokens for s in group),
                pad_token_id=pad,
                # The tracker ends each row at its stop tokens; `generate` may stop whole rows
                # there too, unless one of them generates through them (ignore_eos).
                eos_token_id=-1 if any(s.params.ignore_eos for s in group) else sorted(self.loaded.stop_ids),
            )
            with torch.inference_mode():
                self.loaded.model.generate(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    generation_config=config,
                    logits_processor=LogitsProcessorList([sampling]),
                    stopping_criteria=StoppingCriteriaList([tracker]),
                )
            tracker.finish_all("length")
        except Exception as exc:
            log.exception("batched generate failed (%d requests)", len(group))
            for s in group:
                s.finish("error", exc)


class _RowSampling:
    """LogitsProcessor: per-row temperature/top_p/seed (see sample_rows). A row whose
    sampling failed is ended with that error (on_failure) and samples no more."""

    def __init__(self, rows, on_failure: Callable[[int, BaseException], None]):
        self.rows = list(rows)
        self.on_failure = on_failure

    def __call__(self, input_ids, scores):
        for i, exc in sample_rows(scores, self.rows).items():
            self.rows[i] = None
            self.on_failure(i, exc)
        return scores


class _RowTracker:
    """StoppingCriteria that hands each row's new token to its stream and ends rows one by one.

    A row ends at a stop token (not emitted), at its own max_new_tokens, or when its stream
    was cancelled. `generate` stops once every row has ended.
    """

    def __init__(self, streams: list[GenerationStream], stop_ids: frozenset[int],
                 samplers: Sequence[RowSampler | None] = ()):
        self.streams = streams
        self.stop_ids = stop_ids
        self.samplers = list(samplers) or [None] * len(streams)
        self.counts = [0] * len(streams)
        self.ended = [False] * len(streams)

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        last = input_ids[:, -1].tolist()
        with batched_delivery():
            self._hand_out(last)
        return torch.tensor(self.ended, dtype=torch.bool, device=input_ids.device)

    def _hand_out(self, last: list[int]) -> None:
        for i, s in enumerate(self.streams):
            if self.ended[i]:
                continue
            if s.cancelled:
                self._end(i, "cancelled")
            elif last[i] in self.stop_ids and not s.params.ignore_eos:
                self._end(i, "stop")
            else:
                sampler = self.samplers[i]
                if sampler is not None:
                    sampler.observe(last[i])
                s.emit([last[i]], sampler.take_logprobs() if sampler is not None else None)
                self.counts[i] += 1
                if self.counts[i] >= s.params.max_new_tokens:
                    self._end(i, "length")

    def _end(self, i: int, reason: str, error: BaseException | None = None) -> None:
        self.ended[i] = True
        self.streams[i].finish(reason, error)

    def fail(self, i: int, error: BaseException) -> None:
        """End row i with an error (its sampling failed); the other rows go on."""
        if not self.ended[i]:
            self._end(i, "error", error)

    def finish_all(self, reason: str) -> None:
        for i in range(len(self.streams)):
            if not self.ended[i]:
                self._end(i, reason)


# ---------------------------------------------------------------------------------------
# continuous engine: transformers' continuous batching manager


class ContinuousEngine:
    """Iteration-level batching: requests join and leave the running batch at every step.

    Wraps transformers' ContinuousBatchingManager (its own generation thread). Our sampler
    replaces the manager's logits processors so that per-request temperature, top_p and
    seed work exactly as in the adaptive engine; it also reports each step's batch size.
    submit() and the result callbacks run on the event loop.

    Two manager internals are used (transformers 5.23; test_serving_engine.py pins them):
    `manager.logit_processor` is replaced before start, and a cancelled request's result
    handler is removed from `manager.output_router` (the manager leaves it behind).
    """

    engine = "continuous"  # as a Backend of openai_api: submit(stream)

    def __init__(self, loaded: LoadedModel, num_blocks: int, page_size: int, max_batch_tokens: int,
                 on_batch: BatchObserver | None = None):
        from transformers import ContinuousBatchingConfig, GenerationConfig

        self.loaded = loaded
        self._sampler = _new_continuous_sampler(on_batch)
        generation_config = GenerationConfig(
            do_sample=False,  # greedy argmax; sampling rows are made one-hot by the sampler
            max_new_tokens=16,
            eos_token_id=sorted(loaded.stop_ids),
            pad_token_id=loaded.tokenizer.pad_token_id,
        )
        cb_config = ContinuousBatchingConfig(
            num_blocks=num_blocks,
            page_size=page_size,
            max_batch_tokens=max_batch_tokens,
            # The sampler keeps per-step state between preparing and processing a batch,
            # which async batching (prepare the next batch while the current one runs) breaks.
            use_async_batching=False,
            allow_block_sharing=False,
        )
        self.manager = loaded.model.init_continuous_batching(
            generation_config=generation_config, continuous_batching_config=cb_config
        )
        self.manager.logit_processor = _sampler_list(self._sampler)

    def launch(self) -> None:
        """Start the manager's generation thread."""
        self.manager.start()

    def stop(self) -> None:
        if self.manager.is_running():
            self.manager.stop(block=True, timeout=10)

    @property
    def is_running(self) -> bool:
        return self.manager.is_running()

    def submit(self, stream: GenerationStream) -> None:
        """Start generating for stream (call on its event loop)."""
        if not self.manager.is_running():
            raise Unavailable("the generation engine is not running; the server is not ready", retry_after_s=1)
        rid = stream.request_id
        stop_ids = self.loaded.stop_ids
        emitted = 0

        def on_output(output) -> None:
            nonlocal emitted
            tokens = list(output.generated_tokens)
            finished = output.is_finished()
            hit_stop = bool(tokens) and finished and tokens[-1] in stop_ids and not stream.params.ignore_eos
            new = tokens[emitted: len(tokens) - 1 if hit_stop else len(tokens)]
            emitted += len(new)
            stream.emit(new, sampler.take_logprobs(len(new)) if new else None)
            if output.error:
                self._sampler.forget(rid)
                stream.finish("error", RuntimeError(output.error))
            elif finished:
                self._sampler.forget(rid)
                stream.finish("stop" if hit_stop else "length")

        def on_cancel() -> None:
            self.manager.cancel_request(rid)
            self._sampler.forget(rid)
            # A cancelled request gets no final output, so its handler would stay registered.
            with self.manager.output_router._lock:
                self.manager.output_router.result_handlers.pop(rid, None)

        stream.claimed = True
        sampler = self._sampler.register(rid, stream.params,
                                         on_failure=lambda exc: self._fail(rid, stream, on_cancel, exc))
        self.manager.register_result_handler(rid, on_output)
        stream.add_cancel_hook(on_cancel)
        self.manager.add_request(
            stream.prompt_ids, request_id=rid, max_new_tokens=stream.params.max_new_tokens, streaming=True,
            eos_token_id=-1 if stream.params.ignore_eos else sorted(stop_ids),  # -1: none
        )


    def _fail(self, rid: str, stream: GenerationStream, on_cancel: Callable[[], None], error: BaseException) -> None:
        """End one request with an error from the manager's thread (its sampling failed):
        the manager drops it, and the stream tells its client; the batch goes on."""
        try:
            on_cancel()
        finally:
            stream.finish("error", error)


def _sampler_list(sampler):
    from transformers import LogitsProcessorList
    from transformers.generation.continuous_batching.cb_logits_processors import (
        ContinuousBatchingLogitsProcessorList,
    )

    class _SamplerList(ContinuousBatchingLogitsProcessorList):
        def __init__(self):
            super().__init__(LogitsProcessorList([sampler]))
            self.tensors_required = 1  # one (unused) argument row; the manager sizes its buffers by it

    return _SamplerList()


class _ContinuousSampler:
    """A continuous-batching logits processor: sample_rows over the requests of each step.

    The manager calls prepare_tensor_args with the requests that get a new token in the
    coming forward pass (in the order of the logits rows), then __call__ with those logits.
    """

    supported_kwargs: dict[str, type] = {}
    ignored_kwargs: tuple[str, ...] = ()

    def __init__(self, on_batch: BatchObserver | None):
        self.on_batch = on_batch
        self._params: dict[str, RowSampler] = {}
        self._on_failure: dict[str, Callable[[BaseException], None]] = {}
        self._lock = threading.Lock()
        self._rows: list = []
        self._ids: list[str] = []

    def register(self, request_id: str, params: SamplingParams,
                 on_failure: Callable[[BaseException], None] | None = None) -> RowSampler:
        sampler = RowSampler(params)
        with self._lock:
            self._params[request_id] = sampler
            if on_failure is not None:
                self._on_failure[request_id] = on_failure
        return sampler

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._params.pop(request_id, None)
            self._on_failure.pop(request_id, None)

    # ContinuousBatchingLogitsProcessor interface
    def fill_defaults(self, int32_tensor) -> None:
        int32_tensor.zero_()

    def prepare_tensor_args(self, requests_with_new_token):
        import torch

        with self._lock:
            self._ids = [r.state.request_id for r in requests_with_new_token]
            self._rows = [self._params.get(rid) for rid in self._ids]
        if self.on_batch and self._rows:
            self.on_batch(len(self._rows))
        return torch.zeros(len(self._rows), dtype=torch.int32)

    def __call__(self, scores, tensor_arg):
        failures = sample_rows(scores, self._rows)
        for i, exc in failures.items():
            with self._lock:
                on_failure = self._on_failure.get(self._ids[i])
            if on_failure is not None:
                on_failure(exc)
        counting = [i for i, r in enumerate(self._rows) if i not in failures and r is not None
                    and r.counts_tokens]
        if counting:  # the manager's argmax will pick exactly these (the scores are shaped / one-hot)
            for i, token in zip(counting, scores[counting].argmax(dim=-1).tolist()):
                self._rows[i].observe(token)
        return scores


def _new_continuous_sampler(on_batch: BatchObserver | None) -> _ContinuousSampler:
    """A _ContinuousSampler that is also a transformers ContinuousBatchingLogitsProcessor
    (the manager keeps only those); built here so importing this module stays light."""
    from transformers.generation.continuous_batching.cb_logits_processors import (
        ContinuousBatchingLogitsProcessor,
    )

    class ContinuousSampler(_ContinuousSampler, ContinuousBatchingLogitsProcessor):
        pass

    return ContinuousSampler(on_batch)
