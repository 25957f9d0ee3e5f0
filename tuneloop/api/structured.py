"""A request's structured output and tools, read and checked before it runs.

- constraint_of: response_format (json_object, json_schema), vLLM's structured_outputs
  (json, json_object, regex, choice, grammar) and its older guided_* names, as one
  serving.constraints.Constraint, or None for free text.
- tool_plan: tools + tool_choice + parallel_tool_calls. `auto` leaves the model free and
  reads the calls it writes; `required` and a named function constrain the answer to call
  blocks with arguments valid against the tool's parameters (chat_format.tool_call_grammar).
  With `auto` and a JSON response_format, the answer is either calls or the JSON.

Every problem is an InvalidRequest naming its parameter; a schema the grammar library cannot
compile names the construct (`Unimplemented keys: ["not"]`).
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from typing import Any

from tuneloop.chat_format import JSON_LAYOUT, ToolCallStream, tool_call_grammar
from tuneloop.serving.constraints import Constraint, ConstraintError, check, json_schema
from tuneloop.serving.errors import InvalidRequest

MAX_TOOLS = 128  # OpenAI's limit
TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
MAX_SPEC_CHARS = 200_000  # a schema, regex or grammar longer than this is refused before compiling


@dataclass
class ToolPlan:
    tools: list[dict]  # the request's function tools, as sent
    choice: str  # auto | required | named
    names: set[str]  # the tools a call may name (one with a named choice)
    parallel: bool

    def reader(self) -> ToolCallStream:
        return ToolCallStream(self.names)

    @property
    def forced(self) -> bool:
        return self.choice != "auto"


def _top(param: str) -> str:
    """The request parameter a path names (the message keeps the whole path)."""
    return param.split(".")[0].split("[")[0]


def _too_long(text: str, param: str) -> None:
    if len(text) > MAX_SPEC_CHARS:
        raise InvalidRequest(
            f"{param}: {len(text)} characters; at most {MAX_SPEC_CHARS} are accepted", param=_top(param)
        )


def _schema_constraint(schema: Any, param: str) -> Constraint:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise InvalidRequest(f"{param}: not a JSON schema (not valid JSON)", param=_top(param)) from None
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{param}: a JSON schema must be an object", param=_top(param))
    constraint = json_schema(schema)
    _too_long(constraint.spec, param)
    return constraint


def _response_format(rf: dict[str, Any]) -> Constraint | None:
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object")
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec and "name" not in spec:
            raise InvalidRequest(
                'response_format: json_schema needs {"name": ..., "schema": {...}}', param="response_format"
            )
        return _schema_constraint(spec.get("schema", {}), "response_format.json_schema.schema")
    raise InvalidRequest(
        f"response_format: unknown type {kind!r}; use text, json_object or json_schema", param="response_format"
    )


def _structured_outputs(so: dict[str, Any]) -> Constraint:
    given = [k for k in ("json", "json_object", "regex", "choice", "grammar") if so.get(k) not in (None, False)]
    unknown = sorted(set(so) - {"json", "json_object", "regex", "choice", "grammar", "disable_fallback", "backend"})
    if unknown:
        raise InvalidRequest(f"structured_outputs: unknown field(s) {unknown}", param="structured_outputs")
    if len(given) != 1:
        raise InvalidRequest(
            "structured_outputs: give exactly one of json, json_object, regex, choice, grammar",
            param="structured_outputs",
        )
    key = given[0]
    value = so[key]
    return _constraint(key, value, f"structured_outputs.{key}")


def _constraint(key: str, value: Any, param: str) -> Constraint:
    if key == "json":
        return _schema_constraint(value, param)
    if key == "json_object":
        return Constraint("json_object")
    if key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise InvalidRequest(f"{param}: a non-empty list of non-empty strings", param=_top(param))
        spec = json.dumps(value)
        _too_long(spec, param)
        return Constraint("choice", spec)
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{param}: a non-empty string", param=_top(param))
    _too_long(value, param)
    return Constraint("regex" if key == "regex" else "grammar", value)


def constraint_of(body) -> Constraint | None:
    """The request's output constraint, from whichever one parameter sets it."""
    sources = []
    if body.response_format is not None:
        if not isinstance(body.response_format, dict):
            raise InvalidRequest("response_format must be an object", param="response_format")
        found = _response_format(body.response_format)
        if found is not None:
            sources.append(("response_format", found))
    if body.structured_outputs is not None:
        sources.append(("structured_outputs", _structured_outputs(body.structured_outputs)))
    for key, name in (("json", "guided_json"), ("regex", "guided_regex"), ("choice", "guided_choice")):
        value = getattr(body, name)
        if value is not None:
            sources.append((name, _constraint(key, value, name)))
    if body.guided_grammar is not None:
        sources.append(("guided_grammar", _constraint("grammar", body.guided_grammar, "guided_grammar")))
    if len(sources) > 1:
        raise InvalidRequest(
            f"give one way of constraining the output, not {' and '.join(n for n, _ in sources)}", param=sources[1][0]
        )
    if sources and body.ignore_eos:
        raise InvalidRequest(
            "ignore_eos cannot be used with a structured output: the answer ends where its grammar does",
            param="ignore_eos",
        )
    return sources[0][1] if sources else None


