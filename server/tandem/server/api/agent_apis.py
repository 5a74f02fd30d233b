"""The engine's side of the Responses and Messages APIs (``wire/agent_routes.py``): the chat
route is what they run on, and ``/v1/messages/count_tokens`` renders the chat template the
same request would."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from tandem.server.wire.agent_routes import AgentAPIs, ChatAnswer, chat_request
from tandem.server.wire.body import ParsedJSONRoute
from tandem.server.wire.messages_api import (
    MESSAGES_ERRORS,
    CountTokensRequest,
    CountTokensResponse,
    chat_body,
)
from tandem.server.wire.protocol import ChatCompletionRequest

from . import mapping
from .generation import off_loop, tokenize_text
from .openai_routes import chat_completions
from .state import get_state

router = APIRouter(route_class=ParsedJSONRoute)


async def run_chat(chat: ChatCompletionRequest, request: Request) -> ChatAnswer:
    """The chat route itself: its whole answer, or its stream's bytes."""
    answer = await chat_completions(chat, request)
    if isinstance(answer, StreamingResponse):
        return answer.body_iterator  # type: ignore[return-value]
    return answer


def agent_apis() -> AgentAPIs:
    return AgentAPIs(run_chat=run_chat)


@router.post(
    "/v1/messages/count_tokens", response_model=CountTokensResponse, responses=MESSAGES_ERRORS
)
async def count_tokens(body: CountTokensRequest, request: Request) -> dict[str, Any]:
    """The prompt tokens the same ``/v1/messages`` request would take (system, tools and
    the chat template's own tokens included)."""
    state = get_state(request)
    chat = chat_request(chat_body(body))
    state.check_model(chat.model)
    text = await off_loop(state, mapping.render_chat, state.tokenizer, chat)
    ids = await off_loop(state, tokenize_text, state, text, "messages", add_special_tokens=False)
    return {"input_tokens": len(ids)}
