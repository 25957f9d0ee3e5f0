"""Driving the serving engines and the OpenAI app in-process, as several test modules do:
prompts, the single-request `generate` reference, stream readers, one batch through each
engine, and the app over an engine with its clients (the official SDK and raw httpx, both
through ASGI). The model they run is conftest.py's `loaded`."""

from __future__ import annotations

import asyncio
import random

PROMPTS = [
    "Hello world",
    "The quick brown fox jumps over",
    "A model server answers completions and chat completions over HTTP. Tokens are generated",
    "x",
    "Continuous batching lets requests join",
]


def reference(loaded, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Single-request greedy `generate`, with the same stop tokens, stop tokens stripped."""
    import torch
    from transformers import GenerationConfig

    out = loaded.model.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        generation_config=GenerationConfig(
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=sorted(loaded.stop_ids),
            pad_token_id=loaded.tokenizer.pad_token_id,
        ),
    )[0, len(prompt_ids) :].tolist()
    if out and out[-1] in loaded.stop_ids:
        out.pop()
    return out


async def read_then_cancel(stream, after: int = 3) -> tuple[int, list[int]]:
    """Read stream until `after` tokens have come, cancel it, drain it.

    Returns the tokens read and the tokens the engine still emitted for the stream after the
    cancel (the list fills as the engine goes on; read it once the others have run). The
    tokens read depend on how busy the event loop was; the late ones count engine steps.
    """
    got, late = 0, []
    emit = stream.emit

    def emit_after_cancel(token_ids, logprobs=None):
        late.extend(token_ids)
        emit(token_ids, logprobs)

    async for new in stream.events():
        got += len(new)
        if got >= after and not stream.cancelled:
            stream.emit = emit_after_cancel
            stream.cancel()
    return got, late


# An engine notices a cancel at its next step: the step under way may still emit a token.
MAX_LATE_TOKENS = 2


async def collect(stream) -> tuple[list[int], str]:
    ids = []
    async for new in stream.events():
        ids += new
    return ids, stream.finish_reason


async def endings(streams, how=str, timeout: float = 10) -> list:
    """How each stream ended: its finish_reason, or how(the Unavailable it ended with)."""
    from tuneloop.serving.errors import Unavailable

    outcomes = []
    for s in streams:
        try:
            await asyncio.wait_for(collect(s), timeout=timeout)
            outcomes.append(s.finish_reason)
        except Unavailable as exc:
            outcomes.append(how(exc))
    return outcomes


def run_adaptive(loaded, specs, sizes=None):
    """Run (prompt_ids, SamplingParams) specs as one adaptive batch; [(ids, finish_reason)]."""
    from tuneloop.serving.adaptive_engine import BatchGenerator
    from tuneloop.serving.engine import GenerationStream

    async def main():
        streams = [GenerationStream(f"a{i}", ids, p) for i, (ids, p) in enumerate(specs)]
        batcher = BatchGenerator(loaded, on_batch=sizes.append if sizes is not None else None)
        job = asyncio.get_running_loop().run_in_executor(None, batcher.run, streams)
        results = await asyncio.gather(*(collect(s) for s in streams))
        await job
        return results

    return asyncio.run(main())


def make_server(loaded, backend, **kw):
    from tuneloop.api.server import OpenAIServer
    from tuneloop.serving.admission import AdmissionController
    from tuneloop.serving.setup import ServedModel

    admission = AdmissionController(kw.pop("max_concurrency", 64), kw.pop("timeout", 30.0), retry_after_s=2)
    server = OpenAIServer(
        loaded=loaded,
        backend=backend,
        admission=admission,
        served=ServedModel("tiny", "3", aliases=["tiny@champion"]),
        **kw,
    )
    server.ready = True
    return server


def sdk(app):
    import httpx
    import openai

    transport = httpx.ASGITransport(app=app)
    return openai.AsyncOpenAI(
        base_url="http://test/v1",
        api_key="unused",
        max_retries=0,
        http_client=httpx.AsyncClient(transport=transport, base_url="http://test"),
    )


def raw(app):
    import httpx

    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def run_slots(
    loaded,
    specs,
    num_slots=8,
    compile=False,
    stagger_s=0.0,
    sizes=None,
    engine_out=None,
    decode_attention="kernel",
    forward="transformers",
    burst=0,
    **engine_kw,
):
    """Run (prompt_ids, SamplingParams) specs through a SlotEngine; [(ids, finish_reason)].

    forward: transformers' (what test_serving_slots.py tests: padded prefill, the decoding
    kernel, sdpa, torch.compile) unless asked otherwise (test_fused_forward.py asks for the
    fused one).

    stagger_s > 0: requests arrive at random times within it (seeded), so newcomers join
    a running batch and are prefilled between other rows' decoding steps. burst: the first
    that many arrive together, so the batch fills however fast the machine finishes requests
    (staggered alone, a fast one can answer each before the next arrives).
    """
    from tuneloop.serving.engine import GenerationStream
    from tuneloop.serving.slots import SlotEngine

    async def main():
        engine = SlotEngine(
            loaded,
            num_slots=num_slots,
            compile=compile,
            on_batch=sizes.append if sizes is not None else None,
            decode_attention=decode_attention,
            forward=forward,
            **engine_kw,
        )
        engine.launch()
        await asyncio.to_thread(engine.ready.wait, 600)
        rng = random.Random(0)

        async def one(i, ids, params):
            delay = rng.random() * stagger_s
            await asyncio.sleep(0 if i < burst else delay)
            stream = GenerationStream(f"s{i}", ids, params)
            engine.submit(stream)
            return await collect(stream)

        try:
            return await asyncio.gather(*(one(i, ids, p) for i, (ids, p) in enumerate(specs)))
        finally:
            if engine_out is not None:
                engine_out.append(engine)
            engine.stop()

    return asyncio.run(main())


def many_specs(loaded, n=24, seed=1):
    """n prompts of 1..40 tokens, max_tokens 1..60: more requests than slots, uneven lengths."""
    from tuneloop.serving.engine import SamplingParams

    rng = random.Random(seed)
    tok = loaded.tokenizer
    specs = []
    for _ in range(n):
        text = " ".join(rng.choice(PROMPTS) for _ in range(rng.randint(1, 3)))
        ids = tok(text)["input_ids"][: rng.randint(1, 40)]
        specs.append((ids, SamplingParams(max_new_tokens=rng.randint(1, 60), temperature=0.0)))
    return specs


def assert_greedy_matches(loaded, specs, results):
    for (ids, params), (got, finish) in zip(specs, results):
        want = reference(loaded, ids, params.max_new_tokens)
        assert got == want, f"prompt of {len(ids)} tokens, max_tokens {params.max_new_tokens}"
        assert finish == ("length" if len(want) == params.max_new_tokens else "stop")


async def gather_outcomes(streams):
    out = []
    for s in streams:
        try:
            out.append(await asyncio.wait_for(collect(s), timeout=60))
        except asyncio.TimeoutError:
            out.append("hung")
        except Exception as exc:  # noqa: BLE001 - the outcome under test
            out.append(exc)
    return out


def run_engine(loaded, engine_name, specs, keep: list | None = None):
    """Run (prompt ids, SamplingParams) specs through one engine; [(ids, finish_reason) or the
    exception]. keep: a list that receives the streams."""
    from tuneloop.serving.adaptive_engine import BatchGenerator
    from tuneloop.serving.continuous_engine import ContinuousEngine
    from tuneloop.serving.engine import GenerationStream
    from tuneloop.serving.slots import SlotEngine

    async def main():
        streams = [GenerationStream(f"{engine_name}{i}", ids, p) for i, (ids, p) in enumerate(specs)]
        if keep is not None:
            keep.extend(streams)
        if engine_name == "adaptive":
            job = asyncio.get_running_loop().run_in_executor(None, BatchGenerator(loaded).run, streams)
            results = await gather_outcomes(streams)
            await job
            return results
        engine = (
            SlotEngine(loaded, num_slots=8)
            if engine_name == "slots"
            else ContinuousEngine(loaded, num_blocks=64, page_size=32, max_batch_tokens=256)
        )
        engine.launch()
        try:
            if engine_name == "slots":
                await asyncio.to_thread(engine.ready.wait, 120)
            for s in streams:
                engine.submit(s)
            return await gather_outcomes(streams)
        finally:
            engine.stop()

    return asyncio.run(main())
