"""POST /v1/moderations: OpenAI's moderation endpoint over the hooks' content filter (the
gateway's rules and its trained prompt-injection classifier)."""

from __future__ import annotations

import uuid

from fastapi import Request

from tuneloop.api.handlers import call_of, hooks_of
from tuneloop.api.protocol import ModerationRequest
from tuneloop.serving.errors import InvalidRequest, RouteNotFound, Unavailable


async def create_moderation(body: ModerationRequest, request: Request) -> dict:
    texts = [body.input] if isinstance(body.input, str) else list(body.input)
    if not texts:
        raise InvalidRequest("input: an empty list has nothing to classify", param="input")
    call = call_of(request)
    call.prompt = texts
    moderated = await hooks_of(request).moderate(call, texts)
    if moderated is None:
        server = request.app.state.server
        if server is None or not server.ready:
            raise Unavailable("the server is loading or warming up; retry shortly", retry_after_s=2)
        raise RouteNotFound("moderation is off on this server (gateway.filter.prompts and outputs are off)")
    model_id, verdicts = moderated
    results = [
        {
            "flagged": v.flagged,
            "categories": v.categories,
            "category_scores": v.scores,
            "category_applied_input_types": {c: ["text"] for c in v.categories},
        }
        for v in verdicts
    ]
    return {"id": f"modr-{uuid.uuid4().hex}", "model": model_id, "results": results}
