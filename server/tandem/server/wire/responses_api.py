"""OpenAI's Responses API (``/v1/responses``) as a thin mapping onto the chat request: its
request model, its input items as chat messages, and a finished chat completion as a
``response`` object. The engine and the proxy both serve it this way (``agent_routes``), so
chat templates, tool parsers, reasoning parsers, structured output and P/D are the chat
route's own, never copied."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import Field

from .errors import APIError
from .protocol import (
    MAX_MESSAGES,
    MAX_TOOLS,
    APIModel,
    MaxTokens,
    Stop,
    StrictOut,
    Temperature,
    TopP,
)

Item = dict[str, Any]
_TEXT_PARTS = ("input_text", "output_text", "text")
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


class ResponsesRequest(APIModel):
    """``POST /v1/responses``. Input items are messages (text parts), ``function_call`` and
    ``function_call_output``; ``reasoning`` items are accepted and skipped."""

    model: str | None = None
    input: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[dict[str, Any]], Field(min_length=1, max_length=MAX_MESSAGES)]
    )
    instructions: str | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stop: Stop | None = None
    seed: int | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    store: bool | None = True
    previous_response_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    background: bool | None = None
    metadata: dict[str, str] | None = None
    stream: bool | None = False


class ResponseObject(StrictOut):
    """The ``response`` object (``output`` holds ``message``, ``function_call`` and
    ``reasoning`` items)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    previous_response_id: str | None = None


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def text_of(content: Any, param: str, kinds: tuple[str, ...] = _TEXT_PARTS) -> str:
    """A message's content (a string, or text parts of ``kinds``) as one string; any other
    part is a 400 naming ``param`` (image inputs are not served)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{param} must be a string or a list of text parts", param=param)
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in kinds:
            raise APIError(
                400,
                f"{param}: only text parts are supported",
                param=param,
                code="unsupported_value",
            )
        if not isinstance(part.get("text"), str):
            raise APIError(400, f"{param}: a text part needs 'text'", param=param)
        texts.append(part["text"])
    return "".join(texts)


def _string(item: Item, key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"'{param}.{key}' must be a string", param=f"{param}.{key}")
    return value


def _call(item: Item, param: str) -> dict[str, Any]:
    return {
        "id": _string(item, "call_id", param),
        "type": "function",
        "function": {
            "name": _string(item, "name", param),
            "arguments": _string(item, "arguments", param),
        },
    }


def input_messages(input_: str | list[Item]) -> list[dict[str, Any]]:
    """Input items as chat messages; consecutive ``function_call`` items are one assistant
    turn's ``tool_calls``."""
    if isinstance(input_, str):
        return [{"role": "user", "content": input_}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(input_):
        param = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            given = item.get("role")
            role = _ROLES.get(given) if isinstance(given, str) else None
            if role is None:
                raise APIError(400, f"'{param}.role' is not a message role", param=param)
            out.append({"role": role, "content": text_of(item.get("content"), param)})
        elif kind == "function_call":
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant" or "tool_calls" not in last:
                last = {"role": "assistant", "content": "", "tool_calls": []}
                out.append(last)
            last["tool_calls"].append(_call(item, param))
        elif kind == "function_call_output":
            output = text_of(item.get("output"), f"{param}.output")
            out.append(
                {"role": "tool", "tool_call_id": _string(item, "call_id", param), "content": output}
            )
        elif kind != "reasoning":
            raise APIError(
                400,
                f"input item type {kind!r} is not supported",
                param=param,
                code="unsupported_value",
            )
    return out


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            raise APIError(
                400,
                "only function tools with a name are supported",
                param=f"tools.{i}",
                code="unsupported_value",
            )
        fn = {"name": tool["name"], "parameters": tool.get("parameters")}
        if isinstance(tool.get("description"), str):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(400, "tool_choice must name a function tool", param="tool_choice")


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise APIError(
            400, "text.format.type must be text, json_object or json_schema", param="text.format"
        )
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
    return {"type": "json_schema", "json_schema": {"name": "response", **schema}}


def chat_body(body: ResponsesRequest, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat request this response runs as: ``history`` (the previous response's
    conversation) then the input, after the instructions."""
    if body.background:
        raise APIError(
            400,
            "background responses are not supported",
            param="background",
            code="unsupported_value",
        )
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": system + history + input_messages(body.input),
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "stop": body.stop,
        "seed": body.seed,
        "tools": _chat_tools(body.tools),
        "tool_choice": _chat_tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": _response_format(body.text),
        "stream": bool(body.stream),
    }
    if body.stream:
        chat["stream_options"] = {"include_usage": True}
    return {k: v for k, v in chat.items() if v is not None}


def usage(chat_usage: dict[str, Any] | None) -> dict[str, Any]:
    u = chat_usage or {}
    prompt, completion = u.get("prompt_tokens", 0), u.get("completion_tokens", 0)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        },
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def envelope(body: ResponsesRequest, response_id: str, model: str | None) -> dict[str, Any]:
    """The ``response`` object's fields that echo the request (an in-progress response)."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "model": model or body.model or "",
        "output": [],
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "store": body.store is not False,
        "temperature": body.temperature,
        "text": {"format": (body.text or {}).get("format") or {"type": "text"}},
        "tool_choice": body.tool_choice or "auto",
        "tools": body.tools or [],
        "top_p": body.top_p,
        "truncation": "disabled",
        "metadata": body.metadata or {},
        "usage": None,
    }


def message_item(text: str, status: str = "completed") -> Item:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {
        "type": "message",
        "id": new_item_id("msg"),
        "status": status,
        "role": "assistant",
        "content": [part] if status == "completed" else [],
    }


def reasoning_item(text: str) -> Item:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"type": "reasoning", "id": new_item_id("rs"), "summary": [], "content": content}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> Item:
    return {
        "type": "function_call",
        "id": new_item_id("fc"),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def finish(response: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
    """The status a chat ``finish_reason`` gives the response."""
    if finish_reason == "length":
        response.update(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
    else:
        response["status"] = "completed"
    return response


def response_object(
    body: ResponsesRequest, response_id: str, chat: dict[str, Any]
) -> dict[str, Any]:
    """A finished chat completion as the ``response`` object."""
    choice = chat["choices"][0]
    message = choice["message"]
    out: list[Item] = []
    if message.get("reasoning_content"):
        out.append(reasoning_item(message["reasoning_content"]))
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        out.append(message_item(message.get("content") or ""))
    out += [call_item(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls]
    response = envelope(body, response_id, chat.get("model"))
    response.update(output=out, usage=usage(chat.get("usage")))
    return finish(response, choice.get("finish_reason"))


def output_messages(output: list[Item]) -> list[dict[str, Any]]:
    """A response's output as the chat messages a later ``previous_response_id`` continues."""
    return input_messages(
        [
            {"type": "message", "role": "assistant", "content": item["content"]}
            if item["type"] == "message"
            else item
            for item in output
            if item["type"] in ("message", "function_call")
        ]
    )
