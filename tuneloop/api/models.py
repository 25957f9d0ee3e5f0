"""Which model a request names: the served base (its name:version or an alias), or a team's
fine-tune of it (`ft:<base>:<team>:<suffix>:<job>`, a LoRA adapter from the registry,
tuneloop/finetune/adapters.py) that only keys of that team see; everyone else gets the same
404 as for a model that does not exist."""

from __future__ import annotations

import asyncio
import logging

from fastapi import Request

from tuneloop.api.server import OpenAIServer
from tuneloop.files import ANONYMOUS
from tuneloop.finetune.adapters import AdapterCatalog, is_ft_id
from tuneloop.serving.errors import InvalidRequest, ModelNotFound, Unavailable
from tuneloop.serving.lora import AdapterRef

log = logging.getLogger("tuneloop.api")


def catalog_of(request: Request) -> AdapterCatalog | None:
    return getattr(request.app.state, "adapters", None)


def _not_found(server: OpenAIServer, model: str) -> ModelNotFound:
    return ModelNotFound(
        f"The model '{model}' does not exist; this server serves {', '.join(server.served.ids)}", param="model"
    )


async def _find(catalog: AdapterCatalog, model: str, tenant: str | None):
    """The caller's adapter version of this ft: id (None: not theirs or unknown), off the event
    loop; another base's is a 404 saying so, a registry out of reach a 503."""
    try:
        return await asyncio.to_thread(catalog.find, model, tenant or ANONYMOUS)
    except LookupError as exc:
        raise ModelNotFound(str(exc), param="model") from None
    except Exception:
        log.exception("the registry's fine-tuned models could not be read")
        raise Unavailable("the model registry is out of reach; retry shortly", retry_after_s=5) from None


async def resolve_model(server: OpenAIServer, model: str, request: Request, tenant: str | None) -> AdapterRef | None:
    """None for the served base; the adapter for the caller's own fine-tune; ModelNotFound else."""
    if model in server.served.ids:
        return None
    catalog = catalog_of(request)
    if catalog is None or not is_ft_id(model):
        raise _not_found(server, model)
    version = await _find(catalog, model, tenant)
    if version is None:
        raise _not_found(server, model)
    if not getattr(server.backend, "supports_adapters", False):
        raise InvalidRequest(
            f"the model '{model}' is a LoRA adapter; this server's engine ({server.backend.engine}) serves none "
            "(the slots engine with serving.forward fused, or vllm, do)",
            param="model",
        )
    return await asyncio.to_thread(catalog.ref, version)


async def model_cards(server: OpenAIServer, request: Request, tenant: str | None) -> list[dict]:
    """The caller's fine-tunes of the served base, as /v1/models lists them."""
    catalog = catalog_of(request)
    if catalog is None:
        return []
    try:
        versions = await asyncio.to_thread(catalog.visible, tenant or ANONYMOUS)
    except Exception:  # the registry out of reach: the base is still listed, and said so in the log
        log.exception("the registry's fine-tuned models could not be read; /v1/models lists the base only")
        return []
    return [card(server, v) for v in versions]


def card(server: OpenAIServer, version) -> dict:
    return {
        "id": version.model_id,
        "object": "model",
        "created": version.created,
        "owned_by": version.owner,
        "root": server.served.id,
        "parent": server.served.id,
    }


async def model_card(server: OpenAIServer, model: str, request: Request, tenant: str | None) -> dict | None:
    catalog = catalog_of(request)
    if catalog is None or not is_ft_id(model):
        return None
    version = await _find(catalog, model, tenant)
    return card(server, version) if version is not None else None
