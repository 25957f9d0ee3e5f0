"""POST /v1/chat/completions: the assistant's next message through the model's chat template,
in chat's shape (Shape); the request's path is handlers.serve, shared with completions."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from tuneloop.api.handlers import Shape, serve
from tuneloop.api.logprobs import ChatLogprobs
from tuneloop.api.prepare import prepare, tokenize_chat, tokenized
from tuneloop.api.protocol import ChatCompletionRequest
from tuneloop.api.server import OpenAIServer
from tuneloop.api.structured import checked_constraint, constraint_of, tool_plan
from tuneloop.chat_format import ToolCall, ToolCallStream, content_text, parse_tool_calls

ARGUMENT_PIECE = 48  # characters of a streamed call's arguments per chunk


def _message(content: str, calls: list[ToolCall]) -> dict:
    out: dict[str, Any] = {
        "role": "assistant",
        "content": content.strip() or None if calls else content,
        "refusal": None,
    }
    if calls:
        out["tool_calls"] = [c.openai() for c in calls]
    return out


def _finish(finish: str, calls) -> str:
    """OpenAI's finish_reason of an answer that ends by calling tools."""
    return "tool_calls" if calls and finish == "stop" else finish


class ChatShape(Shape):
    route, id_prefix, chunk_object, json_object = "chat", "chatcmpl", "chat.completion.chunk", "chat.completion"

    def prompt_texts(self, server: OpenAIServer, body: ChatCompletionRequest):
        texts = [content_text(m.content) for m in body.messages]
        return texts, [m.role for m in body.messages], texts

    def with_texts(self, body: ChatCompletionRequest, texts: list[str], old: list[str]):
        messages = [
            m if new == was else m.model_copy(update={"content": new}) for m, new, was in zip(body.messages, texts, old)
        ]
        return body.model_copy(update={"messages": messages})

    def logged_prompt(self, server: OpenAIServer, body: ChatCompletionRequest):
        out = []
        for m in body.messages:
            entry: dict[str, Any] = {"role": m.role, "content": content_text(m.content)}
            if m.tool_calls:
                entry["tool_calls"] = [c.model_dump(mode="json") for c in m.tool_calls]
            out.append(entry)
        return out

    async def prepare(self, server, body: ChatCompletionRequest, hooks, call):
        plan = tool_plan(body)
        constraint = constraint_of(body)
        tools = plan.tools if plan is not None else None
        prompts = await tokenized(lambda s, b: tokenize_chat(s, b, tools), server, body)
        constraint = await checked_constraint(server, body, plan, constraint)
        prepared = prepare(server, body, prompts, "messages", constraint=constraint, tools=plan)
        if plan is not None:
            prepared.readers = [plan.reader() for _ in prepared.prompts]
        return prepared

    def logprobs(self, server, body: ChatCompletionRequest, gens, prepared):
        return ChatLogprobs(server) if body.logprobs else None

    def choice(self, i, text, finish, entries, logprobs, prepared):
        calls: list[ToolCall] = []
        if prepared.tools is not None:
            text, calls = parse_tool_calls(text, prepared.tools.names)
        return {
            "index": i,
            "message": _message(text, calls),
            "logprobs": logprobs and logprobs.render(entries),
            "finish_reason": _finish(finish, calls),
        }

    def delta(self, i, text, finish, entries, logprobs, prepared=None):
        reader: ToolCallStream | None = prepared.readers[i] if prepared is not None and prepared.readers else None
        if reader is None:
            return {
                "index": i,
                "delta": {"content": text} if text else {},
                "logprobs": logprobs and logprobs.render(entries),
                "finish_reason": finish,
            }
        # With tools: content as it is known not to open a call; each call once it is whole,
        # its id and name first, then its arguments in pieces (they always assemble to JSON).
        content = reader.feed(text)
        if finish is not None:
            content += reader.flush()
        out = []
        if content or entries:
            out.append({"index": i, "delta": {"content": content}, "logprobs": logprobs and logprobs.render(entries)})
        for call in reader.take_new():
            k = reader.calls.index(call)
            opening = {"index": k, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
            out.append({"index": i, "delta": {"tool_calls": [opening]}, "logprobs": None})
            args = call.arguments
            for start in range(0, len(args), ARGUMENT_PIECE):
                piece = {"index": k, "function": {"arguments": args[start : start + ARGUMENT_PIECE]}}
                out.append({"index": i, "delta": {"tool_calls": [piece]}, "logprobs": None})
        if finish is not None:
            out.append({"index": i, "delta": {}, "logprobs": None, "finish_reason": _finish(finish, reader.calls)})
        for d in out:
            d.setdefault("finish_reason", None)
        return out

    def stored(self, i, text, finish, prepared):
        if prepared.tools is None:
            return {"text": text, "finish_reason": finish}
        content, calls = parse_tool_calls(text, prepared.tools.names)
        return {
            "text": content,
            "finish_reason": _finish(finish, calls),
            "tool_calls": [c.openai() for c in calls] or None,
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
        # a replay is a new response: its calls get new ids (an agent keys results by them)
        calls = [{**call, "id": ToolCall(call["function"]["name"], "").id} for call in c.get("tool_calls") or []]
        if delta:
            out["delta"] = {"content": c["text"]}
            if calls:
                out["delta"]["tool_calls"] = [{"index": k, **call} for k, call in enumerate(calls)]
        else:
            out["message"] = {"role": "assistant", "content": c["text"] or (None if calls else ""), "refusal": None}
            if calls:
                out["message"]["tool_calls"] = calls
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
        return choice["message"]["content"] or ""


SHAPE = ChatShape()


async def create_chat_completion(server: OpenAIServer, body: ChatCompletionRequest, request: Request):
    return await serve(SHAPE, server, body, request)
