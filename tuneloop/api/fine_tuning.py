"""/v1/fine_tuning/jobs: OpenAI's fine-tuning jobs API over the job store (tuneloop/finetune).

    POST /v1/fine_tuning/jobs                      create (model, training_file, validation_file,
                                                   suffix, seed, method supervised|dpo, metadata)
    GET  /v1/fine_tuning/jobs                      this team's jobs, newest first (after, limit)
    GET  /v1/fine_tuning/jobs/{id}                 one job
    POST /v1/fine_tuning/jobs/{id}/cancel          cancel an active job
    GET  /v1/fine_tuning/jobs/{id}/events          its events, newest first (after, limit)
    GET  /v1/fine_tuning/jobs/{id}/checkpoints     its checkpoints (after, limit)

A job is its creator's team's (the key's scope, as for files): any other key gets 404. The
`model` is the served base (a fine-tune of a fine-tune is refused); the job trains a LoRA
adapter of it, and the resulting `ft:` model is served by this server beside the base.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any, Literal

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, field_validator

from tuneloop.api.files import owner_of
from tuneloop.api.handlers import call_of, hooks_of
from tuneloop.api.server import server_of
from tuneloop.files import FilesError
from tuneloop.finetune.adapters import SUFFIX, is_ft_id
from tuneloop.finetune.jobs import JobError, JobLimit, JobNotFound, JobStore, NotCancellable
from tuneloop.finetune.runner import limits_for
from tuneloop.serving.errors import InvalidRequest, RateLimited, RouteNotFound, ServingError

JOBS_ROUTE = "/v1/fine_tuning/jobs"

Auto = Literal["auto"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SupervisedHyperparameters(_Strict):
    n_epochs: int | Auto = Field("auto", description="Passes over the training file (1-50).")
    batch_size: int | Auto = "auto"
    learning_rate_multiplier: float | Auto = "auto"

    @field_validator("n_epochs")
    @classmethod
    def _epochs(cls, v):
        if v != "auto" and not 1 <= v <= 50:
            raise ValueError("n_epochs must be 1-50 or 'auto'")
        return v

    @field_validator("batch_size")
    @classmethod
    def _batch(cls, v):
        if v != "auto" and not 1 <= v <= 256:
            raise ValueError("batch_size must be 1-256 or 'auto'")
        return v

    @field_validator("learning_rate_multiplier")
    @classmethod
    def _lr(cls, v):
        if v != "auto" and not 0 < v <= 10:
            raise ValueError("learning_rate_multiplier must be in (0, 10] or 'auto'")
        return v


class DpoHyperparameters(SupervisedHyperparameters):
    beta: float | Auto = "auto"

    @field_validator("beta")
    @classmethod
    def _beta(cls, v):
        if v != "auto" and not 0 < v <= 2:
            raise ValueError("beta must be in (0, 2] or 'auto'")
        return v


class SupervisedMethod(_Strict):
    hyperparameters: SupervisedHyperparameters = SupervisedHyperparameters()


class DpoMethod(_Strict):
    hyperparameters: DpoHyperparameters = DpoHyperparameters()


class Method(_Strict):
    type: Literal["supervised", "dpo"]
    supervised: SupervisedMethod | None = None
    dpo: DpoMethod | None = None


class FineTuningJobRequest(_Strict):
    model: str
    training_file: str
    validation_file: str | None = None
    suffix: str | None = Field(None, max_length=64)
    seed: int | None = Field(None, ge=0, le=2_147_483_647)
    method: Method | None = None
    hyperparameters: SupervisedHyperparameters | None = None  # OpenAI's older place for them
    integrations: list[dict[str, Any]] | None = None
    metadata: dict[str, str] | None = None


def jobs_of(request: Request) -> JobStore:
    server_of(request)  # ready and not draining, as every route
    store = getattr(request.app.state, "jobs", None)
    if store is None:
        raise RouteNotFound("fine-tuning jobs are off on this server (fine_tuning.enabled)")
    return store


class NoSuchJob(ServingError):
    status, type, code, reason = 404, "invalid_request_error", None, "not_found"


def _error(exc: JobError) -> ServingError:
    if isinstance(exc, JobNotFound):
        return NoSuchJob(str(exc), param="fine_tuning_job_id")
    if isinstance(exc, JobLimit):
        return RateLimited(str(exc), code="jobs_limit_exceeded")
    if isinstance(exc, NotCancellable):
        return InvalidRequest(str(exc), param="fine_tuning_job_id")
    return InvalidRequest(str(exc))


async def _run(fn, *args, **kwargs):
    try:
        return await asyncio.to_thread(fn, *args, **kwargs)
    except JobError as exc:
        raise _error(exc) from None


def _method(body: FineTuningJobRequest) -> dict[str, Any]:
    """OpenAI's method object, filled in (hyperparameters given at the top level go to supervised)."""
    if body.method is None:
        hp = body.hyperparameters or SupervisedHyperparameters()
        return {"type": "supervised", "supervised": {"hyperparameters": hp.model_dump()}}
    if body.hyperparameters is not None:
        raise InvalidRequest(
            "give hyperparameters inside `method`, not at the top level as well", param="hyperparameters"
        )
    kind = body.method.type
    given = getattr(body.method, kind)
    other = "dpo" if kind == "supervised" else "supervised"
    if getattr(body.method, other) is not None:
        raise InvalidRequest(f"method.type is {kind}: leave out method.{other}", param=f"method.{other}")
    hp = (given or (SupervisedMethod() if kind == "supervised" else DpoMethod())).hyperparameters
    return {"type": kind, kind: {"hyperparameters": hp.model_dump()}}


