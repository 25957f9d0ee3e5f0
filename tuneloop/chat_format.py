"""Chat conversations with tools, as a model reads and writes them: one place for serving
(the API renders requests and parses answers) and training (fine-tuning data with tool calls).

A conversation is OpenAI's: messages with roles system / developer / user / assistant / tool,
an assistant message may carry `tool_calls`, a tool message answers one by `tool_call_id`,
and the request may list `tools` (function definitions).

How tools reach the model:
- A chat template that renders tools itself (it reads `tools` and `tool_calls`, as Qwen2.5's,
  Hermes' or SmolLM3's do) gets them as they are, in transformers' form.
- Any other template (SmolLM2's, the demo model's) gets the documented fallback format
  (docs/api.md, "Tool calling"): the tools' signatures in the system message between
  <tools></tools>, each call the assistant makes as a JSON object {"name", "arguments"}
  between <tool_call></tool_call>, and each tool result as a user turn between
  <tool_response></tool_response>.

Both ways the model writes calls as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
which parse_tool_calls and ToolCallStream read back, and tool_call_grammar constrains to
valid arguments (the Hermes format; the templates that render tools natively use it too).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"

FALLBACK_TOOLS_PROMPT = (
    "# Tools\n\n"
    "You may call one or more functions to help with the user's request.\n\n"
    "The functions you can call are listed between <tools></tools>, one JSON signature a line:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "To call a function, write a JSON object with its name and arguments between "
    "<tool_call></tool_call>:\n"
    '<tool_call>\n{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}\n</tool_call>'
)


def content_text(content: Any) -> str:
    """A message's content as text: a string, a list of text parts (dicts or the API's part
    models), or None (an assistant message that only calls tools)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") if isinstance(part, dict) else part.text for part in content)


def template_renders_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders `tools` and `tool_calls` itself."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # a set of named templates
        template = " ".join(str(t) for t in template.values())
    return "tools" in template and "tool_calls" in template


def call_text(name: str, arguments: str | dict) -> str:
    """One tool call as the model writes it (arguments: a JSON text or an object)."""
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n{CALL_CLOSE}"


def arguments_object(arguments: str | None) -> dict | None:
    """A call's arguments text as the JSON object it must be (empty: {}), or None where it is not one."""
    try:
        args = json.loads(arguments or "{}")
    except ValueError:
        return None
    return args if isinstance(args, dict) else None


def _signature(tool: dict) -> str:
    fn = tool.get("function", tool)
    out = {"type": "function", "function": {k: fn[k] for k in ("name", "description", "parameters") if k in fn}}
    return json.dumps(out, ensure_ascii=False)


