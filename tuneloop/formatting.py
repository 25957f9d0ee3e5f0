"""How an Example becomes model input: the one place training, evaluation and serving agree on.

- Chat-like examples go through the tokenizer's chat template. The loss is taken on the
  assistant tokens only: where the template marks them ({% generation %}), every assistant
  turn is learnt; otherwise the prompt prefix (all turns before the last, plus the
  generation prompt) is masked and the last assistant turn is learnt.
- Legacy prompt/completion examples are raw text: prompt + completion + eos, loss on the
  completion + eos.
"""

from __future__ import annotations

from typing import Any

from tuneloop.data.schema import Example

IGNORE_INDEX = -100  # labels with this value carry no loss (torch cross-entropy default)


def _as_ids(out: Any) -> list[int]:
    # apply_chat_template returns a list, or a BatchEncoding/dict, depending on version/options.
    if isinstance(out, dict) or hasattr(out, "keys"):
        return list(out["input_ids"])
    return list(out)


def prompt_ids(example: Example, tokenizer) -> list[int]:
    """Token ids the model is given to produce the completion (generation input)."""
    if example.messages is None:
        return tokenizer(example.prompt or "", add_special_tokens=False)["input_ids"]
    return _as_ids(tokenizer.apply_chat_template(example.messages[:-1], add_generation_prompt=True, tokenize=True))


def prompt_text(example: Example, tokenizer) -> str:
    """The generation input as text (what a client would send)."""
    if example.messages is None:
        return example.prompt or ""
    return tokenizer.apply_chat_template(example.messages[:-1], add_generation_prompt=True, tokenize=False)


def encode_example(example: Example, tokenizer, max_length: int) -> dict[str, list[int]]:
    """input_ids, attention_mask and labels (prompt masked with IGNORE_INDEX), truncated to max_length."""
    eos = tokenizer.eos_token_id
    if example.messages is None:
        p = prompt_ids(example, tokenizer)
        c = tokenizer(example.completion, add_special_tokens=False)["input_ids"] + [eos]
        ids = p + c
        labels = [IGNORE_INDEX] * len(p) + c
    else:
        ids, labels = None, None
        try:
            out = tokenizer.apply_chat_template(
                example.messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            mask = out.get("assistant_masks")
            if mask is not None and any(mask):
                ids = list(out["input_ids"])
                labels = [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]
        except (ValueError, TypeError, KeyError):
            pass  # template without {% generation %} markers: fall back to prefix masking
        if ids is None:
            p = prompt_ids(example, tokenizer)
            ids = _as_ids(tokenizer.apply_chat_template(example.messages, tokenize=True))
            if ids[: len(p)] != p:
                raise ValueError(
                    f"{example.example_id}: chat template renders the prompt differently with and "
                    "without the answer; cannot locate the assistant tokens"
                )
            labels = [IGNORE_INDEX] * len(p) + ids[len(p) :]
    ids, labels = ids[:max_length], labels[:max_length]
    return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels}


def count_tokens(example: Example, tokenizer) -> int:
    """Tokens of the whole example as encode_example encodes it, before its cut to max_length:
    what the data gate and the length policy (validation.overlong) measure."""
    if example.messages is None:
        completion = tokenizer(example.completion, add_special_tokens=False)["input_ids"]
        return len(prompt_ids(example, tokenizer)) + len(completion) + 1  # + eos
    # Both of encode_example's paths encode exactly this (with or without the assistant mask).
    return len(_as_ids(tokenizer.apply_chat_template(example.messages, tokenize=True)))


def context_window(model_config, tokenizer=None) -> int | None:
    """The longest sequence the model takes, from its config (or the tokenizer); None if unknown."""
    for name in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = getattr(model_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    value = getattr(tokenizer, "model_max_length", None)
    # Tokenizers without a limit report a huge sentinel (int(1e30)).
    return value if isinstance(value, int) and 0 < value < 10**8 else None


def clean_completion(text: str, tokenizer) -> str:
    """Cut a generated completion at the first end marker and strip whitespace."""
    for marker in ("<|im_end|>", "<|endoftext|>", tokenizer.eos_token or ""):
        if marker and marker in text:
            text = text.split(marker, 1)[0]
    return text.strip()
