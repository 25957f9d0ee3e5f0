"""Read fine-tuning data in the formats people already have, into `Example`s.

Formats (see tuneloop/data/schema.py for the normalised shape):

  chat    OpenAI chat fine-tuning JSONL   {"messages": [{"role", "content"}, ...], "tools"?: [...]}
  legacy  OpenAI legacy JSONL             {"prompt": ..., "completion": ...}
  alpaca  Alpaca, a JSON array file or JSONL of {"instruction", "input", "output"}
  dolly   Dolly JSONL                     {"instruction", "context", "response", "category"?}
  dpo     OpenAI DPO (preference) JSONL   {"input": {"messages", "tools"?, "parallel_tool_calls"?},
                                           "preferred_output": [assistant message],
                                           "non_preferred_output": [assistant message]}

The first four are supervised rows (a completion to learn); dpo rows are preference pairs (a
prompt, the preferred answer and the non-preferred one: Example.rejected), what preference
tuning (training.objective dpo) trains on. A file holds one kind: one that mixes preference
rows with supervised ones is refused whole (DataError naming a row of each), since either
kind's rows would be rejects to the other. A dpo row is refused when an output is missing,
is not one assistant message, is empty, or is the same answer as the other.

Every row either becomes an Example or a Reject that names file, line and reason; nothing
is dropped without a trace (blank lines are not rows: they are skipped). Problems with the
file as a whole (missing, empty, not UTF-8, a JSON array that does not parse) raise DataError.

Line numbers are 1-based lines of the file. example_id is "<file name>:<line>" for JSONL;
in a JSON array a row is a record, not a line (a minified array puts every record on line 1):
example_id is "<file name> record <n>" with n the record's 1-based position in the array,
a Reject and messages say "record <n>" too, and source_line is still the line where the
record starts, so an editor can jump to it.

Chat rows may carry tools as OpenAI's fine-tuning format has them: function definitions in
"tools", assistant messages with "tool_calls" (content null when they only call), and
"tool" messages answering a call by "tool_call_id". The contract checks that each call is
well formed (an id, a function name among the row's tools when it lists any, arguments that
are a JSON object's text) and that each tool message answers a call made earlier in the
conversation; the legacy "functions" / "function_call" form is refused with a pointer to
the new one. A final assistant turn that calls tools is learnt as the model writes calls
(tuneloop/chat_format.py: <tool_call> blocks); that text is the Example's completion.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from tuneloop.data.schema import CHAT_ROLES, Example, Reject, message_text

FORMATS = ("chat", "legacy", "alpaca", "dolly", "dpo")

# The keys that identify each format, as told to the user when detection fails.
FORMAT_KEYS = {
    "chat": "messages",
    "legacy": "prompt, completion",
    "alpaca": "instruction, input, output",
    "dolly": "instruction, context, response",
    "dpo": "input, preferred_output, non_preferred_output",
}
PREFERENCE_FORMATS = ("dpo",)  # rows that are pairs (chosen, rejected), not one completion

# OpenAI's legacy format ends completions with this literal text; it marks the end of the
# example and must never be learnt as words.
END_MARKER = "<|endoftext|>"
_END_MARKER_RE = re.compile(r"\s*" + re.escape(END_MARKER) + r"\s*\Z")

# How many leading records auto-detection looks at.
DETECT_RECORDS = 50


class DataError(Exception):
    """A data file (or set of rows) that cannot be used; the message says which and why."""


@dataclass
class LoadResult:
    examples: list[Example] = field(default_factory=list)
    rejects: list[Reject] = field(default_factory=list)
    format: str = ""


class RowError(ValueError):
    """One row's problem; becomes a Reject (internal to this module)."""


# ---------------------------------------------------------------------------- reading

@dataclass
class _Record:
    line: int  # 1-based line where the record starts
    number: int  # the number in example_id: the line (JSONL) or the array position
    raw: str  # the text as read
    value: Any = None
    error: str | None = None  # set when the text is not valid JSON
    in_array: bool = False  # a record of a JSON array: its location is "record N", not a line

    @property
    def where(self) -> str:
        return f"record {self.number}" if self.in_array else f"line {self.line}"

    def at(self, path: Path | str) -> str:
        """The record's location as messages and ids give it: "file:3" or "file record 3"."""
        return f"{path} record {self.number}" if self.in_array else f"{path}:{self.line}"