def template_messages(messages: list[dict], tools: list[dict] | None, native: bool) -> list[dict]:
    """OpenAI-format messages as the chat template takes them: `developer` read as `system`,
    content parts joined; with native=False, tools, calls and results in the fallback format."""
    out: list[dict] = []
    for m in messages:
        role = "system" if m.get("role") == "developer" else m.get("role")
        text = content_text(m.get("content"))
        calls = m.get("tool_calls") or []
        if native:
            msg: dict[str, Any] = {"role": role, "content": text}
            if calls:
                msg["tool_calls"] = [
                    {
                        "type": "function",
                        "id": c.get("id"),
                        "function": {
                            "name": c["function"]["name"],
                            "arguments": json.loads(c["function"]["arguments"] or "{}"),
                        },
                    }
                    for c in calls
                ]
            if role == "tool" and m.get("tool_call_id"):
                msg["tool_call_id"] = m["tool_call_id"]
            out.append(msg)
        elif calls:
            blocks = [call_text(c["function"]["name"], c["function"]["arguments"] or "{}") for c in calls]
            out.append({"role": "assistant", "content": "\n".join(([text] if text else []) + blocks)})
        elif role == "tool":
            response = f"<tool_response>\n{text}\n</tool_response>"
            # consecutive results of parallel calls share one user turn
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "_tool_results": True})
        else:
            out.append({"role": role, "content": text})
    for msg in out:
        msg.pop("_tool_results", None)
    if tools and not native:
        prompt = FALLBACK_TOOLS_PROMPT.format(tools="\n".join(_signature(t) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def render_chat(
    tokenizer, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True
) -> str:
    """The conversation as the model's prompt text (raises what the template raises)."""
    rendered, kwargs = template_call(tokenizer, messages, tools)
    return tokenizer.apply_chat_template(
        rendered, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
    )


def template_call(tokenizer, messages: list[dict], tools: list[dict] | None) -> tuple[list[dict], dict[str, Any]]:
    """The messages and keyword arguments render_chat hands the chat template (for a call it
    does not make itself, e.g. training's assistant-token mask)."""
    native = template_renders_tools(tokenizer)
    kwargs: dict[str, Any] = {}
    if native and tools:
        kwargs["tools"] = [{"type": "function", "function": t.get("function", t)} for t in tools]
    return template_messages(messages, tools, native), kwargs


# ---- reading calls back ----------------------------------------------------------------------


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object's text
    id: str = field(default_factory=lambda: f"call_{secrets.token_hex(12)}")

    def openai(self, index: int | None = None) -> dict:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            out = {"index": index, **out}
        return out


def _read_call(body: str, names: set[str] | None) -> ToolCall | None:
    """A call block's body as a ToolCall, or None where it is not a call of a known tool with
    an object of arguments (then the text stays content)."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict) or (names is not None and obj["name"] not in names):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def parse_tool_calls(text: str, names: set[str] | None = None) -> tuple[str, list[ToolCall]]:
    """(the content outside call blocks, the calls) of a whole answer. A block that is not a
    valid call of a known tool stays in the content, as the model wrote it."""
    stream = ToolCallStream(names)
    content = stream.feed(text) + stream.flush()
    return content, stream.calls


class ToolCallStream:
    """An answer read as it streams: feed(delta) returns the content the client may see now
    (a tail that may open a call block is held back); each complete, valid call is appended to
    `calls` (and to `new`, until taken), so a streamed call only goes out whole and always
    assembles to valid JSON. flush() at the end returns what was held, less a call block left
    unfinished (cut off by max_tokens)."""

    def __init__(self, names: set[str] | None = None):
        self.names = names
        self.calls: list[ToolCall] = []
        self.new: list[ToolCall] = []
        self._buf = ""  # text not yet handed out: a possible block opening, or a whole open block

    def feed(self, delta: str) -> str:
        self._buf += delta
        out = []
        while self._buf:
            start = self._buf.find(CALL_OPEN)
            if start < 0:
                keep = _partial_suffix(self._buf, CALL_OPEN)
                out.append(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
                break
            out.append(self._buf[:start])
            end = self._buf.find(CALL_CLOSE, start)
            if end < 0:
                self._buf = self._buf[start:]
                break
            block = self._buf[start : end + len(CALL_CLOSE)]
            self._buf = self._buf[end + len(CALL_CLOSE) :]
            call = _read_call(block[len(CALL_OPEN) : -len(CALL_CLOSE)].strip(), self.names)
            if call is None:
                out.append(block)
            else:
                self.calls.append(call)
                self.new.append(call)
                if self._buf.startswith("\n"):  # the separator after a block is markup too
                    self._buf = self._buf[1:]
        return "".join(out)

    def take_new(self) -> list[ToolCall]:
        new, self.new = self.new, []
        return new

    def flush(self) -> str:
        rest, self._buf = self._buf, ""
        if rest.startswith(CALL_OPEN):  # a call cut off (max_tokens): never handed out half
            return ""
        return rest


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of text that is a beginning of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


# ---- constraining calls ----------------------------------------------------------------------

# How the grammar writes JSON (llguidance's options): one space after , and :, as json.dumps
# does by default; no other whitespace outside strings (a small model loops on whitespace).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _lark_string(text: str) -> str:
    return json.dumps(text)


def tool_call_grammar(tools: list[dict], parallel: bool = True) -> str:
    """A Lark grammar (llguidance's dialect, %json for a JSON schema) whose sentences are one
    call block, or several with parallel=True, of one of `tools` with arguments valid
    against that tool's parameters schema."""
    rules = []
    names = []
    for i, tool in enumerate(tools):
        fn = tool.get("function", tool)
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        schema = {
            "type": "object",
            "properties": {"name": {"const": fn["name"]}, "arguments": params},
            "required": ["name", "arguments"],
            "additionalProperties": False,
            "x-guidance": JSON_LAYOUT,
        }
        rules.append(f"fn_{i}: %json {json.dumps(schema)}")
        names.append(f"fn_{i}")
    call = f"call: {_lark_string(CALL_OPEN + chr(10))} ({' | '.join(names)}) {_lark_string(chr(10) + CALL_CLOSE)}"
    start = f"start: call ({_lark_string(chr(10))} call)*" if parallel else "start: call"
    return "\n".join([start, call, *rules]) + "\n"
