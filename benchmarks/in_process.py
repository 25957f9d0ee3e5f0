"""What the in-process engine benchmarks share (lora.py, structured.py, fine_tuning_job.py): the
model presets by name, chat prompts in the served model's rendering, and one batch of
requests run to the end on an engine."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def preset_config(name: str) -> Path:
    """The config of a preset: `smollm2` or anything else (the demo's default)."""
    return ROOT / "configs" / ("smollm2.yaml" if name == "smollm2" else "default.yaml")


def preset_model(name: str) -> Path:
    """The model folder of `smollm2` or `demo` (built or converted once), else `name` as a folder."""
    if name not in ("smollm2", "demo"):
        return Path(name)
    from tuneloop.bootstrap import ensure_base_model
    from tuneloop.config import load_config

    return Path(ensure_base_model(load_config(preset_config(name), environ={})))


def chat_prompts(loaded, questions: list[str], n: int, tools=None) -> list[list[int]]:
    """n prompts' token ids, question i mod len(questions) as one user message, rendered as served."""
    from tuneloop.chat_format import render_chat

    return [
        loaded.encode(
            render_chat(loaded.tokenizer, [{"role": "user", "content": questions[i % len(questions)]}], tools)
        )
        for i in range(n)
    ]


async def run_batch(engine, specs) -> tuple[float, list[tuple[list[int], str | None]]]:
    """Submit every (prompt ids, SamplingParams) at once; the wall time and each one's tokens and
    finish reason, in order."""
    from tuneloop.serving.engine import GenerationStream

    async def one(i, ids, params):
        stream = GenerationStream(f"r{i}-{time.perf_counter_ns()}", ids, params)
        engine.submit(stream)
        got = []
        async for new in stream.events():
            got += new
        return got, stream.finish_reason

    started = time.perf_counter()
    out = await asyncio.gather(*(one(i, ids, p) for i, (ids, p) in enumerate(specs)))
    return time.perf_counter() - started, list(out)
