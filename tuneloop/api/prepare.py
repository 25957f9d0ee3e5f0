"""A generation request before it runs, the same for completions and chat: the model name,
the prompt's bound, tokenisation (off the event loop), the parameters OpenAI knows and this
server refuses, the context window, and one SamplingParams per choice."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from tuneloop.api.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields, TokenizeRequest
from tuneloop.api.server import OpenAIServer
from tuneloop.api.structured import ToolPlan
from tuneloop.chat_format import arguments_object, content_text, render_chat
from tuneloop.serving.constraints import Constraint
from tuneloop.serving.engine import SamplingParams
from tuneloop.serving.errors import ContextLengthExceeded, InvalidRequest, ModelNotFound


@dataclass
class Prepared:
    prompts: list[list[int]]  # one per choice (a prompt repeated n times)
    params: list[SamplingParams]  # one per choice
    stop: list[str]
    include_usage: bool
    prompt_tokens: int  # each prompt counted once, whatever n is
    echo: list[str] | None = None  # per choice: the prompt's text, returned before the completion
    tools: ToolPlan | None = None  # chat with tools: how the answer's calls are read
    readers: list | None = None  # streamed chat with tools: each choice's ToolCallStream


def check_model(server: OpenAIServer, model: str) -> None:
    if model not in server.served.ids:
        raise ModelNotFound(
            f"The model '{model}' does not exist; this server serves {', '.join(server.served.ids)}",
            param="model",
        )


def prompt_texts(body) -> tuple[list[str], list[list[int]]]:
    """(the prompt's texts, its token-id prompts) as sent."""
    if isinstance(body, ChatCompletionRequest):
        texts = [content_text(m.content) for m in body.messages]
        # the tools and earlier calls are rendered into the prompt too
        extra = [json.dumps(body.tools)] if body.tools else []
        extra += [c.function.arguments for m in body.messages for c in m.tool_calls or []]
        return texts + extra, []
    items, _ = prompt_items(body.prompt)
    return [p for p in items if isinstance(p, str)], [p for p in items if not isinstance(p, str)]


def bound_prompt(server: OpenAIServer, body) -> None:
    """ContextLengthExceeded at once for a prompt that cannot fit the context window whatever
    its tokens: more token ids than the window, or more characters than the window's tokens
    can stand for (context x LoadedModel.max_token_chars). A prompt of megabytes is refused
    in microseconds, before PII analysis, the content filter or the tokenizer read it."""
    ctx = server.context_length
    texts, id_prompts = prompt_texts(body)
    param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
    longest_ids = max((len(p) for p in id_prompts), default=0)
    if longest_ids > ctx:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {ctx} tokens; the {param} holds {longest_ids} token ids.",
            param=param,
        )
    chars = sum(len(t) for t in texts) if isinstance(body, ChatCompletionRequest) else max(map(len, texts), default=0)
    bound = ctx * server.loaded.max_token_chars
    if chars > bound:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {ctx} tokens; the {param} holds {chars} characters, more than "
            f"{ctx} tokens can (at most {server.loaded.max_token_chars} characters a token). Please shorten it.",
            param=param,
        )


async def tokenized(fn, server: OpenAIServer, body) -> list[list[int]]:
    """fn(server, body) in a worker thread, never on the event loop; a long prompt's text is
    encoded without the GIL (LoadedModel.encode), so the loop serves everyone else meanwhile."""
    return await asyncio.to_thread(fn, server, body)


def _refuse_unsupported(body: SamplingFields) -> None:
    """Parameters OpenAI knows and this server does not implement: a 400 naming each, never
    silently ignored (each would change the answer)."""
    if isinstance(body, CompletionRequest) and (body.tools or body.tool_choice not in (None, "none")):
        raise InvalidRequest("tools: tool calling is for /v1/chat/completions", param="tools")
    if isinstance(body, ChatCompletionRequest):
        if body.audio is not None:
            raise InvalidRequest("audio: audio output is not supported by this server", param="audio")
        if body.top_logprobs is not None and not body.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs=true", param="top_logprobs")
    if isinstance(body, CompletionRequest):
        if body.logprobs is not None and body.echo:
            raise InvalidRequest(
                "echo with logprobs is not supported: the prompt's own logprobs are not computed", param="echo"
            )
        if body.best_of is not None and body.best_of != body.n:
            raise InvalidRequest(
                f"best_of={body.best_of}: server-side ranking of completions is not supported; "
                "give best_of equal to n, or leave it out",
                param="best_of",
            )


