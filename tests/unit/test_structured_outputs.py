"""Structured outputs and tool calling by constrained decoding (serving/constraints.py,
api/structured.py, chat_format.py), in process through the official SDK.

The model is a random-weight tiny model (2,048-token context, for the tools' system prompt):
the worst writer there is, so what it writes under a grammar shows what the grammar alone
guarantees. Its schemas bound every value (enum, maxLength, minimum/maximum) so that an
answer can end; an unbounded one is cut by max_tokens and says "length", as OpenAI does.
"""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest

from tests.support.openai_schema import validate
from tests.support.serving import make_server, raw, sdk

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tests.support.serving_tiny_model import build_tiny_model
    from tuneloop.serving.engine import load_model

    return load_model(build_tiny_model(tmp_path_factory.mktemp("tiny2k"), context_length=2048), num_threads=1)


def engine_of(kind: str, loaded):
    if kind == "slots":
        from tuneloop.serving.slots import SlotEngine

        return SlotEngine(loaded, num_slots=8)
    if kind == "continuous":
        from tuneloop.serving.continuous_engine import ContinuousEngine

    from tuneloop.serving.continuous_engine import ContinuousEngine

    return ContinuousEngine(loaded, num_blocks=256, page_size=32, max_batch_tokens=2048)


def run(loaded, test, kind: str = "slots", cfg=None):
    """test(app) against the app over an engine; through the gateway if cfg (then test(app, gateway))."""
    from tuneloop.api.app import create_app
    from tuneloop.gateway.pipeline import Gateway

    async def main():
        engine = engine_of(kind, loaded)
        engine.launch()
        if hasattr(engine, "ready"):
            await asyncio.to_thread(engine.ready.wait, 600)
        app = create_app()
        app.state.server = make_server(loaded, engine)
        gateway = Gateway.from_config(cfg, load_classifier=False) if cfg is not None else None
        app.state.gateway = gateway
        try:
            return await (test(app) if gateway is None else test(app, gateway))
        finally:
            engine.stop()
            if gateway is not None:
                await gateway.close()

    return asyncio.run(main())


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


@pytest.mark.parametrize("kind", ["slots", "continuous"])
def test_every_answer_is_valid_json_of_the_schema_in_every_engine(model, kind):
    """Greedy and sampled rows of one batch, beside unconstrained rows: each constrained answer
    parses and validates; the unconstrained neighbours answer as they do alone."""

    async def test(app):
        client = sdk(app)
        alone = await client.chat.completions.create(model="tiny", messages=ASK, max_tokens=12, temperature=0)
        batch = [
            client.chat.completions.create(
                model="tiny", messages=ASK, max_tokens=120, response_format=schema_format(PERSON), n=3, seed=7
            ),
            client.chat.completions.create(
                model="tiny", messages=ASK, max_tokens=120, temperature=0, response_format=schema_format(PERSON)
            ),
            client.chat.completions.create(model="tiny", messages=ASK, max_tokens=12, temperature=0),
        ]
        sampled, greedy, free = await asyncio.gather(*batch)
        for choice in [*sampled.choices, *greedy.choices]:
            assert choice.finish_reason == "stop", choice
            jsonschema.validate(json.loads(choice.message.content), PERSON)
        assert free.choices[0].message.content == alone.choices[0].message.content
        validate("CreateChatCompletionResponse", greedy.model_dump(mode="json", exclude_unset=True))

    run(model, test, kind)


def test_the_adaptive_batch_constrains_its_rows_too(model):
    """BentoML's adaptive batch (one `generate` per batch) masks through its logits processor."""
    from tests.support.serving import run_adaptive
    from tuneloop.serving.constraints import json_schema
    from tuneloop.serving.engine import SamplingParams

    ids = model.encode("Hello world")
    specs = [
        (ids, SamplingParams(max_new_tokens=120, constraint=json_schema(PERSON), seed=1)),
        (ids, SamplingParams(max_new_tokens=120, temperature=0, constraint=json_schema(PERSON))),
        (ids, SamplingParams(max_new_tokens=120, temperature=0)),
    ]
    out = run_adaptive(model, specs)
    for tokens, finish in out[:2]:
        assert finish == "stop"
        jsonschema.validate(json.loads(model.tokenizer.decode(tokens)), PERSON)
    assert out[2][1] == "length"  # the free row goes on beside them


