"""A small, learnable training task (sentiment words -> "positive"/"negative"): a few dozen
steps show a clear drop in eval loss and correct greedy answers. The training plan's tests
and the real jobs' use the same rows. The same task as preference pairs (OpenAI's DPO
format: the right label preferred, the wrong one not) for preference tuning's tests."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tuneloop.data.schema import Example

GOOD = "great lovely excellent wonderful superb fantastic perfect".split()
BAD = "awful terrible broken useless horrible poor boring".split()
THINGS = "phone book movie lamp chair song game kettle".split()


def sentiment_examples(n: int, seed: int) -> list[Example]:
    rng = random.Random(seed)
    examples = []
    for i in range(n):
        positive = rng.random() < 0.5
        a, b = rng.sample(GOOD if positive else BAD, 2)
        label = "positive" if positive else "negative"
        messages = [
            {
                "role": "user",
                "content": f"Is this review positive or negative?\nThe {rng.choice(THINGS)} was {a} and {b}.",
            },
            {"role": "assistant", "content": label},
        ]
        examples.append(Example(example_id=f"sentiment:{seed}:{i}", completion=label, messages=messages))
    return examples


def write_jsonl(path: Path, examples: list[Example]) -> Path:
    path.write_text("".join(json.dumps(e.to_dict()) + "\n" for e in examples))
    return path


def sentiment_dataset(folder: Path) -> Path:
    """folder laid out like a prepared dataset: train.jsonl (256 rows) + eval.jsonl (32)."""
    write_jsonl(folder / "train.jsonl", sentiment_examples(256, seed=0))
    write_jsonl(folder / "eval.jsonl", sentiment_examples(32, seed=1))
    return folder


def sentiment_preference_rows(n: int, seed: int) -> list[dict]:
    """The sentiment task as OpenAI DPO rows: the right label preferred, the other one not.
    Half the pairs prefer each word, so a model that merely likes one word wins half."""
    rows = []
    for ex in sentiment_examples(n, seed):
        wrong = "negative" if ex.completion == "positive" else "positive"
        rows.append(
            {
                "input": {"messages": ex.messages[:-1]},
                "preferred_output": [{"role": "assistant", "content": ex.completion}],
                "non_preferred_output": [{"role": "assistant", "content": wrong}],
            }
        )
    return rows
