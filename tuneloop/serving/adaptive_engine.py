"""The "adaptive" engine: one left-padded batched `generate` over whatever requests BentoML's
adaptive batcher collected.

Requests leave the batch early (eos, their own max_tokens, cancelled) through a per-row
stopping criterion, but nobody joins a running batch: newcomers wait for the next one.
Per-row sampling is sampling.py's, through a logits processor.

torch and transformers are imported where they are used: importing this module stays light.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Iterable, Sequence

from tuneloop.serving.engine import BatchObserver, GenerationStream, LoadedModel, batched_delivery
from tuneloop.serving.lora import AdaptersNotServed
from tuneloop.serving.sampling import RowSampler, row_sampler, sample_rows

log = logging.getLogger(__name__)


class BatchGenerator:
    """Runs a batch of streams with one left-padded `generate` call (the "adaptive" engine).

    Used from BentoML's batchable API, which collects the batch; run() blocks until every
    stream of the batch has finished.
    """

    supports_adapters = False
    adapter_refusal = "the adaptive engine serves no LoRA adapters (the slots engine does)"

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
            if s.params.adapter is not None:  # the API checks supports_adapters first; this is the backstop
                s.finish(
                    "error",
                    AdaptersNotServed(f"model {s.params.adapter.name!r} is a LoRA adapter: {self.adapter_refusal}"),
                )
                continue
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
            attention_mask = torch.tensor([[0] * (width - len(s.prompt_ids)) + [1] * len(s.prompt_ids) for s in group])
            input_ids = input_ids.to(self.loaded.model.device)
            attention_mask = attention_mask.to(self.loaded.model.device)
            rows = [row_sampler(s.params, self.loaded) for s in group]
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

    def __init__(
        self, streams: list[GenerationStream], stop_ids: frozenset[int], samplers: Sequence[RowSampler | None] = ()
    ):
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
