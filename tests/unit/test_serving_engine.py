"""Serving, in-process: both engines against `generate`, sampling, cancellation, text and
stop strings, and the OpenAI API's shapes and errors (FastAPI app over the continuous
engine, through httpx's ASGI transport and the official `openai` SDK).

The real `bentoml serve` tests are in test_serving_api.py.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.support.serving import (
    MAX_LATE_TOKENS,
    PROMPTS,
    collect,
    make_server,
    raw,
    read_then_cancel,
    reference,
    run_adaptive,
    sdk,
)


def run_continuous(loaded, specs, sizes=None):
    from tuneloop.serving.continuous_engine import ContinuousEngine
    from tuneloop.serving.engine import GenerationStream

    async def main():
        engine = ContinuousEngine(
            loaded,
            num_blocks=64,
            page_size=32,
            max_batch_tokens=256,
            on_batch=sizes.append if sizes is not None else None,
        )
        engine.launch()
        try:
            streams = [GenerationStream(f"c{i}", ids, p) for i, (ids, p) in enumerate(specs)]
            for s in streams:
                engine.submit(s)
            return await asyncio.gather(*(collect(s) for s in streams))
        finally:
            engine.stop()

    return asyncio.run(main())


def greedy_specs(loaded):
    from tuneloop.serving.engine import SamplingParams

    tok = loaded.tokenizer
    return [
        (tok(p)["input_ids"], SamplingParams(max_new_tokens=6 + 7 * i, temperature=0.0)) for i, p in enumerate(PROMPTS)
    ]


@pytest.mark.parametrize("engine", ["adaptive", "continuous"])
def test_greedy_batch_equals_single_request_generate(loaded, engine):
    specs = greedy_specs(loaded)
    sizes: list[int] = []
    results = (run_adaptive if engine == "adaptive" else run_continuous)(loaded, specs, sizes)
    for (ids, params), (got, finish) in zip(specs, results):
        want = reference(loaded, ids, params.max_new_tokens)
        assert got == want
        assert finish == ("length" if len(want) == params.max_new_tokens else "stop")
    # all five ran together (the continuous batch shrinks as requests finish)
    assert max(sizes) == len(specs)


def test_seeded_sampling_is_reproducible_and_engine_independent(loaded):
    from tuneloop.serving.engine import SamplingParams

    ids = loaded.tokenizer(PROMPTS[1])["input_ids"]
    seeded = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.9, seed=1234)
    other = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.9, seed=99)
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    a = run_adaptive(loaded, [(ids, seeded), (ids, seeded), (ids, other), (ids, greedy)])
    c = run_continuous(loaded, [(ids, seeded), (ids, greedy)])
    assert a[0] == a[1] == c[0]  # same seed, same tokens, whoever shares the batch
    assert a[2][0] != a[0][0]
    assert a[3] == c[1]
    assert a[3][0] == reference(loaded, ids, 12)


def test_sample_rows_respects_top_p():
    import torch

    from tuneloop.serving.engine import SamplingParams
    from tuneloop.serving.sampling import RowSampler, sample_rows

    # token 0 holds ~88% of the mass: top_p=0.5 must always pick it, greedy rows stay untouched
    logits = torch.tensor([[4.0, 2.0, 1.0, 0.0]] * 3)
    rows = [RowSampler(SamplingParams(1, temperature=1.0, top_p=0.5, seed=s)) for s in range(2)] + [None]
    for _ in range(20):
        out = logits.clone()
        assert sample_rows(out, rows) == {}
        assert out[:2].argmax(-1).tolist() == [0, 0]
        assert torch.equal(out[2], logits[2])
    free = [RowSampler(SamplingParams(1, temperature=1.0, top_p=1.0, seed=7))]
    picks = set()
    for _ in range(200):
        out = logits[:1].clone()
        sample_rows(out, free)
        picks.add(out.argmax(-1).item())
    assert len(picks) > 1


@pytest.mark.parametrize("engine", ["adaptive", "continuous"])
def test_cancelled_generation_stops(loaded, engine):
    from tuneloop.serving.adaptive_engine import BatchGenerator
    from tuneloop.serving.continuous_engine import ContinuousEngine
    from tuneloop.serving.engine import GenerationStream, SamplingParams

    ids = loaded.tokenizer(PROMPTS[0])["input_ids"]

    async def main():
        stream = GenerationStream("k", ids, SamplingParams(max_new_tokens=200, temperature=0.0))
        other = GenerationStream("o", ids, SamplingParams(max_new_tokens=30, temperature=0.0))
        if engine == "adaptive":
            job = asyncio.get_running_loop().run_in_executor(None, BatchGenerator(loaded).run, [stream, other])
        else:
            ce = ContinuousEngine(loaded, num_blocks=64, page_size=32, max_batch_tokens=256)
            ce.launch()
            ce.submit(stream)
            ce.submit(other)
        got, late = await read_then_cancel(stream)
        other_ids, _ = await collect(other)  # the batch goes on for the others
        if engine == "adaptive":
            await job
        else:
            handlers = dict(ce.manager.output_router.result_handlers)
            ce.stop()
            assert handlers == {}  # nothing left registered for the cancelled request
        return got, late, stream.finish_reason, len(other_ids)

    got, late, reason, other_len = asyncio.run(main())
    assert reason == "cancelled" and got < 200
    assert len(late) <= MAX_LATE_TOKENS  # the engine stopped generating it
    assert other_len == 30


def test_adaptive_splits_batches_that_would_overflow_the_context(loaded):
    from tuneloop.serving.engine import SamplingParams

    ctx = loaded.context_length
    long_prompt = (loaded.tokenizer(PROMPTS[2])["input_ids"] * 40)[: ctx - 4]
    short = loaded.tokenizer(PROMPTS[0])["input_ids"]
    sizes: list[int] = []
    results = run_adaptive(
        loaded,
        [(long_prompt, SamplingParams(4, temperature=0.0)), (short, SamplingParams(100, temperature=0.0))],
        sizes,
    )
    assert sorted(sizes) == [1, 1]
    assert results[0][0] == reference(loaded, long_prompt, 4)
    assert results[1][0] == reference(loaded, short, 100)


# ---------------------------------------------------------------------------------------
# text assembly


class _CharTokenizer:
    """One character per token id (id = code point); enough to test stop-string logic."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def _feed(stop, text):
    from tuneloop.serving.text import TextAssembler

    asm = TextAssembler(_CharTokenizer(), stop)
    deltas = []
    for ch in text:
        deltas.append(asm.add([ord(ch)]))
        if asm.stopped:
            break
    deltas.append(asm.flush())
    return deltas, asm


