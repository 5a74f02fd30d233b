"""Ollama's model routes (``/api/tags``, ``/api/show``, ``/api/ps``, ``/api/version``,
``/api/pull``) for the one served model; the entry's shape is ``wire.ollama``'s, shared with
the proxy."""

from __future__ import annotations

from typing import Any

import anyio.to_thread
from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from tandem.server.engine.default_model import NAME, default_model_path, is_default_name
from tandem.server.wire.body import ParsedJSONRoute
from tandem.server.wire.errors import APIError
from tandem.server.wire.ollama import OLLAMA_VERSION, ollama_model
from tandem.server.wire.protocol import (
    ERROR_RESPONSES,
    OllamaPullRequest,
    OllamaShowRequest,
    streamed,
)
from tandem.server.wire.sse import ndjson_line

from .state import get_state

router = APIRouter(route_class=ParsedJSONRoute)


def _model_info(info: dict[str, Any]) -> dict[str, Any]:
    """Ollama's ``model_info`` keys (``general.*``, ``<family>.context_length``) for the weights."""
    details = info.get("details") or {}
    family = details.get("family", "")
    return {
        "general.architecture": family,
        "general.parameter_count": details.get("parameter_count"),
        "general.file_type": details.get("quantization_level"),
        f"{family}.context_length" if family else "context_length": info.get("max_model_len"),
        "context_length": info.get("max_model_len"),
    }


@router.get("/api/tags")
async def tags(request: Request) -> dict[str, Any]:
    """The served model and its LoRA adapters (Ollama's local model list)."""
    state = get_state(request)
    details = state.engine.info.get("details")
    names = [state.model_name, *state.engine.served_loras]
    return {"models": [ollama_model(n, details) for n in names]}


@router.get("/api/ps")
async def ps(request: Request) -> dict[str, Any]:
    """The served model once the engine is ready (Ollama's loaded models)."""
    state = get_state(request)
    ready = state.engine.state == "ready"
    details = state.engine.info.get("details")
    return {"models": [ollama_model(state.model_name, details)] if ready else []}


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
        "details": ollama_model(state.model_name, info.get("details"))["details"],
        "model_info": _model_info(info),
        "capabilities": ["completion"],
    }


@router.post(
    "/api/pull",
    responses=ERROR_RESPONSES | streamed("application/x-ndjson", "one JSON object a line"),
)
async def pull(body: OllamaPullRequest, request: Request) -> Any:
    """The served model is there already; the default model (by any of its names) is fetched
    into the cache as ``tandem serve`` would (once); any other name is a 404 saying what can
    be pulled. Streamed as Ollama's NDJSON progress unless ``stream: false``."""
    state = get_state(request)
    name = body.model or body.name or ""
    served = state.settings.served_model_name
    if name not in ("", "default", served, f"{served}:latest"):
        if not is_default_name(name):
            raise APIError(
                404,
                f"cannot pull '{name}': this server pulls only its own model '{served}' or the "
                f"default model '{NAME}' (a local file is served with tandem serve --model PATH)",
                code="model_not_found",
                param="model",
            )
        await anyio.to_thread.run_sync(default_model_path)
    steps = [{"status": "pulling manifest"}, {"status": "verifying sha256 digest"}]
    done = {"status": "success"}
    if body.stream is False:
        return done
    lines = b"".join(ndjson_line(s) for s in [*steps, done])
    return StreamingResponse(iter([lines]), media_type="application/x-ndjson")
