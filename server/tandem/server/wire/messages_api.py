"""Anthropic's Messages API (``/v1/messages``) as a thin mapping onto the chat request: its
request models, its content blocks as chat messages, a finished chat completion as a
``message``, and its error shape. Served by the engine and the proxy alike (``agent_routes``)."""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

from pydantic import Field

from .errors import APIError
from .protocol import (
    ERROR_RESPONSES,
    MAX_MESSAGES,
    MAX_STOP,
    MAX_TOOLS,
    APIModel,
    MaxTokens,
    StopString,
    StrictOut,
    Temperature,
    TopK,
    TopP,
    streamed,
)
from .responses_api import text_of

Block = dict[str, Any]
MESSAGES_PATH = "/v1/messages"
# Anthropic's error type for each status (https://docs.anthropic.com/en/api/errors).
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
TEXT = ("text",)  # the only content blocks read as text
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


class MessageParam(APIModel):
    role: Literal["user", "assistant"]
    content: Annotated[str, Field(min_length=1)] | list[dict[str, Any]]


class CountTokensRequest(APIModel):
    """``POST /v1/messages/count_tokens``: what a message would count as input."""

    model: str | None = None
    messages: Annotated[list[MessageParam], Field(min_length=1, max_length=MAX_MESSAGES)]
    system: str | list[dict[str, Any]] | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``."""

    max_tokens: MaxTokens
    stop_sequences: Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    metadata: dict[str, Any] | None = None
    stream: bool | None = False


class MessageObject(StrictOut):
    """The ``message`` object (``content`` holds ``text``, ``tool_use`` and ``thinking``
    blocks)."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None = None
    usage: dict[str, int]


class CountTokensResponse(StrictOut):
    input_tokens: int


class AnthropicErrorDetail(StrictOut):
    type: str
    message: str


class AnthropicError(StrictOut):
    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


# The Messages routes answer errors in Anthropic's shape (``anthropic_errors``).
MESSAGES_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": AnthropicError} for code in (*ERROR_RESPONSES, 502, 504)
}
MESSAGES_RESPONSES = MESSAGES_ERRORS | streamed("text/event-stream", "Anthropic's events")


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error shape (its SDK raises the typed error of the status)."""
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _tool_call(block: Block, param: str) -> dict[str, Any]:
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
        raise APIError(400, f"{param}: a tool_use block needs 'id' and 'name'", param=param)
    arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
    return {
        "id": block["id"],
        "type": "function",
        "function": {"name": block["name"], "arguments": arguments},
    }


def _turn(role: str, content: str | list[Block], param: str) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: its ``tool_result`` blocks become ``tool``
    messages (first, as they answer the previous turn), its ``tool_use`` blocks tool calls."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    results, texts, calls = [], [], []
    for j, block in enumerate(content):
        kind, where = block.get("type"), f"{param}.content.{j}"
        if kind == "text":
            texts.append(text_of([block], where, TEXT))
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_call(block, where))
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise APIError(400, f"{where}: a tool_result needs 'tool_use_id'", param=where)
            text = text_of(block.get("content") or "", where, TEXT)
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
        elif kind not in ("thinking", "redacted_thinking"):
            raise APIError(400, f"{where}: block type {kind!r} is not supported", param=where)
    out = list(results)
    if texts or calls or not results:
        message: dict[str, Any] = {"role": role, "content": "".join(texts)}
        if calls:
            message["tool_calls"] = calls
        out.append(message)
    return out


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool.get("name"), str) or tool.get("type") not in (None, "custom"):
            raise APIError(
                400, f"tools.{i}: only custom tools with a name are supported", param=f"tools.{i}"
            )
        fn = {"name": tool["name"], "parameters": tool.get("input_schema")}
        if isinstance(tool.get("description"), str):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """``(tool_choice, parallel_tool_calls)`` in chat's terms."""
    if choice is None:
        return None, None
    parallel = False if choice.get("disable_parallel_tool_use") else None
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise APIError(
        400, "tool_choice.type must be auto, any, tool (with a name) or none", param="tool_choice"
    )


def chat_messages(body: CountTokensRequest) -> list[dict[str, Any]]:
    system = (
        [{"role": "system", "content": text_of(body.system, "system", TEXT)}] if body.system else []
    )
    turns = [
        m
        for i, msg in enumerate(body.messages)
        for m in _turn(msg.role, msg.content, f"messages.{i}")
    ]
    return system + turns


def chat_body(body: CountTokensRequest) -> dict[str, Any]:
    """The chat request this message runs as (``count_tokens`` renders the same)."""
    tool_choice, parallel = _tool_choice(body.tool_choice)
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": chat_messages(body),
        "tools": _tools(body.tools),
        "tool_choice": tool_choice,
        "parallel_tool_calls": parallel,
    }
    if isinstance(body, MessagesRequest):
        chat.update(
            max_tokens=body.max_tokens,
            stop=body.stop_sequences or None,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            stream=bool(body.stream),
        )
        if body.stream:
            chat["stream_options"] = {"include_usage": True}
    return {k: v for k, v in chat.items() if v is not None}


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def stop_reason(finish_reason: str | None, matched: Any) -> tuple[str | None, str | None]:
    """``(stop_reason, stop_sequence)`` of a chat ``finish_reason`` (and the stop string
    it matched, when one did)."""
    if finish_reason is None:
        return None, None
    if finish_reason == "stop" and isinstance(matched, str):
        return "stop_sequence", matched
    return _STOP_REASONS.get(finish_reason, "end_turn"), None


def usage(chat_usage: dict[str, Any] | None) -> dict[str, Any]:
    """Anthropic counts cache reads apart: ``input_tokens`` are the prompt tokens computed."""
    u = chat_usage or {}
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": u.get("prompt_tokens", 0) - cached,
        "output_tokens": u.get("completion_tokens", 0),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the ``input`` object (an object the model did not write: ``{}``)."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def envelope(message_id: str, model: str) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage(None),
    }


def message_object(message_id: str, chat: dict[str, Any]) -> dict[str, Any]:
    """A finished chat completion as the ``message`` object."""
    choice = chat["choices"][0]
    message = choice["message"]
    content: list[Block] = []
    if message.get("reasoning_content"):
        content.append(
            {"type": "thinking", "thinking": message["reasoning_content"], "signature": ""}
        )
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        fn = call["function"]
        content.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": fn["name"],
                "input": tool_input(fn["arguments"]),
            }
        )
    reason, sequence = stop_reason(choice.get("finish_reason"), choice.get("stop_reason"))
    out = envelope(message_id, chat.get("model") or "")
    out.update(
        content=content, stop_reason=reason, stop_sequence=sequence, usage=usage(chat.get("usage"))
    )
    return out
