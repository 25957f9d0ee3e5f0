"""POST /tokenize and /detokenize, as vLLM serves them (also under /v1/): the served model's
token ids of a prompt or of chat messages rendered through its chat template, with the count
and the context window a client budgets with; and token ids back to text. Behind the API key
and the request limit, and logged."""

from __future__ import annotations

import asyncio

from fastapi import Request

from tuneloop.api.handlers import call_of
from tuneloop.api.models import resolve_model
from tuneloop.api.prepare import tokenize_chat
from tuneloop.api.protocol import DetokenizeRequest, TokenizeRequest
from tuneloop.api.server import OpenAIServer
from tuneloop.serving.errors import InvalidRequest


def _chat_ids(server: OpenAIServer, body: TokenizeRequest) -> list[int]:
    return tokenize_chat(server, body)[0]


def _prompt_ids(server: OpenAIServer, body: TokenizeRequest) -> list[int]:
    tok = server.loaded.tokenizer
    return list(tok(body.prompt or "", add_special_tokens=body.add_special_tokens)["input_ids"])


async def create_tokenize(server: OpenAIServer, body: TokenizeRequest, request: Request) -> dict:
    call = call_of(request)
    if body.model is not None:  # a fine-tune reads text with its base's tokenizer
        await resolve_model(server, body.model, request, call.tenant)
    call.model, call.model_version = server.served.name, server.served.version
    bound = server.context_length * server.loaded.max_token_chars
    size = len(body.prompt or "") + sum(len(str(m.content)) for m in body.messages or [])
    if size > bound:  # a text no window can hold: refused before the tokenizer reads megabytes of it
        raise InvalidRequest(
            f"the text holds {size} characters, more than any prompt of this model can", param="prompt"
        )
    ids = await asyncio.to_thread(_chat_ids if body.messages is not None else _prompt_ids, server, body)
    call.prompt_tokens = len(ids)
    return {"count": len(ids), "max_model_len": server.context_length, "tokens": ids}


async def create_detokenize(server: OpenAIServer, body: DetokenizeRequest, request: Request) -> dict:
    if body.model is not None:
        await resolve_model(server, body.model, request, call_of(request).tenant)
    vocab = server.loaded.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise InvalidRequest(
            f"tokens: token id {bad[0]} is outside this model's vocabulary (0..{vocab - 1})", param="tokens"
        )
    if len(body.tokens) > server.context_length:
        raise InvalidRequest(
            f"tokens: {len(body.tokens)} ids, more than this model's context of {server.context_length}",
            param="tokens",
        )
    call = call_of(request)
    call.model, call.model_version = server.served.name, server.served.version
    text = await asyncio.to_thread(server.loaded.tokenizer.decode, body.tokens)
    return {"prompt": text}
