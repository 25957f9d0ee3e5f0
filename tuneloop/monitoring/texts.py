"""The text that is monitored: what the user wrote (a chat's last user message, a
completion's prompt), from a training example and from a request-log record alike."""

from __future__ import annotations


def example_text(example) -> str | None:
    """tuneloop.data.schema.Example -> its user text."""
    if example.messages is None:
        return example.prompt or None
    users = [m["content"] for m in example.messages[:-1] if m.get("role") == "user"]
    return users[-1] if users else None


def record_text(record: dict) -> str | None:
    """A request-log record -> the user text of its prompt (None when not logged)."""
    prompt = record.get("prompt")
    if prompt is None:
        return None
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        users = [m.get("content") for m in prompt if m.get("role") == "user" and isinstance(m.get("content"), str)]
        return users[-1] if users else None
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return prompt[-1]  # several completion prompts, or the screened texts of a refusal
    return None
