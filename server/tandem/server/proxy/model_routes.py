"""The models the proxy serves, answered from its registry: OpenAI's list and entry, and
Ollama's lists and version (every served model counts as loaded)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from tandem.server.wire.body import ParsedJSONRoute
from tandem.server.wire.errors import APIError
from tandem.server.wire.ollama import OLLAMA_VERSION, ollama_model

from .state import get_state

router = APIRouter(route_class=ParsedJSONRoute)


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request) -> dict[str, Any]:
    state = get_state(request)
    if model_id not in state.registry.models():
        raise APIError(
            404,
            f"The model '{model_id}' does not exist",
            code="model_not_found",
            param="model",
        )
    return _card(model_id, state.created, state.registry.adapter_parents())


def _card(name: str, created: int, parents: dict[str, str]) -> dict[str, Any]:
    """A model's entry; a LoRA adapter's names its base as ``parent``, as the engine's does."""
    card = {"id": name, "object": "model", "created": created, "owned_by": "tandem"}
    return card if name not in parents else {**card, "parent": parents[name]}


@router.get("/api/tags")
async def ollama_tags(request: Request) -> dict[str, Any]:
    """Ollama's model list: every model some healthy engine serves."""
    reg = get_state(request).registry
    return {"models": [ollama_model(m, reg.model_details(m)) for m in reg.models()]}


@router.get("/api/ps")
async def ollama_ps(request: Request) -> dict[str, Any]:
    """Ollama's loaded models: here every served model is loaded."""
    reg = get_state(request).registry
    return {"models": [ollama_model(m, reg.model_details(m)) for m in reg.models()]}


@router.get("/api/version")
async def ollama_version() -> dict[str, str]:
    return {"version": OLLAMA_VERSION}


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    """Every model some healthy engine serves."""
    state = get_state(request)
    parents = state.registry.adapter_parents()
    return {
        "object": "list",
        "data": [_card(m, state.created, parents) for m in state.registry.models()],
    }
