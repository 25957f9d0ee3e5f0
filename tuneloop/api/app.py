"""The OpenAI-compatible HTTP API: the FastAPI app and its routes, a module per route family
(the shape of vLLM's entrypoints/openai: protocol.py the schemas, completions.py / chat.py /
moderations.py / feedback.py the handlers, this file the router).

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (stateless: GET and
DELETE /v1/responses/{id} are a 400), POST /v1/moderations, POST /v1/feedback, GET /v1/models,
GET /v1/models/{model}, and the Files API (/v1/files: files.py). The app knows nothing about
BentoML: it talks to a Backend (something with `engine` and `submit(stream)`), which bentos/service.py
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
from tuneloop.api.files import (
    FILE_LIST_DOC,
    FILE_UPLOAD_DOC,
    UPLOAD_ROUTE,
    create_file,
    delete_file,
    file_content,
    list_files,
    retrieve_file,
)
from tuneloop.api.fine_tuning import (
    JOBS_ROUTE,
    FineTuningJobRequest,
    cancel_job,
    create_job,
    job_checkpoints,
    job_events,
    list_jobs,
    refuse_pause,
    retrieve_job,
)
from tuneloop.api.handlers import call_of
from tuneloop.api.middleware import HooksMiddleware, ProcessingTimeMiddleware
from tuneloop.api.models import model_card, model_cards
from tuneloop.api.moderations import create_moderation
from tuneloop.api.prepare import check_model
from tuneloop.api.protocol import (
    ERROR_RESPONSES,
    RESPONSES_SSE_DOC,
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
    FileDeleted,
    FileList,
    FileObject,
    ModelCard,
    ModelList,
    ModerationRequest,
    ModerationResponse,
    ResponseObject,
    ResponsesRequest,
    TokenizeRequest,
    TokenizeResponse,
)
from tuneloop.api.responses import create_response
from tuneloop.api.responses_input import refuse_retrieval
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
    app.state.files = None  # a tuneloop.files.FileStore (open_file_store(cfg)): /v1/files on
    # Fine-tuning jobs (/v1/fine_tuning/jobs): a tuneloop.finetune.JobStore, the config its limits
    # come from, and the Dispatcher that runs the jobs; the AdapterCatalog serves their ft: models.
    app.state.jobs = None
    app.state.fine_tuning_config = None
    app.state.dispatcher = None
    app.state.adapters = None
    # The hooks around every /v1 request (HooksMiddleware): the interface layer
    # (tuneloop/gateway; set app.state.gateway before app.state.server; without one every /v1
    # route is open: unit tests, gateway-less embedding) and the request log
    # (tuneloop/requestlog; set app.state.request_log to a RequestLog to turn it on).
    app.state.gateway = None
    app.state.request_log = None
    app.add_middleware(HooksMiddleware, prefix=HOOKED)
    # The server's own time for each /v1 response, as OpenAI's header reports it.
    app.add_middleware(ProcessingTimeMiddleware)
    # Outermost: a body over the limit is refused (413) before any of the above reads it. The
    # upload route bounds its own body as it streams it (files.max_upload_bytes: api/files.py).
    app.add_middleware(BodyLimit, limit=max_request_bytes, exempt=(UPLOAD_ROUTE,))

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

    @app.post(
        "/v1/responses",
        response_model=ResponseObject,
        tags=["OpenAI"],
        responses={**ERROR_RESPONSES, 200: {"content": RESPONSES_SSE_DOC}},
    )
    async def responses(body: ResponsesRequest, request: Request):
        """OpenAI's Responses API, stateless: the model's next output items (messages, function calls)."""
        return await create_response(server_of(request), body, request)

    @app.get("/v1/responses/{response_id}", tags=["OpenAI"], responses=ERROR_RESPONSES)
    async def retrieve_response(response_id: str, request: Request):
        """Not supported (400): this server stores no responses."""
        raise refuse_retrieval(response_id)

    @app.delete("/v1/responses/{response_id}", tags=["OpenAI"], responses=ERROR_RESPONSES)
    async def delete_response(response_id: str, request: Request):
        """Not supported (400): this server stores no responses."""
        raise refuse_retrieval(response_id)

    @app.post("/v1/responses/{response_id}/cancel", tags=["OpenAI"], responses=ERROR_RESPONSES)
    async def cancel_response(response_id: str, request: Request):
        """Not supported (400): there are no background responses."""
        raise refuse_retrieval(response_id)

    @app.get("/v1/responses/{response_id}/input_items", tags=["OpenAI"], responses=ERROR_RESPONSES)
    async def response_input_items(response_id: str, request: Request):
        """Not supported (400): this server stores no responses."""
        raise refuse_retrieval(response_id)

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

    @app.post(
        UPLOAD_ROUTE,
        response_model=FileObject,
        tags=["OpenAI"],
        responses=ERROR_RESPONSES,
        openapi_extra=FILE_UPLOAD_DOC,
    )
    async def files_upload(request: Request):
        """Upload fine-tuning data (multipart `file`, `purpose` fine-tune), checked against the data contract."""
        return await create_file(request)

    @app.get(
        UPLOAD_ROUTE, response_model=FileList, tags=["OpenAI"], responses=ERROR_RESPONSES, openapi_extra=FILE_LIST_DOC
    )
    async def files_list(request: Request):
        """This key's team's files (`purpose`, `limit`, `after`, `order`), newest first by default."""
        return await list_files(request)

    @app.get(UPLOAD_ROUTE + "/{file_id}", response_model=FileObject, tags=["OpenAI"], responses=ERROR_RESPONSES)
    async def files_retrieve(file_id: str, request: Request):
        return await retrieve_file(request, file_id)

    @app.delete(UPLOAD_ROUTE + "/{file_id}", response_model=FileDeleted, tags=["OpenAI"], responses=ERROR_RESPONSES)
    async def files_delete(file_id: str, request: Request):
        return await delete_file(request, file_id)

    @app.get(
        UPLOAD_ROUTE + "/{file_id}/content",
        tags=["OpenAI"],
        responses={**ERROR_RESPONSES, 200: {"content": {"application/octet-stream": {}}}},
    )
    async def files_content(file_id: str, request: Request):
        """The file's bytes, as uploaded."""
        return await file_content(request, file_id)

    @app.post(JOBS_ROUTE, tags=["OpenAI"], responses=ERROR_RESPONSES)
    async def fine_tuning_create(body: FineTuningJobRequest, request: Request):
        """Create a fine-tuning job: a LoRA adapter of the served model trained on an uploaded file."""
        return await create_job(request, body)

    @app.get(JOBS_ROUTE, tags=["OpenAI"], responses=ERROR_RESPONSES)
    async def fine_tuning_list(request: Request):
        """This key's team's fine-tuning jobs, newest first (`after`, `limit`, `metadata[k]`)."""
        return await list_jobs(request)

    @app.get(JOBS_ROUTE + "/{job_id}", tags=["OpenAI"], responses=ERROR_RESPONSES)
    async def fine_tuning_retrieve(job_id: str, request: Request):
        return await retrieve_job(request, job_id)

    @app.post(JOBS_ROUTE + "/{job_id}/cancel", tags=["OpenAI"], responses=ERROR_RESPONSES)
    async def fine_tuning_cancel(job_id: str, request: Request):
        return await cancel_job(request, job_id)

    @app.get(JOBS_ROUTE + "/{job_id}/events", tags=["OpenAI"], responses=ERROR_RESPONSES)
    async def fine_tuning_events(job_id: str, request: Request):
        """The job's events, newest first (`after`, `limit`): status changes, training steps' metrics."""
        return await job_events(request, job_id)

    @app.get(JOBS_ROUTE + "/{job_id}/checkpoints", tags=["OpenAI"], responses=ERROR_RESPONSES)
    async def fine_tuning_checkpoints(job_id: str, request: Request):
        return await job_checkpoints(request, job_id)

    @app.post(JOBS_ROUTE + "/{job_id}/pause", tags=["OpenAI"], responses=ERROR_RESPONSES)
    async def fine_tuning_pause(job_id: str, request: Request):
        """Not supported (400): cancel and create again."""
        raise refuse_pause(job_id)

    @app.post(JOBS_ROUTE + "/{job_id}/resume", tags=["OpenAI"], responses=ERROR_RESPONSES)
    async def fine_tuning_resume(job_id: str, request: Request):
        """Not supported (400): cancel and create again."""
        raise refuse_pause(job_id)

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
        data += await model_cards(server, request, call_of(request).tenant)  # the caller's own fine-tunes
        return {"object": "list", "data": data}

    @app.get("/v1/models/{model:path}", response_model=ModelCard, tags=["OpenAI"], responses=ERROR_RESPONSES)
    async def retrieve_model(model: str, request: Request):
        server = server_of(request)
        s = server.served
        embedder = getattr(request.app.state, "embedder", None)
        if embedder is not None and model == embedder.model_id:
            return _embedding_card(embedder, s.created)
        if model not in s.ids:
            card = await model_card(server, model, request, call_of(request).tenant)
            if card is not None:
                return card
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
