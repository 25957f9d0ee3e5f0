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
    parallel_tool_calls: bool | None = Field(
        None, description="With tools: whether one answer may call several (default true)."
    )
    # Structured outputs (constrained decoding, serving/constraints.py) and tool calling.
    response_format: dict[str, Any] | None = Field(
        None,
        description='{"type": "text"}, {"type": "json_object"}, or {"type": "json_schema", "json_schema": '
        '{"name", "schema", "strict"}}: the answer is valid JSON (matching the schema), by constrained decoding.',
    )
    structured_outputs: dict[str, Any] | None = Field(
        None,
        description="vLLM's extension: exactly one of json (a schema), json_object, regex, choice (a list of "
        "strings) or grammar (Lark, or GBNF); the answer matches it.",
    )
    guided_json: dict[str, Any] | Text | None = Field(
        None, description="vLLM's older name for structured_outputs.json."
    )
    guided_regex: Text | None = Field(None, description="vLLM's older name for structured_outputs.regex.")
    guided_choice: list[Text] | None = Field(None, description="vLLM's older name for structured_outputs.choice.")
    guided_grammar: Text | None = Field(None, description="vLLM's older name for structured_outputs.grammar.")
    tools: list[dict[str, Any]] | None = Field(
        None, description='Chat only: functions the model may call ({"type": "function", "function": {...}}).'
    )
    tool_choice: Any = Field(
        None, description='"none", "auto" (the default with tools), "required", or {"type": "function", ...}.'
    )


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


class ToolCallFunction(_Strict):
    name: Text
    arguments: Text = Field(description="The arguments as a JSON object's text.")


class ToolCallItem(_Strict):
    id: Text
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | list[TextContentPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCallItem] | None = Field(None, description="An assistant message's calls.")
    tool_call_id: Text | None = Field(None, description="A tool message: the call it answers.")
    refusal: Text | None = Field(None, description="Accepted on assistant messages, not rendered.")

    @model_validator(mode="after")
    def _consistent(self) -> "ChatMessage":
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id (the id of the call it answers)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.content is None and not (self.role == "assistant" and (self.tool_calls or self.refusal)):
            raise ValueError(f"a {self.role} message needs content")
        return self


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = Field(False, description="The log-probability of each token of the answer.")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="With logprobs: this many alternatives each.")
    modalities: list[Literal["text"]] | None = Field(None, description='Only ["text"].')
    audio: Any = Field(None, description="Not supported: a value is a 400.")


# ---- the Responses API (POST /v1/responses, tuneloop/api/responses.py): stateless --------------

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class ResponseTextPart(_Strict):
    """A message's text part: input_text, or output_text (an earlier answer sent back)."""

    type: Literal["input_text", "output_text"]
    text: Text
    annotations: list[Any] | None = Field(None, description="Accepted on output_text, not read.")
    logprobs: list[Any] | None = Field(None, description="Accepted on output_text, not read.")


class ResponseMessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | list[ResponseTextPart]
    id: Text | None = None
    status: ItemStatus | None = None
    phase: Literal["commentary", "final_answer"] | None = None


class ResponseFunctionCallItem(_Strict):
    """A call the model made (an earlier answer's function_call item, sent back)."""

    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text = Field(description="A JSON object's text.")
    id: Text | None = None
    status: ItemStatus | None = None
    namespace: Text | None = None
    caller: dict[str, Any] | None = None


class ResponseFunctionCallOutputItem(_Strict):
    """The result of a call, for the model to read."""

    type: Literal["function_call_output"]
    call_id: Text
    output: Text | list[ResponseTextPart]
    id: Text | None = None
    status: ItemStatus | None = None


class ResponseStreamOptions(_Strict):
    include_obfuscation: bool | None = Field(None, description="Accepted, not used: events are not padded.")


class ResponseTextConfig(_Strict):
    format: dict[str, Any] | None = Field(
        None,
        description='{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "name", "schema", '
        '"strict"}: the answer is valid JSON (matching the schema), by constrained decoding.',
    )
    verbosity: Literal["low", "medium", "high"] | None = Field(None, description='Only "medium" (the default).')


