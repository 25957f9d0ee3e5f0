"""The content filter: stage 1 a versioned rule set, stage 2 the trained classifier.

Rules (gateway.filter.rules) are regular expressions, each with an id and a category; a
match flags the text in that category with score 1. Both stages read the same screening views
of a text (tuneloop/gateway/normalize.py: Unicode-normalised, invisible characters removed,
look-alike letters folded, leetspeak and spaced letters read, encoded runs decoded): a text is
flagged when any view is. The classifier
(tuneloop/gateway/filter_model.py, trained and registered by flows/filter.py, loaded by
alias) scores prompt injection; its work is micro-batched: concurrent checks (prompts of
concurrent requests, the inputs of /v1/moderations) that arrive while one batch runs go
together into the next one, up to max_batch_size.

Verdicts come in OpenAI's moderation shape: every OpenAI category (assessed here only by
rules that name it), plus `prompt_injection`.
"""

from __future__ import annotations

import asyncio
import inspect
import re
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from tuneloop.gateway.normalize import screening_views

OPENAI_CATEGORIES = (
    "harassment",
    "harassment/threatening",
    "hate",
    "hate/threatening",
    "illicit",
    "illicit/violent",
    "self-harm",
    "self-harm/intent",
    "self-harm/instructions",
    "sexual",
    "sexual/minors",
    "violence",
    "violence/graphic",
)
INJECTION = "prompt_injection"


@dataclass
class Verdict:
    flagged: bool
    categories: dict[str, bool]
    scores: dict[str, float]
    rules: list[str] = field(default_factory=list)  # ids of the rules that matched
    classifier_flagged: bool = False  # the classifier's score reached its threshold

    def blocks(self, classifier_action: str) -> bool:
        """Whether this verdict refuses: any rule match; a classifier flag when it may block."""
        return bool(self.rules) or (self.classifier_flagged and classifier_action == "block")

    def flagged_categories(self) -> list[str]:
        return [c for c, v in self.categories.items() if v]

    def summary(self) -> dict:
        """As the request log keeps it: {flagged, categories, rules, score}."""
        return {
            "flagged": bool(self.flagged),
            "categories": self.flagged_categories(),
            "rules": list(self.rules),
            "score": round(float(max(self.scores.values(), default=0.0)), 4) if self.scores else None,
        }


class RuleSet:
    def __init__(self, rules: Sequence[Any], version: str):
        self.version = version
        self.rules = [(r.id, r.category, re.compile(r.pattern, re.IGNORECASE | re.DOTALL)) for r in rules]
        self.categories = list(dict.fromkeys([*OPENAI_CATEGORIES, INJECTION, *(c for _, c, _ in self.rules)]))

    def match(self, text: str) -> list[tuple[str, str]]:
        """(rule id, category) of every rule that matches any screening view of `text`
        (normalised, de-obfuscated, decoded: tuneloop/gateway/normalize.py)."""
        views = screening_views(text)
        return [(rid, cat) for rid, cat, rx in self.rules if any(rx.search(v) for v in views)]


class MicroBatcher:
    """Runs fn(list of items) -> list of results one batch at a time (a coroutine function is
    awaited, a plain one runs in a worker thread); what arrives meanwhile waits (at most
    max_latency_s more) and joins the next batch."""

    def __init__(
        self,
        fn: Callable[[list], Sequence] | Callable[[list], Awaitable[Sequence]],
        max_batch_size: int,
        max_latency_s: float,
        on_batch: Callable[[int], None] | None = None,
    ):
        self.fn = fn
        self._awaitable = inspect.iscoroutinefunction(fn)
        self.max_batch_size = max_batch_size
        self.max_latency_s = max_latency_s
        self.on_batch = on_batch
        self._pending: list[tuple[Any, asyncio.Future]] = []
        self._worker: asyncio.Task | None = None

    async def run(self, items: Sequence) -> list:
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in items]
        self._pending.extend(zip(items, futures))
        if self._worker is None or self._worker.done():
            self._worker = loop.create_task(self._work())
        return list(await asyncio.gather(*futures))

    async def _work(self) -> None:
        while self._pending:
            if len(self._pending) < self.max_batch_size and self.max_latency_s > 0:
                await asyncio.sleep(self.max_latency_s)  # let concurrent callers join
            batch, self._pending = self._pending[: self.max_batch_size], self._pending[self.max_batch_size :]
            batch = [(item, fut) for item, fut in batch if not fut.done()]  # a caller that gave up
            if not batch:
                continue
            if self.on_batch:
                self.on_batch(len(batch))
            try:
                items = [item for item, _ in batch]
                if self._awaitable:
                    pending = self.fn(items)
                    assert isinstance(pending, Awaitable)  # a coroutine function's call: a coroutine
                    results = await pending
                else:
                    results = await asyncio.to_thread(self._call_plain, items)
            except Exception as exc:
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            for (_, fut), result in zip(batch, results):
                if not fut.done():
                    fut.set_result(result)

    def _call_plain(self, items: list) -> Sequence:
        """fn(items) for a plain (not coroutine) function: in the worker thread."""
        results = self.fn(items)
        assert not isinstance(results, Awaitable)  # not a coroutine function: its results themselves
        return results


