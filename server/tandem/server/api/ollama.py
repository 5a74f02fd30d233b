"""Ollama's model routes (``/api/tags``, ``/api/show``, ``/api/ps``, ``/api/version``) and the
shape of one model entry, shared with the proxy (which answers the lists from its registry)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request

from .body import ParsedJSONRoute
from .protocol import ERROR_RESPONSES, OllamaShowRequest
from .state import get_state

# The Ollama API version these routes follow (the client only checks that one is reported).
OLLAMA_VERSION = "0.6.0"

router = APIRouter(route_class=ParsedJSONRoute)


def ollama_model(name: str, modified: datetime | None = None) -> dict[str, Any]:
    """One ``/api/tags`` or ``/api/ps`` entry. Sizes and digests are Ollama's blob bookkeeping,
    which Tandem has no counterpart for: reported as 0 and empty."""
    return {
        "name": name,
        "model": name,
        "modified_at": (modified or datetime.now(UTC)).isoformat(),
        "size": 0,
        "digest": "",
        "details": {
            "format": "safetensors",
            "family": "",
            "parameter_size": "",
            "quantization_level": "",
        },
    }


@router.get("/api/tags")
async def tags(request: Request) -> dict[str, Any]:
    """The served model (Ollama's local model list)."""
    return {"models": [ollama_model(get_state(request).model_name)]}


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
