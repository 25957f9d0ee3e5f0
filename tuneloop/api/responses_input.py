"""A Responses API request read into the chat request it means (to_chat), and what this
stateless server refuses (refuse_stateful, refuse_retrieval): the input side of
api/responses.py. Errors name Responses' own parameters (text.format, max_output_tokens,
input, tools[i].name), never chat's."""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel, ValidationError

from tuneloop.api.protocol import (
    ChatCompletionRequest,
    ResponseFunctionCallItem,
    ResponseFunctionCallOutputItem,
    ResponseMessageItem,
    ResponsesRequest,
)
from tuneloop.chat_format import arguments_object, content_text
from tuneloop.serving.errors import InvalidRequest

LOGPROBS = "message.output_text.logprobs"
NO_OPS = {"reasoning.encrypted_content"}  # nothing to include: the model does not reason
TOOL_FIELDS = {"type", "name", "description", "parameters", "strict"}
FORMAT_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
STATELESS = "this server is stateless: it keeps no responses"


# ---- refusals ----------------------------------------------------------------------------------


def refuse_stateful(body: ResponsesRequest) -> None:
    """What needs stored state or features this server does not have: a 400 naming each."""
    if body.store:
        raise InvalidRequest(
            f"store=true is not supported: {STATELESS} to retrieve later. Send store=false or leave it out.",
            param="store",
        )
    if body.previous_response_id is not None:
        raise InvalidRequest(
            f"previous_response_id is not supported: {STATELESS}. Send the whole conversation in input "
            "(earlier output items included) and store=false.",
            param="previous_response_id",
        )
    if body.conversation is not None:
        raise InvalidRequest(
            f"conversation is not supported: {STATELESS} or conversations. Send the whole conversation in input.",
            param="conversation",
        )
    if body.background:
        raise InvalidRequest(
            f"background=true is not supported: {STATELESS} to poll. Send background=false or leave it out.",
            param="background",
        )
    if body.prompt is not None:
        raise InvalidRequest(
            "prompt (a stored prompt template) is not supported; send instructions and input", param="prompt"
        )
    if body.context_management is not None:
        raise InvalidRequest("context_management is not supported by this server", param="context_management")
    if body.reasoning and any(v is not None for v in body.reasoning.values()):
        raise InvalidRequest("reasoning is not supported: this model does not reason", param="reasoning")
    if body.truncation == "auto":
        raise InvalidRequest(
            'truncation "auto" is not supported: the input is never cut; send "disabled" or leave it out',
            param="truncation",
        )
    if body.text is not None and body.text.verbosity not in (None, "medium"):
        raise InvalidRequest(
            f'text.verbosity "{body.text.verbosity}" is not supported; only "medium" (the default)',
            param="text.verbosity",
        )
    for value in body.include or []:
        if value != LOGPROBS and value not in NO_OPS:
            raise InvalidRequest(
                f"include: {value!r} is not supported; only {LOGPROBS!r} (with top_logprobs)", param="include"
            )


def refuse_retrieval(response_id: str) -> InvalidRequest:
    """GET/DELETE /v1/responses/{id} and its sub-routes: nothing is stored to find."""
    return InvalidRequest(
        f"response {response_id[:80]!r} cannot be retrieved, cancelled or deleted: {STATELESS} "
        "(create them with store=false or without store).",
        param="response_id",
    )


# ---- the request as the chat request it means ----------------------------------------------------


def _param(prefix: str, loc: tuple) -> str:
    out = prefix
    for p in loc:
        if isinstance(p, int):
            out += f"[{p}]"
        elif p in ("str", "list[ResponseTextPart]") or "[" in str(p):
            break  # a union member's name
        else:
            out += f".{p}"
    return out


def _validated(model: type[BaseModel], raw: dict, where: str) -> Any:
    """raw as `model`, or a 400 naming the field of input[i] that is wrong."""
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        e = exc.errors()[0]
        param = _param(where, tuple(e.get("loc", ())))
        if e.get("type") == "extra_forbidden":
            raise InvalidRequest(f"{param}: unknown field", param="input") from None
        if e.get("type") == "missing":
            raise InvalidRequest(f"{param}: missing", param="input") from None
        raise InvalidRequest(f"{param}: {e.get('msg')}", param="input") from None


def _check_parts(content: Any, where: str) -> None:
    """Text parts only: this model reads text."""
    if not isinstance(content, list):
        return
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text"):
            raise InvalidRequest(
                f"{where}[{j}]: {json.dumps(kind)} parts are not supported; this model reads text only "
                '({"type": "input_text", "text": ...})',
                param="input",
            )


