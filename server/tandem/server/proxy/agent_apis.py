"""The proxy's side of the Responses and Messages APIs (``wire/agent_routes.py``): they run
as chat requests through the proxy's own chat routing, so they are disaggregated exactly
when a chat request would be, and their stored responses live here, at the client's edge."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from tandem.server.wire.agent_routes import AgentAPIs, ChatAnswer
from tandem.server.wire.errors import APIError
from tandem.server.wire.protocol import ChatCompletionRequest

from .engine_routes import routed_chat


def upstream_error(response: Response) -> APIError:
    """An error answer (the engine's, or the proxy's own) as the error it carries."""
    try:
        error: Any = json.loads(bytes(response.body)).get("error")
    except (ValueError, AttributeError):
        error = None
    if not isinstance(error, dict):
        return APIError(response.status_code, f"HTTP {response.status_code}")
    return APIError(
        response.status_code,
        str(error.get("message") or f"HTTP {response.status_code}"),
        code=error.get("code"),
        param=error.get("param"),
        type=error.get("type"),
    )


async def run_chat(chat: ChatCompletionRequest, request: Request) -> ChatAnswer:
    """The chat request through the flow: its whole answer, or its stream's bytes."""
    body = chat.model_dump(mode="json", by_alias=True, exclude_unset=True)
    response = await routed_chat(body, request)
    if response.status_code >= 400:
        raise upstream_error(response)
    if isinstance(response, StreamingResponse):
        return response.body_iterator  # type: ignore[return-value]
    return json.loads(bytes(response.body))


def agent_apis() -> AgentAPIs:
    return AgentAPIs(run_chat=run_chat)
