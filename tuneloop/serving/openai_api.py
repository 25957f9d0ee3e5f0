"""The OpenAI-compatible HTTP API: schemas, the FastAPI app, SSE streaming, error shapes.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models,
GET /v1/models/{model}. The app knows nothing about BentoML: it talks to a Backend
(something with `engine` and `submit(stream)`), which bentos/service.py provides
for the adaptive (BentoML batching), continuous and slots engines. create_app() builds the
FastAPI app before the model is loaded; attach an OpenAIServer to app.state.server once it
is. Until then, and until warm-up is done, every route answers 503.

What a request goes through: model name check (404) -> parameter checks (400, naming the
parameter) -> prompt rendering and tokenisation -> context window check (400
context_length_exceeded) -> admission (429 + Retry-After) -> generation with a deadline
(504) while watching for the client going away (its generations are cancelled, its slots
freed) -> OpenAI-shaped JSON or SSE chunks ending with `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from tuneloop.asgi import ApiMiddleware
from tuneloop.gateway.pipeline import GatewayMiddleware, RequestGate, gate_of
from tuneloop.requestlog.asgi import RequestLogMiddleware, record_of
from tuneloop.requestlog.record import RequestRecord, utc_iso, verdict_summary
from tuneloop.serving.admission import AdmissionController, Ticket
from tuneloop.serving.untrusted import DEFAULT_MAX_REQUEST_BYTES, BodyLimit
from tuneloop.serving.engine import GenerationStream, LoadedModel, SamplingParams
from tuneloop.serving.errors import (
    ContextLengthExceeded,
    InternalError,
    InvalidRequest,
    ModelNotFound,
    RequestTimeout,
    RouteNotFound,
    ServingError,
    Unavailable,
    error_for_status,
)

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------
# request / response schemas (they are also what the served OpenAPI spec documents)


class _Strict(BaseModel):
    # OpenAI answers an unknown argument with 400 "Unrecognized request argument": so do we.
    # Strict types: `"stream": "yes"` or `"max_tokens": "5"` is a 400 naming the parameter,
    # not silently read as true / 5.
    model_config = ConfigDict(extra="forbid", strict=True)


def _no_lone_surrogates(text: str) -> str:
    """JSON may carry UTF-16 surrogate escapes (`"\\ud800"`) that pair with nothing; such a
    string is no text: the tokenizer cannot take it and no response can be encoded with it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"contains a lone UTF-16 surrogate ({text[exc.start]!a}) at character {exc.start}; "
                         "send valid Unicode text") from None
    return text


Text = Annotated[str, AfterValidator(_no_lone_surrogates)]
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # OpenAI's range for seed


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    model: Text
    max_tokens: int | None = Field(None, ge=1, description="Default: until a stop token or the context window.")
    max_completion_tokens: int | None = Field(None, ge=1, description="The same as max_tokens (give one of them).")
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=128, description="Choices per prompt; with a seed, choice j samples with seed + j.")
    stop: Text | list[Text] | None = Field(None, description="Up to 4 strings; the text stops before them.")
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(None, description="Token id (as a string) -> bias in [-100, 100].")
    ignore_eos: bool = Field(False, description="vLLM's extension: keep generating through stop tokens.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Accepted and not used (documented as such): they change no answer.
    user: Text | None = Field(None, description="Accepted, not used.")
    metadata: dict[str, Text] | None = Field(None, description="Accepted, not used.")
    store: bool | None = Field(None, description="Accepted, not used: nothing is stored for later retrieval.")
    service_tier: Text | None = Field(None, description="Accepted, not used.")
    parallel_tool_calls: bool | None = Field(None, description="Accepted without tools, not used.")
    # Known to OpenAI, not implemented: a request that sets one is refused, naming it.
    response_format: dict[str, Any] | None = Field(None, description='Only {"type": "text"}.')
    tools: list[dict[str, Any]] | None = Field(None, description="Not supported: a non-empty list is a 400.")
    tool_choice: Any = Field(None, description='Only "none".')


class CompletionRequest(_SamplingFields):
    prompt: Text | list[Text] | list[int] | list[list[int]] = Field(
        description="A string, a list of strings, or token ids (a list, or a list of lists)")
    echo: bool = Field(False, description="Return the prompt's text before the completion.")
    suffix: Text | None = Field(None, description="Fill-in-the-middle; only for models with FIM tokens.")
    logprobs: int | None = Field(None, ge=0, le=5, description="The log-probability of each token and of this "
                                 "many alternatives (of the model's own distribution, as vLLM reports it).")
    best_of: int | None = Field(None, ge=1, description="Only equal to n (no server-side ranking).")


class TextContentPart(_Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer"]
    content: Text | list[TextContentPart]
    name: Text | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = Field(False, description="The log-probability of each token of the answer.")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="With logprobs: this many alternatives each.")
    modalities: list[Literal["text"]] | None = Field(None, description='Only ["text"].')
    audio: Any = Field(None, description="Not supported: a value is a 400.")


class ModerationRequest(_Strict):
    input: Text | list[Text] = Field(description="A string or a list of strings to classify.")
    model: Text | None = Field(None, description="Accepted; the server's content filter answers whatever it names.")


class FeedbackRequest(_Strict):
    """tuneloop's own route (OpenAI has none): what a client says about a logged request."""

    request_id: str = Field(pattern=r"^(req_|chatcmpl-|cmpl-)[0-9a-f]{32}$",
                            description="The request's x-request-id header (req_...) or its response id "
                                        "(chatcmpl-... / cmpl-...).")
    rating: int | None = Field(None, ge=-1, le=1, description="-1 bad, 0 neutral, 1 good.")
    correction: Text | None = Field(None, min_length=1, max_length=100_000,
                                    description="The completion the model should have given: a candidate "
                                                "training example (validated before any training uses it).")
    comment: Text | None = Field(None, max_length=4000)

    @model_validator(mode="after")
    def _something(self) -> "FeedbackRequest":
        if self.rating is None and self.correction is None:
            raise ValueError("give a rating, a correction, or both")
        return self


class FeedbackResponse(BaseModel):
    id: str
    object: Literal["feedback"] = "feedback"
    created: int
    request_id: str


class ModerationResult(BaseModel):
    flagged: bool
    categories: dict[str, bool]
    category_scores: dict[str, float]
    category_applied_input_types: dict[str, list[str]]


class ModerationResponse(BaseModel):
    id: str
    model: str
    results: list[ModerationResult]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # no prompt cache: always 0


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


FinishReason = Literal["stop", "length", "content_filter"]


class ContentFilterResults(BaseModel):
    """The gateway's output filter (gateway.filter.outputs: annotate | block), Azure OpenAI's field name."""

    flagged: bool
    categories: list[str]
    rules: list[str]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None
    refusal: None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason
    content_filter_results: ContentFilterResults | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    refusal: None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason
    content_filter_results: ContentFilterResults | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tuneloop"
    root: str  # the registered name:version every alias points at


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid parameter (param names it) or context_length_exceeded"},
    404: {"model": ErrorResponse, "description": "Unknown model (code model_not_found)"},
    429: {"model": ErrorResponse, "description": "Server at capacity; see Retry-After"},
    503: {"model": ErrorResponse, "description": "Not ready (loading or warming up)"},
    504: {"model": ErrorResponse, "description": "Generation did not finish within the request timeout"},
    # Also keeps FastAPI from documenting its own 422, which this API never answers.
    "default": {"model": ErrorResponse, "description": "Any other error, in the same shape"},
}
SSE_DOC = {"text/event-stream": {"schema": {"type": "string", "description": "with stream=true: `data: <chunk>` "
                                            "events, then `data: [DONE]`"}}}

# ---------------------------------------------------------------------------------------
# the server object the routes use


