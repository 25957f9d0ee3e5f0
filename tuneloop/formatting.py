"""How an Example becomes model input: the one place training, evaluation and serving agree on.

- Chat-like examples go through the tokenizer's chat template, rendered by
  tuneloop.chat_format exactly as the server renders a request (train and serve agree):
  tools, assistant tool calls and tool results in the template's own format where it has
  one, else in the documented fallback (<tool_call> blocks, <tool_response> turns, the
  tools' signatures in the system message). The loss is taken on the assistant tokens
  only: where the template marks them ({% generation %}), every assistant turn is learnt;
  otherwise the prompt prefix (all turns before the last, plus the generation prompt) is
  masked and the last assistant turn is learnt. A turn that calls tools is learnt as the
  text the model writes for the calls.
- Legacy prompt/completion examples are raw text: prompt + completion + eos, loss on the
  completion + eos.
- Preference examples (prompt, chosen, rejected: training.objective dpo) are the prompt as
  generation input and each answer as the tokens the whole conversation adds after it, both
  rendered as a chat example's (encode_preference); what preference tuning trains on and what
  the preference win rate (tuneloop/preference.py) scores.
"""

from __future__ import annotations

from dataclasses import replace

from tuneloop.chat_format import render_chat, template_call
from tuneloop.data.schema import Example

IGNORE_INDEX = -100  # labels with this value carry no loss (torch cross-entropy default)


def _chat_text(example: Example, tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    return render_chat(tokenizer, messages, example.tools, add_generation_prompt=add_generation_prompt)


def _tokens(text: str, tokenizer) -> list[int]:
    # What apply_chat_template(tokenize=True) does with its text: the template writes the
    # special tokens itself, so none are added.
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def prompt_ids(example: Example, tokenizer) -> list[int]:
    """Token ids the model is given to produce the completion (generation input)."""
    if example.messages is None:
        return tokenizer(example.prompt or "", add_special_tokens=False)["input_ids"]
    return _tokens(prompt_text(example, tokenizer), tokenizer)


def prompt_text(example: Example, tokenizer) -> str:
    """The generation input as text (what a client would send, as the server renders it)."""
    if example.messages is None:
        return example.prompt or ""
    return _chat_text(example, tokenizer, example.messages[:-1], add_generation_prompt=True)


def _full_ids(example: Example, tokenizer) -> list[int]:
    """The whole conversation's token ids, the answer included."""
    return _tokens(_chat_text(example, tokenizer, example.messages or [], add_generation_prompt=False), tokenizer)


def _answer_ids(example: Example, tokenizer, answer: dict, prompt: list[int]) -> list[int]:
    """The tokens the conversation ending in `answer` adds after the prompt's tokens."""
    messages = [*(example.messages or [])[:-1], answer]
    ids = _tokens(_chat_text(example, tokenizer, messages, add_generation_prompt=False), tokenizer)
    if ids[: len(prompt)] != prompt:
        raise ValueError(
            f"{example.example_id}: chat template renders the prompt differently with and "
            "without the answer; cannot locate the answer's tokens"
        )
    return ids[len(prompt) :]


def encode_preference(example: Example, tokenizer) -> dict[str, list[int]]:
    """prompt_ids, chosen_ids and rejected_ids of a preference example (TRL's DPO columns):
    the prompt as the server renders a request, each answer as the tokens the whole
    conversation with it adds (its end-of-turn marker included). Not cut: the trainer's
    collator keeps max_length. ValueError for a row that is not a preference pair."""
    if example.rejected is None or not example.messages:
        raise ValueError(f"{example.example_id}: not a preference example (no rejected answer)")
    prompt = prompt_ids(example, tokenizer)
    return {
        "prompt_ids": prompt,
        "chosen_ids": _answer_ids(example, tokenizer, example.messages[-1], prompt),
        "rejected_ids": _answer_ids(example, tokenizer, example.rejected, prompt),
    }


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
            # the conversation and keyword arguments as render_chat hands them to the template
            messages, kwargs = template_call(tokenizer, example.messages, example.tools)
            out = tokenizer.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, **kwargs
            )
            mask = out.get("assistant_masks")
            if mask is not None and any(mask):
                ids = list(out["input_ids"])
                labels = [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]
        except (ValueError, TypeError, KeyError):
            pass  # template without {% generation %} markers: fall back to prefix masking
        if ids is None:
            p = prompt_ids(example, tokenizer)
            answer = _answer_ids(example, tokenizer, example.messages[-1], p)
            ids, labels = p + answer, [IGNORE_INDEX] * len(p) + answer
    ids, labels = ids[:max_length], labels[:max_length]
    return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels}


def count_tokens(example: Example, tokenizer) -> int:
    """Tokens of the whole example as encode_example encodes it, before its cut to max_length:
    what the data gate and the length policy (validation.overlong) measure."""
    if example.messages is None:
        completion = tokenizer(example.completion, add_special_tokens=False)["input_ids"]
        return len(prompt_ids(example, tokenizer)) + len(completion) + 1  # + eos
    if example.rejected is not None:  # a preference pair: the longer of its two conversations
        with_rejected = replace(example, messages=[*(example.messages or [])[:-1], example.rejected])
        return max(len(_full_ids(example, tokenizer)), len(_full_ids(with_rejected, tokenizer)))
    # Both of encode_example's paths encode exactly this (with or without the assistant mask).
    return len(_full_ids(example, tokenizer))


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
