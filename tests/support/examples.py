"""Training rows built in code, for the data gate's tests and its report's."""

from __future__ import annotations

from tuneloop.data.schema import Example


def chat(example_id: str, question: str, answer: str) -> Example:
    return Example(
        example_id=example_id,
        completion=answer,
        messages=[{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
        source_format="chat",
    )


def legacy(example_id: str, prompt: str, completion: str) -> Example:
    return Example(example_id=example_id, prompt=prompt, completion=completion, source_format="legacy")