class Backend(Protocol):
    engine: str

    def submit(self, stream: GenerationStream) -> None:
        """Begin generating for stream without waiting for it (tokens arrive in the stream)."""


@dataclass
class ServedModel:
    name: str
    version: str
    aliases: list[str] = field(default_factory=list)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def id(self) -> str:
        return f"{self.name}:{self.version}"

    @property
    def ids(self) -> list[str]:
        """Every name a request may use: name:version first, then the aliases."""
        out = [self.id]
        for alias in [*self.aliases, self.name]:
            if alias not in out:
                out.append(alias)
        return out


@dataclass
class OpenAIServer:
    loaded: LoadedModel
    backend: Backend
    admission: AdmissionController
    served: ServedModel
    default_max_tokens: int | None = None  # None: until a stop token or the context window
    max_tokens_limit: int | None = None  # None: the context window
    metrics: Any = None  # tuneloop.serving.metrics.ServingMetrics, or None
    stream_interval_s: float = 0.0  # see GenerationStream: tokens within it share one chunk
    ready: bool = False  # set once warm-up is done
    draining: bool = False  # shutting down: in-flight generations finish, new requests get 503
    # Closed while a new model version is swapped in (tuneloop/serving/hotswap.py): new
    # generations wait here, so each is answered wholly by one version.
    swap_gate: asyncio.Event | None = None

    @property
    def fingerprint(self) -> str:
        return f"tuneloop-{self.backend.engine}"

    @property
    def context_length(self) -> int:
        """The longest request (prompt + completion) served: the engine's where it has one
        (the slots engine's KV cache slots), else the model's context window."""
        return getattr(self.backend, "context_length", None) or self.loaded.context_length

    def count_rejection(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.reject(reason)


def _server(request: Request) -> OpenAIServer:
    server = getattr(request.app.state, "server", None)
    if server is None or not server.ready:
        raise Unavailable("the model is loading or warming up; retry shortly", retry_after_s=2)
    if server.draining:
        raise Unavailable("the server is shutting down; retry (another replica answers)", retry_after_s=1)
    return server


# ---------------------------------------------------------------------------------------
# text: token ids -> text deltas, with stop strings


class TextAssembler:
    """Turns one generation's token ids into text deltas; detects stop strings.

    Decodes incrementally with prefix/read offsets into `ids` (byte-level BPE splits
    characters across tokens): each call decodes only the tokens not yet settled into
    text plus one step of context, and searches for stop strings only where a new hit
    could start, so the work per call is bounded by the new tokens. Text that could
    still become a stop string, or is an incomplete character (a trailing U+FFFD), is
    held back, so nothing at or after a stop string is ever sent.
    """

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self._longest = max((len(s) for s in self.stop), default=0)
        self.ids: list[int] = []
        self.sent = 0  # characters already handed out
        self.stopped = False  # a stop string was found
        self._prefix = 0  # ids[_prefix:_read]: context decoded with the unsettled tokens
        self._read = 0  # ids[:_read] are settled into text
        self._prefix_text = ""  # decode(ids[_prefix:_read])
        self._done = 0  # length of the settled text, decode(ids[:_read])
        self._win_start = 0  # the settled text kept, from this character on ...
        self._win = ""  # ... (older text is sent and can no longer be part of a stop string)
        self._checked = 0  # settled text already searched for stop strings

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _settle(self) -> str:
        """Settles the new tokens' text if it ends on a whole character; returns what stays unsettled."""
        if self._read == len(self.ids):
            return ""
        new_text = self._decode(self.ids[self._prefix:])
        if len(new_text) <= len(self._prefix_text):
            return ""
        pending = new_text[len(self._prefix_text):]
        if pending.endswith("\ufffd"):
            return pending
        self._win += pending
        self._done += len(pending)
        self._prefix, self._read = self._read, len(self.ids)
        self._prefix_text = self._decode(self.ids[self._prefix:self._read])
        return ""

    def add(self, token_ids: list[int]) -> str:
        if self.stopped:
            return ""
        self.ids.extend(token_ids)
        return self._step(final=False)

    def flush(self) -> str:
        """The rest of the text once the generation has ended."""
        return "" if self.stopped else self._step(final=True)

    def _step(self, final: bool) -> str:
        pending = self._settle()
        base, text = self._win_start, self._win + pending  # text: the whole text from `base` on
        # a hit starting earlier would lie wholly in text already searched
        start = max(self._checked - self._longest + 1 - base, 0)
        self._checked = self._done
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            return self._take(text, min(hits))
        if final:
            return self._take(text, len(text))
        safe, sent = len(text.rstrip("\ufffd")), self.sent - base
        for s in self.stop:
            if safe <= sent:
                break
            for k in range(min(len(s) - 1, safe), 0, -1):
                if text.endswith(s[:k], 0, safe):
                    safe -= k
                    break
        return self._take(text, safe)

    def _take(self, text: str, upto: int) -> str:
        """Hands out text[sent:upto] (positions relative to the kept window), then trims the window."""
        base = self._win_start
        delta = ""
        if upto + base > self.sent:
            delta, self.sent = text[self.sent - base:upto], upto + base
        keep_from = max(min(self.sent, self._done) - self._longest, 0)
        if keep_from > base:
            self._win, self._win_start = self._win[keep_from - base:], keep_from
        return delta


# ---------------------------------------------------------------------------------------
# preparing a request


@dataclass
class _Prepared:
    prompts: list[list[int]]  # one per choice (a prompt repeated n times)
    params: list[SamplingParams]  # one per choice
    stop: list[str]
    include_usage: bool
    prompt_tokens: int  # each prompt counted once, whatever n is
    echo: list[str] | None = None  # per choice: the prompt's text, returned before the completion


def _check_model(server: OpenAIServer, model: str) -> None:
    if model not in server.served.ids:
        raise ModelNotFound(
            f"The model '{model}' does not exist; this server serves {', '.join(server.served.ids)}",
            param="model",
        )


def _prompt_texts(body) -> tuple[list[str], list[list[int]]]:
    """(the prompt's texts, its token-id prompts) as sent."""
    if isinstance(body, ChatCompletionRequest):
        return [m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)
                for m in body.messages], []
    prompt = body.prompt
    items = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else list(prompt)
    return [p for p in items if isinstance(p, str)], [p for p in items if not isinstance(p, str)]


def _bound_prompt(server: OpenAIServer, body) -> None:
    """ContextLengthExceeded at once for a prompt that cannot fit the context window whatever
    its tokens: more token ids than the window, or more characters than the window's tokens
    can stand for (context x LoadedModel.max_token_chars). A prompt of megabytes is refused
    in microseconds, before PII analysis, the content filter or the tokenizer read it."""
    ctx = server.context_length
    texts, id_prompts = _prompt_texts(body)
    param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
    longest_ids = max((len(p) for p in id_prompts), default=0)
    if longest_ids > ctx:
        raise ContextLengthExceeded(f"This model's maximum context length is {ctx} tokens; the {param} holds "
                                    f"{longest_ids} token ids.", param=param)
    chars = sum(len(t) for t in texts) if isinstance(body, ChatCompletionRequest) else max(map(len, texts), default=0)
    bound = ctx * server.loaded.max_token_chars
    if chars > bound:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {ctx} tokens; the {param} holds {chars} characters, more than "
            f"{ctx} tokens can (at most {server.loaded.max_token_chars} characters a token). Please shorten it.",
            param=param)


async def _tokenized(fn, server: OpenAIServer, body) -> list[list[int]]:
    """fn(server, body) in a worker thread, never on the event loop; a long prompt's text is
    encoded without the GIL (LoadedModel.encode), so the loop serves everyone else meanwhile."""
    return await asyncio.to_thread(fn, server, body)


