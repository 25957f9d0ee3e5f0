"""The normalised training example: the one shape every loader produces.

Chat-like sources (OpenAI chat, Alpaca, Dolly) become `messages`: the whole conversation,
whose last message is the assistant turn that is learnt (`completion` repeats its content).
OpenAI legacy prompt/completion pairs stay raw text: `prompt` + `completion`, no template.

Chat examples may call tools, in OpenAI's shape: `tools` lists the function definitions,
an assistant message may carry `tool_calls` (its content then may be None) and a `tool`
message answers one by `tool_call_id`. They are rendered for training exactly as the
server renders requests (tuneloop/chat_format.py), and a final turn that calls tools has
as its completion the text the model writes for the calls (<tool_call> blocks).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from tuneloop.chat_format import call_text, content_text

ROLES = ("system", "user", "assistant")  # the roles of messages written by hand (behaviour suites)
CHAT_ROLES = ROLES + ("tool",)  # the roles a chat training conversation may hold


def message_text(message: dict[str, Any]) -> str:
    """A message's text as the model reads or writes it: its content, then each tool call as
    a <tool_call> block (the fallback format's assistant turn; plain content unchanged)."""
    text = content_text(message.get("content"))
    calls = [call_text(c["function"]["name"], c["function"]["arguments"] or "{}") for c in message.get("tool_calls") or []]
    return "\n".join(([text] if text else []) + calls) if calls else text


@dataclass
class Example:
    example_id: str  # "<file name>:<line>" ("<file name> record <n>" in a JSON array): readable, unique
    completion: str  # the text the model must learn to produce
    prompt: str | None = None  # legacy format only
    # chat-like formats: [{"role", "content"}...], plus "tool_calls" / "tool_call_id" where tools are used
    messages: list[dict[str, Any]] | None = None
    source_file: str = ""
    source_line: int = 0
    source_format: str = ""
    source_record: int | None = None  # JSON array files: the record's 1-based position
    extra: dict[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] | None = None  # chat: the functions the conversation may call (OpenAI's "tools")
    # preference rows only: the non-preferred answer, an assistant message; the preferred one
    # is the last of `messages` (and `completion` its text)
    rejected: dict[str, Any] | None = None

    @property
    def is_preference(self) -> bool:
        return self.rejected is not None

    @property
    def rejected_text(self) -> str:
        """The non-preferred answer's text as the model would write it ("" for other rows)."""
        return message_text(self.rejected) if self.rejected is not None else ""

    @property
    def prompt_text(self) -> str:
        """The input side as flat text (for checks, dedup and leakage; not for training)."""
        if self.messages is None:
            return self.prompt or ""
        return "\n".join(f"{m['role']}: {message_text(m)}" for m in self.messages[:-1])

    @property
    def content_hash(self) -> str:
        """Hash of what the model sees: equal for duplicates, whatever file/line they came from."""
        seen: dict[str, Any] = {"prompt": self.prompt, "messages": self.messages, "completion": self.completion}
        if self.tools:  # only then: examples without tools hash as they always did
            seen["tools"] = self.tools
        if self.rejected is not None:  # likewise: supervised rows keep their hash
            seen["rejected"] = self.rejected
        payload = json.dumps(
            seen,
            sort_keys=True,
            ensure_ascii=False,
        )
        return hashlib.sha256(payload.encode()).hexdigest()

    @property
    def prompt_hash(self) -> str:
        return hashlib.sha256(self.prompt_text.strip().lower().encode()).hexdigest()

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if d["tools"] is None:  # an example without tools is written as it always was
            del d["tools"]
        if d["rejected"] is None:  # and a supervised one without a rejected answer
            del d["rejected"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Example":
        return cls(**d)


@dataclass
class Reject:
    """A row set aside or changed, and why.

    A row that could not become an Example (action "dropped", policy None), or one a
    validation policy dropped or changed (policy "overlong" or "pii", action "dropped",
    "truncated" or "redacted"; a truncated or redacted row is in train/eval, changed).
    """

    source_file: str
    source_line: int  # where the row starts in the file (an editor can jump there)
    reason: str
    # The line (or record) as read, so nothing is lost; for a row a policy touched, the example
    # as normalised, except for personal data or secrets: never copied here (the file is named).
    raw: str
    source_record: int | None = None  # JSON array files: the row is "record N", not a line
    example_id: str = ""  # the example's id, for a row that became one
    action: str = "dropped"
    policy: str | None = None

    @property
    def location(self) -> str:
        if self.source_record is not None:
            return f"{self.source_file} record {self.source_record}"
        return f"{self.source_file}:{self.source_line}"

    def to_dict(self) -> dict[str, Any]:
        # Fields at their default are left out: a row that did not parse reads as it always did.
        defaults = {"source_record": None, "example_id": "", "action": "dropped", "policy": None}
        return {k: v for k, v in asdict(self).items() if k not in defaults or v != defaults[k]}

    def __str__(self) -> str:
        return f"{self.location}: {self.reason}"
