"""One generation request, completions or chat, from its body to its response: written once.

    model name -> the hooks' lookup (a stored answer is replayed) -> the prompt's bound ->
    the hooks' prompt screening -> tokenisation -> parameters and context window -> the hooks'
    reservation -> admission and generation (Generations) -> the choices in the route's shape,
    JSON or SSE -> the hooks' store

What differs between the routes is a Shape (completions.py, chat.py): which texts make the
prompt, how it is tokenised, and how a choice, a chunk and the stream's first chunks look.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tuneloop.api.generation import Generations, generate_or_raise, sse, stream_response, usage
from tuneloop.api.prepare import Prepared, bound_prompt, check_model
from tuneloop.api.server import OpenAIServer
from tuneloop.hooks import Hooks
from tuneloop.requestlog.record import RequestRecord

CALL_KEY = "tuneloop_call"  # the request's RequestRecord in the ASGI scope's state
HOOKS_KEY = "tuneloop_hooks"  # its Hooks


def call_of(request: Request) -> RequestRecord:
    """This request's record (HooksMiddleware makes one for every /v1 request; a bare one
    for a route called without it)."""
    state = request.scope.setdefault("state", {})
    call = state.get(CALL_KEY)
    if call is None:
        call = state[CALL_KEY] = RequestRecord(route=request.url.path, method=request.method)
    return call


def hooks_of(request: Request) -> Hooks:
    return request.scope.get("state", {}).get(HOOKS_KEY) or Hooks([])


class Shape:
    """What a generation route does its own way; the rest is serve() below."""

    route = ""  # the cache's route name
    id_prefix = ""
    chunk_object = ""  # the SSE chunks' `object`
    json_object = ""  # the JSON answer's `object`

    def prompt_texts(self, server: OpenAIServer, body) -> tuple[list[str], list[str] | None, Any]:
        """(the prompt's texts for screening, their roles or None, how to put them back);
        texts None: leave the body as it is (tokenisation answers for it)."""
        raise NotImplementedError

    def with_texts(self, body, texts: list[str], how: Any):
        """The body with its screened texts (how: what prompt_texts returned)."""
        raise NotImplementedError

    def logged_prompt(self, server: OpenAIServer, body) -> Any:
        raise NotImplementedError

    async def prepare(self, server: OpenAIServer, body, hooks: Hooks, call: RequestRecord) -> Prepared:
        raise NotImplementedError

    def logprobs(self, server: OpenAIServer, body, gens: Generations, prepared: Prepared):
        raise NotImplementedError

    def choice(self, i: int, text: str, finish: str, entries, logprobs, prepared: Prepared) -> dict:
        raise NotImplementedError

    def delta(self, i: int, text: str, finish: str | None, entries, logprobs) -> dict:
        raise NotImplementedError

    def first_chunks(self, base: dict, gens: Generations, prepared: Prepared, logprobs) -> list[dict]:
        raise NotImplementedError

    def cached_choice(self, i: int, c: dict, delta: bool) -> dict:
        raise NotImplementedError

    def cached_first_chunks(self, base: dict, choices: int, extra: dict) -> list[dict]:
        return []

    def answer_text(self, choice: dict) -> str:
        raise NotImplementedError


async def serve(shape: Shape, server: OpenAIServer, body, request: Request):
    check_model(server, body.model)
    hooks, call = hooks_of(request), call_of(request)
    call.stream, call.model, call.model_version = bool(body.stream), server.served.name, server.served.version
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    base = _base(server, shape, call)
    # A stored answer first: a hit is an answer to this very request after the same screening
    # (the gateway's key carries its policy), so it skips PII analysis and the classifier.
    hit = await hooks.lookup(call, server.served.id, shape.route, body.model_dump(mode="json"))
    if hit is not None:
        _log_hit(shape, server, body, hit, call, hooks)
        return _replay(shape, hit, base, bool(body.stream), include_usage)
    bound_prompt(server, body)  # before anything reads the prompt: PII analysis, the filter, the tokenizer
    body = await _screen(shape, server, body, hooks, call)
    call.prompt, call.prompt_redacted = shape.logged_prompt(server, body), hooks.prompts_redacted()
    prepared = await shape.prepare(server, body, hooks, call)
    await hooks.reserve(call, prepared.prompt_tokens + sum(p.max_new_tokens for p in prepared.params))
    await _versioned(server, base, call)
    gens = Generations(server, prepared, base["id"], hooks, call)
    logprobs = shape.logprobs(server, body, gens, prepared)
    echo = prepared.echo

    def stored(i: int, text: str, finish: str | None) -> dict:
        return {"text": text, "finish_reason": finish, "content_filter_results": gens.filter_results(i)}

    if body.stream:

        def chunk(i, delta, finish, usage=None, entries=None):
            choices = [] if i is None else [shape.delta(i, delta or "", finish, entries, logprobs)]
            if finish is not None and gens.filter_results(i) is not None:
                choices[0]["content_filter_results"] = gens.filter_results(i)
            out = {**base, "choices": choices}
            if prepared.include_usage:
                out["usage"] = usage
            return out

        async def done():
            await _store(
                hooks,
                call,
                gens,
                [
                    stored(i, (echo[i] if echo else "") + gens.texts[i], gens.finish_reasons[i])
                    for i in range(len(gens.streams))
                ],
            )

        first = shape.first_chunks(base, gens, prepared, logprobs)
        return stream_response(gens, chunk, prepared.include_usage, first, on_done=done)

    results = await generate_or_raise(gens, request)
    if results is None:
        return Response(status_code=499)  # client closed the request (nginx's code); nobody reads it
    choices = []
    for i, (text, finish, entries) in enumerate(results):
        if finish == "content_filter":
            text, entries = "", []
        choice = shape.choice(i, text, finish, entries, logprobs, prepared)
        if gens.filter_results(i) is not None:
            choice["content_filter_results"] = gens.filter_results(i)
        choices.append(choice)
    await _store(
        hooks, call, gens, [stored(i, shape.answer_text(c), c["finish_reason"]) for i, c in enumerate(choices)]
    )
    return JSONResponse({**base, "object": shape.json_object, "choices": choices, "usage": usage(gens)})


def _base(server: OpenAIServer, shape: Shape, call: RequestRecord) -> dict:
    """The response's own fields. `model`: the version actually serving, as OpenAI answers a
    request for an alias with the snapshot's name (set again by _versioned once admitted)."""
    rid = f"{shape.id_prefix}-{uuid.uuid4().hex}"
    call.response_id = rid
    return {
        "id": rid,
        "object": shape.chunk_object,
        "created": int(time.time()),
        "model": server.served.id,
        "system_fingerprint": server.fingerprint,
    }


async def _screen(shape: Shape, server: OpenAIServer, body, hooks: Hooks, call: RequestRecord):
    """The hooks' prompt side (the gateway: PII redaction or a 400, the content filter) on every
    text of the prompt; returns the body the model sees (redacted)."""
    texts, roles, how = shape.prompt_texts(server, body)
    if texts is None:
        return body
    screened = await hooks.screen_prompts(call, texts, roles)
    return body if screened == texts else shape.with_texts(body, screened, how)


async def _versioned(server: OpenAIServer, base: dict, call: RequestRecord) -> None:
    """Wait out a model swap in progress, then name the version that will answer."""
    while server.swap_gate is not None:
        await server.swap_gate.wait()
    base["model"] = server.served.id
    call.model, call.model_version = server.served.name, server.served.version


async def _store(hooks: Hooks, call: RequestRecord, gens: Generations, choices: list[dict]) -> None:
    if gens.cacheable_result():
        await hooks.store(call, {"choices": choices, "usage": usage(gens)})


def _log_hit(shape: Shape, server: OpenAIServer, body, cached: dict, call: RequestRecord, hooks: Hooks) -> None:
    """A hit's record, from its entry: the prompt as the hook that stored it kept it (the
    gateway: as it redacted it, where it did; else the log's writer redacts it), and the
    answers as the client got them, already redacted where the policy redacts outputs."""
    if call.prompt is None:
        call.prompt, call.prompt_redacted = shape.logged_prompt(server, body), False
    call.completions = [c["text"] for c in cached["choices"]]
    call.finish_reasons = [c["finish_reason"] for c in cached["choices"]]
    call.prompt_tokens = cached["usage"]["prompt_tokens"]
    call.completion_tokens = cached["usage"]["completion_tokens"]
    call.completion_redacted = hooks.redacts_outputs()


def _replay(shape: Shape, cached: dict, base: dict, stream: bool, include_usage: bool):
    """A stored answer as a fresh response: JSON, or a proper SSE stream for a streaming client."""
    usage_ = {**cached["usage"], "prompt_tokens_details": {"cached_tokens": cached["usage"]["prompt_tokens"]}}

    def choice(i: int, c: dict, delta: bool) -> dict:
        out = shape.cached_choice(i, c, delta)
        if c.get("content_filter_results") is not None:
            out["content_filter_results"] = c["content_filter_results"]
        return out

    if not stream:
        return JSONResponse(
            {
                **base,
                "object": shape.json_object,
                "choices": [choice(i, c, False) for i, c in enumerate(cached["choices"])],
                "usage": usage_,
            }
        )
    extra = {"usage": None} if include_usage else {}
    chunks = shape.cached_first_chunks(base, len(cached["choices"]), extra)
    for i, c in enumerate(cached["choices"]):
        chunks.append({**base, "choices": [choice(i, c, True)], **extra})
    if include_usage:
        chunks.append({**base, "choices": [], "usage": usage_})
    text = "".join(sse(c) for c in chunks) + sse("[DONE]")
    return Response(text, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
