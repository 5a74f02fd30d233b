"""The Responses and Messages routes, one definition for the engine and the proxy: each maps
its request onto a chat request, runs it through the server's own chat path (``AgentAPIs.
run_chat``: the engine's chat route, or the proxy's routing, P/D included) and maps the chat
answer (whole, or its stream) back into its own shape. Each app puts its ``AgentAPIs`` on
``app.state.agent_apis``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from pydantic import ValidationError

from . import messages_api, responses_api
from .body import ParsedJSONRoute
from .chat_stream import translated
from .errors import APIError, validation_message
from .messages_stream import MessagesStream
from .protocol import ERROR_RESPONSES, SSE_RESPONSES, ChatCompletionRequest
from .response_store import ResponseStore, StoredResponse
from .responses_stream import ResponsesStream
from .sse import SSE_HEADERS, DisconnectAwareStreamingResponse, sse_payloads
from .tenancy import request_owner

ChatAnswer = dict[str, Any] | AsyncIterator[bytes]
# The server's chat path: a chat request to its whole answer, or its SSE bytes when streamed.
ChatRunner = Callable[[ChatCompletionRequest, Request], Awaitable[ChatAnswer]]


@dataclass
class AgentAPIs:
    run_chat: ChatRunner
    store: ResponseStore = field(default_factory=ResponseStore)


router = APIRouter(route_class=ParsedJSONRoute)


def _apis(request: Request) -> AgentAPIs:
    return request.app.state.agent_apis


def chat_request(body: dict[str, Any]) -> ChatCompletionRequest:
    """The mapped chat request, validated as the chat route validates its own (a 400 names
    the field as the chat request has it)."""
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        message, param = validation_message(exc)
        raise APIError(400, message, code="invalid_value", param=param) from exc


def _events(stream: AsyncIterator[bytes]) -> DisconnectAwareStreamingResponse:
    return DisconnectAwareStreamingResponse(
        stream, media_type="text/event-stream", headers=SSE_HEADERS
    )


# ----- Responses ----------------------------------------------------------------------------
def _stored(request: Request, response_id: str, param: str = "response_id") -> StoredResponse:
    found = _apis(request).store.get(request_owner(request), response_id)
    if found is None:
        raise APIError(
            404, f"Response with id '{response_id}' not found.", param=param, code="not_found"
        )
    return found


def _remember(
    request: Request,
    body: responses_api.ResponsesRequest,
    response: dict[str, Any],
    conversation: list[dict[str, Any]],
) -> None:
    if body.store is not False and response["status"] in ("completed", "incomplete"):
        whole = conversation + responses_api.output_messages(response["output"])
        _apis(request).store.put(request_owner(request), StoredResponse(response, whole))


async def _stored_events(
    request: Request,
    body: responses_api.ResponsesRequest,
    stream: ResponsesStream,
    answer: AsyncIterator[bytes],
    conversation: list[dict[str, Any]],
) -> AsyncIterator[bytes]:
    async for event in translated(stream, sse_payloads(answer)):
        yield event
    _remember(request, body, stream.response, conversation)


@router.post("/v1/responses", response_model=responses_api.ResponseObject, responses=SSE_RESPONSES)
async def create_response(body: responses_api.ResponsesRequest, request: Request) -> Any:
    """OpenAI's Responses API over the chat path; ``stream: true`` answers its typed events."""
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        history = _stored(request, body.previous_response_id, "previous_response_id").conversation
    chat = chat_request(responses_api.chat_body(body, history))
    conversation = history + responses_api.input_messages(body.input)
    response_id = responses_api.new_item_id("resp")
    answer = await _apis(request).run_chat(chat, request)
    if isinstance(answer, dict):
        response = responses_api.response_object(body, response_id, answer)
        _remember(request, body, response, conversation)
        return response
    stream = ResponsesStream(responses_api.envelope(body, response_id, chat.model))
    return _events(_stored_events(request, body, stream, answer, conversation))


@router.get(
    "/v1/responses/{response_id}",
    response_model=responses_api.ResponseObject,
    responses=ERROR_RESPONSES,
)
async def get_response(response_id: str, request: Request) -> dict[str, Any]:
    """A stored response (``store`` not false), to the key that created it."""
    return _stored(request, response_id).response


@router.delete("/v1/responses/{response_id}", responses=ERROR_RESPONSES)
async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
    _stored(request, response_id)
    _apis(request).store.delete(request_owner(request), response_id)
    return {"id": response_id, "object": "response", "deleted": True}


@router.post("/v1/responses/{response_id}/cancel", responses=ERROR_RESPONSES)
async def cancel_response(response_id: str, request: Request) -> dict[str, Any]:
    """Only background responses can be cancelled, and none runs in the background here."""
    _stored(request, response_id)
    raise APIError(
        400, "Only responses created with background=true can be cancelled.", param="response_id"
    )


# ----- Messages -----------------------------------------------------------------------------
@router.post(
    messages_api.MESSAGES_PATH,
    response_model=messages_api.MessageObject,
    responses=messages_api.MESSAGES_RESPONSES,
)
async def create_message(body: messages_api.MessagesRequest, request: Request) -> Any:
    """Anthropic's Messages API over the chat path; ``stream: true`` answers its events."""
    chat = chat_request(messages_api.chat_body(body))
    message_id = messages_api.new_message_id()
    answer = await _apis(request).run_chat(chat, request)
    if isinstance(answer, dict):
        return messages_api.message_object(message_id, answer)
    stream = MessagesStream(message_id, chat.model or "")
    return _events(translated(stream, sse_payloads(answer)))