def _json_type(value: Any) -> str:
    """JSON's name for a Python value's type, as the user wrote it in the file."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _read_text(path: Path) -> str:
    if not path.exists():
        raise DataError(f"{path}: file not found")
    if not path.is_file():
        raise DataError(f"{path}: not a file")
    data = path.read_bytes()
    try:
        # utf-8-sig: a byte-order mark (some Windows editors add one) is not data.
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise DataError(
            f"{path}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); "
            "save the file as UTF-8"
        ) from None
    if not text.strip():
        raise DataError(f"{path}: empty file, no rows")
    return text


def _jsonl_records(text: str) -> Iterator[_Record]:
    # Split on "\n" only: str.splitlines() would also split on U+2028 and friends,
    # which JSON allows unescaped inside strings.
    for number, line in enumerate(text.split("\n"), start=1):
        line = line.rstrip("\r")
        if not line.strip():
            continue  # blank lines are not rows
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            yield _Record(number, number, line, error=f"invalid JSON: {exc.msg} (column {exc.colno})")
            continue
        yield _Record(number, number, line, value=value)


def _array_records(path: Path, text: str) -> list[_Record]:
    """Walk a JSON array record by record, noting the line each record starts on.

    A record that does not parse leaves no reliable place to resume, so that is a
    file-level error (with its line and column) rather than a Reject.
    """
    decoder = json.JSONDecoder()
    ws = re.compile(r"\s*")
    records: list[_Record] = []
    pos = ws.match(text, 0).end() + 1  # past "["
    lines_before, counted_to = 0, 0

    def line_at(offset: int) -> int:
        nonlocal lines_before, counted_to
        lines_before += text.count("\n", counted_to, offset)
        counted_to = offset
        return lines_before + 1

    pos = ws.match(text, pos).end()
    if text.startswith("]", pos):
        return records
    while True:
        start = pos
        try:
            value, pos = decoder.raw_decode(text, start)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{exc.lineno}: invalid JSON array: {exc.msg} (column {exc.colno})") from None
        records.append(_Record(line_at(start), len(records) + 1, text[start:pos], value=value, in_array=True))
        pos = ws.match(text, pos).end()
        if text.startswith(",", pos):
            pos = ws.match(text, pos + 1).end()
            continue
        if text.startswith("]", pos):
            break
        line = line_at(pos)
        raise DataError(f"{path}:{line}: invalid JSON array: expected ',' or ']' after record {len(records)}")
    if text[pos + 1:].strip():
        raise DataError(f"{path}:{line_at(pos + 1)}: invalid JSON array: text after the closing ']'")
    return records


def _read_records(path: Path, text: str) -> list[_Record]:
    stripped = text.lstrip()
    if stripped.startswith("["):
        first_line = stripped.split("\n", 1)[0].strip()
        try:
            json.loads(first_line)
            one_line_value = True
        except json.JSONDecodeError:
            one_line_value = False
        # A JSONL file whose first row happens to be an array (a mistake, rejected below)
        # versus a JSON array file: a complete JSON value on line 1 followed by more lines
        # is JSONL; otherwise the file is one array.
        if not (one_line_value and "\n" in stripped.strip()):
            return _array_records(path, text)
    return list(_jsonl_records(text))


# ---------------------------------------------------------------------- detection

def _formats_of(keys: set[str]) -> list[str]:
    found = []
    if "messages" in keys:
        found.append("chat")
    if {"prompt", "completion"} <= keys:
        found.append("legacy")
    if "instruction" in keys and "output" in keys:
        found.append("alpaca")
    if "instruction" in keys and "response" in keys:
        found.append("dolly")
    if "preferred_output" in keys or "non_preferred_output" in keys:
        found.append("dpo")
    return found


def _check_one_kind(path: Path, records: list[_Record]) -> None:
    """A file of preference rows and supervised rows together is refused whole."""
    first: dict[bool, _Record] = {}  # is a preference row -> the first row of that kind
    for r in records:
        if isinstance(r.value, dict):
            fmts = _formats_of(set(r.value))
            if len(fmts) == 1:  # a row that fits two formats is detect_format's to refuse
                first.setdefault(fmts[0] in PREFERENCE_FORMATS, r)
        if len(first) == 2:
            pref, sup = first[True], first[False]
            sup_fmt = _formats_of(set(sup.value))[0]
            raise DataError(
                f"{path}: mixes preference rows (OpenAI's DPO format, first at {pref.where}) with supervised "
                f"rows ({sup_fmt}, first at {sup.where}); a file must be all one kind: put them in two files"
            )


def detect_format(path: Path, records: list[_Record]) -> str:
    """The format named by the keys of the first records that are JSON objects."""
    objects = [r for r in records if isinstance(r.value, dict)][:DETECT_RECORDS]
    if not objects:
        problems = "; ".join(f"{r.where}: {r.error or 'expected a JSON object, got ' + _json_type(r.value)}"
                             for r in records[:3])
        raise DataError(f"{path}: no JSON object rows to tell the format from ({problems})")
    seen: dict[str, str] = {}  # format -> where the first row that looks like it is
    for r in objects:
        fmts = _formats_of(set(r.value))
        if len(fmts) > 1:
            raise DataError(
                f"{r.at(path)}: ambiguous format: keys {sorted(r.value)} fit {' and '.join(fmts)}; "
                "set data.format explicitly"
            )
        if fmts:
            seen.setdefault(fmts[0], r.where)
    if len(seen) > 1:
        where = ", ".join(f"{fmt} ({at})" for fmt, at in seen.items())
        raise DataError(f"{path}: ambiguous format: the first rows look like {where}; "
                        "use one format per file or set data.format explicitly")
    if not seen:
        keys = sorted({k for r in objects for k in r.value})
        expected = "; ".join(f"{fmt}: {keys}" for fmt, keys in FORMAT_KEYS.items())
        raise DataError(f"{path}: unknown format: keys seen {keys}; expected one of {expected}")
    return next(iter(seen))


# ---------------------------------------------------------------------- normalisers

def _get_text(record: dict, key: str, required: bool = True, prefix: str = "") -> str:
    """A string field: missing, wrong type or blank are the row's error."""
    if key not in record or (not required and record[key] is None):
        if required:
            raise RowError(f"{prefix}missing field '{key}'")
        return ""
    value = record[key]
    if not isinstance(value, str):
        raise RowError(f"{prefix}field '{key}' must be a string, got {_json_type(value)}")
    if required and not value.strip():
        raise RowError(f"{prefix}field '{key}' is empty")
    return value