def _refuse_unsupported(body: _SamplingFields) -> None:
    """Parameters OpenAI knows and this server does not implement: a 400 naming each, never
    silently ignored (each would change the answer)."""
    if body.response_format is not None and body.response_format != {"type": "text"}:
        raise InvalidRequest(f"response_format {json.dumps(body.response_format)[:100]} is not supported: this server "
                             'does no constrained decoding; only {"type": "text"}', param="response_format")
    if body.tools:
        raise InvalidRequest("tools: tool calling is not supported by this server", param="tools")
    if body.tool_choice not in (None, "none"):
        raise InvalidRequest('tool_choice: tool calling is not supported by this server (only "none")',
                             param="tool_choice")
    if isinstance(body, ChatCompletionRequest):
        if body.audio is not None:
            raise InvalidRequest("audio: audio output is not supported by this server", param="audio")
        if body.top_logprobs is not None and not body.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs=true", param="top_logprobs")
    if isinstance(body, CompletionRequest):
        if body.logprobs is not None and body.echo:
            raise InvalidRequest("echo with logprobs is not supported: the prompt's own logprobs are not computed",
                                 param="echo")
        if body.best_of is not None and body.best_of != body.n:
            raise InvalidRequest(f"best_of={body.best_of}: server-side ranking of completions is not supported; "
                                 "give best_of equal to n, or leave it out", param="best_of")


def _logit_bias(server: OpenAIServer, bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    out = []
    vocab = server.loaded.vocab_size
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidRequest(f"logit_bias: key {key!r} is not a token id", param="logit_bias") from None
        if not 0 <= token < vocab:
            raise InvalidRequest(f"logit_bias: token id {token} is outside this model's vocabulary (0..{vocab - 1})",
                                 param="logit_bias")
        if not -100 <= value <= 100:
            raise InvalidRequest(f"logit_bias: the bias of token {token} is {value}; biases must lie in [-100, 100]",
                                 param="logit_bias")
        out.append((token, float(value)))
    return tuple(out)


def _prepare(server: OpenAIServer, body: _SamplingFields, prompts: list[list[int]], prompt_param: str,
             echo: list[str] | None = None) -> _Prepared:
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
        raise InvalidRequest(f"{param}={max_tokens} is above this server's limit of {server.max_tokens_limit}",
                             param=param)
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
    if isinstance(body, ChatCompletionRequest):
        top = (body.top_logprobs or 0) if body.logprobs else None
    else:
        top = body.logprobs
    choices, params = [], []
    for ids in prompts:
        for j in range(body.n):
            seed = None if body.seed is None else body.seed + j  # n seeded choices differ, reproducibly
            choices.append(ids)
            params.append(SamplingParams(max_new_tokens=wanted, temperature=body.temperature, top_p=body.top_p,
                                         seed=seed, presence_penalty=body.presence_penalty,
                                         frequency_penalty=body.frequency_penalty, logit_bias=bias,
                                         ignore_eos=body.ignore_eos, logprobs=top))
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    echoed = [text for text in echo for _ in range(body.n)] if echo is not None else None
    return _Prepared(choices, params, stop, include_usage, sum(len(p) for p in prompts), echoed)


def _tokenize_completion(server: OpenAIServer, body: CompletionRequest) -> list[list[int]]:
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]  # one prompt: a string or one list of token ids
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
                raise InvalidRequest(f"prompt: token id {bad[0]} is outside this model's vocabulary "
                                     f"(0..{server.loaded.vocab_size - 1})", param="prompt")
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
        raise InvalidRequest("suffix: this model has no fill-in-the-middle tokens "
                             f"({', '.join(FIM_TOKENS)}), so it cannot insert text", param="suffix")
    return f"{FIM_TOKENS[0]}{prefix}{FIM_TOKENS[1]}{suffix}{FIM_TOKENS[2]}"


def _echo_texts(server: OpenAIServer, body: CompletionRequest, prompts: list[list[int]]) -> list[str] | None:
    if not body.echo:
        return None
    if body.suffix is not None:
        raise InvalidRequest("echo and suffix cannot be used together", param="echo")
    texts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    if texts and isinstance(texts[0], str):
        return list(texts)
    return [server.loaded.tokenizer.decode(ids, skip_special_tokens=False) for ids in prompts]


def _tokenize_chat(server: OpenAIServer, body: ChatCompletionRequest) -> list[list[int]]:
    tok = server.loaded.tokenizer
    if not getattr(tok, "chat_template", None):
        raise InvalidRequest("this model has no chat template; use /v1/completions", param="messages")
    messages = []
    for m in body.messages:
        content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)
        messages.append({"role": "system" if m.role == "developer" else m.role, "content": content})
    try:
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # a template may reject a conversation (e.g. roles out of order)
        raise InvalidRequest(f"messages: the chat template rejected them: {exc}", param="messages") from None
    return [server.loaded.encode(text)]


# ---------------------------------------------------------------------------------------
# running a request


class _Aborted(Exception):
    """The generation was cancelled from outside (timeout, client gone) before it ended."""


