"""OpenAI parameters beyond the basics, as vLLM's OpenAI server accepts them.

Engine level, the same for all three engines: logit_bias, presence/frequency penalties and
ignore_eos (vLLM's extension) give identical greedy text whoever runs them, and logprobs
equal the model's own log-softmax. API level, with
the official `openai` SDK over the slots engine in-process: n > 1 (with list prompts and
seeds), echo, token-id prompts, logprobs on both routes (also streamed), max_completion_tokens on both routes, no max_tokens = until
a stop token or the context window, usage details, the documented no-op parameters, and a
400 naming each parameter that is known to OpenAI but not implemented here.

The same requests through the real `bentoml serve`: test_serving_api.py.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.support.serving import make_server, raw, run_engine, sdk

ENGINES = ["adaptive", "continuous", "slots"]


def _greedy(loaded, prompt: str, **params):
    from tuneloop.serving.engine import SamplingParams

    return (loaded.tokenizer(prompt)["input_ids"], SamplingParams(temperature=0.0, **params))


def test_shaping_and_ignore_eos_are_the_same_on_every_engine(loaded):
    eos = loaded.tokenizer.eos_token_id
    specs = [
        _greedy(loaded, "Hello world", max_new_tokens=12),
        _greedy(loaded, "Hello world", max_new_tokens=12, presence_penalty=1.5, frequency_penalty=2.0),
        _greedy(loaded, "Hello world", max_new_tokens=12, logit_bias=((eos, 100.0),)),  # stops at once
        _greedy(loaded, "Hello world", max_new_tokens=12, logit_bias=((eos, 100.0),), ignore_eos=True),
        _greedy(loaded, "The quick brown fox", max_new_tokens=10, logit_bias=((42, 100.0),)),
    ]
    results = {engine: run_engine(loaded, engine, specs) for engine in ENGINES}
    for engine, got in results.items():
        assert not [g for g in got if isinstance(g, Exception)], (engine, got)
    plain, penalised, stopped, through, biased = results["slots"]
    assert results["adaptive"] == results["continuous"] == results["slots"]
    assert penalised[0] != plain[0]
    # frequency_penalty 2 on a 12-token greedy text: no token repeats more than twice
    assert max(penalised[0].count(t) for t in penalised[0]) <= 2 < max(plain[0].count(t) for t in plain[0])
    assert stopped == ([], "stop")
    assert through == ([eos] * 12, "length")  # the stop token is generated, and does not stop it
    assert biased == ([42] * 10, "length")


def run_api(loaded, test, **engine_kw):
    from tuneloop.api.app import create_app
    from tuneloop.serving.slots import SlotEngine

    async def main():
        engine = SlotEngine(loaded, **{"num_slots": 8, **engine_kw})
        engine.launch()
        await asyncio.to_thread(engine.ready.wait, 120)
        server = make_server(loaded, engine)
        app = create_app()
        app.state.server = server
        try:
            return await test(app, server)
        finally:
            engine.stop()

    return asyncio.run(main())


def test_n_echo_token_prompts_and_max_completion_tokens(loaded):
    async def test(app, server):
        client = sdk(app)
        r = await client.completions.create(
            model="tiny", prompt=["Hello world", "The quick"], n=3, max_tokens=6, temperature=1.0, seed=11
        )
        assert [c.index for c in r.choices] == list(range(6))
        tok = loaded.tokenizer
        prompt_tokens = len(tok("Hello world")["input_ids"]) + len(tok("The quick")["input_ids"])
        assert r.usage.prompt_tokens == prompt_tokens  # each prompt once, not once per choice
        assert r.usage.completion_tokens == 36
        again = await client.completions.create(
            model="tiny", prompt=["Hello world", "The quick"], n=3, max_tokens=6, temperature=1.0, seed=11
        )
        assert [c.text for c in again.choices] == [c.text for c in r.choices]  # seeded: reproducible
        assert len({c.text for c in r.choices[:3]}) > 1  # and the n choices of one prompt differ
        one = await client.completions.create(
            model="tiny", prompt="Hello world", max_tokens=6, temperature=1.0, seed=12
        )
        assert one.choices[0].text == r.choices[1].text  # choice j samples with seed + j

        echoed = await client.completions.create(
            model="tiny", prompt="Hello world", max_tokens=5, temperature=0, echo=True
        )
        # (the SDK's completions.create has no max_completion_tokens argument; vLLM and this server take it)
        plain = await client.completions.create(
            model="tiny", prompt="Hello world", temperature=0, extra_body={"max_completion_tokens": 5}
        )
        assert echoed.choices[0].text == "Hello world" + plain.choices[0].text
        assert plain.usage.completion_tokens <= 5
        stream = await client.completions.create(
            model="tiny", prompt="Hello world", max_tokens=5, temperature=0, echo=True, stream=True
        )
        assert "".join([c.choices[0].text async for c in stream if c.choices]) == echoed.choices[0].text

        ids = tok("Hello world")["input_ids"]
        by_ids = await client.completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0)
        assert by_ids.choices[0].text == plain.choices[0].text
        batch = await client.completions.create(model="tiny", prompt=[ids, ids[:1]], max_tokens=3, temperature=0)
        assert len(batch.choices) == 2 and batch.usage.prompt_tokens == len(ids) + 1

        chat = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], n=2, temperature=0, max_completion_tokens=4
        )
        assert [c.index for c in chat.choices] == [0, 1] and chat.choices[0].message == chat.choices[1].message
        streamed = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hi"}],
            n=2,
            temperature=0,
            max_completion_tokens=4,
            stream=True,
        )
        texts, finishes = {0: "", 1: ""}, {}
        async for c in streamed:
            for choice in c.choices:
                texts[choice.index] += choice.delta.content or ""
                if choice.finish_reason:
                    finishes[choice.index] = choice.finish_reason
        assert texts == {0: chat.choices[0].message.content, 1: chat.choices[1].message.content}
        assert set(finishes) == {0, 1}

    run_api(loaded, test)


def test_no_max_tokens_means_until_a_stop_token_or_the_window(loaded):
    async def test(app, server):
        client = sdk(app)
        eos = loaded.tokenizer.eos_token_id
        r = await client.completions.create(
            model="tiny", prompt="Hello world", temperature=0, extra_body={"ignore_eos": True}
        )
        assert r.choices[0].finish_reason == "length"
        assert r.usage.total_tokens == loaded.context_length  # it filled the window
        r = await client.completions.create(
            model="tiny", prompt="Hello world", temperature=0, logit_bias={str(eos): 100}
        )
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 0
        d = r.usage.model_dump()
        assert d["prompt_tokens_details"]["cached_tokens"] == 0
        assert d["completion_tokens_details"]["reasoning_tokens"] == 0

    run_api(loaded, test)


def test_no_op_parameters_are_accepted_and_unsupported_ones_named(loaded):
    import openai

    async def test(app, server):
        client = sdk(app)
        messages = [{"role": "user", "content": "Hi"}]
        base = await client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=6)
        same = await client.chat.completions.create(
            model="tiny",
            messages=messages,
            temperature=0,
            max_tokens=6,
            user="u1",
            metadata={"team": "a"},
            store=False,
            service_tier="auto",
            parallel_tool_calls=False,
            response_format={"type": "text"},
            tool_choice="none",
            extra_body={"modalities": ["text"]},
        )
        assert same.choices[0].message.content == base.choices[0].message.content
        refused = [
            ({"response_format": {"type": "xml"}}, "response_format"),
            (  # a schema keyword the grammar library cannot honour: named, not ignored
                {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
                "response_format",
            ),
            ({"tools": [{"type": "code_interpreter"}]}, "tools"),
            ({"tool_choice": "auto"}, "tool_choice"),  # without tools
            ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs=true
            ({"extra_body": {"audio": {"voice": "alloy", "format": "wav"}}}, "audio"),
            ({"extra_body": {"modalities": ["audio"]}}, "modalities[0]"),
            ({"logit_bias": {"999999": 1}}, "logit_bias"),
            ({"logit_bias": {"x": 1}}, "logit_bias"),
            ({"logit_bias": {"5": -101}}, "logit_bias"),
            ({"max_tokens": 4, "max_completion_tokens": 4}, "max_completion_tokens"),
            ({"presence_penalty": 2.5}, "presence_penalty"),
            ({"extra_body": {"functions": [{"name": "f"}]}}, "functions"),
        ]
        for extra, param in refused:
            with pytest.raises(openai.BadRequestError) as e:
                await client.chat.completions.create(model="tiny", messages=messages, **extra)
            assert e.value.body["param"] == param, (extra, e.value.body)
        for extra, param in [
            ({"logprobs": 2, "echo": True}, "echo"),
            ({"suffix": " end."}, "suffix"),
            ({"best_of": 3}, "best_of"),
            ({"prompt": [[1, 2], [999999]]}, "prompt"),
        ]:
            with pytest.raises(openai.BadRequestError) as e:
                await client.completions.create(**{"model": "tiny", "prompt": "Hi", **extra})
            assert e.value.body["param"] == param, (extra, e.value.body)
        ok = await client.completions.create(model="tiny", prompt="Hi", best_of=2, n=2, max_tokens=2)
        assert len(ok.choices) == 2

    run_api(loaded, test)


def test_logprobs_are_the_models_own_on_every_engine(loaded):
    import torch

    specs = [
        _greedy(loaded, "Hello world", max_new_tokens=5, logprobs=3),
        _greedy(loaded, "The quick brown fox", max_new_tokens=4, logprobs=0, logit_bias=((42, 5.0),)),
    ]
    streams_by_engine = {}
    for engine in ENGINES:
        captured = []
        run_engine(loaded, engine, specs, keep=captured)
        streams_by_engine[engine] = [s.token_logprobs for s in captured]
    ref = streams_by_engine["slots"]
    for engine, got in streams_by_engine.items():
        for a, b in zip(got, ref):
            assert len(a) == len(b) > 0, engine
            for (own_a, top_a), (own_b, top_b) in zip(a, b):
                assert abs(own_a - own_b) < 1e-4 and [t for t, _ in top_a] == [t for t, _ in top_b], engine
    # the first token's entry is the model's own distribution at the end of the prompt, before logit_bias
    for (ids, params), entries in zip(specs, ref):
        with torch.inference_mode():
            lp = torch.log_softmax(loaded.model(torch.tensor([ids])).logits[0, -1].float(), -1)
        own, top = entries[0]
        assert len(top) == params.logprobs
        if top:
            values, best = torch.topk(lp, params.logprobs)
            assert [t for t, _ in top] == best.tolist()
            assert abs(top[0][1] - float(values[0])) < 1e-4 and abs(own - float(values[0])) < 1e-4  # greedy
        else:
            assert abs(own - float(lp[42])) < 1e-4  # the biased pick, scored by the unbiased model


def test_logprobs_through_the_api(loaded):
    async def test(app, server):
        client = sdk(app)
        r = await client.completions.create(model="tiny", prompt="Hello world", max_tokens=6, temperature=0, logprobs=2)
        lp = r.choices[0].logprobs
        assert "".join(lp.tokens) == r.choices[0].text and len(lp.tokens) == r.usage.completion_tokens
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(len(lp.tokens))]
        assert all(len(top) <= 2 and lp.tokens[k] in top for k, top in enumerate(lp.top_logprobs))
        assert all(v <= 0 for v in lp.token_logprobs)

        messages = [{"role": "user", "content": "Hi"}]
        chat = await client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
        )
        content = chat.choices[0].logprobs.content
        assert "".join(c.token for c in content) == chat.choices[0].message.content
        assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob == c.logprob for c in content)
        assert all(bytes(c.bytes).decode() == c.token for c in content)
        streamed = await client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3, stream=True
        )
        pieces = [
            e
            for c in [c async for c in streamed]
            if c.choices and c.choices[0].logprobs
            for e in c.choices[0].logprobs.content
        ]
        # the streamed request reuses the first one's prompt from the prefix cache: the same tokens,
        # and log-probabilities equal to ~1e-5 (its last prompt token is prefilled on its own, as a
        # chunked prefill would); rounding both to 5 decimals could still split at a boundary
        assert [e.token for e in pieces] == [e.token for e in content]
        assert [e.logprob for e in pieces] == pytest.approx([e.logprob for e in content], abs=1e-4)
        plain = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0)
        assert plain.choices[0].logprobs is None

    run_api(loaded, test)


def test_requests_are_bounded_by_the_kv_cache_slot_not_the_model_window(loaded):
    import openai

    async def test(app, server):
        client = sdk(app)
        assert server.context_length == 64 < loaded.context_length
        with pytest.raises(openai.BadRequestError) as e:
            await client.completions.create(model="tiny", prompt="Hello world", max_tokens=63)
        assert e.value.body["code"] == "context_length_exceeded" and "is 64 tokens" in e.value.body["message"]
        r = await client.completions.create(
            model="tiny", prompt="Hello world", temperature=0, extra_body={"ignore_eos": True}
        )
        assert r.usage.total_tokens == 64 and r.choices[0].finish_reason == "length"  # no max_tokens: the slot

    run_api(loaded, test, kv_cache_tokens=512, max_model_len=64)


def test_responses_validate_against_openais_published_schemas(loaded):
    """Every response shape above, checked with jsonschema against OpenAI's published OpenAPI
    spec (vendored: tests/support/openai_schemas/): stricter than the SDK, whose models accept
    missing fields. The spec has no schema for a streamed completions chunk: those are checked
    as a whole completion whose finish_reason and usage may still be null."""
    import json

    from tests.support.openai_schema import validate

    def check(name: str, body: dict) -> None:
        if name == "CompletionStreamChunk":
            body = {
                **body,
                "choices": [{**c, "finish_reason": c["finish_reason"] or "length"} for c in body["choices"]],
            }
            if body.get("usage") is None:
                body.pop("usage", None)
            name = "CreateCompletionResponse"
        validate("ErrorResponse" if name == "Error" else name, body)

    def events(text: str) -> list[dict]:
        out = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
        assert out[-1] == "[DONE]"
        return [json.loads(e) for e in out[:-1]]

    async def test(app, server):
        checked = 0
        async with raw(app) as http:

            async def both(route: str, body: dict, whole: str, chunk: str) -> None:
                nonlocal checked
                check(whole, (await http.post(route, json=body)).json())
                r = await http.post(route, json={**body, "stream": True, "stream_options": {"include_usage": True}})
                for event in events(r.text):
                    check(chunk, event)
                    checked += 1

            for extra in ({}, {"logprobs": 3}, {"echo": True, "n": 2}, {"prompt": ["a", "b"], "stop": ["x"]}):
                await both(
                    "/v1/completions",
                    {"model": "tiny", "prompt": "Hello", "max_tokens": 5, **extra},
                    "CreateCompletionResponse",
                    "CompletionStreamChunk",
                )
            messages = [{"role": "user", "content": "Hi"}]
            for extra in ({}, {"logprobs": True, "top_logprobs": 2}, {"n": 2, "temperature": 0.5, "seed": 1}):
                await both(
                    "/v1/chat/completions",
                    {"model": "tiny", "messages": messages, "max_tokens": 5, **extra},
                    "CreateChatCompletionResponse",
                    "CreateChatCompletionStreamResponse",
                )
            for body in (
                {"model": "nope", "prompt": "x"},
                {"model": "tiny", "prompt": "x", "n": 0},
                {"model": "tiny", "prompt": "x", "tools": [{"type": "function"}]},
            ):
                r = await http.post("/v1/completions", json=body)
                assert r.status_code in (400, 404)
                check("Error", r.json())
        assert checked > 20

    run_api(loaded, test)