def _rest(record: dict, known: set[str]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if k not in known}


def _tools(record: dict) -> list[dict[str, Any]] | None:
    """The row's `tools` (OpenAI's function definitions), checked; None when the row has none."""
    if "functions" in record or "function_call" in record:
        raise RowError("the legacy 'functions' / 'function_call' fields are not supported: "
                       "list the functions under 'tools' and write the calls as 'tool_calls'")
    if "parallel_tool_calls" in record and not isinstance(record["parallel_tool_calls"], bool):
        raise RowError(f"field 'parallel_tool_calls' must be a boolean, got {_json_type(record['parallel_tool_calls'])}")
    if record.get("tools") is None:
        return None
    tools = record["tools"]
    if not isinstance(tools, list):
        raise RowError(f"field 'tools' must be an array, got {_json_type(tools)}")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        prefix = f"tools[{i}]: "
        if not isinstance(tool, dict):
            raise RowError(f"{prefix}expected an object, got {_json_type(tool)}")
        if tool.get("type", "function") != "function":
            raise RowError(f"{prefix}unknown tool type {tool['type']!r} (expected 'function')")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise RowError(f"{prefix}field 'function' must be an object, got {_json_type(fn)}")
        name = _get_text(fn, "name", prefix=prefix + "function: ")
        if name in names:
            raise RowError(f"{prefix}function '{name}' is defined twice")
        names.add(name)
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise RowError(f"{prefix}function '{name}': field 'parameters' must be an object (a JSON schema), "
                           f"got {_json_type(fn['parameters'])}")
    return tools or None