def test_stop_string_cuts_text_and_never_leaks_a_prefix():
    deltas, asm = _feed(["END"], "abcENxyzEND tail")
    assert "".join(deltas) == "abcENxyz"
    assert asm.stopped
    # "EN" was held back until it could no longer start "END"
    assert all("EN" not in d or d.startswith("ENx") for d in deltas)
    deltas, asm = _feed(["\n\n", "###"], "one\ntwo ##")
    assert "".join(deltas) == "one\ntwo ##" and not asm.stopped


def test_byte_level_text_is_not_split_inside_a_character(loaded):
    from tuneloop.serving.text import TextAssembler

    tok = loaded.tokenizer
    ids = tok("café ünïcode ✓", add_special_tokens=False)["input_ids"]
    asm = TextAssembler(tok, [])
    deltas = [asm.add([i]) for i in ids] + [asm.flush()]
    assert "".join(deltas) == "café ünïcode ✓"
    assert not any("\ufffd" in d for d in deltas)


# ---------------------------------------------------------------------------------------
# the OpenAI API in-process (continuous engine), through the official SDK


class _StuckBackend:
    """Fault simulation: an engine that accepts work and never produces a token."""

    engine = "stuck"

    def __init__(self):
        self.streams = []

    def submit(self, stream):
        self.streams.append(stream)


def run_with_engine(loaded, test, **kw):
    """Run `await test(app, server)` against an app over a live continuous engine."""
    from prometheus_client import CollectorRegistry

    from tuneloop.api.app import create_app
    from tuneloop.serving.continuous_engine import ContinuousEngine
    from tuneloop.serving.metrics import ServingMetrics

    async def main():
        engine = ContinuousEngine(loaded, num_blocks=64, page_size=32, max_batch_tokens=256)
        engine.launch()
        try:
            registry = CollectorRegistry()
            server = make_server(loaded, engine, metrics=ServingMetrics("tiny:3", "continuous", registry), **kw)
            app = create_app()
            app.state.server = server
            return await test(app, server, registry)
        finally:
            engine.stop()

    return asyncio.run(main())