def test_json_object_choice_regex_and_grammar(model):
    async def test(app):
        client = sdk(app)
        obj = await client.chat.completions.create(
            model="tiny",
            messages=ASK,
            max_tokens=200,
            temperature=0,
            # vLLM's extension on top: any object, of keys from a short list (so it can end)
            response_format={"type": "json_object"},
            logit_bias={},
        )
        text = obj.choices[0].message.content
        if obj.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict), text
        else:  # cut: what there is is the start of an object
            assert obj.choices[0].finish_reason == "length" and text.startswith("{"), text
        picked = await client.chat.completions.create(
            model="tiny",
            messages=ASK,
            max_tokens=20,
            n=4,
            seed=1,
            extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
        )
        assert {c.message.content for c in picked.choices} <= {"yes", "no", "maybe"}
        phone = await client.completions.create(
            model="tiny", prompt="Call", max_tokens=20, n=3, seed=2, extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"}
        )
        for c in phone.choices:
            assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", c.text) and c.finish_reason == "stop", c
        lark = await client.chat.completions.create(
            model="tiny",
            messages=ASK,
            max_tokens=20,
            temperature=0,
            extra_body={"structured_outputs": {"grammar": 'start: "The answer is " ("red" | "blue") "."'}},
        )
        assert lark.choices[0].message.content in ("The answer is red.", "The answer is blue.")
        gbnf = await client.chat.completions.create(
            model="tiny",
            messages=ASK,
            max_tokens=20,
            temperature=0,
            extra_body={"guided_grammar": 'root ::= "A" | "B"'},
        )
        assert gbnf.choices[0].message.content in ("A", "B")

    run(model, test)


def test_a_cut_answer_says_length(model):
    async def test(app):
        client = sdk(app)
        cut = await client.chat.completions.create(
            model="tiny", messages=ASK, max_tokens=3, temperature=0, response_format=schema_format(PERSON)
        )
        assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 3
        assert cut.choices[0].message.content.startswith("{")

    run(model, test)