class ContentFilter:
    def __init__(
        self,
        rules: RuleSet,
        classifier=None,
        threshold: float | None = None,
        model_id: str | None = None,
        max_batch_size: int = 32,
        max_latency_ms: float = 5.0,
        timeout_s: float = 5.0,
        on_batch: Callable[[int], None] | None = None,
        on_texts: Callable[[int, int], None] | None = None,
        on_cpu: Callable[[float], None] | None = None,
    ):
        self.rules = rules
        self.classifier = classifier
        self.threshold = threshold if threshold is not None else getattr(classifier, "threshold", 0.5)
        self.timeout_s = timeout_s
        # What /v1/moderations names as its model: the classifier's registered version and the rules' version.
        self.model_id = f"{model_id or 'rules-only'}+rules-{rules.version}"
        self.on_texts = on_texts  # (cleared by the screen, encoded) per batch
        self.on_cpu = on_cpu  # the classifier's own thread CPU seconds per batch
        self.batcher = None
        if classifier is not None:
            # A classifier in another process is awaited (no worker thread to hand the batch to).
            fn = self._ascores if hasattr(classifier, "ascores") else self._scores
            self.batcher = MicroBatcher(fn, max_batch_size, max_latency_ms / 1000, on_batch)

    async def _ascores(self, texts: list[str]) -> list[float]:
        c = self.classifier
        reply = await c.ascores(texts)
        if self.on_texts is not None:
            self.on_texts(reply["screened"], reply["encoded"])
        return list(reply["scores"])

    def _scores(self, texts: list[str]) -> list[float]:
        c = self.classifier
        before = (getattr(c, "screened_out", 0), getattr(c, "encoded", 0))
        cpu = time.thread_time()
        try:
            scores = list(c.scores(texts))
        finally:
            if self.on_cpu is not None:
                self.on_cpu(time.thread_time() - cpu)
        if self.on_texts is not None:
            self.on_texts(getattr(c, "screened_out", 0) - before[0], getattr(c, "encoded", 0) - before[1])
        return scores

    async def check(self, texts: Sequence[str], classify: bool = True) -> list[Verdict]:
        """A verdict per text (classify=False: the rules only). Raises TimeoutError or the
        classifier's error: the caller fails closed."""
        scores = [None] * len(texts)
        if self.batcher is not None and texts and classify:
            async with asyncio.timeout(self.timeout_s):
                scores = await self.batcher.run(list(texts))
        return [self._verdict(text, score) for text, score in zip(texts, scores)]

    def _verdict(self, text: str, injection_score: float | None) -> Verdict:
        categories = {c: False for c in self.rules.categories}
        scores = {c: 0.0 for c in self.rules.categories}
        matched = self.rules.match(text)
        for _, cat in matched:
            categories[cat], scores[cat] = True, 1.0
        by_classifier = injection_score is not None and injection_score >= self.threshold
        if injection_score is not None:
            scores[INJECTION] = max(scores[INJECTION], float(injection_score))
            categories[INJECTION] = categories[INJECTION] or by_classifier
        return Verdict(any(categories.values()), categories, scores, [rid for rid, _ in matched], by_classifier)
