"""The slots engine in a process of its own (serving.engine_process,
tuneloop/serving/engine_process.py): the same tokens as generate() for many requests that
join, queue and leave; cancellation frees the child's slot; a child that dies fails its
running requests with 503 at once and turns the server not ready; stopping ends running and
queued streams; a model the child cannot load is reported, not hung on. Through the real
`bentoml serve`, with a weight swap into the child: test_hotswap.py."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from tests.support.serving import PROMPTS, collect, endings, many_specs, read_then_cancel, reference
from tests.support.serving_tiny_model import build_tiny_model


def serving(**kw):
    from tuneloop.config import ServingConfig

    return ServingConfig.model_validate(
        {"engine_process": True, "compile": False, "num_threads": 1, "dtype": "float32", **kw}
    )


def run(folder, test, **settings):
    """await test(engine) against an EngineProcess over folder's model; stopped after."""
    from tuneloop.serving.engine import load_tokenizer
    from tuneloop.serving.engine_process import EngineProcess

    sizes: list[int] = []

    async def main():
        engine = EngineProcess(load_tokenizer(folder), serving(**settings), on_batch=sizes.append)
        engine.launch()
        try:
            await asyncio.to_thread(engine.ready.wait, 300)
            return await test(engine), engine, sizes
        finally:
            await asyncio.to_thread(engine.stop)

    return asyncio.run(main())


def stream(rid, ids, max_tokens):
    from tuneloop.serving.engine import GenerationStream, SamplingParams

    return GenerationStream(rid, ids, SamplingParams(max_new_tokens=max_tokens, temperature=0.0))


def test_greedy_through_the_child_equals_generate_with_joins_leaves_and_a_queue(tiny_model_dir, loaded):
    specs = many_specs(loaded)

    async def test(engine):
        assert engine.is_running and engine.forward_name == "fused", engine.failed
        streams = []
        for i, (ids, params) in enumerate(specs):
            from tuneloop.serving.engine import GenerationStream

            streams.append(GenerationStream(f"s{i}", ids, params))
            engine.submit(streams[-1])
            await asyncio.sleep(0.002 * (i % 3))  # some join a running batch
        return await asyncio.gather(*(collect(s) for s in streams))

    results, engine, sizes = run(tiny_model_dir, test, max_batch_size=8)
    for (ids, params), (got, finish) in zip(specs, results):
        want = reference(loaded, ids, params.max_new_tokens)
        assert got == want, f"prompt of {len(ids)} tokens, max_tokens {params.max_new_tokens}"
        assert finish == ("length" if len(want) == params.max_new_tokens else "stop")
    assert sizes and max(sizes) <= 8  # the child's batch sizes reach the server's metrics
    assert engine.context_length == 256 and not engine.is_running  # stopped after the test


def test_a_cancelled_generation_frees_its_slot_in_the_child(tiny_model_dir, loaded):
    ids = loaded.tokenizer(PROMPTS[0])["input_ids"]

    async def test(engine):
        doomed, other, waiting = stream("k", ids, 200), stream("o", ids, 30), stream("w", ids, 5)
        for s in (doomed, other, waiting):  # two slots: `waiting` needs the cancelled one's
            engine.submit(s)
        got, _ = await read_then_cancel(doomed)  # the child's tokens reach the parent late: not counted
        return got, doomed.finish_reason, (await collect(other))[0], (await collect(waiting))[0]

    (got, reason, other_ids, waiting_ids), _, _ = run(tiny_model_dir, test, max_batch_size=2)
    assert reason == "cancelled" and got < 200
    assert other_ids == reference(loaded, ids, 30)
    assert waiting_ids == reference(loaded, ids, 5)