class ResponsesRequest(_Strict):
    """POST /v1/responses, stateless: everything the model reads comes with the request."""

    model: Text
    input: Text | list[dict[str, Any]] = Field(
        description="A string (the user's message), or a list of items: messages (role user, system, developer "
        "or assistant; content a string or input_text/output_text parts), function_call and "
        "function_call_output items."
    )
    instructions: Text | None = Field(None, description="A system message before the input.")
    tools: list[dict[str, Any]] | None = Field(
        None, description='Function tools: {"type": "function", "name", "description", "parameters", "strict"}.'
    )
    tool_choice: Any = Field(
        None, description='"none", "auto" (the default), "required", or {"type": "function", "name"}.'
    )
    parallel_tool_calls: bool | None = Field(
        None, description="Whether one answer may call several tools (default true)."
    )
    text: ResponseTextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1, description="Default: until a stop token or the context window.")
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool | None = False
    stream_options: ResponseStreamOptions | None = None
    include: list[Text] | None = Field(
        None, description='"message.output_text.logprobs" (with top_logprobs); "reasoning.encrypted_content": no-op.'
    )
    top_logprobs: int | None = Field(None, ge=0, le=20, description="With include message.output_text.logprobs.")
    metadata: dict[str, Text] | None = Field(None, description="Echoed in the response, not used.")
    # Accepted and not used: they change no answer.
    user: Text | None = Field(None, description="Accepted, not used.")
    safety_identifier: Text | None = Field(None, description="Accepted, not used.")
    prompt_cache_key: Text | None = Field(None, description="Accepted, not used.")
    prompt_cache_retention: Text | None = Field(None, description="Accepted, not used.")
    service_tier: Text | None = Field(None, description="Accepted, not used.")
    max_tool_calls: int | None = Field(None, ge=1, description="Accepted, not used: there are no built-in tools.")
    truncation: Literal["auto", "disabled"] | None = Field(None, description='Only "disabled" (the default).')
    # OpenAI's stateful and other features: this server refuses them (a 400 naming each).
    store: bool | None = Field(None, description="Only false or left out: nothing is stored.")
    previous_response_id: Text | None = Field(None, description="Not supported (nothing is stored).")
    conversation: Any = Field(None, description="Not supported (nothing is stored).")
    background: bool | None = Field(None, description="Only false.")
    reasoning: dict[str, Any] | None = Field(None, description="Not supported: not a reasoning model.")
    prompt: Any = Field(None, description="Not supported (stored prompt templates).")
    context_management: Any = Field(None, description="Not supported.")


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


class FeedbackPreference(_Strict):
    """Two answers to a logged request's prompt, one preferred: a preference pair for DPO."""

    chosen: Text = Field(min_length=1, max_length=100_000, description="The preferred completion.")
    rejected: Text = Field(min_length=1, max_length=100_000, description="The non-preferred completion.")

    @model_validator(mode="after")
    def _two_answers(self) -> "FeedbackPreference":
        if self.chosen == self.rejected:
            raise ValueError("chosen and rejected are the same text: nothing to prefer")
        return self


class FeedbackRequest(_Strict):
    """tuneloop's own route (OpenAI has none): what a client says about a logged request."""

    request_id: str = Field(
        pattern=r"^(req_|chatcmpl-|cmpl-|resp_)[0-9a-f]{32}$",
        description="The request's x-request-id header (req_...) or its response id (chatcmpl-, cmpl-, resp_...).",
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
    preference: FeedbackPreference | None = Field(
        None,
        description="A preferred and a non-preferred completion for the request's prompt: a candidate "
        "preference pair for DPO (validated before any training uses it).",
    )

    @model_validator(mode="after")
    def _something(self) -> "FeedbackRequest":
        if self.rating is None and self.correction is None and self.preference is None:
            raise ValueError("give a rating, a correction, a preference, or several")
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
    cached_tokens: int = 0  # prompt tokens the engine's prefix cache did not prefill (slots, vllm; others: 0)


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


FinishReason = Literal["stop", "length", "content_filter", "tool_calls"]


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


class FunctionCall(BaseModel):
    name: str
    arguments: str  # always a complete JSON object's text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None when the message only calls tools
    refusal: None = None
    tool_calls: list[ToolCall] | None = None


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


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(BaseModel):
    """POST /v1/responses' answer (OpenAI's Response; its stream: the Responses events)."""

    model_config = ConfigDict(extra="allow")
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete"]
    error: None = None
    incomplete_details: dict[str, str] | None
    instructions: str | None
    model: str
    output: list[dict[str, Any]] = Field(description="message and function_call items")
    parallel_tool_calls: bool
    tool_choice: Any
    tools: list[dict[str, Any]]
    temperature: float | None
    top_p: float | None
    metadata: dict[str, str]
    usage: ResponseUsage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tuneloop"
    root: str  # the registered name:version every alias points at


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class FileObject(BaseModel):
    """OpenAI's File object (/v1/files)."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["processed"] = "processed"  # every kept file passed the data contract
    expires_at: int | None = None  # files here do not expire
    status_details: str | None = None


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


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
RESPONSES_SSE_DOC = {
    "text/event-stream": {
        "schema": {
            "type": "string",
            "description": "with stream=true: `event: <type>` / `data: <event>` pairs, from response.created to "
            "response.completed (or response.incomplete, or an error event)",
        }
    }
}
SSE_DOC = {
    "text/event-stream": {
        "schema": {"type": "string", "description": "with stream=true: `data: <chunk>` events, then `data: [DONE]`"}
    }
}
