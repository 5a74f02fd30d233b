"""The Responses and Messages APIs' mappings, without a server: input items and content
blocks as chat messages, a chat answer (thinking, text, tool calls) as a ``response`` or a
``message``, a chat stream as each API's typed events, and the response store's scoping."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tandem.server.wire import messages_api, responses_api
from tandem.server.wire.chat_stream import translated
from tandem.server.wire.errors import APIError
from tandem.server.wire.messages_stream import MessagesStream
from tandem.server.wire.response_store import ResponseStore, StoredResponse
from tandem.server.wire.responses_stream import ResponsesStream
from tandem.server.wire.sse import sse_event, sse_payloads

CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
CHAT = {
    "model": "m",
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": None,
                "reasoning_content": "hmm",
                "tool_calls": [CALL],
            },
            "finish_reason": "tool_calls",
        }
    ],
    "usage": {
        "prompt_tokens": 10,
        "completion_tokens": 4,
        "prompt_tokens_details": {"cached_tokens": 6},
    },
}
DELTAS = [
    {"role": "assistant", "content": ""},
    {"reasoning_content": "hm"},
    {"reasoning_content": "m"},
    {"content": "Let me "},
    {"content": "look."},
    {
        "tool_calls": [
            {
                "index": 0,
                "id": "call_1",
                "type": "function",
                "function": {"name": "f", "arguments": ""},
            }
        ]
    },
    {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]},
    {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]},
]


def _chunks(finish: str = "tool_calls") -> list[dict[str, Any]]:
    out = [{"choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in DELTAS]
    out.append({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
    out.append({"choices": [], "usage": CHAT["usage"]})
    return out


async def _aiter(items: list[Any]) -> AsyncIterator[Any]:
    for item in items:
        yield item


def _events(stream: AsyncIterator[bytes]) -> list[tuple[str, dict[str, Any]]]:
    async def collect() -> list[bytes]:
        return [e async for e in stream]

    out = []
    for raw in asyncio.run(collect()):
        head, data = raw.decode().strip().split("\n")
        out.append((head.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_input_items_are_chat_messages() -> None:
    items = [
        {"role": "developer", "content": "be brief"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
    ]
    messages = responses_api.input_messages(items)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["c1", "c2"]
    assert messages[3] == {"role": "tool", "tool_call_id": "c1", "content": "one"}


def test_a_chat_answer_is_a_response_with_reasoning_and_call_items() -> None:
    body = responses_api.ResponsesRequest(input="x")
    r = responses_api.response_object(body, "resp_1", CHAT)
    assert [o["type"] for o in r["output"]] == ["reasoning", "function_call"]
    assert r["output"][0]["content"] == [{"type": "reasoning_text", "text": "hmm"}]
    assert r["output"][1]["call_id"] == "call_1" and r["output"][1]["arguments"] == '{"a": 1}'
    assert r["usage"]["input_tokens_details"] == {"cached_tokens": 6}
    assert r["status"] == "completed"
    assert responses_api.output_messages(r["output"]) == [
        {"role": "assistant", "content": "", "tool_calls": [CALL]}
    ]


def test_a_chat_answer_is_a_message_with_thinking_and_tool_use() -> None:
    m = messages_api.message_object("msg_1", CHAT)
    assert m["content"] == [
        {"type": "thinking", "thinking": "hmm", "signature": ""},
        {"type": "tool_use", "id": "call_1", "name": "f", "input": {"a": 1}},
    ]
    assert m["stop_reason"] == "tool_use"
    assert m["usage"]["input_tokens"] == 4 and m["usage"]["cache_read_input_tokens"] == 6
    assert messages_api.stop_reason("stop", "END") == ("stop_sequence", "END")
    assert messages_api.stop_reason("length", None) == ("max_tokens", None)


def test_anthropic_turns_are_chat_messages() -> None:
    body = messages_api.MessagesRequest(
        max_tokens=4,
        system=[{"type": "text", "text": "sys"}],
        messages=[
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "content": [{"type": "text", "text": "r"}],
                    },
                    {"type": "text", "text": "thanks"},
                ],
            },
        ],
        tools=[{"name": "f", "input_schema": {"type": "object"}}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    )
    chat = messages_api.chat_body(body)
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "assistant", "tool", "user"]
    assert chat["messages"][2]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    with pytest.raises(APIError):
        messages_api.chat_body(
            messages_api.MessagesRequest(
                max_tokens=4, messages=[{"role": "user", "content": [{"type": "image"}]}]
            )
        )


def test_responses_stream_events() -> None:
    body = responses_api.ResponsesRequest(input="x", stream=True)
    stream = ResponsesStream(responses_api.envelope(body, "resp_1", "m"))
    events = _events(translated(stream, _aiter(_chunks())))
    kinds = [k for k, _ in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    assert all(e["type"] == k for k, e in events)
    final = events[-1][1]["response"]
    assert [o["type"] for o in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][1]["content"][0]["text"] == "Let me look."
    assert final["output"][2]["arguments"] == '{"a": 1}'
    assert final["usage"]["output_tokens"] == 4


def test_responses_stream_failure_and_length() -> None:
    body = responses_api.ResponsesRequest(input="x", stream=True)
    failing = [{"error": {"message": "boom", "code": "logits_not_finite"}}]
    events = _events(
        translated(ResponsesStream(responses_api.envelope(body, "r", "m")), _aiter(failing))
    )
    assert events[-1][0] == "response.failed"
    assert events[-1][1]["response"]["error"] == {"code": "logits_not_finite", "message": "boom"}
    cut = [{"choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": "length"}]}]
    events = _events(
        translated(ResponsesStream(responses_api.envelope(body, "r", "m")), _aiter(cut))
    )
    assert events[-1][0] == "response.incomplete"
    assert events[-1][1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_messages_stream_events() -> None:
    events = _events(translated(MessagesStream("msg_1", "m"), _aiter(_chunks())))
    kinds = [k for k, _ in events]
    assert kinds[:2] == ["message_start", "ping"]
    assert kinds[-2:] == ["message_delta", "message_stop"]
    blocks = [e["content_block"]["type"] for k, e in events if k == "content_block_start"]
    assert blocks == ["thinking", "text", "tool_use"]
    deltas = [e["delta"]["type"] for k, e in events if k == "content_block_delta"]
    assert deltas == ["thinking_delta"] * 2 + ["text_delta"] * 2 + ["input_json_delta"] * 2
    assert kinds.count("content_block_stop") == 3
    end = events[-2][1]
    assert end["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert end["usage"]["output_tokens"] == 4
    failing = [{"error": {"message": "boom"}}]
    events = _events(translated(MessagesStream("msg_1", "m"), _aiter(failing)))
    assert events[-1] == (
        "error",
        {"type": "error", "error": {"type": "api_error", "message": "boom"}},
    )


def test_sse_payloads_survive_any_split() -> None:
    raw = b"".join(sse_event({"n": i}) for i in range(3)) + b"data: [DONE]\n\n"
    pieces = [raw[i : i + 7] for i in range(0, len(raw), 7)]

    async def collect() -> list[dict[str, Any]]:
        return [p async for p in sse_payloads(_aiter(pieces))]

    assert asyncio.run(collect()) == [{"n": 0}, {"n": 1}, {"n": 2}]


def test_response_store_is_per_owner_bounded_and_expiring() -> None:
    store = ResponseStore(capacity=2)
    for rid in ("a", "b", "c"):
        store.put("alice", StoredResponse({"id": rid}, []))
    assert store.get("alice", "a") is None  # the least recently stored went first
    assert store.get("alice", "c") is not None and store.get("bob", "c") is None
    assert not store.delete("bob", "c") and store.delete("alice", "c")
    expired = ResponseStore(ttl_seconds=-1)
    expired.put(None, StoredResponse({"id": "x"}, []))
    assert expired.get(None, "x") is None