class _Generations:
    """The generations of one request: their streams, admission ticket and metrics.

    close() is the one exit: it cancels what still runs, records metrics and frees the
    slots; it is idempotent and called from every path (done, error, timeout, disconnect).
    """

    def __init__(self, server: OpenAIServer, prepared: _Prepared, request_id: str, gate: RequestGate | None = None,
                 record: RequestRecord | None = None):
        self.server = server
        self.request_id = request_id
        self.gate = gate
        self.record = record  # the request log's record, completed in close()
        share = gate.gateway.share_for(gate.key, server.admission.max_concurrency) if gate is not None else None
        tokens = sum(len(ids) + p.max_new_tokens for ids, p in zip(prepared.prompts, prepared.params))
        try:
            self.ticket: Ticket = server.admission.admit(len(prepared.prompts), tokens, share)
        except Exception:
            if gate is not None:
                gate.settle(0)  # nothing generated: the whole reservation goes back
            raise
        loop = asyncio.get_running_loop()
        # loop.time() and time.monotonic() are the same clock.
        self.deadline = self.ticket.deadline
        self.started_at = time.perf_counter()
        self.streams = [GenerationStream(f"{request_id}-{i}", ids, params, loop, server.stream_interval_s)
                        for i, (ids, params) in enumerate(zip(prepared.prompts, prepared.params))]
        self.prompt_tokens = prepared.prompt_tokens
        self.assemblers = [TextAssembler(server.loaded.tokenizer, prepared.stop) for _ in self.streams]
        self.completion_tokens = [0] * len(self.streams)
        self._got_token = [False] * len(self.streams)
        self.finish_reasons: list[str | None] = [None] * len(self.streams)  # as the client sees them
        # The gateway's output side: PII redaction per choice (streams hold back a tail), the
        # text as the client got it (for the output filter and the cache), the filter's verdicts.
        self.redactors = [gate.output_redactor() if gate else None for _ in self.streams]
        # logprob entries wait until the redaction has let their text out (None: not redacted)
        wants = any(p.logprobs is not None for p in prepared.params)
        self.held = [_HeldLogprobs(_TokenText(server), r.inner) if r is not None and wants else None
                     for r in self.redactors]
        self.texts = [""] * len(self.streams)
        self.verdicts: list[Any] = [None] * len(self.streams)
        self._closed = False
        self.abort_reason: str | None = None
        if server.metrics:
            for _ in self.streams:
                server.metrics.generation_admitted()
        try:
            for s in self.streams:
                server.backend.submit(s)
        except Exception:
            self.close()
            raise

    async def choice_deltas(self, i: int):
        """(text delta, finish_reason or None, logprob entries of the new tokens) for choice i
        until it ends (entries only when the request asked for logprobs)."""
        stream, text = self.streams[i], self.assemblers[i]
        seen = 0  # stream.token_logprobs handed out so far
        async for ids in stream.events():
            if not self._got_token[i]:
                self._got_token[i] = True
                if self.server.metrics:
                    self.server.metrics.first_token()
                if self.record is not None:
                    self.record.first_token()
            delta = await self._out(i, text.add(ids))
            self.completion_tokens[i] = len(text.ids)
            logprobs = stream.token_logprobs[seen:seen + len(ids)]  # delivered in the tokens' order
            seen += len(logprobs)
            entries = list(zip(ids, logprobs))
            held = self.held[i]
            if held is not None:
                held.add(entries)
            if text.stopped:
                stream.cancel()  # a stop string ended it: stop generating
                delta += await self._out(i, "", final=True)
                yield delta, await self._finish(i, "stop"), entries if held is None else held.release(final=True)
                return
            if held is not None:
                entries = held.release()
            if delta or entries:
                yield delta, None, entries
        if stream.finish_reason == "cancelled":
            raise _Aborted(self.abort_reason or "cancelled")
        last = await self._out(i, text.flush(), final=True)
        yield (last, await self._finish(i, "stop" if stream.finish_reason == "stop" else "length"),
               [] if self.held[i] is None else self.held[i].release(final=True))

    async def _out(self, i: int, delta: str, final: bool = False) -> str:
        """What the client may see of a text delta: PII redacted (a tail held back until it is
        known not to start an entity; all of it at the end)."""
        redactor = self.redactors[i]
        if self.held[i] is not None:
            self.held[i].raw += len(delta)
        if redactor is not None:
            delta = await redactor.add(delta) if delta else ""
            if final:
                delta += await redactor.flush()
        self.texts[i] += delta
        return delta

    async def _finish(self, i: int, reason: str) -> str:
        """The finish reason the client sees: the output filter may turn it into content_filter."""
        if self.gate is not None:
            verdicts = await self.gate.check_output([self.texts[i]])
            if verdicts:
                self.verdicts[i] = verdicts[0]
                if self.gate.output_blocked(verdicts[0]):
                    reason = "content_filter"
        self.finish_reasons[i] = reason
        return reason

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        unfinished = [s for s in self.streams if not s.done]
        for s in unfinished:
            s.cancel()
        # Errors that become a response are counted where they do; a client that left is not.
        if self.abort_reason == "client_disconnected" or (unfinished and self.abort_reason is None):
            self.server.count_rejection("client_disconnected")
        if self.server.metrics:
            for i, s in enumerate(self.streams):
                self.server.metrics.generation_ended(s, self.started_at, self._got_token[i], self.finish_reasons[i])
        self.ticket.release()
        if self.gate is not None:  # the unused part of the token reservation goes back
            self.gate.settle(self.prompt_tokens + sum(self.completion_tokens))
        r = self.record
        if r is not None:
            r.completions, r.finish_reasons = list(self.texts), list(self.finish_reasons)
            r.prompt_tokens, r.completion_tokens = self.prompt_tokens, sum(self.completion_tokens)
            r.completion_redacted = self.gate is not None and self.gate.redacts_outputs
            if any(v is not None for v in self.verdicts):
                r.output_filter = [verdict_summary(v) for v in self.verdicts]
            if self.abort_reason is not None and r.error_code is None:
                r.error_code = self.abort_reason

    def filter_results(self, i: int) -> dict | None:
        """The output filter's annotation of choice i (Azure OpenAI's field name), or None."""
        v = self.verdicts[i]
        if v is None:
            return None
        return {"flagged": v.flagged, "categories": v.flagged_categories(), "rules": v.rules}

    def cacheable_result(self) -> bool:
        return all(r in ("stop", "length") for r in self.finish_reasons)

    def timeout_error(self) -> RequestTimeout:
        self.abort_reason = "timeout"
        return RequestTimeout(
            f"the generation did not finish within the request timeout of "
            f"{self.server.admission.request_timeout_s:g} s"
        )


async def _watch_disconnect(request: Request, gens: _Generations) -> None:
    """Cancel the generations when the client goes away (non-streaming requests)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            gens.abort_reason = "client_disconnected"
            for s in gens.streams:
                s.cancel()
            return


async def _run_to_end(gens: _Generations, request: Request) -> list[tuple[str, str, list]]:
    async def one(i: int) -> tuple[str, str, list]:
        parts, finish, entries = [], "length", []
        async for delta, reason, new in gens.choice_deltas(i):
            parts.append(delta)
            entries += new
            finish = reason or finish
        return "".join(parts), finish, entries

    watcher = asyncio.ensure_future(_watch_disconnect(request, gens))
    try:
        async with asyncio.timeout_at(gens.deadline):
            return list(await asyncio.gather(*(one(i) for i in range(len(gens.streams)))))
    except TimeoutError:
        raise gens.timeout_error() from None
    finally:
        watcher.cancel()


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


class _SSEResponse(StreamingResponse):
    """A StreamingResponse that always runs on_close, even if the body was never iterated."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _stream_response(gens: _Generations, make_chunk, include_usage: bool, first_chunks: list[dict], on_done=None):
    """SSE over all choices of a request, interleaved as their tokens arrive.

    Events that are ready together go out in one write: each write passes BentoML's and
    Starlette's middleware (an OpenTelemetry span each) and a socket send, which at 32
    streams was most of the event loop's work. So the opening chunks (the role) go with
    the first content, a stream's last content with its finish chunk, the usage chunk and
    `[DONE]`; nothing waits for anything that has not arrived yet.
    """

    async def body():
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async for delta, finish, entries in gens.choice_deltas(i):
                    queue.put_nowait((i, delta, finish, entries))
            except Exception as exc:  # handed to the consumer below
                queue.put_nowait((i, exc, None, None))

        tasks = [asyncio.ensure_future(pump(i)) for i in range(len(gens.streams))]
        out = [_sse(chunk) for chunk in first_chunks]  # events not yet written
        error: ServingError | None = None
        try:
            pending = len(tasks)
            async with asyncio.timeout_at(gens.deadline):
                while pending:
                    ready = [await queue.get()]
                    while not queue.empty():
                        ready.append(queue.get_nowait())
                    for i, delta, finish, entries in ready:
                        if isinstance(delta, BaseException):
                            raise delta
                        if finish is not None:
                            pending -= 1
                        if delta or finish or entries:
                            out.append(_sse(make_chunk(i, delta, finish, entries=entries)))
                    if pending:
                        yield "".join(out)
                        out = []
            if include_usage:
                out.append(_sse(make_chunk(None, None, None, usage=_usage(gens))))
            if on_done is not None:
                await on_done()
        except TimeoutError:
            error = gens.timeout_error()
        except _Aborted:
            return  # cancelled because the client left: nobody to tell
        except ServingError as err:  # e.g. BentoML's batcher shed the request (503)
            error = err
        except Exception:
            log.exception("streamed generation %s failed", gens.request_id)
            error = InternalError("generation failed; see the server log")
        finally:
            for t in tasks:
                t.cancel()
        if error is not None:
            # Headers are sent already: the error travels as an SSE event (the SDK raises it).
            gens.abort_reason = error.reason
            gens.server.count_rejection(error.reason)
            if gens.record is not None:
                gens.record.error_code, gens.record.error_type = error.code or error.reason, error.type
            out.append(_sse(error.body()))
        out.append(_sse("[DONE]"))
        yield "".join(out)

    return _SSEResponse(body(), on_close=gens.close)