def _logit_bias(server: OpenAIServer, bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    out = []
    vocab = server.loaded.vocab_size
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidRequest(f"logit_bias: key {key!r} is not a token id", param="logit_bias") from None
        if not 0 <= token < vocab:
            raise InvalidRequest(
                f"logit_bias: token id {token} is outside this model's vocabulary (0..{vocab - 1})", param="logit_bias"
            )
        if not -100 <= value <= 100:
            raise InvalidRequest(
                f"logit_bias: the bias of token {token} is {value}; biases must lie in [-100, 100]", param="logit_bias"
            )
        out.append((token, float(value)))
    return tuple(out)


def prepare(
    server: OpenAIServer,
    body: SamplingFields,
    prompts: list[list[int]],
    prompt_param: str,
    echo: list[str] | None = None,
    constraint: Constraint | None = None,
    tools: ToolPlan | None = None,
) -> Prepared:
    _refuse_unsupported(body)
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise InvalidRequest("give max_tokens or max_completion_tokens, not both", param="max_completion_tokens")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > 4:
        raise InvalidRequest("stop: at most 4 stop sequences are allowed", param="stop")
    if body.stream_options is not None and not body.stream:
        raise InvalidRequest("stream_options is only allowed with stream=true", param="stream_options")
    ctx = server.context_length
    longest = max(len(p) for p in prompts)
    if max_tokens is not None and server.max_tokens_limit is not None and max_tokens > server.max_tokens_limit:
        raise InvalidRequest(
            f"{param}={max_tokens} is above this server's limit of {server.max_tokens_limit}", param=param
        )
    if max_tokens is not None:
        wanted = max_tokens
    else:  # until a stop token or the end of the context window (or the server's default)
        wanted = max(ctx - longest, 1)
        for cap in (server.default_max_tokens, server.max_tokens_limit):
            wanted = min(wanted, cap) if cap is not None else wanted
    if longest + wanted > ctx:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {ctx} tokens. However, you requested {longest + wanted} "
            f"tokens ({longest} in the {prompt_param}, {wanted} for the completion). Please reduce the length "
            f"of the {prompt_param} or of {param}.",
            param=prompt_param,
        )
    bias = _logit_bias(server, body.logit_bias)
    top: int | None = None
    if isinstance(body, ChatCompletionRequest):
        top = (body.top_logprobs or 0) if body.logprobs else None
    elif isinstance(body, CompletionRequest):
        top = body.logprobs
    choices, params = [], []
    for ids in prompts:
        for j in range(body.n):
            seed = None if body.seed is None else body.seed + j  # n seeded choices differ, reproducibly
            choices.append(ids)
            params.append(
                SamplingParams(
                    max_new_tokens=wanted,
                    temperature=body.temperature,
                    top_p=body.top_p,
                    seed=seed,
                    presence_penalty=body.presence_penalty,
                    frequency_penalty=body.frequency_penalty,
                    logit_bias=bias,
                    ignore_eos=body.ignore_eos,
                    logprobs=top,
                    constraint=constraint,
                )
            )
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    echoed = [text for text in echo for _ in range(body.n)] if echo is not None else None
    return Prepared(choices, params, stop, include_usage, sum(len(p) for p in prompts), echoed, tools)


def prompt_items(prompt: str | list[str] | list[int] | list[list[int]]) -> tuple[list[str | list[int]], bool]:
    """A completions prompt as a list of prompts (each a text or token ids), and whether it was
    one prompt: a string or one list of token ids."""
    if isinstance(prompt, str):
        return [prompt], True
    if prompt and isinstance(prompt[0], int):
        return [[t for t in prompt if isinstance(t, int)]], True
    return [p for p in prompt if not isinstance(p, int)], False