def _function(tool: Any, i: int) -> dict:
    param = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise InvalidRequest(
            f'{param}: only function tools are supported ({{"type": "function", "function": {{...}}}})', param="tools"
        )
    fn = tool["function"]
    try:  # free-form JSON: no lone UTF-16 surrogate, which no tokenizer takes (protocol.Text)
        json.dumps(tool, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(
            f"{param}: contains a lone UTF-16 surrogate; send valid Unicode text", param="tools"
        ) from None
    name = fn.get("name")
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise InvalidRequest(f"{param}.function.name: {name!r}; a name is 1-64 letters, digits, _ or -", param="tools")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise InvalidRequest(f"{param}.function.parameters: a JSON schema object", param="tools")
    return {"type": "function", "function": {**fn, "parameters": params}}


def tool_plan(body) -> ToolPlan | None:
    """The request's tools and how they may be called; None when no call can be made."""
    tools = body.tools or []
    choice = body.tool_choice
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"tools: {len(tools)} tools; at most {MAX_TOOLS}", param="tools")
    functions = [_function(t, i) for i, t in enumerate(tools)]
    names = [f["function"]["name"] for f in functions]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise InvalidRequest(f"tools: the names {dupes} are given more than once", param="tools")
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise InvalidRequest(
                'tool_choice: "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
                param="tool_choice",
            )
        if name not in names:
            raise InvalidRequest(f"tool_choice: no tool named {name!r} is given in tools", param="tool_choice")
        return ToolPlan([f for f in functions if f["function"]["name"] == name], "named", {name}, False)
    if choice not in ("none", "auto", "required"):
        raise InvalidRequest(
            f'tool_choice: {json.dumps(choice)[:80]}; use "none", "auto", "required" or a function',
            param="tool_choice",
        )
    if choice != "none" and not tools:
        raise InvalidRequest(f'tool_choice "{choice}" needs tools', param="tool_choice")
    if choice == "none":
        return None
    parallel = body.parallel_tool_calls is not False
    return ToolPlan(functions, choice, set(names), parallel)


def _check(constraint: Constraint, tokenizer, param: str, what: str) -> None:
    try:
        check(constraint, tokenizer)
    except ConstraintError as exc:
        raise InvalidRequest(
            f"{param}: {what} cannot be used: {exc}", param=param.split(".")[0].split("[")[0]
        ) from None


def output_constraint(body, plan: ToolPlan | None, constraint: Constraint | None, tokenizer) -> Constraint | None:
    """What the answer must match, checked with the model's tokenizer (run off the event loop:
    a grammar is compiled here). Each tool's schema is checked on its own first, so an error
    names the tool."""
    if constraint is not None:
        _check(constraint, tokenizer, _param_of(body), "the schema" if "json" in constraint.kind else "the constraint")
    if plan is None:
        return constraint
    if plan.forced or constraint is not None:
        for i, tool in enumerate(body.tools or []):
            if tool.get("function", {}).get("name") in plan.names:
                schema = tool["function"].get("parameters") or {"type": "object", "properties": {}}
                _check(json_schema(schema), None, f"tools[{i}].function.parameters", "the parameters schema")
    if plan.forced:
        if constraint is not None:
            raise InvalidRequest(
                f'tool_choice "{plan.choice}" makes the answer a tool call; it cannot also follow a response_format',
                param="response_format",
            )
        grammar = Constraint("grammar", tool_call_grammar(plan.tools, plan.parallel))
        _check(grammar, tokenizer, "tools", "the tools")
        return grammar
    if constraint is not None:  # auto: calls, or the JSON answer
        if constraint.kind not in ("json_schema", "json_object"):
            raise InvalidRequest(
                "with tools, only a JSON response_format can constrain the answer", param=_param_of(body)
            )
        schema = json.loads(constraint.spec) if constraint.kind == "json_schema" else {"type": "object"}
        schema = {**schema, "x-guidance": JSON_LAYOUT} if isinstance(schema, dict) else schema
        calls = tool_call_grammar(plan.tools, plan.parallel).replace("start:", "calls:", 1)
        lark = f"start: calls | answer\nanswer: %json {json.dumps(schema)}\n{calls}"
        grammar = Constraint("grammar", lark)
        _check(grammar, tokenizer, _param_of(body), "the schema with the tools")
        return grammar
    return None


async def checked_constraint(server, body, plan: ToolPlan | None, constraint: Constraint | None) -> Constraint | None:
    """output_constraint off the event loop (it compiles a grammar, and builds the model's
    grammar tokenizer once); a request with neither tools nor a constraint has none to check."""
    if plan is None and constraint is None:
        return None
    return await asyncio.to_thread(lambda: output_constraint(body, plan, constraint, server.loaded.grammar_tokenizer))


def _param_of(body) -> str:
    for name in ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice"):
        if getattr(body, name, None) is not None:
            return name
    return "guided_grammar"