async def create_job(request: Request, body: FineTuningJobRequest) -> dict:
    store, server = jobs_of(request), server_of(request)
    owner = owner_of(request)
    if is_ft_id(body.model):
        raise InvalidRequest(
            f"fine-tune the base model ({server.served.name}); a fine-tune of a fine-tune is not supported here",
            param="model",
        )
    if body.model not in server.served.ids:
        raise InvalidRequest(
            f"model {body.model!r}: this server fine-tunes the model it serves: {', '.join(server.served.ids)}",
            param="model",
        )
    if not getattr(server.backend, "supports_adapters", False):
        raise InvalidRequest(
            f"this server's engine ({server.backend.engine}) cannot serve the LoRA adapter a job makes "
            "(the slots engine with serving.forward fused, or vllm, can)",
            param="model",
        )
    if body.suffix is not None and not SUFFIX.match(body.suffix):
        raise InvalidRequest("suffix: up to 64 letters, digits, '-' or '_'", param="suffix")
    if body.integrations:
        raise InvalidRequest("integrations are not supported here (see the MLflow run instead)", param="integrations")
    if body.metadata is not None and (
        len(body.metadata) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in body.metadata.items())
    ):
        raise InvalidRequest(
            "metadata: at most 16 pairs, keys up to 64 and values up to 512 characters", param="metadata"
        )
    files = getattr(request.app.state, "files", None)
    if files is None:
        raise RouteNotFound("the Files API is off on this server: jobs read their data from it")
    for param in ("training_file", "validation_file"):
        file_id = getattr(body, param)
        if file_id is None:
            continue
        try:
            stored = await asyncio.to_thread(files.get, file_id, owner)
        except FilesError:
            raise InvalidRequest(f"invalid {param}: {file_id} (no such file of this team)", param=param) from None
        if stored.purpose != "fine-tune":
            raise InvalidRequest(f"invalid {param}: {file_id} has purpose {stored.purpose!r}", param=param)
    method = _method(body)
    supervised_hp = method[method["type"]]["hyperparameters"]
    tier = hooks_of(request).tier()
    job_body: dict[str, Any] = {
        "model": server.served.id,
        "training_file": body.training_file,
        "validation_file": body.validation_file,
        "user_provided_suffix": body.suffix,
        "seed": body.seed if body.seed is not None else random.randint(0, 2**31 - 1),
        "method": method,
        "hyperparameters": {k: supervised_hp[k] for k in ("n_epochs", "batch_size", "learning_rate_multiplier")},
        "fine_tuned_model": None,
        "finished_at": None,
        "error": None,
        "result_files": [],
        "trained_tokens": None,
        "estimated_finish": None,
        "integrations": [],
        "metadata": body.metadata,
        # the base it trains on and is served with (not shown: underscored keys stay inside)
        "_base": {
            "id": server.served.id,
            "name": server.served.name,
            "version": server.served.version,
            "path": str(server.loaded.path),
        },
    }
    job = await _run(store.create, owner, tier, job_body, limits_for(request.app.state.fine_tuning_config, tier))
    dispatcher = getattr(request.app.state, "dispatcher", None)
    if dispatcher is not None:
        dispatcher.wake()
    call_of(request).response_id = job.id
    return job.openai()


def _page(request: Request, default: int, most: int) -> tuple[str | None, int]:
    q = request.query_params
    after = q.get("after") or None
    raw = q.get("limit")
    try:
        limit = int(raw) if raw is not None else default
    except ValueError:
        raise InvalidRequest("limit must be an integer", param="limit") from None
    if not 1 <= limit <= most:
        raise InvalidRequest(f"limit must be 1-{most}", param="limit")
    return after, limit


async def list_jobs(request: Request) -> dict:
    store = jobs_of(request)
    after, limit = _page(request, 20, 100)
    metadata = {k[len("metadata[") : -1]: v for k, v in request.query_params.items() if k.startswith("metadata[")}
    jobs, more = await _run(store.list, owner_of(request), after, limit if not metadata else 10_000)
    data = [j.openai() for j in jobs]
    if metadata:
        data = [j for j in data if all((j.get("metadata") or {}).get(k) == v for k, v in metadata.items())]
        more = more or len(data) > limit
        data = data[:limit]
    return {"object": "list", "data": data, "has_more": more}


async def retrieve_job(request: Request, job_id: str) -> dict:
    job = await _run(jobs_of(request).get, job_id, owner_of(request))
    return job.openai()


async def cancel_job(request: Request, job_id: str) -> dict:
    store = jobs_of(request)
    job = await _run(store.cancel, job_id, owner_of(request))
    dispatcher = getattr(request.app.state, "dispatcher", None)
    if dispatcher is not None:
        dispatcher.wake()
    return job.openai()


async def job_events(request: Request, job_id: str) -> dict:
    store = jobs_of(request)
    await _run(store.get, job_id, owner_of(request))
    after, limit = _page(request, 20, 1000)
    events, more = await _run(store.events, job_id, after, limit)
    return {"object": "list", "data": events, "has_more": more}


async def job_checkpoints(request: Request, job_id: str) -> dict:
    store = jobs_of(request)
    await _run(store.get, job_id, owner_of(request))
    after, limit = _page(request, 10, 100)
    checkpoints, more = await _run(store.checkpoints, job_id, after, limit)
    return {
        "object": "list",
        "data": checkpoints,
        "has_more": more,
        "first_id": checkpoints[0]["id"] if checkpoints else None,
        "last_id": checkpoints[-1]["id"] if checkpoints else None,
    }


def refuse_pause(job_id: str) -> InvalidRequest:
    return InvalidRequest(
        f"pausing and resuming jobs is not supported here; cancel {job_id} and create it again",
        param="fine_tuning_job_id",
    )
