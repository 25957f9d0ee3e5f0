"""POST /v1/embeddings: the shipped sentence encoder (tuneloop/serving/embedder.py) as an
OpenAI embedding model, through the same hooks as a generation (key, request and token
limits, PII and the content filter on the inputs, the request log)."""

from __future__ import annotations

import base64

from fastapi import Request

from tuneloop.api.handlers import call_of, hooks_of
from tuneloop.api.protocol import EmbeddingRequest
from tuneloop.serving.embedder import Embedder
from tuneloop.serving.errors import InvalidRequest, ModelNotFound, RouteNotFound


def embedder_of(request: Request) -> Embedder:
    embedder = getattr(request.app.state, "embedder", None)
    if embedder is None:
        raise RouteNotFound("embeddings are off on this server (serving.embeddings)")
    return embedder


async def create_embeddings(embedder: Embedder, body: EmbeddingRequest, request: Request) -> dict:
    if body.model != embedder.model_id:
        raise ModelNotFound(
            f"The model '{body.model}' does not exist or is no embedding model; this server embeds with "
            f"{embedder.model_id}",
            param="model",
        )
    raw = [body.input] if isinstance(body.input, str) else list(body.input)
    if any(not isinstance(t, str) for t in raw):
        raise InvalidRequest(
            f"input: token ids are not accepted: they would be another tokenizer's; send the text ({embedder.model_id} "
            "has its own tokenizer)",
            param="input",
        )
    texts: list[str] = [t for t in raw if isinstance(t, str)]
    if len(texts) > embedder.max_inputs:
        raise InvalidRequest(
            f"input: at most {embedder.max_inputs} inputs a request; this one has {len(texts)}", param="input"
        )
    hooks, call = hooks_of(request), call_of(request)
    call.model, call.model_version = embedder.model_id, None
    counts = await embedder.aprepare(texts)  # 400 for an input over the encoder's context, before any screening
    dim = embedder.dimension
    if body.dimensions is not None and body.dimensions != dim:
        raise InvalidRequest(
            f"dimensions={body.dimensions}: {embedder.model_id} gives {dim} dimensions and is not trained to be cut; "
            "leave dimensions out or give it as is",
            param="dimensions",
        )
    texts = await hooks.screen_prompts(call, texts, None)
    call.prompt, call.prompt_redacted = texts, hooks.prompts_redacted()
    tokens = sum(counts)
    await hooks.reserve(call, tokens)
    try:
        vectors = await embedder.aembed(texts)
    finally:
        hooks.release(tokens)
    call.prompt_tokens, call.completion_tokens = tokens, 0
    data = []
    for i, row in enumerate(vectors):
        if body.encoding_format == "base64":
            value: list[float] | str = base64.b64encode(row.astype("<f4").tobytes()).decode("ascii")
        else:
            value = row.tolist()
        data.append({"object": "embedding", "index": i, "embedding": value})
    return {
        "object": "list",
        "data": data,
        "model": embedder.model_id,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