def test_schemas_and_grammars_it_cannot_honour_are_named_and_harm_nothing(model):
    async def test(app):
        http = raw(app)

        async def refused(extra: dict, param: str, words: str):
            body = {"model": "tiny", "messages": ASK, "max_tokens": 4, **extra}
            r = await http.post("/v1/chat/completions", json=body)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == param and words in err["message"], err

        await refused({"response_format": schema_format({"not": {"type": "string"}})}, "response_format", '"not"')
        await refused(
            {"response_format": schema_format({"type": "string", "format": "no-such"})}, "response_format", "no-such"
        )
        await refused(
            {"response_format": schema_format({"type": "string", "pattern": "(?<=a)b"})}, "response_format", "look"
        )
        await refused({"structured_outputs": {"regex": r"[^\s\S]"}}, "structured_outputs", "no answer can start")
        await refused({"structured_outputs": {"grammar": "start: nope"}}, "structured_outputs", "nope")
        await refused(
            {"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "one way of constraining"
        )
        await refused({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos", "ignore_eos")
        await refused({"structured_outputs": {"choice": []}}, "structured_outputs", "non-empty list")
        huge = {"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(20_000)}}
        await refused({"response_format": schema_format(huge)}, "response_format", "characters")
        ok = await sdk(app).chat.completions.create(model="tiny", messages=ASK, max_tokens=4)
        assert ok.choices[0].finish_reason == "length"

    run(model, test)


def _args_valid(call, tool) -> dict:
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


def test_required_and_named_tool_calls_have_valid_arguments(model):
    async def test(app):
        client = sdk(app)
        tools = [WEATHER, CLOCK]
        by_name = {t["function"]["name"]: t for t in tools}
        forced = await client.chat.completions.create(
            model="tiny", messages=ASK, max_tokens=300, tools=tools, tool_choice="required", n=3, seed=3
        )
        for choice in forced.choices:
            assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
            for call in choice.message.tool_calls:
                _args_valid(call, by_name[call.function.name])
                assert call.id.startswith("call_") and call.type == "function"
        validate("CreateChatCompletionResponse", forced.model_dump(mode="json", exclude_unset=True))
        named = await client.chat.completions.create(
            model="tiny",
            messages=ASK,
            max_tokens=300,
            temperature=0,
            tools=tools,
            tool_choice={"type": "function", "function": {"name": "get_time"}},
        )
        (call,) = named.choices[0].message.tool_calls
        assert call.function.name == "get_time" and _args_valid(call, CLOCK)["zone"] in ("UTC", "CET")
        single = await client.chat.completions.create(
            model="tiny",
            messages=ASK,
            max_tokens=300,
            tools=tools,
            tool_choice="required",
            parallel_tool_calls=False,
            n=3,
            seed=5,
        )
        assert all(len(c.message.tool_calls) == 1 for c in single.choices)
        none = await client.chat.completions.create(
            model="tiny", messages=ASK, max_tokens=8, temperature=0, tools=tools, tool_choice="none"
        )
        assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason == "length"

    run(model, test)


def test_streamed_tool_calls_come_whole_with_id_and_name_first(model):
    async def test(app):
        client = sdk(app)
        stream = await client.chat.completions.create(
            model="tiny",
            messages=ASK,
            max_tokens=300,
            tools=[WEATHER, CLOCK],
            tool_choice="required",
            parallel_tool_calls=False,
            seed=11,
            stream=True,
        )
        calls: dict[int, dict] = {}
        finish = None
        async for chunk in stream:
            validate("CreateChatCompletionStreamResponse", chunk.model_dump(mode="json", exclude_unset=True))
            for choice in chunk.choices:
                for piece in choice.delta.tool_calls or []:
                    if piece.index not in calls:  # its first delta names it
                        assert piece.id and piece.function.name and piece.type == "function", piece
                        calls[piece.index] = {"name": piece.function.name, "arguments": ""}
                    calls[piece.index]["arguments"] += piece.function.arguments or ""
                finish = choice.finish_reason or finish
        assert len(calls) == 1 and finish == "tool_calls"
        for call in calls.values():
            tool = WEATHER if call["name"] == "get_weather" else CLOCK
            jsonschema.validate(json.loads(call["arguments"]), tool["function"]["parameters"])

    run(model, test)


def test_a_call_cut_by_max_tokens_never_goes_out_half(model):
    """A tool whose arguments are huge (a 50,000-character string) cannot finish in 40 tokens:
    the answer ends "length" with no call at all, streamed or not; the next request is served."""
    huge = {
        "type": "function",
        "function": {
            "name": "store",
            "parameters": {
                "type": "object",
                "properties": {"blob": {"type": "string", "minLength": 50_000}},
                "required": ["blob"],
            },
        },
    }

    async def test(app):
        client = sdk(app)
        whole = await client.chat.completions.create(
            model="tiny", messages=ASK, max_tokens=40, temperature=0, tools=[huge], tool_choice="required"
        )
        assert whole.choices[0].finish_reason == "length" and not whole.choices[0].message.tool_calls
        assert "<tool_call>" not in (whole.choices[0].message.content or "")
        stream = await client.chat.completions.create(
            model="tiny", messages=ASK, max_tokens=40, temperature=0, tools=[huge], tool_choice="required", stream=True
        )
        finishes, pieces = [], []
        async for chunk in stream:
            for choice in chunk.choices:
                pieces += choice.delta.tool_calls or []
                finishes.append(choice.finish_reason)
                assert "<tool_call>" not in (choice.delta.content or "")
        assert not pieces and finishes[-1] == "length"
        after = await client.chat.completions.create(
            model="tiny", messages=ASK, max_tokens=300, temperature=0, tools=[WEATHER], tool_choice="required"
        )
        assert after.choices[0].finish_reason == "tool_calls"

    run(model, test)


def test_a_conversation_with_calls_and_results(model):
    from tuneloop.chat_format import render_chat

    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"},
    ]

    async def test(app):
        client = sdk(app)
        http = raw(app)
        answer = await client.chat.completions.create(model="tiny", messages=history, max_tokens=6, tools=[WEATHER])
        assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
        # what the model read: the call and its result in the fallback format (tokenize shows it)
        r = await http.post("/tokenize", json={"messages": history})
        assert r.status_code == 200, r.text
        prompt = model.tokenizer.decode(r.json()["tokens"])
        assert (
            prompt == render_chat(model.tokenizer, history)
            and "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt
        )
        for bad, words in [
            ([*ASK, {"role": "tool", "tool_call_id": "nope", "content": "x"}], "answers no tool call"),
            (
                [
                    history[0],
                    {
                        **history[1],
                        "tool_calls": [
                            {**history[1]["tool_calls"][0], "function": {"name": "f", "arguments": "{oops"}}
                        ],
                    },
                ],
                "arguments",
            ),
            ([*ASK, {"role": "tool", "content": "x"}], "tool_call_id"),
        ]:
            r = await http.post("/v1/chat/completions", json={"model": "tiny", "messages": bad, "max_tokens": 2})
            assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
        for tools, words in [
            ([{"type": "function", "function": {"name": "bad name!"}}], "name"),
            ([WEATHER, WEATHER], "more than once"),
        ]:
            r = await http.post("/v1/chat/completions", json={"model": "tiny", "messages": ASK, "tools": tools})
            assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
        r = await http.post(
            "/v1/chat/completions",
            json={
                "model": "tiny",
                "messages": ASK,
                "tools": [WEATHER],
                "tool_choice": {"type": "function", "function": {"name": "nope"}},
            },
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"

    run(model, test)


def test_auto_with_a_json_format_is_a_call_or_the_json(model):
    async def test(app):
        client = sdk(app)
        out = await client.chat.completions.create(
            model="tiny",
            messages=ASK,
            max_tokens=300,
            n=4,
            seed=9,
            tools=[CLOCK],
            response_format=schema_format(PERSON),
        )
        for choice in out.choices:
            if choice.message.tool_calls:
                assert choice.finish_reason == "tool_calls"
                _args_valid(choice.message.tool_calls[0], CLOCK)
            else:
                assert choice.finish_reason == "stop", choice
                jsonschema.validate(json.loads(choice.message.content), PERSON)

    run(model, test)


def test_through_the_gateway_calls_are_counted_logged_and_replayed_from_the_cache(model, tmp_path):
    """A forced call behind a key: its tokens counted against the key (the tools' prompt too),
    the answer stored by the cache and replayed with the same calls, whole and streamed."""
    from tests.support.gateway import bearer, gateway_config

    cfg = gateway_config(tmp_path)
    body = {
        "model": "tiny",
        "messages": ASK,
        "max_tokens": 300,
        "temperature": 0,
        "tools": [WEATHER],
        "tool_choice": "required",
    }

    async def test(app, gateway):
        _, key = gateway.keys.create("erin", "paid")
        http = raw(app)
        assert (await http.post("/v1/chat/completions", json=body)).status_code == 401
        first = await http.post("/v1/chat/completions", headers=bearer(key), json=body)
        assert first.status_code == 200 and first.headers["x-cache"] == "miss", first.text
        calls = first.json()["choices"][0]["message"]["tool_calls"]
        assert first.json()["choices"][0]["finish_reason"] == "tool_calls" and calls
        assert first.json()["usage"]["prompt_tokens"] > 150  # the tools' system prompt is counted
        again = await http.post("/v1/chat/completions", headers=bearer(key), json=body)
        assert again.headers["x-cache"] == "hit"
        replayed = again.json()["choices"][0]["message"]["tool_calls"]
        assert [(c["function"], c["type"]) for c in replayed] == [(c["function"], c["type"]) for c in calls]
        assert {c["id"] for c in replayed}.isdisjoint(c["id"] for c in calls)  # a new response, new call ids
        assert again.json()["choices"][0]["finish_reason"] == "tool_calls"
        validate("CreateChatCompletionResponse", again.json())
        streamed = await http.post("/v1/chat/completions", headers=bearer(key), json={**body, "stream": True})
        assert streamed.headers["x-cache"] == "hit"
        chunks = [json.loads(e[6:]) for e in streamed.text.split("\n\n") if e.startswith("data: {")]
        pieces = [t for c in chunks for ch in c["choices"] for t in ch["delta"].get("tool_calls") or []]
        assert [(p["function"]["name"], json.loads(p["function"]["arguments"])) for p in pieces] == [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls
        ]
        assert all(p["id"].startswith("call_") and p["type"] == "function" for p in pieces)
        assert chunks[-1]["choices"][-1]["finish_reason"] == "tool_calls"

    run(model, test, cfg=cfg)
