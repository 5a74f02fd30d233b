"""The routes the proxy routes to an engine: OpenAI's generation (prefill -> decode when it
pays, ``pd_flow``) and every other engine route as is, each validated against the engine's
own request model first, so the proxy refuses what the engine would, before routing it."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel

from tandem.server.wire.body import ParsedJSONRoute
from tandem.server.wire.messages_api import MESSAGES_ERRORS, CountTokensRequest
from tandem.server.wire.protocol import (
    ERROR_RESPONSES,
    SSE_RESPONSES,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    EncodeRequest,
    GenerateRequest,
    OllamaChatRequest,
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaPullRequest,
    OllamaShowRequest,
    PoolingRequest,
    TokenizeRequest,
    streamed,
)

from .bodies import client_body, json_body
from .pd_flow import PATHS
from .state import get_state

router = APIRouter(route_class=ParsedJSONRoute)

# The body of each route the proxy forwards as is: the engine's model for it.
_ROUTED_BODIES: dict[str, type[BaseModel]] = {
    "generate": GenerateRequest,
    "ollama_generate": OllamaGenerateRequest,
    "ollama_chat": OllamaChatRequest,
    "ollama_show": OllamaShowRequest,
    "ollama_embed": OllamaEmbedRequest,
    "ollama_embeddings": OllamaEmbeddingsRequest,
    "ollama_pull": OllamaPullRequest,
    "embeddings": EmbeddingRequest,
    "pooling": PoolingRequest,
    "encode": EncodeRequest,
    "tokenize": TokenizeRequest,
    "detokenize": DetokenizeRequest,
    "count_tokens": CountTokensRequest,
}

# The proxy's own answers beside the engine's: no engine reachable (502), none in time (504).
_UPSTREAM_RESPONSES = {502: ERROR_RESPONSES[503], 504: ERROR_RESPONSES[503]}
_GENERATION_RESPONSES = SSE_RESPONSES | _UPSTREAM_RESPONSES


def _routed_responses(kind: str) -> dict[int | str, dict[str, Any]]:
    """What a forwarded route answers: the engine's answers (a stream for ``/generate`` and
    Ollama's generation routes) and the proxy's own 502/504."""
    if kind == "generate":
        return _GENERATION_RESPONSES
    if kind == "count_tokens":
        return MESSAGES_ERRORS  # the proxy's 502/504 included, in Anthropic's shape
    if kind in ("ollama_generate", "ollama_chat", "ollama_pull"):
        ndjson = streamed("application/x-ndjson", "one JSON object a line")
        return ERROR_RESPONSES | ndjson | _UPSTREAM_RESPONSES
    return ERROR_RESPONSES | _UPSTREAM_RESPONSES


@router.post("/v1/chat/completions", responses=_GENERATION_RESPONSES)
async def chat_completions(_: ChatCompletionRequest, request: Request) -> Response:
    """Routed to the engines; ``stream: true`` is passed through chunk by chunk."""
    return await routed_chat(json_body(request), request)


async def routed_chat(body: dict[str, Any], request: Request) -> Response:
    """A client's chat request through the flow (P/D when it pays), the proxy's default
    ``max_tokens`` written in: the chat route's, and the Responses and Messages APIs'."""
    state = get_state(request)
    body = client_body(body, request)
    if state.settings.default_max_tokens and not (
        body.get("max_tokens") or body.get("max_completion_tokens")
    ):
        body["max_tokens"] = state.settings.default_max_tokens
    return await state.flow.handle("chat", body, request)


@router.post("/v1/completions", responses=_GENERATION_RESPONSES)
async def completions(_: CompletionRequest, request: Request) -> Response:
    body = client_body(json_body(request), request)
    return await get_state(request).flow.handle("completions", body, request)


def _add_routed(path: str, kind: str) -> None:
    """One engine route the proxy forwards as is (``PATHS``), declared with the engine's body."""

    async def route(_: BaseModel, request: Request) -> Response:
        body = client_body(json_body(request), request)
        return await get_state(request).flow.handle(kind, body, request)

    route.__doc__ = f"Routed to an engine serving the model (``{path}`` there)."
    # The engine's own request model: the OpenAPI document declares the body the engine
    # takes, and the proxy refuses what the engine would, before routing it.
    route.__annotations__ = {**route.__annotations__, "_": _ROUTED_BODIES[kind]}
    router.post(path, name=kind, responses=_routed_responses(kind))(route)


for kind, path in PATHS.items():
    if kind not in ("chat", "completions"):
        _add_routed(path, kind)
del kind, path