def _usage(gens: _Generations) -> dict:
    completion = sum(gens.completion_tokens)
    return {"prompt_tokens": gens.prompt_tokens, "completion_tokens": completion,
            "total_tokens": gens.prompt_tokens + completion,
            # What is known of them: no prompt cache, no reasoning, no predicted outputs.
            "prompt_tokens_details": {"cached_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": 0, "accepted_prediction_tokens": 0,
                                          "rejected_prediction_tokens": 0}}


async def _generate_or_raise(gens: _Generations, request: Request) -> list[tuple[str, str, list]] | None:
    """The (text, finish_reason, logprob entries) of every choice; None if the client went away meanwhile."""
    try:
        return await _run_to_end(gens, request)
    except _Aborted:
        return None
    except ServingError:
        raise
    except Exception as exc:
        log.exception("generation %s failed", gens.request_id)
        gens.abort_reason = "internal_error"
        raise InternalError("generation failed; see the server log") from exc
    finally:
        gens.close()


async def _screen(gate: RequestGate | None, server: OpenAIServer, body):
    """The gateway's prompt side: PII redaction (or a 400) and the content filter on every
    text of the prompt; returns the body the model sees (redacted)."""
    if gate is None:
        return body
    if isinstance(body, ChatCompletionRequest):
        texts = [m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)
                 for m in body.messages]
        roles = gate.gateway.config.filter.roles
        screened = await gate.screen_prompts(texts, [m.role in roles for m in body.messages])
        if screened == texts:
            return body
        messages = [m if new == old else m.model_copy(update={"content": new})
                    for m, new, old in zip(body.messages, screened, texts)]
        return body.model_copy(update={"messages": messages})
    prompt = body.prompt
    single = isinstance(prompt, str) or (bool(prompt) and isinstance(prompt[0], int))
    items = [prompt] if single else list(prompt)
    texts = [p if isinstance(p, str) else server.loaded.tokenizer.decode(p, skip_special_tokens=False)
             for p in items if isinstance(p, str) or all(0 <= t < server.loaded.vocab_size for t in p)]
    if len(texts) != len(items):
        return body  # an out-of-vocabulary token id: tokenisation refuses it with a 400
    screened = await gate.screen_prompts(texts)
    if screened == texts:
        return body
    # Redacted, a token-id prompt becomes text (its ids no longer say what the model sees).
    return body.model_copy(update={"prompt": screened[0] if single else screened})


async def _versioned(server: OpenAIServer, base: dict, record: RequestRecord | None) -> None:
    """Wait out a model swap in progress, then name the version that will answer."""
    while server.swap_gate is not None:
        await server.swap_gate.wait()
    base["model"] = server.served.id
    if record is not None:
        record.model, record.model_version = server.served.name, server.served.version


def _log_prompt(record: RequestRecord | None, server: OpenAIServer, body, gate: RequestGate | None) -> None:
    """The prompt as the model sees it, into the request log (redacted when the gateway
    redacted it; else the log's writer redacts it before writing)."""
    if record is None:
        return
    if isinstance(body, ChatCompletionRequest):
        record.prompt = [{"role": m.role, "content": m.content if isinstance(m.content, str)
                          else "".join(p.text for p in m.content)} for m in body.messages]
    else:
        prompt = body.prompt
        single = isinstance(prompt, str) or (bool(prompt) and isinstance(prompt[0], int))
        items = [prompt] if single else list(prompt)
        tok = server.loaded.tokenizer
        texts = [p if isinstance(p, str) else tok.decode([t for t in p if 0 <= t < server.loaded.vocab_size])
                 for p in items]
        record.prompt = texts[0] if single else texts
    pii = gate.gateway.config.pii if gate is not None and gate.gateway.pii is not None else None
    record.prompt_redacted = pii is not None and pii.mode == "redact"


async def _cached(gate: RequestGate | None, server: OpenAIServer, body, route: str):
    """(cache key or None, the cached answer or None)."""
    if gate is None:
        return None, None
    key = gate.cache_key(server.served.id, route, body.model_dump(mode="json"))
    return key, await gate.cache_get(key)


async def _reserve(gate: RequestGate | None, prepared: _Prepared) -> None:
    if gate is not None:
        await gate.reserve(prepared.prompt_tokens + sum(p.max_new_tokens for p in prepared.params))


async def _store(gate: RequestGate | None, key: str | None, gens: _Generations, choices: list[dict]) -> None:
    if gate is not None and key is not None and gens.cacheable_result():
        value = {"choices": choices, "usage": _usage(gens)}
        r = gens.record
        if r is not None and r.prompt_redacted:
            # The prompt as this policy redacted it for the log: a hit on this entry (same
            # request, same policy: the key carries both) logs it without analysing it again.
            value["log"] = {"prompt": r.prompt, "pii_entities": sorted(set(gate.pii_found))}
        await gate.cache_put(key, value)


def _log_hit(record: RequestRecord | None, server: OpenAIServer, body, cached: dict, gate: RequestGate) -> None:
    """A hit's request-log record, from its cache entry. The entry was written under this
    policy (the key carries it): its prompt as the gateway redacted it, where it did (else
    the log's writer redacts the prompt), and the answers as the client got them, already
    redacted where the policy redacts outputs, as a miss's are (else the writer redacts them)."""
    if record is None:
        return
    logged = cached.get("log")
    if isinstance(logged, dict) and "prompt" in logged:
        record.prompt, record.prompt_redacted = logged["prompt"], True
        record.pii_entities = logged.get("pii_entities") or None
    else:
        _log_prompt(record, server, body, None)
    record.completions = [c["text"] for c in cached["choices"]]
    record.finish_reasons = [c["finish_reason"] for c in cached["choices"]]
    record.prompt_tokens = cached["usage"]["prompt_tokens"]
    record.completion_tokens = cached["usage"]["completion_tokens"]
    record.completion_redacted = gate.redacts_outputs


