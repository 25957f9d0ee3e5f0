"""One request's failure is that request's alone, in-process, for all three engines.

- Parameters that once broke an engine step (temperature 1e-40 and top_p 1e-300 gave NaN
  probabilities; a seed of 2**70 overflowed torch's generator) are served or refused at the
  API, never passed on to fail a batch.
- A row whose sampling raises inside a shared step (fault injected: a broken generator)
  fails with its own error; every other request of that batch finishes exactly as alone.
- A slots engine whose thread dies fails every running and queued request at once and
  refuses new ones (503); its is_running (what /readyz reads) turns false.
- Malformed bodies (lone surrogates, strings for booleans and numbers) are 400s naming the
  parameter, in OpenAI's error shape.
- The slot attention kernel leaves the loading thread's floating-point mode alone.

The same properties through the real `bentoml serve` and schemathesis: test_serving_api.py.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.support.serving import (
    PROMPTS,
    gather_outcomes,
    make_server,
    raw,
    reference,
    run_engine,
)

FAULTY_SEED = 666  # the fault injection below gives this seed a generator that raises


class _BrokenGenerator:
    """Fault simulation: torch.multinomial rejects it, as it would any failure mid-sampling."""


@pytest.fixture
def faulty_seed(monkeypatch):
    from tuneloop.serving import sampling

    real = sampling.make_generator

    def make_generator(seed):
        return _BrokenGenerator() if seed == FAULTY_SEED else real(seed)

    monkeypatch.setattr(sampling, "make_generator", make_generator)


def test_extreme_sampling_values_sample_sanely():
    import torch

    from tuneloop.serving.engine import SamplingParams
    from tuneloop.serving.sampling import RowSampler, make_generator, sample_rows

    logits = torch.tensor([[0.5, 3.0, -1.0, 2.9]] * 4)
    rows = [
        RowSampler(SamplingParams(1, temperature=1e-40, seed=1)),  # greedy in effect
        RowSampler(SamplingParams(1, temperature=1e-4, seed=2)),  # divides to huge logits: no inf/NaN
        RowSampler(SamplingParams(1, temperature=1.0, top_p=1e-300, seed=2**63 - 1)),  # 0.0 in float32
        RowSampler(SamplingParams(1, temperature=2.0, top_p=1e-300, seed=-(2**63))),
    ]
    for _ in range(10):
        out = logits.clone()
        assert sample_rows(out, rows) == {}
        assert out.argmax(-1).tolist() == [1, 1, 1, 1]
    assert SamplingParams(1, temperature=1e-40).greedy and not SamplingParams(1, temperature=1e-4).greedy
    make_generator(2**70)  # engine-side the seed is reduced, never raised on


def test_a_row_whose_sampling_raises_fails_alone(faulty_seed):
    import torch

    from tuneloop.serving.engine import SamplingParams
    from tuneloop.serving.sampling import RowSampler, sample_rows

    logits = torch.tensor([[0.0, 5.0, 1.0]] * 3)
    rows = [
        RowSampler(SamplingParams(1, temperature=1.0, top_p=0.1, seed=1)),
        RowSampler(SamplingParams(1, temperature=1.0, seed=FAULTY_SEED)),
        None,
    ]
    out = logits.clone()
    failures = sample_rows(out, rows)
    assert list(failures) == [1] and isinstance(failures[1], Exception)
    assert out[0].argmax().item() == 1 and torch.equal(out[2], logits[2])


def _specs(loaded):
    from tuneloop.serving.engine import SamplingParams

    tok = loaded.tokenizer
    greedy = [(tok(p)["input_ids"], SamplingParams(max_new_tokens=12, temperature=0.0)) for p in PROMPTS[:3]]
    bad = (tok(PROMPTS[3])["input_ids"], SamplingParams(max_new_tokens=12, temperature=0.8, seed=FAULTY_SEED))
    return greedy[:2] + [bad] + greedy[2:]


@pytest.mark.parametrize("engine_name", ["adaptive", "continuous", "slots"])
def test_one_failing_row_fails_only_its_request(loaded, engine_name, faulty_seed):
    specs = _specs(loaded)
    results = run_engine(loaded, engine_name, specs)
    assert isinstance(results[2], Exception), results[2]  # the faulty request: an error, at once
    for (ids, params), got in zip(specs[:2] + specs[3:], results[:2] + results[3:]):
        assert not isinstance(got, Exception) and got != "hung", got
        want = reference(loaded, ids, params.max_new_tokens)
        assert got[0] == want  # the rest of the batch: exactly what each gives alone


def test_a_dead_slots_engine_fails_waiting_requests_and_refuses_new_ones(loaded, monkeypatch):
    from tuneloop.serving.engine import GenerationStream, SamplingParams
    from tuneloop.serving.errors import Unavailable
    from tuneloop.serving.slots import SlotEngine

    class Killed(BaseException):
        """Fault simulation: what no `except Exception` in the engine loop catches."""

    ids = loaded.tokenizer(PROMPTS[0])["input_ids"]

    async def main():
        engine = SlotEngine(loaded, num_slots=1)
        steps = {"n": 0}
        real_step = engine._step

        def step():
            steps["n"] += 1
            if steps["n"] > 3:
                raise Killed("engine thread killed")
            real_step()

        monkeypatch.setattr(engine, "_step", step)
        engine.launch()
        running = GenerationStream("r", ids, SamplingParams(max_new_tokens=200, temperature=0.0))
        queued = GenerationStream("q", ids, SamplingParams(max_new_tokens=5, temperature=0.0))
        engine.submit(running)
        engine.submit(queued)
        outcomes = await gather_outcomes([running, queued])
        await asyncio.to_thread(engine._thread.join, 10)
        with pytest.raises(Unavailable):
            engine.submit(GenerationStream("late", ids, SamplingParams(max_new_tokens=5)))
        return outcomes, engine.is_running

    outcomes, running = asyncio.run(main())
    assert not running
    assert all(isinstance(o, Unavailable) and "died" in str(o) for o in outcomes), outcomes


def test_api_refuses_malformed_values_and_serves_extreme_ones(loaded):
    from tuneloop.api.app import create_app
    from tuneloop.serving.slots import SlotEngine

    async def main():
        engine = SlotEngine(loaded, num_slots=8)
        engine.launch()
        await asyncio.to_thread(engine.ready.wait, 120)
        server = make_server(loaded, engine)
        app = create_app()
        app.state.server = server
        base = {"model": "tiny", "prompt": "Hello world", "max_tokens": 6}
        try:
            async with raw(app) as http:
                greedy = (await http.post("/v1/completions", json={**base, "temperature": 0})).json()
                for extreme in ({"temperature": 1e-40}, {"top_p": 1e-300, "temperature": 1e-30}):
                    r = await http.post("/v1/completions", json={**base, **extreme})
                    assert r.status_code == 200, (extreme, r.text)
                    assert r.json()["choices"][0]["text"] == greedy["choices"][0]["text"]
                r = await http.post("/v1/completions", json={**base, "top_p": 1e-300, "seed": 5})
                assert r.status_code == 200
                r = await http.post("/v1/completions", json={**base, "seed": -(2**63), "temperature": 1})
                assert r.status_code == 200
                refused = [
                    ({"seed": 2**70}, "seed"),
                    ({"seed": -(2**63) - 1}, "seed"),
                    ({"stream": "yes"}, "stream"),
                    ({"max_tokens": "6"}, "max_tokens"),
                    ({"temperature": "0"}, "temperature"),
                    ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
                    ({"n": 1.5}, "n"),
                ]
                for extra, param in refused:
                    r = await asyncio.wait_for(http.post("/v1/completions", json={**base, **extra}), 30)
                    assert r.status_code == 400, (extra, r.text)
                    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"
                for body, param in [
                    (b'{"model": "tiny", "prompt": "a\\ud800b"}', "prompt"),
                    (b'{"model": "\\udfff", "prompt": "x"}', "model"),
                    (b'{"model": "tiny", "prompt": "x", "stop": ["\\ud83d"]}', "stop"),
                ]:
                    r = await http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
                    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
                r = await http.post(
                    "/v1/chat/completions",
                    content=b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}',
                    headers={"content-type": "application/json"},
                )
                assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content", r.text
                # the server is unharmed: the same greedy answer as before
                again = (await http.post("/v1/completions", json={**base, "temperature": 0})).json()
                assert again["choices"][0]["text"] == greedy["choices"][0]["text"]
        finally:
            engine.stop()

    asyncio.run(main())


def test_loading_the_kernel_keeps_the_threads_floating_point_mode():
    """GCC < 13 links crtfastmath into an -ffast-math shared object; its constructor turns on
    flush-to-zero on the loading thread, and subnormal floats then become 0 for the process."""
    import ctypes

    import numpy as np

    from tuneloop.serving import slot_attention

    tiny = np.float32(1e-38)
    assert tiny / np.float32(10) != 0  # subnormals work before ...
    assert slot_attention.load_kernel() is not None
    ctypes.CDLL(None)  # (the kernel's library is loaded now)
    assert tiny / np.float32(10) != 0  # ... and after
    assert all("-ffast-math" not in flags for flags, _ in slot_attention.BUILDS)
    signature = slot_attention._cpu_signature()
    assert "flags" in signature or "Features" in signature  # the whole instruction set keys the cache