def _tool_calls(m: dict, prefix: str, tool_names: set[str] | None, call_ids: set[str]) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls`, checked and normalised to OpenAI's shape; each id is
    added to call_ids (the calls a later tool message may answer)."""
    calls = m["tool_calls"]
    if not isinstance(calls, list):
        raise RowError(f"{prefix}field 'tool_calls' must be an array, got {_json_type(calls)}")
    out = []
    for j, call in enumerate(calls):
        at = f"{prefix}tool_calls[{j}]: "
        if not isinstance(call, dict):
            raise RowError(f"{at}expected an object, got {_json_type(call)}")
        call_id = _get_text(call, "id", prefix=at)
        if call_id in call_ids:
            raise RowError(f"{at}call id '{call_id}' is used twice in the conversation")
        if call.get("type", "function") != "function":
            raise RowError(f"{at}unknown call type {call['type']!r} (expected 'function')")
        fn = call.get("function")
        if not isinstance(fn, dict):
            raise RowError(f"{at}field 'function' must be an object, got {_json_type(fn)}")
        name = _get_text(fn, "name", prefix=at + "function: ")
        if tool_names is not None and name not in tool_names:
            raise RowError(f"{at}calls '{name}', which is not among the row's tools ({', '.join(sorted(tool_names))})")
        arguments = _get_text(fn, "arguments", prefix=at + "function: ")
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise RowError(f"{at}function '{name}': 'arguments' is not valid JSON: {exc.msg} "
                           f"(column {exc.colno})") from None
        if not isinstance(parsed, dict):
            raise RowError(f"{at}function '{name}': 'arguments' must be a JSON object, got {_json_type(parsed)}")
        call_ids.add(call_id)
        out.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
    return out


# Per-message fields that are part of the conversation (kept in the message); any other
# (OpenAI's "weight" on assistant turns, ...) is kept in extra["message_fields"], not used.
_MESSAGE_KEYS = {"role", "content", "tool_calls", "tool_call_id"}


def _chat_messages(
    raw_messages: list, tool_names: set[str] | None, call_ids: set[str], answered: set[str], where: str = "messages"
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(messages, each message's other fields) of a conversation, checked; `where` names the
    array in the reasons. call_ids and answered carry the calls made and answered so far."""
    messages, message_fields = [], []
    for i, m in enumerate(raw_messages):
        prefix = f"{where}[{i}]: "
        if not isinstance(m, dict):
            raise RowError(f"{prefix}expected an object, got {_json_type(m)}")
        role = _get_text(m, "role", prefix=prefix)
        if "function_call" in m or role == "function":
            raise RowError(f"{prefix}the legacy 'function_call' / 'function' role form is not supported: "
                           "write the call as 'tool_calls' and its result as a 'tool' message")
        if role not in CHAT_ROLES:
            raise RowError(f"{prefix}unknown role '{role}' (expected system, user, assistant or tool)")
        has_calls = m.get("tool_calls") not in (None, [])  # null or [] is no call (as clients send it)
        if has_calls and role != "assistant":
            raise RowError(f"{prefix}only an assistant message may carry 'tool_calls', not a '{role}' message")
        tool_fields: dict[str, Any] = {}
        if has_calls:
            # An assistant message that only calls tools has no text: null (or no) content.
            content = None if m.get("content") is None else _get_text(m, "content", required=False, prefix=prefix)
            tool_fields["tool_calls"] = _tool_calls(m, prefix, tool_names, call_ids)
        elif role == "tool":
            if m.get("tool_call_id") is None:
                raise RowError(f"{prefix}a tool message needs 'tool_call_id': the id of the call it answers")
            call_id = _get_text(m, "tool_call_id", prefix=prefix)
            if call_id not in call_ids:
                raise RowError(f"{prefix}the tool message answers call id '{call_id}', "
                               "which no earlier assistant message made")
            if call_id in answered:
                raise RowError(f"{prefix}call id '{call_id}' is answered twice")
            answered.add(call_id)
            if m.get("content") is None:
                raise RowError(f"{prefix}missing field 'content' (the tool's result)")
            content = _get_text(m, "content", required=False, prefix=prefix)  # a result may be ""
            tool_fields["tool_call_id"] = call_id
        else:
            content = _get_text(m, "content", prefix=prefix)
        message = {"role": role, "content": content, **tool_fields}
        messages.append(message)
        message_fields.append(_rest(m, _MESSAGE_KEYS))
    return messages, message_fields


def _chat(record: dict) -> dict[str, Any]:
    if "messages" not in record:
        raise RowError("missing field 'messages'")
    raw_messages = record["messages"]
    if not isinstance(raw_messages, list):
        raise RowError(f"field 'messages' must be an array, got {_json_type(raw_messages)}")
    if not raw_messages:
        raise RowError("field 'messages' is empty")
    tools = _tools(record)
    tool_names = {t["function"]["name"] for t in tools} if tools else None
    messages, message_fields = _chat_messages(raw_messages, tool_names, set(), set())
    if not any(m["role"] == "assistant" for m in messages):
        raise RowError("no assistant message: nothing to learn")
    if messages[-1]["role"] != "assistant":
        raise RowError(f"last message must be from the assistant, got '{messages[-1]['role']}'")
    extra = _rest(record, {"messages", "tools"})
    if any(message_fields):
        extra["message_fields"] = message_fields
    out: dict[str, Any] = {"messages": messages, "completion": message_text(messages[-1]), "extra": extra}
    if tools:
        out["tools"] = tools
    return out


PREFERRED, NON_PREFERRED = "preferred_output", "non_preferred_output"


def _dpo(record: dict) -> dict[str, Any]:
    """OpenAI's DPO row: the prompt conversation in input.messages (and its tools), and one
    assistant message each in preferred_output and non_preferred_output."""
    if "input" not in record:
        raise RowError("missing field 'input' (the prompt: {\"messages\": [...]})")
    inp = record["input"]
    if not isinstance(inp, dict):
        raise RowError(f"field 'input' must be an object, got {_json_type(inp)}")
    if "messages" not in inp:
        raise RowError("input: missing field 'messages'")
    raw_messages = inp["messages"]
    if not isinstance(raw_messages, list):
        raise RowError(f"input: field 'messages' must be an array, got {_json_type(raw_messages)}")
    if not raw_messages:
        raise RowError("input: field 'messages' is empty")
    try:
        tools = _tools(inp)
    except RowError as exc:
        raise RowError(f"input: {exc}") from None
    tool_names = {t["function"]["name"] for t in tools} if tools else None
    call_ids: set[str] = set()
    answered: set[str] = set()
    prompt, prompt_fields = _chat_messages(raw_messages, tool_names, call_ids, answered, where="input.messages")
    if prompt[-1]["role"] not in ("user", "tool"):
        raise RowError(f"input.messages: the last message must be a user or tool message (the outputs answer it), "
                       f"got '{prompt[-1]['role']}'")
    answers: dict[str, dict[str, Any]] = {}
    answer_fields: dict[str, dict[str, Any]] = {}
    for key in (PREFERRED, NON_PREFERRED):
        if key not in record:
            raise RowError(f"missing field '{key}' (a list of one assistant message)")
        output = record[key]
        if not isinstance(output, list):
            raise RowError(f"field '{key}' must be an array of one assistant message, got {_json_type(output)}")
        if len(output) != 1:
            raise RowError(f"field '{key}' must hold exactly one assistant message, got {len(output)}")
        if isinstance(output[0], dict) and output[0].get("role") != "assistant":
            raise RowError(f"{key}[0]: must be an assistant message, got role {output[0].get('role')!r}")
        # Each answer continues the same prompt: the calls it makes are its own.
        (answer,), (fields,) = _chat_messages(output, tool_names, set(call_ids), set(answered), where=key)
        answers[key], answer_fields[key] = answer, fields
    chosen, rejected = answers[PREFERRED], answers[NON_PREFERRED]
    if chosen == rejected:
        raise RowError(f"{PREFERRED} and {NON_PREFERRED} are the same answer: nothing to prefer")
    extra = {**_rest(inp, {"messages", "tools"}), **_rest(record, {"input", PREFERRED, NON_PREFERRED})}
    if any(prompt_fields) or any(answer_fields.values()):
        extra["message_fields"] = [*prompt_fields, answer_fields[PREFERRED]]
        if answer_fields[NON_PREFERRED]:
            extra["rejected_fields"] = answer_fields[NON_PREFERRED]
    out: dict[str, Any] = {"messages": [*prompt, chosen], "completion": message_text(chosen), "rejected": rejected,
                           "extra": extra}
    if tools:
        out["tools"] = tools
    return out


def _legacy(record: dict) -> dict[str, Any]:
    prompt = _get_text(record, "prompt")
    completion = _get_text(record, "completion")
    stripped = _END_MARKER_RE.sub("", completion)
    if not stripped.strip():
        raise RowError(f"field 'completion' is empty once the {END_MARKER} end marker is removed")
    return {"prompt": prompt, "completion": stripped, "extra": _rest(record, {"prompt", "completion"})}


def _instruction_pair(user: str, assistant: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]


# Alpaca and Dolly fields are hand-written text with stray edge whitespace in the wild:
# they are stripped before being joined into messages (chat content is kept byte for byte).
def _alpaca(record: dict) -> dict[str, Any]:
    instruction = _get_text(record, "instruction").strip()
    extra_input = _get_text(record, "input", required=False).strip()
    output = _get_text(record, "output").strip()
    user = instruction + ("\n\n" + extra_input if extra_input else "")
    return {"messages": _instruction_pair(user, output), "completion": output,
            "extra": _rest(record, {"instruction", "input", "output"})}


def _dolly(record: dict) -> dict[str, Any]:
    instruction = _get_text(record, "instruction").strip()
    context = _get_text(record, "context", required=False).strip()
    response = _get_text(record, "response").strip()
    user = instruction + ("\n\nContext:\n" + context if context else "")
    # "category" (Dolly's task type) lands in extra with any other key.
    return {"messages": _instruction_pair(user, response), "completion": response,
            "extra": _rest(record, {"instruction", "context", "response"})}


NORMALISERS: dict[str, Callable[[dict], dict[str, Any]]] = {
    "chat": _chat, "legacy": _legacy, "alpaca": _alpaca, "dolly": _dolly, "dpo": _dpo,
}


def row_problem(record: Any, format: str) -> str | None:
    """Why one row (as parsed from JSON) does not meet the data contract of `format`, or None:
    for rows made by code (feedback exports) before they are written."""
    if not isinstance(record, dict):
        return f"expected a JSON object, got {_json_type(record)}"
    try:
        NORMALISERS[format](record)
    except RowError as exc:
        return str(exc)
    return None


# ---------------------------------------------------------------------- entry point

def load_file(path: Path | str, format: str = "auto") -> LoadResult:
    """Read one data file into Examples and Rejects.

    format: "auto" (detected from the keys of the first records) or one of FORMATS.
    Raises DataError for problems with the file as a whole.
    """
    path = Path(path)
    if format != "auto" and format not in NORMALISERS:
        raise DataError(f"unknown data format {format!r}; expected auto or one of {', '.join(FORMATS)}")
    text = _read_text(path)
    records = _read_records(path, text)
    if not records:
        raise DataError(f"{path}: no rows (an empty JSON array)")
    _check_one_kind(path, records)
    fmt = detect_format(path, records) if format == "auto" else format
    normalise = NORMALISERS[fmt]
    result = LoadResult(format=fmt)
    for r in records:
        try:
            if r.error:
                raise RowError(r.error)
            if not isinstance(r.value, dict):
                raise RowError(f"expected a JSON object, got {_json_type(r.value)}")
            fields = normalise(r.value)
        except RowError as exc:
            result.rejects.append(Reject(source_file=str(path), source_line=r.line, reason=str(exc), raw=r.raw,
                                         source_record=r.number if r.in_array else None))
            continue
        result.examples.append(Example(
            example_id=r.at(path.name),
            source_file=str(path),
            source_line=r.line,
            source_format=fmt,
            source_record=r.number if r.in_array else None,
            **fields,
        ))
    return result
