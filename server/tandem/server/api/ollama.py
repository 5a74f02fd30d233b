"""Ollama's model routes (``/api/tags``, ``/api/show``, ``/api/ps``, ``/api/version``) for the
one served model; the entry's shape is ``wire.ollama``'s, shared with the proxy."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from tandem.server.wire.body import ParsedJSONRoute
from tandem.server.wire.ollama import OLLAMA_VERSION, ollama_model
from tandem.server.wire.protocol import ERROR_RESPONSES, OllamaShowRequest

from .state import get_state

router = APIRouter(route_class=ParsedJSONRoute)


@router.get("/api/tags")
async def tags(request: Request) -> dict[str, Any]:
    """The served model and its LoRA adapters (Ollama's local model list)."""
    state = get_state(request)
    return {"models": [ollama_model(n) for n in [state.model_name, *state.engine.served_loras]]}


@router.get("/api/ps")
async def ps(request: Request) -> dict[str, Any]:
    """The served model once the engine is ready (Ollama's loaded models)."""
    state = get_state(request)
    ready = state.engine.state == "ready"
    return {"models": [ollama_model(state.model_name)] if ready else []}


@router.get("/api/version")
async def version() -> dict[str, str]:
    return {"version": OLLAMA_VERSION}


@router.post("/api/show", responses=ERROR_RESPONSES)
async def show(body: OllamaShowRequest, request: Request) -> dict[str, Any]:
    """The served model's template and configuration (404 for any other name)."""
    state = get_state(request)
    state.check_model(body.model or body.name)
    info = state.engine.info
    return {
        "modelfile": "",
        "parameters": "",
        "template": getattr(state.tokenizer, "chat_template", None) or "",
        "details": ollama_model(state.model_name)["details"],
        "model_info": {
            "context_length": info.get("max_model_len"),
            "root": state.settings.model_dir,
        },
        "capabilities": ["completion"],
    }