def _replay(cached: dict, base: dict, stream: bool, include_usage: bool, chat: bool):
    """A cached answer as a fresh response: JSON, or a proper SSE stream for a streaming client."""
    usage = {**cached["usage"], "prompt_tokens_details": {"cached_tokens": cached["usage"]["prompt_tokens"]}}

    def choice(i: int, c: dict, delta: bool) -> dict:
        out = {"index": i, "finish_reason": c["finish_reason"], "logprobs": None}
        if chat:
            out["delta" if delta else "message"] = ({"content": c["text"]} if delta else
                                                    {"role": "assistant", "content": c["text"], "refusal": None})
        else:
            out["text"] = c["text"]
        if c.get("content_filter_results") is not None:
            out["content_filter_results"] = c["content_filter_results"]
        return out

    if not stream:
        return JSONResponse({**base, "object": "chat.completion" if chat else "text_completion",
                             "choices": [choice(i, c, False) for i, c in enumerate(cached["choices"])],
                             "usage": usage})
    chunks = []
    extra = {"usage": None} if include_usage else {}
    if chat:
        chunks.append({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}
                                           for i in range(len(cached["choices"]))], **extra})
    for i, c in enumerate(cached["choices"]):
        chunks.append({**base, "choices": [choice(i, c, True)], **extra})
    if include_usage:
        chunks.append({**base, "choices": [], "usage": usage})
    body = "".join(_sse(c) for c in chunks) + _sse("[DONE]")
    return Response(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _begin(server: OpenAIServer, body, request: Request, route: str, id_prefix: str, obj: str):
    """What both generation routes do first: (gate, request-log record, cache key, cached
    answer or None, the body the model sees, the response's base fields)."""
    _check_model(server, body.model)
    gate = gate_of(request)
    record = record_of(request)
    if record is not None:
        record.stream, record.model, record.model_version = bool(body.stream), server.served.name, server.served.version
    # The cache first: a hit is an answer to this very request after the same screening
    # (the key carries the gateway's policy), so it skips PII analysis and the classifier.
    key, hit = await _cached(gate, server, body, route)
    if hit is not None:  # it took its request unit with the lookup: a hit does not count against tokens
        _log_hit(record, server, body, hit, gate)
    else:
        _bound_prompt(server, body)  # before anything reads the prompt: PII analysis, the filter, the tokenizer
        body = await _screen(gate, server, body)
        _log_prompt(record, server, body, gate)
    rid = f"{id_prefix}-{uuid.uuid4().hex}"
    if record is not None:
        record.response_id = rid
    # `model`: the version actually serving, as OpenAI answers a request for an alias with the
    # snapshot's name (set again by _versioned once a generation is admitted).
    base = {"id": rid, "object": obj, "created": int(time.time()), "model": server.served.id,
            "system_fingerprint": server.fingerprint}
    return gate, record, key, hit, body, base


async def create_completion(server: OpenAIServer, body: CompletionRequest, request: Request):
    gate, record, key, hit, body, base = await _begin(server, body, request, "completions", "cmpl", "text_completion")
    if hit is not None:
        return _replay(hit, base, body.stream, bool(body.stream_options and body.stream_options.include_usage),
                       chat=False)
    prompts = await _tokenized(_tokenize_completion, server, body)
    prepared = _prepare(server, body, prompts, "prompt", echo=_echo_texts(server, body, prompts))
    if gate is not None and prepared.echo:
        prepared.echo = await gate.redact_output(prepared.echo)
    echo = prepared.echo
    await _reserve(gate, prepared)
    await _versioned(server, base, record)
    gens = _Generations(server, prepared, base["id"], gate, record)
    logprobs = _CompletionLogprobs(server, body.logprobs, len(gens.streams), echo)

    def stored(i: int, text: str, finish: str) -> dict:
        return {"text": text, "finish_reason": finish, "content_filter_results": gens.filter_results(i)}

    if body.stream:
        def chunk(i, delta, finish, usage=None, entries=None):
            choices = [] if i is None else [{"index": i, "text": delta or "", "finish_reason": finish,
                                             "logprobs": logprobs.render(i, delta or "", entries)}]
            if finish is not None and gens.filter_results(i) is not None:
                choices[0]["content_filter_results"] = gens.filter_results(i)
            out = {**base, "choices": choices}
            if prepared.include_usage:
                out["usage"] = usage
            return out

        async def done():
            await _store(gate, key, gens, [stored(i, (echo[i] if echo else "") + gens.texts[i], gens.finish_reasons[i])
                                     for i in range(len(gens.streams))])

        first = [chunk(i, text, None) for i, text in enumerate(echo)] if echo else []
        return _stream_response(gens, chunk, prepared.include_usage, first, on_done=done)

    results = await _generate_or_raise(gens, request)
    if results is None:
        return Response(status_code=499)  # client closed the request (nginx's code); nobody reads it
    choices = []
    for i, (text, finish, entries) in enumerate(results):
        if finish == "content_filter":
            text, entries = "", []
        choice = {"index": i, "text": (echo[i] if echo else "") + text, "finish_reason": finish,
                  "logprobs": logprobs.render(i, text, entries)}
        if gens.filter_results(i) is not None:
            choice["content_filter_results"] = gens.filter_results(i)
        choices.append(choice)
    await _store(gate, key, gens, [stored(i, c["text"], c["finish_reason"]) for i, c in enumerate(choices)])
    return JSONResponse({**base, "choices": choices, "usage": _usage(gens)})


async def create_chat_completion(server: OpenAIServer, body: ChatCompletionRequest, request: Request):
    gate, record, key, hit, body, base = await _begin(server, body, request, "chat", "chatcmpl",
                                                      "chat.completion.chunk")
    if hit is not None:
        return _replay(hit, base, body.stream, bool(body.stream_options and body.stream_options.include_usage),
                       chat=True)
    prepared = _prepare(server, body, await _tokenized(_tokenize_chat, server, body), "messages")
    await _reserve(gate, prepared)
    await _versioned(server, base, record)
    gens = _Generations(server, prepared, base["id"], gate, record)
    logprobs = _ChatLogprobs(server) if body.logprobs else None

    def stored(i: int, text: str, finish: str) -> dict:
        return {"text": text, "finish_reason": finish, "content_filter_results": gens.filter_results(i)}

    if body.stream:
        def chunk(i, delta, finish, usage=None, entries=None):
            choices = [] if i is None else [{"index": i, "delta": {"content": delta} if delta else {},
                                             "logprobs": logprobs and logprobs.render(entries),
                                             "finish_reason": finish}]
            if finish is not None and gens.filter_results(i) is not None:
                choices[0]["content_filter_results"] = gens.filter_results(i)
            out = {**base, "choices": choices}
            if prepared.include_usage:
                out["usage"] = usage
            return out

        async def done():
            await _store(gate, key, gens, [stored(i, gens.texts[i], gens.finish_reasons[i])
                                     for i in range(len(gens.streams))])

        first = {**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None} for i in range(len(gens.streams))]}
        if prepared.include_usage:
            first["usage"] = None
        return _stream_response(gens, chunk, prepared.include_usage, [first], on_done=done)

    results = await _generate_or_raise(gens, request)
    if results is None:
        return Response(status_code=499)
    choices = []
    for i, (text, finish, entries) in enumerate(results):
        if finish == "content_filter":
            text, entries = "", []
        choice = {"index": i, "message": {"role": "assistant", "content": text, "refusal": None},
                  "logprobs": logprobs and logprobs.render(entries), "finish_reason": finish}
        if gens.filter_results(i) is not None:
            choice["content_filter_results"] = gens.filter_results(i)
        choices.append(choice)
    await _store(gate, key, gens, [stored(i, c["message"]["content"], c["finish_reason"]) for i, c in enumerate(choices)])
    return JSONResponse({**base, "object": "chat.completion", "choices": choices, "usage": _usage(gens)})


async def create_moderation(moderator, body: ModerationRequest, request: Request) -> dict:
    """OpenAI's /v1/moderations over the gateway's content filter (rules + classifier)."""
    texts = [body.input] if isinstance(body.input, str) else list(body.input)
    if not texts:
        raise InvalidRequest("input: an empty list has nothing to classify", param="input")
    record = record_of(request)
    if record is not None:
        record.prompt = texts
    gate = gate_of(request)
    if gate is not None:
        verdicts = await gate.check_content(texts, "moderation")
    else:
        verdicts = await moderator.check(texts)
    results = [{"flagged": v.flagged, "categories": v.categories, "category_scores": v.scores,
                "category_applied_input_types": {c: ["text"] for c in v.categories}} for v in verdicts]
    return {"id": f"modr-{uuid.uuid4().hex}", "model": moderator.model_id, "results": results}


def create_feedback(request_log, body: FeedbackRequest, request: Request) -> dict:
    if request_log is None:
        raise RouteNotFound("feedback needs the request log, which is off on this server (request_log.enabled)")
    gate = gate_of(request)
    key = gate.key if gate is not None else None
    fid, created = f"fb_{uuid.uuid4().hex}", int(time.time())
    record = record_of(request)
    request_log.submit({"kind": "feedback", "feedback_id": fid, "time": utc_iso(time.time()),
                        "request_id": body.request_id, "key_id": key.id if key else None,
                        "tenant": key.tenant if key else None, "rating": body.rating,
                        "correction": body.correction, "comment": body.comment,
                        "via": record.request_id if record is not None else None}, stream="feedback")
    return {"id": fid, "object": "feedback", "created": created, "request_id": body.request_id}


