"""The "continuous" engine: transformers' ContinuousBatchingManager, with our per-request
sampling (sampling.py); requests join and leave the running batch at every step.

transformers is imported where it is used: importing this module stays light, and the
manager's classes to subclass are only built when an engine is made.
"""

from __future__ import annotations

import threading
from typing import Callable

from tuneloop.serving.engine import BatchObserver, GenerationStream, LoadedModel, SamplingParams
from tuneloop.serving.errors import Unavailable
from tuneloop.serving.lora import AdaptersNotServed
from tuneloop.serving.sampling import RowSampler, sample_rows


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

    engine = "continuous"  # as an API Backend: submit(stream)
    supports_adapters = False
    adapter_refusal = "the continuous engine serves no LoRA adapters (the slots engine does)"

    def __init__(
        self,
        loaded: LoadedModel,
        num_blocks: int,
        page_size: int,
        max_batch_tokens: int,
        on_batch: BatchObserver | None = None,
    ):
        from transformers import ContinuousBatchingConfig, GenerationConfig

        self.loaded = loaded
        self._sampler = _new_continuous_sampler(on_batch)
        self._sampler.loaded = loaded
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
        if stream.params.adapter is not None:
            raise AdaptersNotServed(f"model {stream.params.adapter.name!r} is a LoRA adapter: {self.adapter_refusal}")
        rid = stream.request_id
        stop_ids = self.loaded.stop_ids
        emitted = 0

        def on_output(output) -> None:
            nonlocal emitted
            tokens = list(output.generated_tokens)
            finished = output.is_finished()
            hit_stop = bool(tokens) and finished and tokens[-1] in stop_ids and not stream.params.ignore_eos
            new = tokens[emitted : len(tokens) - 1 if hit_stop else len(tokens)]
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
        sampler = self._sampler.register(
            rid, stream.params, on_failure=lambda exc: self._fail(rid, stream, on_cancel, exc)
        )
        self.manager.register_result_handler(rid, on_output)
        stream.add_cancel_hook(on_cancel)
        self.manager.add_request(
            stream.prompt_ids,
            request_id=rid,
            max_new_tokens=stream.params.max_new_tokens,
            streaming=True,
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
        self.loaded = None  # the engine's LoadedModel (constrained rows read its tokenizer)
        self._params: dict[str, RowSampler] = {}
        self._on_failure: dict[str, Callable[[BaseException], None]] = {}
        self._lock = threading.Lock()
        self._rows: list = []
        self._ids: list[str] = []

    def register(
        self, request_id: str, params: SamplingParams, on_failure: Callable[[BaseException], None] | None = None
    ) -> RowSampler:
        sampler = RowSampler(params, self.loaded)
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
        counting = [
            i
            for i, r in enumerate(self._rows)
            if i not in failures and r is not None and (r.counts_tokens or r.params.constraint is not None)
        ]
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
