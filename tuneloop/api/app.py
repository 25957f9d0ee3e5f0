"""The OpenAI-compatible HTTP API: the FastAPI app and its routes, a module per route family
(the shape of vLLM's entrypoints/openai: protocol.py the schemas, completions.py / chat.py /
moderations.py / feedback.py the handlers, this file the router).

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/moderations, POST
/v1/feedback, GET /v1/models, GET /v1/models/{model}. The app knows nothing about BentoML: it
talks to a Backend (something with `engine` and `submit(stream)`), which bentos/service.py
provides for the adaptive (BentoML batching), continuous and slots engines. create_app()
builds the app before the model is loaded; attach an OpenAIServer to app.state.server once
it is. Until then, and until warm-up is done, every route answers 503.

What a request goes through: the hooks (the request log, the gateway: tuneloop/hooks.py) ->
model name check (404) -> parameter checks (400, naming the parameter) -> prompt rendering
and tokenisation -> context window check (400 context_length_exceeded) -> admission (429 +
Retry-After) -> generation with a deadline (504) while watching for the client going away
(its generations are cancelled, its slots freed) -> OpenAI-shaped JSON or SSE chunks ending
with `data: [DONE]`.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tuneloop.api.chat import create_chat_completion
from tuneloop.api.completions import create_completion
from tuneloop.api.embeddings import create_embeddings, embedder_of
from tuneloop.api.errors import error_response, validation_error
from tuneloop.api.feedback import create_feedback
from tuneloop.api.middleware import HooksMiddleware, ProcessingTimeMiddleware
from tuneloop.api.moderations import create_moderation
from tuneloop.api.prepare import check_model
from tuneloop.api.protocol import (
    ERROR_RESPONSES,
    SSE_DOC,
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingList,
    EmbeddingRequest,
    FeedbackRequest,
    FeedbackResponse,
    ModelCard,
    ModelList,
    ModerationRequest,
    ModerationResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from tuneloop.api.server import server_of
from tuneloop.api.tokenize import create_detokenize, create_tokenize
from tuneloop.serving.errors import InternalError, ServingError, error_for_status
from tuneloop.serving.untrusted import DEFAULT_MAX_REQUEST_BYTES, BodyLimit

log = logging.getLogger("tuneloop.api")
# The routes behind the hooks (key, limits, log): OpenAI's under /v1 and vLLM's tokenizer routes.
HOOKED = ("/v1/", "/tokenize", "/detokenize")


def create_app(
    title: str = "tuneloop OpenAI-compatible API",
    version: str = "1",
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> FastAPI:
    """The FastAPI app; set app.state.server to an OpenAIServer once the model is ready."""
    app = FastAPI(title=title, version=version, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = None
    app.state.embedder = None  # a tuneloop.serving.embedder.Embedder: /v1/embeddings on
    # The hooks around every /v1 request (HooksMiddleware): the interface layer
    # (tuneloop/gateway; set app.state.gateway before app.state.server; without one every /v1
    # route is open: unit tests, gateway-less embedding) and the request log
    # (tuneloop/requestlog; set app.state.request_log to a RequestLog to turn it on).
    app.state.gateway = None
    app.state.request_log = None
    app.add_middleware(HooksMiddleware, prefix=HOOKED)
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

    @app.post(
        "/v1/completions",
        response_model=Completion,
        tags=["OpenAI"],
        responses={**ERROR_RESPONSES, 200: {"content": SSE_DOC}},
    )
    async def completions(body: CompletionRequest, request: Request):
        """Text completion of a prompt (or of each prompt of a list)."""
        return await create_completion(server_of(request), body, request)

    @app.post(
        "/v1/chat/completions",
        response_model=ChatCompletion,
        tags=["OpenAI"],
        responses={**ERROR_RESPONSES, 200: {"content": SSE_DOC}},
    )
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        """The assistant's next message, rendered through the model's chat template."""
        return await create_chat_completion(server_of(request), body, request)

    @app.post("/v1/moderations", response_model=ModerationResponse, tags=["OpenAI"], responses=ERROR_RESPONSES)
    async def moderations(body: ModerationRequest, request: Request):
        """Classify text with the content filter: its rules and the trained prompt-injection classifier."""
        return await create_moderation(body, request)

    @app.post("/v1/feedback", response_model=FeedbackResponse, tags=["tuneloop"], responses=ERROR_RESPONSES)
    async def feedback(body: FeedbackRequest, request: Request):
        """A rating and/or a corrected completion for a logged request (stored with the request log)."""
        return create_feedback(request.app.state.request_log, body, request)

    @app.post("/v1/embeddings", response_model=EmbeddingList, tags=["OpenAI"], responses=ERROR_RESPONSES)
    async def embeddings(body: EmbeddingRequest, request: Request):
        """Vectors of texts from the shipped sentence encoder (all-MiniLM-L6-v2, 384 dimensions, normalised)."""
        server_of(request)  # ready and not draining, as every route
        return await create_embeddings(embedder_of(request), body, request)

    @app.post("/tokenize", response_model=TokenizeResponse, tags=["vLLM"], responses=ERROR_RESPONSES)
    async def tokenize(body: TokenizeRequest, request: Request):
        """The served model's token ids of a prompt, or of chat messages through its chat template."""
        return await create_tokenize(server_of(request), body, request)

    @app.post("/detokenize", response_model=DetokenizeResponse, tags=["vLLM"], responses=ERROR_RESPONSES)
    async def detokenize(body: DetokenizeRequest, request: Request):
        """Token ids of the served model back to text."""
        return await create_detokenize(server_of(request), body, request)

    @app.get("/v1/models", response_model=ModelList, tags=["OpenAI"], responses=ERROR_RESPONSES)
    async def list_models(request: Request):
        """The served model: its registered name:version, then its aliases; then the embedding model."""
        server = server_of(request)
        s = server.served
        data = [{"id": i, "object": "model", "created": s.created, "owned_by": "tuneloop", "root": s.id} for i in s.ids]
        embedder = getattr(request.app.state, "embedder", None)
        if embedder is not None:
            data.append(_embedding_card(embedder, s.created))
        return {"object": "list", "data": data}

    @app.get("/v1/models/{model:path}", response_model=ModelCard, tags=["OpenAI"], responses=ERROR_RESPONSES)
    async def retrieve_model(model: str, request: Request):
        server = server_of(request)
        s = server.served
        embedder = getattr(request.app.state, "embedder", None)
        if embedder is not None and model == embedder.model_id:
            return _embedding_card(embedder, s.created)
        check_model(server, model)
        return {"id": model, "object": "model", "created": s.created, "owned_by": "tuneloop", "root": s.id}

    return app


def _embedding_card(embedder, created: int) -> dict:
    return {
        "id": embedder.model_id,
        "object": "model",
        "created": created,
        "owned_by": "tuneloop",
        "root": embedder.model_id,
    }
