"""One generation request, completions or chat, from its body to its response: written once.

    model name -> the hooks' lookup (a stored answer is replayed) -> the prompt's bound ->
    the hooks' prompt screening -> tokenisation -> parameters and context window -> the hooks'
    reservation -> admission and generation (Generations) -> the choices in the route's shape,
    JSON or SSE -> the hooks' store

What differs between the routes is a Shape (completions.py, chat.py, responses.py): which
texts make the prompt, how it is tokenised, and how a choice, a chunk and the stream's first
chunks look; a route whose answer is not choices (responses.py) also renders the JSON body, its
own stream and a stored answer's replay.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tuneloop.api.generation import Generations, generate_or_raise, sse, stream_response, usage
from tuneloop.api.models import resolve_model
from tuneloop.api.prepare import Prepared, bound_prompt
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

    def delta(self, i: int, text: str, finish: str | None, entries, logprobs, prepared: Prepared | None = None):
        """One choice's delta dict, or a list of them (each its own chunk)."""
        raise NotImplementedError

    def stored(self, i: int, text: str, finish: str | None, prepared: Prepared) -> dict:
        """Choice i as the cache keeps it (text: what the model wrote)."""
        return {"text": text, "finish_reason": finish}

    def first_chunks(self, base: dict, gens: Generations, prepared: Prepared, logprobs) -> list[dict]:
        raise NotImplementedError

    def cached_choice(self, i: int, c: dict, delta: bool) -> dict:
        raise NotImplementedError

    def cached_first_chunks(self, base: dict, choices: int, extra: dict) -> list[dict]:
        return []

    def answer_text(self, choice: dict) -> str:
        raise NotImplementedError

    def new_id(self) -> str:
        """A new response id."""
        return f"{self.id_prefix}-{uuid.uuid4().hex}"

    def json_body(self, base: dict, choices: list[dict], usage: dict) -> dict:
        """The JSON answer (choices: what choice() or cached_choice() made; usage: chat's)."""
        return {**base, "object": self.json_object, "choices": choices, "usage": usage}

    def own_stream(self, base: dict, gens: Generations, prepared: Prepared, logprobs, on_done) -> Response | None:
        """A route whose stream is not serve()'s chunks of choices ending with `data: [DONE]`
        answers it here (on_done: await it once every choice has ended); None: serve()'s."""
        return None

    def replay_stream(self, base: dict, choices: list[dict], usage: dict) -> str | None:
        """A stored answer as this route's SSE text (choices: cached_choice(delta=False) of each);
        None: serve()'s chunks."""
        return None


async def serve(shape: Shape, server: OpenAIServer, body, request: Request):
    hooks, call = hooks_of(request), call_of(request)
    adapter = await resolve_model(server, body.model, request, call.tenant)  # None: the base
    call.stream, call.model_version = bool(body.stream), server.served.version
    call.model = server.served.name if adapter is None else adapter.name
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    base = _base(server, shape, call, adapter)
    # A stored answer first: a hit is an answer to this very request after the same screening
    # (the gateway's key carries its policy), so it skips PII analysis and the classifier.
    model_key = server.served.id if adapter is None else f"{server.served.id}+{adapter.name}"
    hit = await hooks.lookup(call, model_key, shape.route, body.model_dump(mode="json"))
    if hit is not None:
        _log_hit(shape, server, body, hit, call, hooks)
        return _replay(shape, hit, base, bool(body.stream), include_usage)
    bound_prompt(server, body)  # before anything reads the prompt: PII analysis, the filter, the tokenizer
    body = await _screen(shape, server, body, hooks, call)
    call.prompt, call.prompt_redacted = shape.logged_prompt(server, body), hooks.prompts_redacted()
    prepared = await shape.prepare(server, body, hooks, call)
    if adapter is not None:  # every choice runs with the fine-tune's adapter
        prepared.params = [replace(p, adapter=adapter) for p in prepared.params]
    await hooks.reserve(call, prepared.prompt_tokens + sum(p.max_new_tokens for p in prepared.params))
    await _versioned(server, base, call, adapter)
    gens = Generations(server, prepared, base["id"], hooks, call)
    logprobs = shape.logprobs(server, body, gens, prepared)

    def stored(i: int, text: str, finish: str | None) -> dict:
        return {**shape.stored(i, text, finish, prepared), "content_filter_results": gens.filter_results(i)}

    if body.stream:

        def chunk(i, delta, finish, usage=None, entries=None):
            choices: list[list[dict]]
            if i is None:
                choices = [[]]
            else:
                made = shape.delta(i, delta or "", finish, entries, logprobs, prepared)
                choices = [[c] for c in made] if isinstance(made, list) else [[made]]
                if finish is not None and gens.filter_results(i) is not None:
                    choices[-1][0]["content_filter_results"] = gens.filter_results(i)
            out = [{**base, "choices": c, **({"usage": usage} if prepared.include_usage else {})} for c in choices]
            return out if len(out) != 1 else out[0]

        async def done():
            await _store(
                hooks, call, gens, [stored(i, gens.texts[i], gens.finish_reasons[i]) for i in range(len(gens.streams))]
            )

        own = shape.own_stream(base, gens, prepared, logprobs, done)
        if own is not None:
            return own
        first = shape.first_chunks(base, gens, prepared, logprobs)
        return stream_response(gens, chunk, prepared.include_usage, first, on_done=done)

    results = await generate_or_raise(gens, request)
    if results is None:
        return Response(status_code=499)  # client closed the request (nginx's code); nobody reads it
    choices, kept = [], []
    for i, (text, finish, entries) in enumerate(results):
        if finish == "content_filter":
            text, entries = "", []
        choice = shape.choice(i, text, finish, entries, logprobs, prepared)
        if gens.filter_results(i) is not None:
            choice["content_filter_results"] = gens.filter_results(i)
        choices.append(choice)
        kept.append(stored(i, text, finish))
    await _store(hooks, call, gens, kept)
    return JSONResponse(shape.json_body(base, choices, usage(gens)))


def _base(server: OpenAIServer, shape: Shape, call: RequestRecord, adapter=None) -> dict:
    """The response's own fields. `model`: the version actually serving, as OpenAI answers a
    request for an alias with the snapshot's name (set again by _versioned once admitted)."""
    rid = shape.new_id()
    call.response_id = rid
    return {
        "id": rid,
        "object": shape.chunk_object,
        "created": int(time.time()),
        "model": server.served.id if adapter is None else adapter.name,
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


async def _versioned(server: OpenAIServer, base: dict, call: RequestRecord, adapter=None) -> None:
    """Wait out a model swap in progress, then name the version that will answer (a fine-tune
    keeps its own id: its adapter runs on the base it was trained on, or not at all)."""
    while server.swap_gate is not None:
        await server.swap_gate.wait()
    base["model"] = server.served.id if adapter is None else adapter.name
    call.model = server.served.name if adapter is None else adapter.name
    call.model_version = server.served.version


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
            shape.json_body(base, [choice(i, c, False) for i, c in enumerate(cached["choices"])], usage_)
        )
    own = shape.replay_stream(base, [choice(i, c, False) for i, c in enumerate(cached["choices"])], usage_)
    if own is not None:
        return Response(own, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    extra = {"usage": None} if include_usage else {}
    chunks = shape.cached_first_chunks(base, len(cached["choices"]), extra)
    for i, c in enumerate(cached["choices"]):
        chunks.append({**base, "choices": [choice(i, c, True)], **extra})
    if include_usage:
        chunks.append({**base, "choices": [], "usage": usage_})
    text = "".join(sse(c) for c in chunks) + sse("[DONE]")
    return Response(text, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