def test_a_child_that_dies_fails_its_requests_at_once_and_is_restarted(tiny_model_dir, loaded):
    """Killed mid-generation: its requests fail at once (503), the server is not ready and
    says when to retry, and a new child serves again with the same weights (greedy equal)."""
    import time

    from tuneloop.serving.errors import Unavailable

    ids = loaded.tokenizer(PROMPTS[0])["input_ids"]

    async def test(engine):
        running = [stream(f"r{i}", ids, 250) for i in range(3)]
        for s in running:
            engine.submit(s)
        async for _ in running[0].events():
            break  # generating
        first = engine.pid
        os.kill(first, signal.SIGKILL)
        outcomes = await endings(running, how=lambda exc: exc.status)
        with pytest.raises(Unavailable, match="restarting") as refused:
            engine.submit(stream("late", ids, 5))
        state = (engine.is_running, engine.failed, refused.value.headers.get("Retry-After"))
        t = time.perf_counter()
        while not engine.is_running and time.perf_counter() - t < 120:
            await asyncio.sleep(0.1)
        again = stream("again", ids, 12)
        engine.submit(again)
        return outcomes, state, (await collect(again))[0], engine.pid != first, engine.restarts, engine.gave_up

    (outcomes, (running, failed, retry_after), again, new_child, restarts, gave_up), _, _ = run(tiny_model_dir, test)
    assert outcomes == [503, 503, 503]
    assert not running and "exited" in failed and int(retry_after) >= 1
    assert new_child and restarts == 1 and not gave_up
    assert again == reference(loaded, ids, 12)


def test_crashes_faster_than_restarts_mend_them_give_up(tiny_model_dir, loaded, monkeypatch):
    """More than MAX_RESTARTS crashes within the window: gave_up (the server's /livez then fails)."""
    import time

    from tuneloop.serving import engine_process

    monkeypatch.setattr(engine_process, "MAX_RESTARTS", 1)
    monkeypatch.setattr(engine_process, "RESTART_MAX_DELAY_S", 0.2)

    async def test(engine):
        for _ in range(2):
            t = time.perf_counter()
            while not engine.is_running and time.perf_counter() - t < 120:
                await asyncio.sleep(0.1)
            os.kill(engine.pid, signal.SIGKILL)
            await asyncio.sleep(0.5)
        t = time.perf_counter()
        while not engine.gave_up and time.perf_counter() - t < 30:
            await asyncio.sleep(0.1)
        return engine.gave_up, engine.restarts

    (gave_up, restarts), _, _ = run(tiny_model_dir, test)
    assert gave_up and restarts == 1


def test_stopping_ends_running_and_queued_streams(tiny_model_dir, loaded):
    ids = loaded.tokenizer(PROMPTS[0])["input_ids"]

    async def test(engine):
        running, beside, queued = stream("r", ids, 250), stream("b", ids, 250), stream("q", ids, 5)
        for s in (running, beside, queued):  # two slots: `queued` waits
            engine.submit(s)
        async for _ in running.events():
            break
        await asyncio.to_thread(engine.stop)
        return await endings((running, beside, queued))

    outcomes, engine, _ = run(tiny_model_dir, test, max_batch_size=2)
    assert outcomes == ["the server is shutting down"] * 3
    assert engine.failed is None  # a stop is not a death


def test_a_model_the_child_cannot_load_is_reported_not_waited_on(tmp_path):
    from tuneloop.serving.engine_process import EngineProcess
    from tuneloop.serving.errors import Unavailable

    folder = build_tiny_model(tmp_path / "m")
    from tuneloop.serving.engine import load_tokenizer

    loaded = load_tokenizer(folder)
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")

    async def main():
        engine = EngineProcess(loaded, serving())
        engine.launch()
        assert await asyncio.to_thread(engine.ready.wait, 120)
        with pytest.raises(Unavailable):
            engine.submit(stream("x", [1, 2, 3], 4))
        await asyncio.to_thread(engine.stop)
        return engine

    engine = asyncio.run(main())
    assert not engine.is_running and "cannot load the model" in engine.failed


def test_errors_cross_the_process_boundary_as_the_server_can_read_them():
    import pickle

    from tuneloop.serving.engine_process import _portable
    from tuneloop.serving.errors import InvalidRequest

    err = pickle.loads(pickle.dumps(_portable(InvalidRequest("too long", param="messages"))))
    assert isinstance(err, InvalidRequest) and err.status == 400 and err.message == "too long"

    class Local(Exception):  # defined here: the server's side could not unpickle it
        pass

    other = pickle.loads(pickle.dumps(_portable(Local("boom"))))
    assert type(other) is RuntimeError and "Local: boom" in str(other)
