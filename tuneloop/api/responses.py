"""POST /v1/responses: OpenAI's Responses API (what the OpenAI Agents SDK and newer SDK code
call first), stateless.

A request is read into the chat request it means (to_chat: instructions as a system message
first, message items as messages, function_call items as an assistant message's tool_calls,
function_call_output items as tool messages, Responses' flat function tools in chat's shape,
text.format as response_format, max_output_tokens as max_completion_tokens) and runs through
handlers.serve with ResponsesShape: chat's Shape (the template, tokenisation, the grammar of
structured outputs and forced calls, reading the calls back: the same code as chat) that
answers with a Response object, and streams the Responses events (response.created ...
response.completed, each with its sequence_number; an error as an `error` event).

Nothing is stored: store=true, previous_response_id, conversation, background and retrieving
or deleting a response (GET/DELETE /v1/responses/{id}) are a 400 naming the parameter. The
whole conversation comes with every request, earlier output items included.
"""

from __future__ import annotations

import copy
import json
import time
import uuid
from typing import Any

from fastapi import Request

from tuneloop.api.chat import ARGUMENT_PIECE, ChatShape
from tuneloop.api.generation import stream_response, usage
from tuneloop.api.handlers import serve
from tuneloop.api.protocol import (
    ResponsesRequest,
)
from tuneloop.api.responses_input import refuse_stateful, renamed, to_chat
from tuneloop.api.server import OpenAIServer
from tuneloop.chat_format import ToolCall
from tuneloop.serving.errors import InvalidRequest, ServingError

# ---- the answer ----------------------------------------------------------------------------------


def _hex() -> str:
    return uuid.uuid4().hex


def _status(finish: str | None) -> tuple[str, str | None]:
    if finish == "length":
        return "incomplete", "max_output_tokens"
    if finish == "content_filter":
        return "incomplete", "content_filter"
    return "completed", None


