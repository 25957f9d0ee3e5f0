"""The served embedding model: the shipped sentence encoder (all-MiniLM-L6-v2, tuneloop/embeddings.py)
behind /v1/embeddings.

Loaded on the first request, not at start-up: sentence-transformers and the encoder take ~7 s
to import and load on a 2-core machine, and most servers are never asked for an embedding.
The first request waits for the load; the others queue behind it. Requests that wait while a
batch runs are encoded together as the next batch (up to max_batch_texts inputs, the first
request whole), in a worker thread, never on the event loop; one batch at a time (the encoder
is one model: two batches side by side would share the same cores). A request's vectors are
the same batched or alone (padding is masked): tests/unit/test_api_embeddings_tokenize.py.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import numpy as np

from tuneloop.embeddings import EMBEDDING_MODEL_ID, dimension, embed, encoder_path, load_encoder
from tuneloop.serving.errors import ContextLengthExceeded, InvalidRequest


class Embedder:
    """The encoder (loaded on first use), its tokenizer's counts and its limits."""

    model_id = EMBEDDING_MODEL_ID

    def __init__(
        self, path: Path | None = None, batch_size: int = 64, max_inputs: int = 2048, max_batch_texts: int = 256
    ):
        self.path = path
        self.batch_size = batch_size  # the encoder's own forward batches
        self.max_inputs = max_inputs
        self.max_batch_texts = max_batch_texts  # requests joined into one encoder call, up to this many inputs
        self._model: Any = None
        self._load_lock = threading.Lock()
        self._pending: list[tuple[list[str], asyncio.Future]] = []
        self._worker: asyncio.Task | None = None
        self.batches = 0  # encoder calls made (the batching's effect, for tests and benchmarks)

    def _loaded(self):
        with self._load_lock:
            if self._model is None:
                self._model = load_encoder(self.path or encoder_path(), shared=True)
            return self._model

    @property
    def max_tokens(self) -> int:
        """The longest input in the encoder's tokens (its max_seq_length: 256 for all-MiniLM-L6-v2)."""
        return int(self._loaded().max_seq_length)

    @property
    def dimension(self) -> int:
        return dimension(self._loaded())

    def count(self, texts: list[str]) -> list[int]:
        """Each text's length in the encoder's tokens, special tokens included (what it reads)."""
        tokenizer = self._loaded().tokenizer
        return [len(ids) for ids in tokenizer(texts, add_special_tokens=True)["input_ids"]]

    def check(self, texts: list[str]) -> list[int]:
        """The token counts, or a 400 for an input the encoder would cut (OpenAI refuses an input
        over its model's context rather than embed part of it)."""
        if not texts:
            raise InvalidRequest("input: an empty list has nothing to embed", param="input")
        limit = self.max_tokens
        counts = self.count(texts)
        for i, n in enumerate(counts):
            if n > limit:
                where = "input" if len(texts) == 1 else f"input[{i}]"
                raise ContextLengthExceeded(
                    f"This model's maximum context length is {limit} tokens; {where} has {n}. Shorten it or split it.",
                    param="input",
                )
        return counts

    async def aprepare(self, texts: list[str]) -> list[int]:
        """check() off the event loop (the first call loads the encoder)."""
        return await asyncio.to_thread(self.check, texts)

    async def aembed(self, texts: list[str]) -> np.ndarray:
        """L2-normalised float32 vectors, one row per text (with the requests waiting beside it)."""
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._pending.append((texts, future))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.ensure_future(self._drain())
        return await future

    async def _drain(self) -> None:
        while self._pending:
            batch, size = [], 0
            while self._pending and (not batch or size + len(self._pending[0][0]) <= self.max_batch_texts):
                texts, future = self._pending.pop(0)
                if future.cancelled():  # its client left while it waited
                    continue
                batch.append((texts, future))
                size += len(texts)
            if not batch:
                continue
            flat = [t for texts, _ in batch for t in texts]
            try:
                vectors = await asyncio.to_thread(embed, self._loaded(), flat, self.batch_size)
            except Exception as exc:  # every request of the batch fails alike; the next batch is tried
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            self.batches += 1
            at = 0
            for texts, future in batch:
                if not future.done():
                    future.set_result(vectors[at : at + len(texts)])
                at += len(texts)