def test_api_shapes_streaming_and_usage(loaded):
    async def test(app, server, registry):
        client = sdk(app)
        models = await client.models.list()
        assert [m.id for m in models.data] == ["tiny:3", "tiny@champion", "tiny"]
        assert {m.root for m in models.data} == {"tiny:3"}

        comp = await client.completions.create(model="tiny", prompt=["Hello world", "x"], max_tokens=5, temperature=0)
        assert [c.index for c in comp.choices] == [0, 1]
        assert comp.usage.completion_tokens <= 10 and comp.usage.prompt_tokens == 3
        assert comp.choices[0].finish_reason in ("stop", "length")

        chat = await client.chat.completions.create(
            model="tiny@champion", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
        )
        assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
        chat_prompt = len(
            loaded.tokenizer.apply_chat_template(
                [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=True
            )["input_ids"]
        )
        assert chat.usage.prompt_tokens == chat_prompt

        stream = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == chat.choices[0].message.content

        # stop strings: the text ends before the first one, finish_reason "stop", same when streamed
        full = (
            (await client.completions.create(model="tiny", prompt="Hello world", max_tokens=24, temperature=0))
            .choices[0]
            .text
        )
        stop = full[len(full) // 2 : len(full) // 2 + 2]
        cut = await client.completions.create(
            model="tiny", prompt="Hello world", max_tokens=24, temperature=0, stop=[stop, "never-there"]
        )
        assert cut.choices[0].text == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"
        streamed = await client.completions.create(
            model="tiny", prompt="Hello world", max_tokens=24, temperature=0, stop=stop, stream=True
        )
        pieces = [c.choices[0] async for c in streamed]
        assert "".join(p.text for p in pieces) == cut.choices[0].text and pieces[-1].finish_reason == "stop"

        async with raw(app) as http:
            r = await http.post(
                "/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 3, "stream": True}
            )
            assert r.headers["content-type"].startswith("text/event-stream")
            events = [line for line in r.text.split("\n\n") if line]
            assert events[-1] == "data: [DONE]"
            assert all(e.startswith("data: ") for e in events)

        ttft = registry.get_sample_value(
            "tuneloop_time_to_first_token_seconds_count", {"model": "tiny:3", "engine": "continuous"}
        )
        assert ttft == 8  # 2 prompts + chat + streamed chat + 3 with stop strings + streamed completion
        finished = {
            r: registry.get_sample_value("tuneloop_request_success_total", {"finish_reason": r}) or 0
            for r in ("stop", "length")
        }
        assert finished["stop"] >= 2 and finished["stop"] + finished["length"] == 8
        assert server.admission.in_flight == 0

    run_with_engine(loaded, test)


def test_encode_equals_the_tokenizer(loaded):
    """The server's tokenization (the Rust backend's encode) gives the tokenizer's own ids."""
    for text in [
        "Hello world",
        "",
        " leading and  double  spaces ",
        "<|im_start|>user\nHi<|im_end|>\n",
        "ünïcödé ✓ 汉字 🙂",
        "<|endoftext|>after a special token",
    ]:
        assert loaded.encode(text) == loaded.tokenizer(text, add_special_tokens=False)["input_ids"], text


def test_warm_up_marks_ready_and_freezes_the_heap(loaded):
    import gc

    from tuneloop.serving.setup import warm_up

    async def test(app, server, registry):
        server.ready = False
        gc.unfreeze()
        try:
            await warm_up(server, requests=3)
            assert server.ready
            # what warm-up left alive (model, compiled code, ...) is out of the collector's reach
            assert gc.get_freeze_count() > 10_000
        finally:
            gc.unfreeze()

    run_with_engine(loaded, test)


def test_stream_writes_events_that_are_ready_together_in_one_send(loaded):
    """Each body send passes every middleware (a span each) and a socket write: the role goes
    with the first content, and the last content, finish, usage and [DONE] go together."""

    async def test(app, server, registry):
        sends = []

        async def send(message):
            if message["type"] == "http.response.body" and message.get("body"):
                sends.append(message["body"].decode())

        body = json.dumps(
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 12,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        ).encode()
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            if messages:
                return messages.pop(0)
            await asyncio.Event().wait()  # the client stays connected

        scope = {
            "type": "http",
            "http_version": "1.1",
            "method": "POST",
            "path": "/v1/chat/completions",
            "raw_path": b"/v1/chat/completions",
            "query_string": b"",
            "root_path": "",
            "scheme": "http",
            "headers": [(b"content-type", b"application/json")],
            "client": ("t", 1),
            "server": ("t", 80),
        }
        await app(scope, receive, send)
        events = [[json.loads(e[6:]) if e != "data: [DONE]" else "[DONE]" for e in s.split("\n\n") if e] for s in sends]
        flat = [e for group in events for e in group]
        assert flat[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert flat[-1] == "[DONE]" and 1 <= flat[-2]["usage"]["completion_tokens"] <= 12
        assert flat[-3]["choices"][0]["finish_reason"] in ("stop", "length")
        # what was ready together went out together
        assert len(events[0]) >= 2  # the role and the first content (or the end)
        assert [e for e in events[-1] if e == "[DONE]" or not e["choices"] or e["choices"][0]["finish_reason"]] == flat[
            -3:
        ]
        assert len(sends) < len(flat)

    run_with_engine(loaded, test)


def test_api_errors_are_openai_shaped(loaded):
    import openai

    async def test(app, server, registry):
        client = sdk(app)
        with pytest.raises(openai.BadRequestError) as e:
            await client.completions.create(model="tiny", prompt="Hi", n=0)
        assert e.value.body["param"] == "n"
        with pytest.raises(openai.BadRequestError) as e:
            await client.completions.create(model="tiny", prompt="Hi", temperature=3)
        assert e.value.body["param"] == "temperature"
        with pytest.raises(openai.NotFoundError) as e:
            await client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "Hi"}])
        assert e.value.body["code"] == "model_not_found"
        with pytest.raises(openai.BadRequestError) as e:
            await client.completions.create(model="tiny", prompt="word " * 200, max_tokens=200)
        assert e.value.body["code"] == "context_length_exceeded"
        with pytest.raises(openai.BadRequestError) as e:
            await client.completions.create(model="tiny", prompt="Hi", max_tokens=10_000)
        assert e.value.body["code"] == "context_length_exceeded" and "max_tokens" in e.value.body["message"]
        with pytest.raises(openai.BadRequestError) as e:
            await client.completions.create(model="tiny", prompt="Hi", extra_body={"max_completion_tokens": 10_000})
        assert e.value.body["code"] == "context_length_exceeded" and "max_completion_tokens" in e.value.body["message"]

        async with raw(app) as http:
            cases = [
                ({"model": "tiny", "prompt": "Hi", "logprobs": 6}, "logprobs"),
                ({"prompt": "Hi"}, "model"),
                ({"model": "tiny", "prompt": 12}, "prompt"),
                ({"model": "tiny", "prompt": "Hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
            ]
            for body, param in cases:
                r = await http.post("/v1/completions", json=body)
                assert r.status_code == 400, body
                assert r.json()["error"]["param"] == param
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}
            r = await http.post(
                "/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}
            )
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].role"
            r = await http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
            r = await http.get("/v1/completions")
            assert r.status_code == 405 and "error" in r.json()
        rejected = registry.get_sample_value("tuneloop_requests_rejected_total", {"reason": "invalid_request"})
        assert rejected >= 9
        too_long = registry.get_sample_value("tuneloop_requests_rejected_total", {"reason": "context_length_exceeded"})
        assert too_long == 3

    run_with_engine(loaded, test)