class _TokenText:
    """Token id -> its text, cached (each token's own decode, as OpenAI and vLLM show it)."""

    def __init__(self, server: OpenAIServer):
        self.tokenizer = server.loaded.tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self._cache.get(token)
        if text is None:
            text = self._cache[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return text


class _HeldLogprobs:
    """One choice's logprob entries under output redaction (gateway.pii.outputs: redact).

    A token's own text would show what the redaction removes, so entries wait until the
    stream's redactor has let the text they cover out (StreamRedactor.resolved), and an entry
    whose text falls inside a redacted span is shown with the redacted text instead (the
    span's first token carries the replacement, e.g. "<PHONE_NUMBER>", the others "", and a
    token's characters outside the span stay), its own logprob kept and no alternatives. Token texts are decoded one by one and may count
    characters a little differently from the assembled text (a character split over tokens):
    a span reaches that difference further on both sides, so the error is on the redacted side.
    """

    def __init__(self, token_text: _TokenText, redactor):
        self.text = token_text
        self.redactor = redactor  # the choice's StreamRedactor
        self.held: list[tuple[int, float, list, int, int]] = []  # token, logprob, top, start, end
        self.end = 0  # token-text characters so far
        self.raw = 0  # characters of the assembled (unredacted) text handed to the redactor
        self.shown: set[int] = set()  # spans whose replacement went out

    def add(self, entries) -> None:
        for token, (own, top) in entries:
            n = len(self.text(token))
            self.held.append((token, own, top, self.end, self.end + n))
            self.end += n

    def release(self, final: bool = False) -> list:
        """The entries whose text the redaction has resolved (all of them when final), as
        (token, (logprob, top), shown text or None for the token's own)."""
        margin = abs(self.end - self.raw)
        resolved = self.redactor.resolved
        out = []
        while self.held and (final or self.held[0][4] + margin <= resolved):
            token, own, top, start, end = self.held.pop(0)
            hits = [k for k, (s, e, _) in enumerate(self.redactor.spans) if start < e + margin and s - margin < end]
            if not hits:
                out.append((token, (own, top), None))
                continue
            # The token's text outside the spans stays; each span's replacement goes out once.
            text, shown, pos = self.text(token), [], start
            for k in hits:
                s, e, replacement = self.redactor.spans[k]
                shown.append(text[max(pos - start, 0):max(s - margin - start, 0)])
                if k not in self.shown:
                    shown.append(replacement)
                    self.shown.add(k)
                pos = max(pos, e + margin)
            shown.append(text[min(max(pos - start, 0), len(text)):])
            out.append((token, (own, []), "".join(shown)))
        return out


def _entries(entries):
    """(token, (logprob, top), shown text or None) from a choice's entries, redacted or not."""
    for entry in entries or []:
        yield entry if len(entry) == 3 else (*entry, None)


class _ChatLogprobs:
    """Chat's `logprobs` object: {"content": [{token, logprob, bytes, top_logprobs}], "refusal": None}."""

    def __init__(self, server: OpenAIServer):
        self.text = _TokenText(server)

    def _item(self, token: int, logprob: float, text: str | None = None) -> dict:
        text = self.text(token) if text is None else text
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def render(self, entries) -> dict | None:
        if entries is None:
            return None
        return {"content": [{**self._item(token, own, shown), "top_logprobs": [self._item(t, lp) for t, lp in top]}
                            for token, (own, top), shown in _entries(entries)], "refusal": None}


class _CompletionLogprobs:
    """The legacy completions `logprobs` object: tokens, token_logprobs, top_logprobs and
    text_offset (each token's character offset in the choice's text, echoed prompt included)."""

    def __init__(self, server: OpenAIServer, top: int | None, choices: int, echo: list[str] | None):
        self.top = top
        self.text = _TokenText(server)
        self.offsets = [len(echo[i]) if echo else 0 for i in range(choices)]

    def render(self, i: int, delta: str, entries) -> dict | None:
        if self.top is None:
            return None
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, (own, top), shown in _entries(entries):
            text = self.text(token) if shown is None else shown
            out["tokens"].append(text)
            out["token_logprobs"].append(own)
            out["top_logprobs"].append({self.text(t): lp for t, lp in top})
            out["text_offset"].append(self.offsets[i])
            self.offsets[i] += len(text)
        return out


# ---------------------------------------------------------------------------------------
# the app and its error handlers


def error_response(err: ServingError) -> Response:
    # ASCII-escaped: a message may quote the client's input, which is not always encodable text.
    return Response(json.dumps(err.body()), status_code=err.status, headers=err.headers,
                    media_type="application/json")


def _param_from_loc(loc: tuple) -> str | None:
    parts = [p for p in loc if p != "body"]
    if not parts or not isinstance(parts[0], str):
        return None
    out = parts[0]
    for p in parts[1:]:
        if isinstance(p, int):
            out += f"[{p}]"
        elif p in ChatMessage.model_fields or p in StreamOptions.model_fields or p in TextContentPart.model_fields:
            out += f".{p}"
        else:
            break  # a union member tag such as 'str' or 'list[str]'
    return out


def validation_error(errors: list[dict]) -> InvalidRequest:
    """The first pydantic/FastAPI validation error as an OpenAI 400 naming the parameter."""
    if not errors:
        return InvalidRequest("invalid request")
    e = errors[0]
    if e.get("type") == "json_invalid":
        return InvalidRequest(f"the request body is not valid JSON: {e.get('msg')}")
    param = _param_from_loc(tuple(e.get("loc", ())))
    if e.get("type") == "extra_forbidden":
        return InvalidRequest(f"Unrecognized request argument supplied: {param}", param=param)
    if e.get("type") == "missing" and param:
        return InvalidRequest(f"you must provide '{param}'", param=param)
    return InvalidRequest(f"{param}: {e.get('msg')}" if param else str(e.get("msg")), param=param)


def create_app(title: str = "tuneloop OpenAI-compatible API", version: str = "1",
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    """The FastAPI app; set app.state.server to an OpenAIServer once the model is ready."""
    app = FastAPI(title=title, version=version, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = None
    # The interface layer (tuneloop/gateway): set app.state.gateway before app.state.server;
    # without one every /v1 route is open (unit tests, gateway-less embedding).
    app.state.gateway = None
    app.add_middleware(GatewayMiddleware)
    # The request log (tuneloop/requestlog), outside the gateway so refusals are logged
    # too; set app.state.request_log to a RequestLog to turn it on.
    app.state.request_log = None
    app.add_middleware(RequestLogMiddleware)
    # The server's own time for each /v1 response, as OpenAI's header reports it.
    app.add_middleware(ProcessingTimeMiddleware)
    # Outermost: a body over the limit is refused (413) before any of the above reads it.
    app.add_middleware(BodyLimit, limit=max_request_bytes)

    @app.exception_handler(ServingError)
    async def _serving_error(request: Request, err: ServingError):
        server = getattr(request.app.state, "server", None)
        if server is not None:
            server.count_rejection(err.reason)
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        err = validation_error(list(exc.errors()))
        return await _serving_error(request, err)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return await _serving_error(request, error_for_status(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return await _serving_error(request, InternalError("unexpected server error; see the server log"))

    @app.post("/v1/completions", response_model=Completion, tags=["OpenAI"],
              responses={**ERROR_RESPONSES, 200: {"content": SSE_DOC}})
    async def completions(body: CompletionRequest, request: Request):
        """Text completion of a prompt (or of each prompt of a list)."""
        return await create_completion(_server(request), body, request)

    @app.post("/v1/chat/completions", response_model=ChatCompletion, tags=["OpenAI"],
              responses={**ERROR_RESPONSES, 200: {"content": SSE_DOC}})
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        """The assistant's next message, rendered through the model's chat template."""
        return await create_chat_completion(_server(request), body, request)

    @app.post("/v1/moderations", response_model=ModerationResponse, tags=["OpenAI"], responses=ERROR_RESPONSES)
    async def moderations(body: ModerationRequest, request: Request):
        """Classify text with the content filter: its rules and the trained prompt-injection classifier."""
        gateway = request.app.state.gateway
        moderator = gateway.filter if gateway is not None else None
        if moderator is None:
            if request.app.state.server is None or not request.app.state.server.ready:
                raise Unavailable("the server is loading or warming up; retry shortly", retry_after_s=2)
            raise RouteNotFound("moderation is off on this server (gateway.filter.prompts and outputs are off)")
        return await create_moderation(moderator, body, request)

    @app.post("/v1/feedback", response_model=FeedbackResponse, tags=["tuneloop"], responses=ERROR_RESPONSES)
    async def feedback(body: FeedbackRequest, request: Request):
        """A rating and/or a corrected completion for a logged request (stored with the request log)."""
        return create_feedback(request.app.state.request_log, body, request)

    @app.get("/v1/models", response_model=ModelList, tags=["OpenAI"], responses=ERROR_RESPONSES)
    async def list_models(request: Request):
        """The served model: its registered name:version, then its aliases."""
        server = _server(request)
        s = server.served
        return {"object": "list", "data": [{"id": i, "object": "model", "created": s.created,
                                            "owned_by": "tuneloop", "root": s.id} for i in s.ids]}

    @app.get("/v1/models/{model:path}", response_model=ModelCard, tags=["OpenAI"], responses=ERROR_RESPONSES)
    async def retrieve_model(model: str, request: Request):
        server = _server(request)
        _check_model(server, model)
        s = server.served
        return {"id": model, "object": "model", "created": s.created, "owned_by": "tuneloop", "root": s.id}

    return app


# ---------------------------------------------------------------------------------------
# ASGI middleware


class ProcessingTimeMiddleware(ApiMiddleware):
    """The server's own time on every /v1 response: the milliseconds from the request
    reaching the app to its response starting (the whole answer for a JSON response, the
    time to the stream's start for SSE). Sent as OpenAI sends it, `openai-processing-ms`
    (whole milliseconds), and as the W3C `server-timing: app;dur=<ms>` with microseconds,
    which benchmarks read: a cache hit takes about a millisecond. What a client measures on
    top of it is the HTTP server, the network and the client itself."""

    HEADERS = (b"openai-processing-ms", b"server-timing")

    async def handle(self, scope, receive, send):
        start = time.perf_counter()

        async def send_with_time(message):
            if message["type"] == "http.response.start":
                # Both headers from one reading rounded to microseconds, so the whole
                # milliseconds are that reading rounded (0.5004 ms is "0.500" and "0", not "1").
                ms = round((time.perf_counter() - start) * 1000, 3)
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() not in self.HEADERS]
                headers += [(b"openai-processing-ms", f"{ms:.0f}".encode()),
                            (b"server-timing", f"app;dur={ms:.3f}".encode())]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_time)


# OpenAI shapes for errors answered outside the FastAPI app


class OpenAIErrorMiddleware:
    """Rewrites error responses that are not OpenAI-shaped (BentoML's own 400/404/429/503/504,
    Starlette's plain-text 404/405) into {"error": {...}}, keeping the status (422 -> 400).

    Health and metrics endpoints keep their own bodies (probes read only the status).
    """

    SKIP = ("/livez", "/readyz", "/healthz", "/metrics")

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path", "") in self.SKIP:
            return await self.app(scope, receive, send)
        start: dict | None = None
        chunks: list[bytes] = []

        async def capture(message):
            nonlocal start
            if message["type"] == "http.response.start":
                if message["status"] < 400:
                    start = None
                    return await send(message)
                start = message
                return None
            if message["type"] == "http.response.body" and start is not None:
                chunks.append(message.get("body", b""))
                if message.get("more_body"):
                    return None
                return await self._send_rewritten(scope, start, b"".join(chunks), send)
            return await send(message)

        await self.app(scope, receive, capture)

    @staticmethod
    async def _send_rewritten(scope, start: dict, body: bytes, send) -> None:
        status = start["status"]
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() not in (b"content-length", b"content-type")]
        try:
            data = json.loads(body or b"null")
        except ValueError:
            data = body.decode("utf-8", "replace").strip()
        if isinstance(data, dict) and isinstance(data.get("error"), dict) and "message" in data["error"]:
            new_body, new_status = body, status  # already OpenAI-shaped
        else:
            message = f"{scope.get('method')} {scope.get('path')}: {_message_of(data) or f'HTTP {status}'}"
            err = error_for_status(status, message)
            new_body, new_status = json.dumps(err.body()).encode(), err.status
            if err.headers and not any(k.lower() == b"retry-after" for k, _ in headers):
                headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
        headers += [(b"content-type", b"application/json"), (b"content-length", str(len(new_body)).encode())]
        await send({"type": "http.response.start", "status": new_status, "headers": headers})
        await send({"type": "http.response.body", "body": new_body, "more_body": False})


def _message_of(data) -> str:
    if isinstance(data, str):
        return data
    if isinstance(data, dict):
        msg = data.get("error") or data.get("detail") or data.get("message") or ""
        detail = data.get("detail")
        if isinstance(detail, list) and detail and isinstance(detail[0], dict):
            d = detail[0]
            loc = ".".join(str(p) for p in d.get("loc", ()))
            msg = f"{msg}: {loc}: {d.get('msg')}" if msg else f"{loc}: {d.get('msg')}"
        return str(msg)
    if isinstance(data, (list, tuple)) and data:
        return _message_of(data[0])
    return ""


class InternalRoutesGuard:
    """Makes routes under `prefix` unreachable from outside the process: a request there
    without the process's own token (header `x-tuneloop-internal`, a random secret made at
    start-up and given only to the in-process client) is answered 404, as if the route did
    not exist, before anything parses its body."""

    HEADER = b"x-tuneloop-internal"

    def __init__(self, app, prefix: str, token: str):
        self.app, self.prefix, self.token = app, prefix, token.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("path", "").startswith(self.prefix):
            import hmac

            given = dict(scope.get("headers") or []).get(self.HEADER, b"")
            if not hmac.compare_digest(given, self.token):
                err = RouteNotFound(f"{scope.get('method')} {scope.get('path')}: not found")
                body = json.dumps(err.body()).encode()
                await send({"type": "http.response.start", "status": err.status,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body, "more_body": False})
                return
        await self.app(scope, receive, send)


class PublicOpenAPISpec:
    """The served OpenAPI spec (BentoML's `/docs.json`) as clients should read it: without
    the routes under `hide_prefix` (nobody outside can call them), and declared as OpenAPI
    3.1, which is what its schemas are (pydantic's JSON Schema: numeric exclusiveMinimum,
    `type: null`); BentoML labels them 3.0.2, and 3.0 tools then reject them."""

    def __init__(self, app, hide_prefix: str, path: str = "/docs.json"):
        self.app, self.hide_prefix, self.path = app, hide_prefix, path

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") != self.path:
            return await self.app(scope, receive, send)
        start: dict = {}
        chunks: list[bytes] = []

        async def capture(message):
            if message["type"] == "http.response.start":
                start.update(message)
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
                if not message.get("more_body"):
                    body = b"".join(chunks)
                    if start.get("status") == 200:
                        body = json.dumps(self.rewrite(json.loads(body))).encode()
                    headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
                    await send({**start, "headers": headers + [(b"content-length", str(len(body)).encode())]})
                    await send({"type": "http.response.body", "body": body, "more_body": False})
            else:
                await send(message)

        await self.app(scope, receive, capture)

    def rewrite(self, spec: dict) -> dict:
        spec["openapi"] = "3.1.0"
        spec["paths"] = {k: v for k, v in spec.get("paths", {}).items() if not k.startswith(self.hide_prefix)}
        return spec