def _messages(body: ResponsesRequest) -> list[dict]:
    """Chat messages: the instructions, then each input item (function calls joined to the
    assistant message they follow, each output checked to answer an earlier call)."""
    out: list[dict] = []
    if body.instructions is not None:
        out.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return [*out, {"role": "user", "content": body.input}]
    if not body.input:
        raise InvalidRequest("input: an empty list; give at least one message", param="input")
    calls: set[str] = set()
    assistant_last = False  # the last message is the assistant's, from the item before
    for i, raw in enumerate(body.input):
        where = f"input[{i}]"
        kind = raw.get("type", "message")
        if kind == "message":
            _check_parts(raw.get("content"), f"{where}.content")
            message = _validated(ResponseMessageItem, raw, where)
            out.append({"role": message.role, "content": content_text(message.content)})
            assistant_last = message.role == "assistant"
        elif kind == "function_call":
            call = _validated(ResponseFunctionCallItem, raw, where)
            if arguments_object(call.arguments) is None:
                raise InvalidRequest(f"{where}.arguments: not a JSON object's text", param="input")
            made = {
                "id": call.call_id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            if not assistant_last:
                out.append({"role": "assistant", "content": None})
                assistant_last = True
            out[-1].setdefault("tool_calls", []).append(made)
            calls.add(call.call_id)
        elif kind == "function_call_output":
            _check_parts(raw.get("output"), f"{where}.output")
            result = _validated(ResponseFunctionCallOutputItem, raw, where)
            if result.call_id not in calls:
                raise InvalidRequest(
                    f"{where}.call_id: {result.call_id!r} answers no function_call item before it; send the "
                    f"function_call item too ({STATELESS})",
                    param="input",
                )
            out.append({"role": "tool", "tool_call_id": result.call_id, "content": content_text(result.output)})
            assistant_last = False
        else:
            raise InvalidRequest(
                f"{where}.type: {json.dumps(kind)[:80]} items are not supported; an item is a message, a "
                "function_call or a function_call_output (item_reference and reasoning items need stored "
                f"responses: {STATELESS})",
                param="input",
            )
    return out


def _text_only(value: Any, param: str) -> None:
    """A 400 for JSON that holds a lone UTF-16 surrogate (no text: the tokenizer cannot take it)."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequest(
            f"{param}: contains a lone UTF-16 surrogate; send valid Unicode text", param=param
        ) from exc


def _tools(body: ResponsesRequest) -> list[dict] | None:
    """Responses' flat function tools in chat's shape."""
    if body.tools is None:
        return None
    _text_only(body.tools, "tools")
    out = []
    for i, tool in enumerate(body.tools):
        kind = tool.get("type")
        if kind != "function":
            raise InvalidRequest(
                f"tools[{i}]: {json.dumps(kind)[:80]} tools are not supported by this server; only function tools "
                '({"type": "function", "name", "description", "parameters"})',
                param="tools",
            )
        unknown = sorted(set(tool) - TOOL_FIELDS)
        if unknown:
            raise InvalidRequest(f"tools[{i}]: unknown field(s) {unknown}", param="tools")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(body: ResponsesRequest) -> Any:
    choice = body.tool_choice
    _text_only(choice, "tool_choice")
    if choice is None or choice in ("none", "required"):
        return choice
    if choice == "auto":
        return "auto" if body.tools else None  # OpenAI accepts auto without tools
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        if set(choice) != {"type", "name"}:
            raise InvalidRequest(
                f"tool_choice: unknown field(s) {sorted(set(choice) - {'type', 'name'})}", param="tool_choice"
            )
        return {"type": "function", "function": {"name": choice["name"]}}
    kind = choice.get("type") if isinstance(choice, dict) else None
    if isinstance(kind, str) and kind != "function":
        raise InvalidRequest(
            f'tool_choice of type "{kind[:40]}" is not supported; use "none", "auto", "required" or '
            '{"type": "function", "name": ...}',
            param="tool_choice",
        )
    raise InvalidRequest(
        f'tool_choice: {json.dumps(choice)[:80]}; use "none", "auto", "required" or {{"type": "function", "name": ...}}',
        param="tool_choice",
    )


def _response_format(body: ResponsesRequest) -> dict | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None:
        return None
    _text_only(fmt, "text.format")
    kind = fmt.get("type")
    allowed = {
        "text": {"type"},
        "json_object": {"type"},
        "json_schema": {"type", "name", "schema", "strict", "description"},
    }
    if not isinstance(kind, str) or kind not in allowed:
        raise InvalidRequest(
            f"text.format: unknown type {json.dumps(kind)[:40]}; use text, json_object or json_schema",
            param="text.format",
        )
    unknown = sorted(set(fmt) - allowed[kind])
    if unknown:
        raise InvalidRequest(f"text.format: unknown field(s) {unknown} for type {kind}", param="text.format")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    name, schema = fmt.get("name"), fmt.get("schema")
    if not isinstance(name, str) or not FORMAT_NAME.match(name):
        raise InvalidRequest(
            f"text.format.name: {json.dumps(name)[:80]}; a json_schema format needs a name of 1-64 letters, "
            "digits, _ or -",
            param="text.format.name",
        )
    if not isinstance(schema, dict):
        raise InvalidRequest(
            "text.format.schema: a json_schema format needs a JSON schema object", param="text.format.schema"
        )
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": fmt.get("strict")}}


def to_chat(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request that means what `body` means (its checks as chat's)."""
    chat: dict[str, Any] = {"model": body.model, "messages": _messages(body), "stream": bool(body.stream)}
    tools = _tools(body)
    if tools:
        chat["tools"] = tools
    choice = _tool_choice(body)
    if choice is not None:
        chat["tool_choice"] = choice
    for name, value in (
        ("parallel_tool_calls", body.parallel_tool_calls),
        ("response_format", _response_format(body)),
        ("max_completion_tokens", body.max_output_tokens),
        ("temperature", body.temperature),
        ("top_p", body.top_p),
    ):
        if value is not None:
            chat[name] = value
    if LOGPROBS in (body.include or []):
        chat["logprobs"], chat["top_logprobs"] = True, body.top_logprobs or 0
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:  # the input items are checked above: this is not expected
        raise InvalidRequest(f"input: {exc.errors()[0].get('msg')}", param="input") from None


# chat's parameter names, as the Responses API calls them (in an error's param and message)
_RENAMES = [
    (re.compile(r"\bresponse_format\.json_schema\.schema\b"), "text.format.schema"),
    (re.compile(r"\bresponse_format\b"), "text.format"),
    (re.compile(r"\bmax_completion_tokens\b"), "max_output_tokens"),
    (re.compile(r"\bmessages\b"), "input"),
    (re.compile(r"\b(tools\[\d+\])\.function\."), r"\1."),
]


def renamed(text: str) -> str:
    for pattern, name in _RENAMES:
        text = pattern.sub(name, text)
    return text