def test_overload_is_429_with_retry_after_and_timeout_is_504(loaded):
    """Fault simulation: a stuck engine holds the only slot until the deadline."""
    import openai

    from tuneloop.api.app import create_app

    async def main():
        backend = _StuckBackend()
        server = make_server(loaded, backend, max_concurrency=1, timeout=1.0)
        app = create_app()
        app.state.server = server
        client = sdk(app)
        first = asyncio.ensure_future(client.completions.create(model="tiny", prompt="Hi", max_tokens=4))
        while server.admission.in_flight == 0:
            await asyncio.sleep(0.01)
        with pytest.raises(openai.RateLimitError) as e:
            await client.completions.create(model="tiny", prompt="Hi", max_tokens=4)
        assert e.value.response.headers["retry-after"] == "2"
        with pytest.raises(openai.InternalServerError) as e:
            await first
        assert e.value.status_code == 504 and e.value.body["code"] == "timeout"
        assert backend.streams[0].finish_reason == "cancelled"  # the timed-out generation was stopped
        assert server.admission.in_flight == 0  # and its slot freed

        # streamed: headers are out when the deadline passes, so the error arrives as an event
        async with raw(app) as http:
            r = await http.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "stream": True})
        events = [e for e in r.text.split("\n\n") if e]
        assert '"code":"timeout"' in events[-2].replace(" ", "") and events[-1] == "data: [DONE]"
        assert server.admission.in_flight == 0

    asyncio.run(main())


def test_not_ready_is_503(loaded):
    from tuneloop.api.app import create_app

    async def main():
        app = create_app()
        async with raw(app) as http:
            r = await http.get("/v1/models")
        assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"
        assert "retry-after" in r.headers

    asyncio.run(main())
