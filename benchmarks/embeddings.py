"""/v1/embeddings' encoder: texts/s with requests batched together against one at a time, same
texts, in one run, with the agreement beside it (the largest difference between a text's
vector batched and alone: padding is masked, so they must agree).

    .venv/bin/python benchmarks/embeddings.py [--requests 256] [--concurrency 32]

Each request is one text (a sentence of the shipped sample set's prompts), the shape of a RAG
stack embedding chunks one call at a time. Measures the Embedder (tuneloop/serving/embedder.py)
in process: no HTTP, no gateway (benchmarks/gateway.py measures those).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import numpy as np

from tuneloop.serving.embedder import Embedder

ROOT = Path(__file__).resolve().parents[1]


def texts(n: int) -> list[str]:
    out = []
    with open(ROOT / "data" / "sample" / "train.jsonl") as f:
        for line in f:
            row = json.loads(line)
            text = row.get("prompt") or next((m["content"] for m in row.get("messages", []) if m["role"] == "user"), "")
            if text:
                out.append(text[:500])
            if len(out) == n:
                break
    return out


async def one_at_a_time(embedder: Embedder, items: list[str]) -> tuple[float, list[np.ndarray]]:
    started = time.perf_counter()
    out = [await embedder.aembed([t]) for t in items]
    return time.perf_counter() - started, out


async def concurrent(embedder: Embedder, items: list[str], concurrency: int) -> tuple[float, list[np.ndarray]]:
    gate = asyncio.Semaphore(concurrency)

    async def one(t: str) -> np.ndarray:
        async with gate:
            return await embedder.aembed([t])

    started = time.perf_counter()
    out = await asyncio.gather(*(one(t) for t in items))
    return time.perf_counter() - started, list(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=32)
    args = ap.parse_args()
    items = texts(args.requests)
    embedder = Embedder()

    async def run():
        await embedder.aembed(["warm-up"])  # the load and first-call costs, outside both timings
        alone_s, alone = await one_at_a_time(embedder, items)
        before = embedder.batches
        batched_s, batched = await concurrent(embedder, items, args.concurrency)
        return alone_s, alone, batched_s, batched, embedder.batches - before

    alone_s, alone, batched_s, batched, calls = asyncio.run(run())
    diff = max(float(np.abs(a - b).max()) for a, b in zip(alone, batched))
    print(f"{len(items)} requests of one text each, {args.concurrency} at a time when batched")
    print(f"one at a time: {len(items) / alone_s:8.1f} texts/s ({len(items)} encoder calls)")
    print(f"batched:       {len(items) / batched_s:8.1f} texts/s ({calls} encoder calls)")
    print(f"speed-up:      {alone_s / batched_s:8.2f}x")
    print(f"agreement:     largest difference of a vector batched vs alone {diff:.2e} (bar 1e-5)")


if __name__ == "__main__":
    main()
