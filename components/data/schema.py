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
    example_id: str  # "<file name>:<line>" -- readable and unique within a dataset
    completion: str  # the text the model must learn to produce
    prompt: str | None = None  # legacy format only
    messages: list[dict[str, str]] | None = None  # chat-like formats: [{"role", "content"}...]
    source_file: str = ""
    source_line: int = 0
    source_format: str = ""
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
    """A row that could not become an Example, and why."""

    source_file: str
    source_line: int
    reason: str
    raw: str  # the line (or record) as read, so nothing is lost

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        return f"{self.source_file}:{self.source_line}: {self.reason}"