def tokenize_completion(server: OpenAIServer, body: CompletionRequest) -> list[list[int]]:
    prompt, _ = prompt_items(body.prompt)
    if not prompt:
        raise InvalidRequest("prompt: an empty list has nothing to complete", param="prompt")
    tok = server.loaded.tokenizer
    boundary = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    out = []
    for item in prompt:
        if isinstance(item, str):
            text = item
            if body.suffix is not None:
                text = _fill_in_the_middle(server, item, body.suffix)
            ids = server.loaded.encode(text)
        else:
            if body.suffix is not None:
                raise InvalidRequest("suffix needs a text prompt, not token ids", param="suffix")
            bad = [t for t in item if not 0 <= t < server.loaded.vocab_size]
            if bad:
                raise InvalidRequest(
                    f"prompt: token id {bad[0]} is outside this model's vocabulary (0..{server.loaded.vocab_size - 1})",
                    param="prompt",
                )
            ids = list(item)
        # An empty prompt starts from the document boundary, as GPT-2 style models expect.
        out.append(ids or [boundary])
    return out


FIM_TOKENS = ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")


def _fill_in_the_middle(server: OpenAIServer, prefix: str, suffix: str) -> str:
    """The prompt of a fill-in-the-middle completion: only models trained with FIM tokens have one."""
    tok = server.loaded.tokenizer
    ids = [tok.convert_tokens_to_ids(t) for t in FIM_TOKENS]
    if any(not isinstance(i, int) or i == tok.unk_token_id for i in ids):
        raise InvalidRequest(
            f"suffix: this model has no fill-in-the-middle tokens ({', '.join(FIM_TOKENS)}), so it cannot insert text",
            param="suffix",
        )
    return f"{FIM_TOKENS[0]}{prefix}{FIM_TOKENS[1]}{suffix}{FIM_TOKENS[2]}"


def echo_texts(server: OpenAIServer, body: CompletionRequest, prompts: list[list[int]]) -> list[str] | None:
    if not body.echo:
        return None
    if body.suffix is not None:
        raise InvalidRequest("echo and suffix cannot be used together", param="echo")
    texts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    if texts and isinstance(texts[0], str):
        return list(texts)
    return [server.loaded.tokenizer.decode(ids, skip_special_tokens=False) for ids in prompts]


def tokenize_chat(
    server: OpenAIServer, body: ChatCompletionRequest | TokenizeRequest, tools: list[dict] | None = None
) -> list[list[int]]:
    """The messages (and the tools the model may call) through the model's chat template
    (chat_format.render_chat), opening the assistant's turn unless a /tokenize request says
    not to, as token ids."""
    tok = server.loaded.tokenizer
    if not getattr(tok, "chat_template", None):
        raise InvalidRequest("this model has no chat template; use /v1/completions", param="messages")
    messages = [m.model_dump(exclude_none=True, mode="json") for m in body.messages or []]
    _check_tool_history(messages)
    try:
        opening = body.add_generation_prompt if isinstance(body, TokenizeRequest) else True
        text = render_chat(tok, messages, tools, add_generation_prompt=opening)
    except Exception as exc:  # a template may reject a conversation (e.g. roles out of order)
        raise InvalidRequest(f"messages: the chat template rejected them: {exc}", param="messages") from None
    return [server.loaded.encode(text)]


def _check_tool_history(messages: list[dict]) -> None:
    """Every tool message answers a call an earlier assistant message made; every call's
    arguments are a JSON object."""
    calls: set[str] = set()
    for i, m in enumerate(messages):
        for j, c in enumerate(m.get("tool_calls") or []):
            if arguments_object(c["function"]["arguments"]) is None:
                raise InvalidRequest(
                    f"messages[{i}].tool_calls[{j}].function.arguments: not a JSON object's text", param="messages"
                )
            calls.add(c["id"])
        if m["role"] == "tool" and m["tool_call_id"] not in calls:
            raise InvalidRequest(
                f"messages[{i}]: tool_call_id {m['tool_call_id']!r} answers no tool call of an earlier assistant message",
                param="messages",
            )
