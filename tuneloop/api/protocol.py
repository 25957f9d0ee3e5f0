"""The OpenAI request and response schemas of /v1: what the routes validate and what the
served OpenAPI spec documents (the shape of vLLM's entrypoints/openai/protocol.py)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator


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
        raise ValueError(
            f"contains a lone UTF-16 surrogate ({text[exc.start]!a}) at character {exc.start}; send valid Unicode text"
        ) from None
    return text


Text = Annotated[str, AfterValidator(_no_lone_surrogates)]
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # OpenAI's range for seed


class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingFields(_Strict):
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


class CompletionRequest(SamplingFields):
    prompt: Text | list[Text] | list[int] | list[list[int]] = Field(
        description="A string, a list of strings, or token ids (a list, or a list of lists)"
    )
    echo: bool = Field(False, description="Return the prompt's text before the completion.")
    suffix: Text | None = Field(None, description="Fill-in-the-middle; only for models with FIM tokens.")
    logprobs: int | None = Field(
        None,
        ge=0,
        le=5,
        description="The log-probability of each token and of this "
        "many alternatives (of the model's own distribution, as vLLM reports it).",
    )
    best_of: int | None = Field(None, ge=1, description="Only equal to n (no server-side ranking).")


class TextContentPart(_Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer"]
    content: Text | list[TextContentPart]
    name: Text | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = Field(False, description="The log-probability of each token of the answer.")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="With logprobs: this many alternatives each.")
    modalities: list[Literal["text"]] | None = Field(None, description='Only ["text"].')
    audio: Any = Field(None, description="Not supported: a value is a 400.")


class ModerationRequest(_Strict):
    input: Text | list[Text] = Field(description="A string or a list of strings to classify.")
    model: Text | None = Field(None, description="Accepted; the server's content filter answers whatever it names.")


class EmbeddingRequest(_Strict):
    model: Text
    input: Text | list[Text] | list[int] | list[list[int]] = Field(
        description="A string or a list of strings (token ids are refused: they are another model's tokens)."
    )
    encoding_format: Literal["float", "base64"] = Field("float", description="base64: little-endian float32s.")
    dimensions: int | None = Field(None, ge=1, description="Only the model's own (384): it is not trained to be cut.")
    user: Text | None = Field(None, description="Accepted, not used.")


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a prompt, or chat messages rendered through the model's chat template."""

    model: Text | None = Field(None, description="Optional; the served model's name when given.")
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = Field(True, description="With messages: end with the assistant's turn opening.")
    add_special_tokens: bool = Field(True, description="With a prompt: the tokenizer's special tokens too.")

    @model_validator(mode="after")
    def _one_of(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Strict):
    model: Text | None = Field(None, description="Optional; the served model's name when given.")
    tokens: list[int] = Field(description="Token ids of the served model's vocabulary.")


class DetokenizeResponse(BaseModel):
    prompt: str


class FeedbackRequest(_Strict):
    """tuneloop's own route (OpenAI has none): what a client says about a logged request."""

    request_id: str = Field(
        pattern=r"^(req_|chatcmpl-|cmpl-)[0-9a-f]{32}$",
        description="The request's x-request-id header (req_...) or its response id (chatcmpl-... / cmpl-...).",
    )
    rating: int | None = Field(None, ge=-1, le=1, description="-1 bad, 0 neutral, 1 good.")
    correction: Text | None = Field(
        None,
        min_length=1,
        max_length=100_000,
        description="The completion the model should have given: a candidate "
        "training example (validated before any training uses it).",
    )
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
SSE_DOC = {
    "text/event-stream": {
        "schema": {"type": "string", "description": "with stream=true: `data: <chunk>` events, then `data: [DONE]`"}
    }
}
