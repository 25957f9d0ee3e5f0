"""Live responses of the in-process server checked against OpenAI's published schemas, as
vendored in tests/support/openai_schemas/ (tests/support/openai_schema.py): a chat completion
and every chunk of a streamed one with usage (also with logprobs and n=2), a completion,
float embeddings, the model list and cards, and error bodies. And that the check can fail,
with the path and the reason."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.support.openai_schema import names, validate
from tests.support.serving import make_server, raw

MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def embedder():
    from tuneloop.serving.embedder import Embedder

    return Embedder(max_inputs=8)


def run(loaded, test, embedder=None):
    """`test(http)` against the app over the slots engine (and the embedder, if given)."""
    from tuneloop.api.app import create_app
    from tuneloop.serving.slots import SlotEngine

    async def main():
        engine = SlotEngine(loaded, num_slots=4)
        engine.launch()
        await asyncio.to_thread(engine.ready.wait, 120)
        app = create_app()
        app.state.server = make_server(loaded, engine)
        app.state.embedder = embedder
        try:
            async with raw(app) as http:
                return await test(http)
        finally:
            engine.stop()

    return asyncio.run(main())


def sse(text: str) -> list[dict]:
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e.strip()]
    assert events[-1] == "[DONE]", events[-1]
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.parametrize("extra", [{}, {"logprobs": True, "top_logprobs": 2, "n": 2, "temperature": 0.5, "seed": 1}])
def test_chat_completion_whole_and_streamed(loaded, extra):
    async def test(http):
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 5, **extra}
        r = await http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        validate("CreateChatCompletionResponse", r.json())

        streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
        r = await http.post("/v1/chat/completions", json=streamed)
        assert r.status_code == 200, r.text
        chunks = sse(r.text)
        for chunk in chunks:
            validate("CreateChatCompletionStreamResponse", chunk)
        assert len(chunks) >= 3 and chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0

    run(loaded, test)


def test_completion(loaded):
    """The whole answer only: OpenAI publishes no schema of a /v1/completions stream chunk (its
    CreateCompletionResponse has a finish_reason and usage that may not be null)."""

    async def test(http):
        for extra in ({}, {"logprobs": 2, "n": 2}, {"echo": True}):
            r = await http.post("/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 5, **extra})
            assert r.status_code == 200, r.text
            validate("CreateCompletionResponse", r.json())

    run(loaded, test)


def test_embeddings_and_the_model_list(loaded, embedder):
    async def test(http):
        r = await http.post(
            "/v1/embeddings", json={"model": embedder.model_id, "input": ["a cat", "a dog"], "encoding_format": "float"}
        )
        assert r.status_code == 200, r.text
        validate("CreateEmbeddingResponse", r.json())

        r = await http.get("/v1/models")
        assert r.status_code == 200, r.text
        listed = r.json()
        validate("ListModelsResponse", listed)
        assert embedder.model_id in [m["id"] for m in listed["data"]]  # the embedding model's card too
        for card in ("tiny", embedder.model_id):
            validate("Model", (await http.get(f"/v1/models/{card}")).json())

    run(loaded, test, embedder)


def test_error_bodies(loaded):
    async def test(http):
        r = await http.post("/v1/chat/completions", json={"model": "no-such-model", "messages": MESSAGES})
        assert r.status_code == 404, r.text
        validate("ErrorResponse", r.json())
        r = await http.post("/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": "many"})
        assert r.status_code == 400, r.text
        validate("ErrorResponse", r.json())
        r = await http.get("/v1/models/no-such-model")
        assert r.status_code == 404, r.text
        validate("ErrorResponse", r.json())

    run(loaded, test)


def test_the_check_fails_and_says_where():
    ok = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hi", "refusal": None},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
    }
    validate("CreateChatCompletionResponse", ok)
    with pytest.raises(AssertionError, match=r"at \$: 'choices' is a required property"):
        validate("CreateChatCompletionResponse", {k: v for k, v in ok.items() if k != "choices"})
    wrong = json.loads(json.dumps(ok))
    wrong["choices"][0]["finish_reason"] = "done"
    with pytest.raises(AssertionError, match=r"at \$\.choices\[0\]\.finish_reason: 'done' is not one of"):
        validate("CreateChatCompletionResponse", wrong)
    # In a union the error is the one inside the member the event's `type` names.
    event = {"type": "response.output_text.delta", "item_id": "msg_1", "output_index": 0, "content_index": 0}
    with pytest.raises(AssertionError, match=r"at \$: 'delta' is a required property"):
        validate("ResponseStreamEvent", {**event, "logprobs": [], "sequence_number": 1})
    validate("ResponseStreamEvent", {**event, "delta": "Hi", "logprobs": [], "sequence_number": 1})
    with pytest.raises(KeyError, match="no vendored OpenAI schema"):
        validate("ChatCompletion", ok)


def test_the_schemas_the_new_routes_need_are_vendored():
    have = set(names())
    assert {
        "CreateChatCompletionResponse",
        "CreateChatCompletionStreamResponse",
        "ChatCompletionMessageToolCall",
        "ChatCompletionMessageToolCallChunk",
        "Response",
        "ResponseStreamEvent",
        "ResponseFunctionCallArgumentsDoneEvent",
        "ResponseErrorEvent",
    } <= have
