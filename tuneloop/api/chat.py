"""POST /v1/chat/completions: the assistant's next message through the model's chat template,
in chat's shape (Shape); the request's path is handlers.serve, shared with completions."""

from __future__ import annotations

from fastapi import Request

from tuneloop.api.handlers import Shape, serve
from tuneloop.api.logprobs import ChatLogprobs
from tuneloop.api.prepare import prepare, tokenize_chat, tokenized
from tuneloop.api.protocol import ChatCompletionRequest
from tuneloop.api.server import OpenAIServer


def _text(message) -> str:
    return message.content if isinstance(message.content, str) else "".join(p.text for p in message.content)


class ChatShape(Shape):
    route, id_prefix, chunk_object, json_object = "chat", "chatcmpl", "chat.completion.chunk", "chat.completion"

    def prompt_texts(self, server: OpenAIServer, body: ChatCompletionRequest):
        texts = [_text(m) for m in body.messages]
        return texts, [m.role for m in body.messages], texts

    def with_texts(self, body: ChatCompletionRequest, texts: list[str], old: list[str]):
        messages = [
            m if new == was else m.model_copy(update={"content": new}) for m, new, was in zip(body.messages, texts, old)
        ]
        return body.model_copy(update={"messages": messages})

    def logged_prompt(self, server: OpenAIServer, body: ChatCompletionRequest):
        return [{"role": m.role, "content": _text(m)} for m in body.messages]

    async def prepare(self, server, body: ChatCompletionRequest, hooks, call):
        return prepare(server, body, await tokenized(tokenize_chat, server, body), "messages")

    def logprobs(self, server, body: ChatCompletionRequest, gens, prepared):
        return ChatLogprobs(server) if body.logprobs else None

    def choice(self, i, text, finish, entries, logprobs, prepared):
        return {
            "index": i,
            "message": {"role": "assistant", "content": text, "refusal": None},
            "logprobs": logprobs and logprobs.render(entries),
            "finish_reason": finish,
        }

    def delta(self, i, text, finish, entries, logprobs):
        return {
            "index": i,
            "delta": {"content": text} if text else {},
            "logprobs": logprobs and logprobs.render(entries),
            "finish_reason": finish,
        }

    def first_chunks(self, base, gens, prepared, logprobs):
        # The role first, for every choice in one chunk (it goes out with the first content).
        first = {
            **base,
            "choices": [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(len(gens.streams))
            ],
        }
        if prepared.include_usage:
            first["usage"] = None
        return [first]

    def cached_choice(self, i, c, delta):
        out = {"index": i, "finish_reason": c["finish_reason"], "logprobs": None}
        out["delta" if delta else "message"] = (
            {"content": c["text"]} if delta else {"role": "assistant", "content": c["text"], "refusal": None}
        )
        return out

    def cached_first_chunks(self, base, choices, extra):
        return [
            {
                **base,
                "choices": [
                    {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                    for i in range(choices)
                ],
                **extra,
            }
        ]

    def answer_text(self, choice):
        return choice["message"]["content"]


SHAPE = ChatShape()


async def create_chat_completion(server: OpenAIServer, body: ChatCompletionRequest, request: Request):
    return await serve(SHAPE, server, body, request)
