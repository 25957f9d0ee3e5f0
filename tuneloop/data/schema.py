"""The normalised training example: the one shape every loader produces.

Chat-like sources (OpenAI chat, Alpaca, Dolly) become `messages`: the whole conversation,
whose last message is the assistant turn that is learnt (`completion` repeats its content).
OpenAI legacy prompt/completion pairs stay raw text: `prompt` + `completion`, no template.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant")


@dataclass
class Example:
    example_id: str  # "<file name>:<line>" ("<file name> record <n>" in a JSON array): readable, unique
    completion: str  # the text the model must learn to produce
    prompt: str | None = None  # legacy format only
    messages: list[dict[str, str]] | None = None  # chat-like formats: [{"role", "content"}...]
    source_file: str = ""
    source_line: int = 0
    source_format: str = ""
    source_record: int | None = None  # JSON array files: the record's 1-based position
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_text(self) -> str:
        """The input side as flat text (for checks, dedup and leakage; not for training)."""
        if self.messages is None:
            return self.prompt or ""
        return "\n".join(f"{m['role']}: {m['content']}" for m in self.messages[:-1])

    @property
    def content_hash(self) -> str:
        """Hash of what the model sees: equal for duplicates, whatever file/line they came from."""
        payload = json.dumps(
            {"prompt": self.prompt, "messages": self.messages, "completion": self.completion},
            sort_keys=True,
            ensure_ascii=False,
        )
        return hashlib.sha256(payload.encode()).hexdigest()

    @property
    def prompt_hash(self) -> str:
        return hashlib.sha256(self.prompt_text.strip().lower().encode()).hexdigest()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

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
