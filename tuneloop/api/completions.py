"""POST /v1/completions: the legacy text completion, in its own shape (Shape); the request's
path is handlers.serve, shared with chat."""

from __future__ import annotations

from fastapi import Request

from tuneloop.api.handlers import Shape, serve
from tuneloop.api.logprobs import CompletionLogprobs
from tuneloop.api.prepare import echo_texts, prepare, prompt_items, tokenize_completion, tokenized
from tuneloop.api.protocol import CompletionRequest
from tuneloop.api.server import OpenAIServer
from tuneloop.api.structured import checked_constraint, constraint_of


class CompletionShape(Shape):
    route, id_prefix, chunk_object, json_object = "completions", "cmpl", "text_completion", "text_completion"

    def prompt_texts(self, server: OpenAIServer, body: CompletionRequest):
        items, single = prompt_items(body.prompt)
        texts = [
            p if isinstance(p, str) else server.loaded.tokenizer.decode(p, skip_special_tokens=False)
            for p in items
            if isinstance(p, str) or all(0 <= t < server.loaded.vocab_size for t in p)
        ]
        if len(texts) != len(items):
            return None, None, None  # an out-of-vocabulary token id: tokenisation refuses it with a 400
        return texts, None, single

    def with_texts(self, body: CompletionRequest, texts: list[str], single: bool):
        # Redacted, a token-id prompt becomes text (its ids no longer say what the model sees).
        return body.model_copy(update={"prompt": texts[0] if single else texts})

    def logged_prompt(self, server: OpenAIServer, body: CompletionRequest):
        items, single = prompt_items(body.prompt)
        tok = server.loaded.tokenizer
        texts = [
            p if isinstance(p, str) else tok.decode([t for t in p if 0 <= t < server.loaded.vocab_size]) for p in items
        ]
        return texts[0] if single else texts

    async def prepare(self, server, body: CompletionRequest, hooks, call):
        prompts = await tokenized(tokenize_completion, server, body)
        constraint = await checked_constraint(server, body, None, constraint_of(body))
        prepared = prepare(
            server, body, prompts, "prompt", echo=echo_texts(server, body, prompts), constraint=constraint
        )
        if prepared.echo:
            prepared.echo = await hooks.screen_outputs(call, prepared.echo)
        return prepared

    def logprobs(self, server, body: CompletionRequest, gens, prepared):
        return CompletionLogprobs(server, body.logprobs, len(gens.streams), prepared.echo)

    def choice(self, i, text, finish, entries, logprobs, prepared):
        return {
            "index": i,
            "text": (prepared.echo[i] if prepared.echo else "") + text,
            "finish_reason": finish,
            "logprobs": logprobs.render(i, text, entries),
        }

    def delta(self, i, text, finish, entries, logprobs, prepared=None):
        return {"index": i, "text": text, "finish_reason": finish, "logprobs": logprobs.render(i, text, entries)}

    def first_chunks(self, base, gens, prepared, logprobs):
        # The echoed prompts go first, each as its choice's opening text.
        return (
            [
                {
                    **base,
                    "choices": [self.delta(i, text, None, None, logprobs)],
                    **({"usage": None} if prepared.include_usage else {}),
                }
                for i, text in enumerate(prepared.echo)
            ]
            if prepared.echo
            else []
        )

    def stored(self, i, text, finish, prepared):
        return {"text": (prepared.echo[i] if prepared.echo else "") + text, "finish_reason": finish}

    def cached_choice(self, i, c, delta):
        return {"index": i, "finish_reason": c["finish_reason"], "logprobs": None, "text": c["text"]}

    def answer_text(self, choice):
        return choice["text"]


SHAPE = CompletionShape()


async def create_completion(server: OpenAIServer, body: CompletionRequest, request: Request):
    return await serve(SHAPE, server, body, request)