def _usage(chat: dict) -> dict:
    details = chat.get("prompt_tokens_details") or {}
    return {
        "input_tokens": chat["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": details.get("cached_tokens", 0), "cache_write_tokens": 0},
        "output_tokens": chat["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat["total_tokens"],
    }


def _part(text: str, logprobs: list) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def _sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"


class ResponsesShape(ChatShape):
    """Chat's Shape (prompt, screening, tokenisation, grammar, tool calls), answering as a
    Response and streaming the Responses events."""

    route, id_prefix, chunk_object, json_object = "responses", "resp", "response", "response"

    def __init__(self, request: ResponsesRequest):
        self.request = request

    def new_id(self) -> str:
        return f"resp_{_hex()}"

    def response(
        self, base: dict, status: str, reason: str | None, output: list[dict], usage_: dict | None, filtered
    ) -> dict:
        """The Response object (usage: Responses'; left out while in progress)."""
        r = self.request
        fmt = r.text.format if r.text is not None and r.text.format is not None else {"type": "text"}
        out: dict[str, Any] = {
            "id": base["id"],
            "object": "response",
            "created_at": base["created"],
            "status": status,
            "background": False,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": None,
            "incomplete_details": {"reason": reason} if reason is not None else None,
            "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens,
            "max_tool_calls": r.max_tool_calls,
            "metadata": r.metadata or {},
            "model": base["model"],
            "output": output,
            "parallel_tool_calls": r.parallel_tool_calls is not False,
            "previous_response_id": None,
            "prompt_cache_key": r.prompt_cache_key,
            "reasoning": None,
            "safety_identifier": r.safety_identifier,
            "service_tier": "default",
            "store": False,
            "temperature": 1.0 if r.temperature is None else r.temperature,
            "text": {"format": fmt, "verbosity": "medium"},
            "tool_choice": "auto" if r.tool_choice is None else r.tool_choice,
            "tools": [
                {
                    "type": "function",
                    "name": t.get("name"),
                    "description": t.get("description"),
                    "parameters": t.get("parameters"),
                    "strict": t.get("strict"),
                }
                for t in r.tools or []
            ],
            "top_logprobs": r.top_logprobs or 0,
            "top_p": 1.0 if r.top_p is None else r.top_p,
            "truncation": "disabled",
        }
        if r.user is not None:
            out["user"] = r.user
        if usage_ is not None:
            out["usage"] = usage_
        if filtered is not None:
            out["content_filter_results"] = filtered
        return out

    def json_body(self, base, choices, usage):
        c = choices[0]
        message = c["message"]
        text, calls = message.get("content") or "", message.get("tool_calls") or []
        status, reason = _status(c["finish_reason"])
        output = []
        if text or not calls:
            logprobs = (c.get("logprobs") or {}).get("content") or []
            output.append(
                {
                    "id": f"msg_{_hex()}",
                    "type": "message",
                    "status": status,
                    "role": "assistant",
                    "content": [_part(text, logprobs)],
                }
            )
        for call in calls:
            output.append(
                {
                    "id": f"fc_{_hex()}",
                    "type": "function_call",
                    "status": "completed",
                    "arguments": call["function"]["arguments"],
                    "call_id": call["id"],
                    "name": call["function"]["name"],
                }
            )
        return self.response(base, status, reason, output, _usage(usage), c.get("content_filter_results"))

    def own_stream(self, base, gens, prepared, logprobs, on_done):
        events = _Events(self, base, prepared.readers[0] if prepared.readers else None, logprobs)
        return stream_response(
            gens,
            events.chunk,
            False,
            events.opening(),
            on_done,
            last_chunks=lambda: events.closing(gens.finish_reasons[0], usage(gens), gens.filter_results(0)),
            error_chunk=events.error,
            end=None,
            encode=_sse,
        )

    def replay_stream(self, base, choices, usage):
        c = choices[0]
        message = c["message"]
        text, calls = message.get("content") or "", message.get("tool_calls") or []
        events = _Events(self, base, None, None)
        out = events.opening()
        if text or not calls:
            out += events.text(text) if text else events.open_message()
            out += events.close_message(_status(c["finish_reason"])[0])
        for call in calls:
            out += events.call(ToolCall(call["function"]["name"], call["function"]["arguments"], call["id"]))
        out += events.closing(c["finish_reason"], usage, c.get("content_filter_results"))
        return "".join(_sse(e) for e in out)


class _Events:
    """One streamed response's events, numbered as they are made (the order they go out in).

    Text opens a message item on its first characters; a call closes it and goes out whole
    as a function_call item (its arguments in pieces that assemble to valid JSON). Trailing
    whitespace is held back until more text follows: before a call it is markup, dropped (as
    the whole answer's text is stripped when it calls tools)."""

    def __init__(self, shape: ResponsesShape, base: dict, reader, logprobs):
        self.shape, self.base, self.reader, self.logprobs = shape, base, reader, logprobs
        self.seq = 0
        self.items: list[dict] = []  # the output so far
        self.message: dict | None = None  # the open message item
        self.message_text = ""
        self.part_logprobs: list[dict] = []
        self.held = ""  # trailing whitespace not yet sent
        self.held_entries: list = []  # logprob entries not yet sent

    def event(self, kind: str, **fields) -> dict:
        out = {"type": kind, **copy.deepcopy(fields), "sequence_number": self.seq}
        self.seq += 1
        return out

    def opening(self) -> list[dict]:
        response = self.shape.response(self.base, "in_progress", None, [], None, None)
        return [
            self.event("response.created", response=response),
            self.event("response.in_progress", response=response),
        ]

    def chunk(self, i: int, delta: str | None, finish: str | None, usage=None, entries=None) -> list[dict]:
        delta = delta or ""
        if self.reader is None:
            content, calls = delta, []
        else:
            content = self.reader.feed(delta)
            if finish is not None:
                content += self.reader.flush()
            calls = self.reader.take_new()
        self.held_entries += entries or []
        out = self.text(content, hold=True) if content else []
        for call in calls:
            self.held = ""  # whitespace before a call is its markup
            out += self.close_message("completed")
            out += self.call(call)
        if finish is not None:
            if self.held and not (self.reader is not None and self.reader.calls):
                out += self.text("")  # no call followed: the whitespace is text
            if not self.items and self.message is None:
                out += self.open_message()  # an empty answer is an empty message
            out += self.close_message(_status(finish)[0])
        return out

    def open_message(self) -> list[dict]:
        self.message = {
            "id": f"msg_{_hex()}",
            "type": "message",
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        self.message_text, self.part_logprobs = "", []
        self.items.append(self.message)
        where = {"item_id": self.message["id"], "output_index": len(self.items) - 1, "content_index": 0}
        return [
            self.event("response.output_item.added", output_index=where["output_index"], item=self.message),
            self.event("response.content_part.added", **where, part=_part("", [])),
        ]

    def text(self, content: str, hold: bool = False) -> list[dict]:
        body = self.held + content
        sent = body.rstrip() if hold else body
        self.held = body[len(sent) :]
        if not sent:
            return []
        out = self.open_message() if self.message is None else []
        assert self.message is not None
        logprobs = self._logprobs()
        self.message_text += sent
        self.part_logprobs += logprobs
        where = {"item_id": self.message["id"], "output_index": len(self.items) - 1, "content_index": 0}
        out.append(self.event("response.output_text.delta", **where, delta=sent, logprobs=logprobs))
        return out

    def _logprobs(self) -> list[dict]:
        entries, self.held_entries = self.held_entries, []
        if self.logprobs is None or not entries:
            return []
        return self.logprobs.render(entries)["content"]

    def close_message(self, status: str) -> list[dict]:
        if self.message is None:
            return []
        part = _part(self.message_text, self.part_logprobs)
        where = {"item_id": self.message["id"], "output_index": len(self.items) - 1, "content_index": 0}
        self.message.update(status=status, content=[part])
        out = [
            self.event("response.output_text.done", **where, text=self.message_text, logprobs=self.part_logprobs),
            self.event("response.content_part.done", **where, part=part),
            self.event("response.output_item.done", output_index=where["output_index"], item=self.message),
        ]
        self.message = None
        return out

    def call(self, call: ToolCall) -> list[dict]:
        item = {
            "id": f"fc_{_hex()}",
            "type": "function_call",
            "status": "in_progress",
            "arguments": "",
            "call_id": call.id,
            "name": call.name,
        }
        self.items.append(item)
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        out = [self.event("response.output_item.added", output_index=where["output_index"], item=item)]
        args = call.arguments
        for start in range(0, len(args), ARGUMENT_PIECE):
            out.append(
                self.event(
                    "response.function_call_arguments.delta", **where, delta=args[start : start + ARGUMENT_PIECE]
                )
            )
        out.append(self.event("response.function_call_arguments.done", **where, name=call.name, arguments=args))
        item.update(arguments=args, status="completed")
        out.append(self.event("response.output_item.done", output_index=where["output_index"], item=item))
        return out

    def closing(self, finish: str | None, chat_usage: dict, filtered) -> list[dict]:
        status, reason = _status(finish)
        response = self.shape.response(self.base, status, reason, self.items, _usage(chat_usage), filtered)
        return [self.event(f"response.{status}", response=response)]

    def error(self, err: ServingError) -> dict:
        return self.event("error", code=err.code or err.type, message=err.message, param=err.param)


async def create_response(server: OpenAIServer, body: ResponsesRequest, request: Request):
    refuse_stateful(body)
    chat = to_chat(body)
    try:
        return await serve(ResponsesShape(body), server, chat, request)
    except ServingError as err:
        if isinstance(err, InvalidRequest):  # named as chat names it: say it as Responses does
            err.message = renamed(err.message)
            err.args = (err.message,)
            err.param = renamed(err.param) if err.param else err.param
        raise
